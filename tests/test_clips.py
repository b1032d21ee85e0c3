"""The clips a calibration gives quantize_ (ptq.calibration.clips): each tensor of the plan takes
its own spec's clip, where attention's key and the KV cache's key share one calibration key."""

import torch
from transformers import AutoModelForCausalLM

from ptq.calibration.calibrate import calibrate
from ptq.calibration.clips import input_clip, static_clips
from ptq.quantization.plan import calibration_key, calibration_targets, resolve_plan
from ptq.quantization.recipes import parse_recipe


def test_attention_and_kv_cache_keys_take_their_own_clips(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    r = parse_recipe(
        {
            "name": "r",
            "weights": {"format": "e4m3"},
            "inputs": {"format": "e4m3"},
            "attention": {"format": "e4m3", "observer": "percentile", "percentile": 99.0},
            "kv_cache": {"format": "e4m3", "granularity": "head"},
        }
    )
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = resolve_plan(model, r)
    layers, channels = calibration_targets([plan])
    calibration = calibrate(model, ids, layers, channels=channels)
    clips = static_clips(calibration, model, plan)
    shared = 0
    for layer, tensors in plan.attention.items():
        assert set(clips.attention[layer]) == {t for t, s in tensors.items() if s.static}
        for t, spec in tensors.items():
            want = input_clip(calibration, calibration_key(layer, t), spec)
            assert torch.equal(clips.attention[layer][t], want), (layer, t)
        if "key" in tensors and "kv_cache.key" in tensors:
            shared += 1
            assert (
                clips.attention[layer]["key"].shape != clips.attention[layer]["kv_cache.key"].shape
            )
    assert shared  # the recipe quantizes both, per tensor and per head
    assert static_clips(None, model, plan) is None
