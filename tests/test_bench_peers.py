"""`make bench-peers` helpers: reading per-tensor scales from a compressed-tensors checkpoint, comparing two
tools' scales, and the ptq side's checkpoint against amax / 448 computed independently. No timing here."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.bench_peers import INPUT_SCALE_RTOL, compare_scales, read_scales, run_ptq_side
from ptq.errors import PtqError


def test_read_scales_from_a_sharded_checkpoint_in_any_dtype(tmp_path):
    save_file(
        {
            "model.layers.0.q_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
            "model.layers.0.q_proj.weight_scale": torch.tensor([0.5], dtype=torch.bfloat16),
            "model.layers.0.q_proj.input_scale": torch.tensor([0.375]),
            "model.embed_tokens.weight": torch.ones(3, 4),
        },
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "model.layers.1.o_proj.weight_scale": torch.tensor(
                3.0
            ),  # a 0-d scale is one per tensor too
            "model.layers.1.o_proj.input_scale": torch.tensor([1 / 448], dtype=torch.float32),
        },
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    (tmp_path / "config.json").write_text("{}")

    scales = read_scales(tmp_path)

    assert scales == {
        "model.layers.0.q_proj": {"weight_scale": 0.5, "input_scale": 0.375},
        "model.layers.1.o_proj": {
            "weight_scale": 3.0,
            "input_scale": float(torch.tensor(1 / 448, dtype=torch.float32)),
        },
    }


def test_read_scales_refuses_per_channel_scales_and_an_empty_directory(tmp_path):
    with pytest.raises(PtqError, match="no .safetensors"):
        read_scales(tmp_path)
    save_file({"fc.weight_scale": torch.ones(4, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PtqError, match="fc.weight_scale has 4 elements"):
        read_scales(tmp_path)


def _scales(weight: float, inputs: float) -> dict:
    return {"weight_scale": weight, "input_scale": inputs}


def test_compare_scales_tolerances_and_missing_layers():
    theirs = {"a": _scales(0.25, 0.5), "b": _scales(1.0, 2.0)}
    same = compare_scales(dict(theirs), theirs)
    assert same.agrees() and same.identical == {"weight_scale": 2, "input_scale": 2}
    assert same.max_rel_diff == {"weight_scale": 0.0, "input_scale": 0.0}

    one_ulp = float(
        torch.nextafter(torch.tensor(2.0), torch.tensor(3.0))
    )  # float32 rounding of an input amax
    close = compare_scales({"a": _scales(0.25, 0.5), "b": _scales(1.0, one_ulp)}, theirs)
    assert (
        close.agrees()
        and close.worst_layer["input_scale"] == "b"
        and close.identical["input_scale"] == 1
    )
    assert 0 < close.max_rel_diff["input_scale"] < INPUT_SCALE_RTOL

    far = compare_scales(
        {"a": _scales(0.25, 0.5 * (1 + 10 * INPUT_SCALE_RTOL)), "b": _scales(1.0, 2.0)}, theirs
    )
    assert not far.agrees() and far.worst_layer["input_scale"] == "a"
    assert far.max_rel_diff["input_scale"] == pytest.approx(10 * INPUT_SCALE_RTOL)

    weight_off = compare_scales(
        {
            "a": _scales(float(torch.nextafter(torch.tensor(0.25), torch.tensor(1.0))), 0.5),
            "b": _scales(1.0, 2.0),
        },
        theirs,
    )
    assert not weight_off.agrees()  # weight scales come from the same weights: no tolerance

    missing = compare_scales({"a": _scales(0.25, 0.5)}, theirs)
    assert not missing.agrees() and missing.only_in_theirs == ["b"] and missing.layers == 1
    lacking = compare_scales({"a": {"weight_scale": 0.25}, "b": _scales(1.0, 2.0)}, theirs)
    assert not lacking.agrees() and lacking.max_rel_diff["input_scale"] == float("inf")


def test_ptq_side_writes_amax_over_448_for_every_linear(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 200, (6, 32))
    save_file({"input_ids": ids}, str(tmp_path / "windows.safetensors"))

    timing = run_ptq_side(
        tiny_model, tmp_path / "windows.safetensors", tmp_path / "ptq", batch_size=4
    )
    scales = read_scales(tmp_path / "ptq" / "checkpoint")

    # Independently: a plain transformers model, max |x| of each Linear's input over the same batches.
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    seen: dict[str, float] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.register_forward_pre_hook(
                lambda mod, args, n=name: seen.__setitem__(
                    n, max(seen.get(n, 0.0), float(args[0].abs().max()))
                )
            )
    with torch.no_grad():
        for batch in ids.split(4):
            model(input_ids=batch)
    assert (
        set(scales) == set(seen) and len(seen) == 2 * 7
    )  # q, k, v, o, gate, up, down per layer; not lm_head

    def fp32(v):
        return float(torch.tensor(v, dtype=torch.float32) / 448)

    for name, s in scales.items():
        assert s["weight_scale"] == fp32(
            float(model.get_submodule(name).weight.detach().abs().max())
        )
        assert s["input_scale"] == pytest.approx(fp32(seen[name]), rel=1e-6)
    assert timing["quantize_s"] >= timing["calibrate_s"] > 0 and timing["save_s"] > 0
