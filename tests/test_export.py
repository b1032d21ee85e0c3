"""`ptq quantize`: compressed-tensors checkpoints that transformers reloads, checked against independent
references (compressed-tensors' own schema and compressors, the source safetensors, transformers' loader)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import families
import numpy as np
import pytest
import safetensors.torch
import torch
import yaml
from conftest import TEXT, make_tokenizer

from ptq import cli, progress
from ptq.errors import PtqError
from ptq.quantization.recipes import parse_recipe

FORMATS = {"fp8-e4m3": (torch.float8_e4m3fn, "float", 448.0), "int8": (torch.int8, "int", 127.0)}


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors |= safetensors.torch.load_file(str(f))
    return tensors


@pytest.fixture(scope="module", params=["fp8-e4m3", "int8"])
def exported(request, tiny_model, tmp_path_factory):
    """The tiny Llama exported with each recipe through the CLI, in several shards, verified."""
    out = tmp_path_factory.mktemp("export") / f"tiny-{request.param}"
    text = tmp_path_factory.mktemp("text") / "text.txt"
    text.write_text(TEXT * 3)
    argv = [
        "ptq",
        "quantize",
        str(tiny_model),
        "--recipe",
        request.param,
        "--data",
        str(text),
        "--samples",
        "4",
        "--seq-len",
        "64",
        "--verify-windows",
        "4",
        "--shard-size",
        "0.05",
        "-o",
        str(out),
        "-q",
    ]
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setattr(sys, "argv", argv)
        cli.main()
    progress.QUIET = False
    assert e.value.code == 0
    return request.param, out


def test_checkpoint_layout_sizes_and_config(exported, tiny_model):
    from compressed_tensors.quantization import QuantizationConfig

    recipe, out = exported
    dtype, kind, _ = FORMATS[recipe]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    for name in ("tokenizer.json", "generation_config.json", "README.md", "ptq-export.json"):
        assert (out / name).is_file()
    assert not list(
        out.parent.glob(".*.tmp")
    )  # the temporary directory was renamed, none left behind

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    config = QuantizationConfig.model_validate(qc)  # compressed-tensors' own schema accepts it
    scheme = config.config_groups["group_0"]
    assert config.format == f"{kind}-quantized" and config.ignore == ["lm_head"]
    assert scheme.weights.type == kind and scheme.input_activations.type == kind
    assert scheme.weights.strategy == ("channel" if recipe == "int8" else "tensor")
    assert (
        scheme.input_activations.strategy == "tensor" and scheme.input_activations.dynamic is False
    )

    tensors = read_checkpoint(out)
    source = read_checkpoint(tiny_model)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    quantized = [k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")]
    assert (
        len(quantized) == 14
    )  # 2 layers x (q, k, v, o, gate, up, down); lm_head is tied and left out
    for layer in quantized:
        w = tensors[f"{layer}.weight"]
        assert (
            w.dtype == dtype
            and w.element_size() == 1
            and w.shape == source[f"{layer}.weight"].shape
        )
        assert tensors[f"{layer}.input_scale"].shape == (1,)
    others = [
        k
        for k in tensors
        if not k.endswith(("_scale",)) and k.removesuffix(".weight") not in quantized
    ]
    assert others and all(
        torch.equal(tensors[k], source[k]) for k in others
    )  # unchanged, same dtype
    assert set(others) | {f"{q}.weight" for q in quantized} == set(source)

    info = json.loads((out / "ptq-export.json").read_text())
    size = info["size"]
    params_16bit = sum(t.numel() for t in source.values()) * 2
    assert (
        size["bytes_16bit"] == params_16bit
        and size["bytes_saved"] == params_16bit - index["metadata"]["total_size"]
    )
    card = (out / "README.md").read_text()
    assert (
        recipe in card and info["calibration"]["data_sha256"][:16] in card and "ptq 0.1.0" in card
    )


# The layers vLLM loads into one fused layer (QKVParallelLinear, MergedColumnParallelLinear), written out here
# from vllm/model_executor/models/llama.py's packed_modules_mapping rather than taken from ptq
VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_amax(source: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """The per-tensor amax vLLM's requantize_with_max_scale leaves a fused layer's shards with: the group's largest."""
    parent, _, name = layer.rpartition(".")
    group = next((g for g in VLLM_FUSED if name in g), (name,))
    return (
        torch.stack([source[f"{parent}.{m}.weight"].float().abs().max() for m in group])
        .max()
        .reshape(1)
    )


def test_codes_are_bit_identical_to_an_independent_quantization(exported, tiny_model):
    """Each stored weight equals compressed-tensors' own compressor applied to the source weight with
    scale = amax / max computed here from scratch: per output channel for int8, and per tensor for E4M3 with the
    amax of the layer's vLLM fused group (the export's default --target vllm)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    recipe, out = exported
    dtype, _, fmt_max = FORMATS[recipe]
    config = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"]
    )
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    tensors, source = read_checkpoint(out), read_checkpoint(tiny_model)
    for key in [k for k in tensors if k.endswith(".weight_scale")]:
        layer = key.removesuffix(".weight_scale")
        w = source[f"{layer}.weight"].float()
        amax = w.abs().amax(dim=1, keepdim=True) if recipe == "int8" else group_amax(source, layer)
        scale = amax / fmt_max
        assert torch.equal(tensors[key], scale)
        reference = compressor.compress({"weight": w, "weight_scale": scale}, scheme)["weight"]
        assert reference.dtype == dtype
        assert torch.equal(
            tensors[f"{layer}.weight"].view(torch.uint8), reference.view(torch.uint8)
        )


def test_transformers_reload_matches_the_simulation(exported):
    recipe, out = exported
    ver = json.loads((out / "ptq-export.json").read_text())["verification"]
    assert ver["passed"] and not ver["problems"]
    assert ver["load"]["input_quantized_layers"] == 14 and not ver["load"]["unexpected_keys"]
    assert ver["kl_div"] <= ver["tolerance"]["max_kl_div"] and abs(ver["ppl_delta_pct"]) < 0.01
    assert (
        ver["tensors_checked_in_file"] == 3 * 14
        and not ver["tensors_differing"]
        and "bit for bit" in ver["criterion"]
    )
    card = (out / "README.md").read_text()
    assert "float-order noise floor" in card and "bit for bit" in card
    # under the default --target vllm, ptq's own simulation of static FP8 inputs (x * (1 / scale), engines rule 5)
    # is not transformers' (x / scale): reported next to the gate; int8 inputs round as the loaders do
    own = {"fp8-e4m3": "vLLM's x * (1 / scale) for static FP8 inputs", "int8": None}[recipe]
    assert ver["ptq_rounding"] == own and (own is None or own in card)


def test_the_reload_check_simulates_the_loaders_division_and_compare_vllms_reciprocal(
    tiny_model, tmp_path
):
    from ptq.calibration.calibrate import calibrate
    from ptq.evaluation.data import load_corpus, make_windows
    from ptq.export import verify as export
    from ptq.models.loading import load_model
    from ptq.quantization.plan import calibrated_layers
    from ptq.quantization.quantize import QuantLinear
    from ptq.quantization.recipes import load_recipe

    recipe = load_recipe("fp8-e4m3")
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 3)
    for loader_inputs, reciprocal in ((True, False), (False, True)):
        loaded = load_model(str(tiny_model))
        windows = make_windows(
            load_corpus(str(text), "calibration"), loaded.tokenizer, 64, 2
        ).input_ids
        calibration = calibrate(loaded.model, windows, calibrated_layers(loaded.model, recipe))
        simulated = export.simulate_export(
            loaded.model, recipe, calibration, loader_inputs, target="vllm"
        )
        layers = [
            m
            for m in simulated.modules()
            if isinstance(m, QuantLinear) and m.inputs.format.bits == 8
        ]
        assert layers and all(m.inputs.reciprocal == reciprocal for m in layers)


def test_the_reload_check_quantizes_the_kv_cache_where_its_loader_does(
    tiny_model, ptq_cli, text_file, tmp_path
):
    """transformers 5.17 (with compressed-tensors 0.20) quantizes the KV cache itself from the checkpoint's k_scale and
    v_scale, where 5.24 leaves them unused: reload says which (kv_cache_quantized), and the check's simulation
    quantizes the KV cache in the first case only (the KV-cache exports of tests/test_schemes.py verify under both:
    checked under 5.17 in a venv of its own)."""
    from ptq.calibration.calibrate import load_calibration
    from ptq.export import verify as export
    from ptq.models.loading import load_model
    from ptq.quantization.recipes import load_recipe

    calib = tmp_path / "calib.safetensors"
    args = ("--data", text_file, "--samples", "2", "--seq-len", "32", "-q")
    assert ptq_cli("calibrate", tiny_model, "--recipe", "fp8-e4m3+kv", "-o", calib, *args)[0] == 0
    recipe, calibration = load_recipe("fp8-e4m3+kv"), load_calibration(calib)
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    logits, quantizers = {}, {}
    for kv_cache in (False, True):
        simulated = export.simulate_export(
            load_model(str(tiny_model)).model, recipe, calibration, target="vllm", kv_cache=kv_cache
        )
        quantizers[kv_cache] = sum(len(getattr(m, "kv_cache", ())) for m in simulated.modules())
        logits[kv_cache] = simulated(input_ids=ids).logits
    assert quantizers == {False: 0, True: 4}  # K and V of each of the 2 layers
    assert not torch.equal(logits[False], logits[True])


def test_verification_fails_on_a_wrong_scale(exported, tiny_model, tmp_path):
    """The check can fail: a checkpoint whose input scales are off, or with one layer's weight_scale x2, is caught
    (by the files and by the logits), and so is a load that drops the static input quantization (dequantize=True);
    the correct checkpoint passes, with the noise floor measured."""
    import shutil

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from ptq.calibration.calibrate import calibrate
    from ptq.evaluation.data import load_corpus, make_windows
    from ptq.export import verify as export
    from ptq.export.checkpoint import export_layers
    from ptq.export.reading import reload
    from ptq.export.record import Verification
    from ptq.models.loading import load_model
    from ptq.models.names import checkpoint_names
    from ptq.quantization.plan import calibrated_layers
    from ptq.quantization.recipes import load_recipe

    recipe_name, out = exported
    recipe = load_recipe(recipe_name)
    loaded = load_model(str(tiny_model))
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 3)
    windows = make_windows(load_corpus(str(text), "calibration"), loaded.tokenizer, 64, 4).input_ids
    calibration = calibrate(loaded.model, windows, calibrated_layers(loaded.model, recipe))
    quantized = export_layers(loaded.model, recipe)[0]
    disk = checkpoint_names(loaded.model, [f"{name}.weight" for name in quantized])
    simulated = export.simulate_export(
        loaded.model, recipe, calibration, target="vllm"
    )  # as exported
    expected = export.simulated_tensors(simulated, disk, [])
    assert len(expected) == 3 * 14

    def verify(directory: Path) -> Verification:
        reloaded, info = reload(directory)
        return export.verify(
            simulated, reloaded, info, 14, windows, expected_tensors=expected, directory=directory
        )

    good = verify(out)
    assert good.passed and good.tensors_checked_in_file == 42 and not good.tensors_differing
    assert good.noise_floor.kl_div >= 0 and "eager instead of sdpa" in good.noise_floor.what
    for name, change in (
        ("input_scale", lambda k: k.endswith(".input_scale")),
        ("weight_scale", lambda k: k == "model.layers.1.mlp.down_proj.weight_scale"),
    ):
        bad = tmp_path / f"bad-{name}"
        shutil.copytree(out, bad)
        for f in bad.glob("model-*.safetensors"):
            tensors = safetensors.torch.load_file(str(f))
            tensors = {
                k: v * (3 if name == "input_scale" else 2) if change(k) else v
                for k, v in tensors.items()
            }
            safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})
        result = verify(bad)
        assert not result.passed and any("KL" in p for p in result.problems)
        assert any("differ from ptq's" in p for p in result.problems)
        assert len(result.tensors_differing) == (14 if name == "input_scale" else 1)

    dense = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    info = {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "quantized_layers": 0,
        "input_quantized_layers": 0,
    }
    result = export.verify(simulated, dense.eval(), info, 14, windows)
    assert not result.passed and any("input quantization in 0 of 14" in p for p in result.problems)


def test_compare_accepts_an_exported_directory(exported, ptq_run, tmp_path):
    """ptq compare DIR evaluates the dequantized weights; re-quantizing them with the export's recipe
    reproduces the stored codes exactly."""
    from ptq.models.loading import load_model
    from ptq.quantization.quantize import quantize_weight
    from ptq.quantization.recipes import load_recipe

    recipe_name, out = exported
    loaded = load_model(str(out))
    assert (
        "compressed-tensors checkpoint" in loaded.caveats[0]
        and "its 8-bit weights dequantized" in loaded.caveats[0]
    )
    tensors = read_checkpoint(out)
    recipe = load_recipe(recipe_name)
    layer = "model.layers.0.mlp.down_proj"
    w = loaded.model.get_submodule(layer).weight
    assert type(loaded.model.get_submodule(layer)) is torch.nn.Linear
    assert torch.equal(w, tensors[f"{layer}.weight"].float() * tensors[f"{layer}.weight_scale"])
    codes, scale = quantize_weight(w, recipe.weights)
    assert codes.dtype == tensors[f"{layer}.weight"].dtype
    assert torch.equal(codes.view(torch.uint8), tensors[f"{layer}.weight"].view(torch.uint8))

    code, stdout, stderr = ptq_run(
        "compare", out, recipes=recipe_name, calib_samples=2, max_windows=2, out=tmp_path / "cmp"
    )
    assert code == 0, stderr
    results = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert "compressed-tensors checkpoint" in results["model"]["caveats"][0]


def test_refusals_leave_nothing_behind(tiny_model, ptq_cli, text_file, tmp_path):
    common = ["--data", text_file, "--samples", "2", "--seq-len", "32", "--no-verify", "-q"]
    code, _, err = ptq_cli(
        "quantize", tiny_model, "--recipe", "fp8-e5m2", "-o", tmp_path / "a", *common
    )
    assert code == 2 and "E4M3 and int8 only" in err and not (tmp_path / "a").exists()
    code, _, err = ptq_cli(
        "quantize", tiny_model, "--recipe", "bf16", "-o", tmp_path / "a", *common
    )
    assert code == 2 and not (tmp_path / "a").exists()
    for recipe, message in (
        ("paper-e4m3-pow2", "uses 'pow2' scales"),
        ("paper-e4m3", "quantizes attention inputs"),
        ("paper-e4m3-kv", "quantizes attention and kv_cache inputs"),
        ("int8-smoothquant", "SmoothQuant"),
    ):
        code, _, err = ptq_cli(
            "quantize", tiny_model, "--recipe", recipe, "-o", tmp_path / "a", *common
        )
        assert (
            code == 2
            and message in err
            and len(err.strip().splitlines()) == 1
            and not (tmp_path / "a").exists()
        )

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = ptq_cli("quantize", tiny_model, "-o", mine, *common)
    assert code == 2 and "already exists" in err
    code, _, err = ptq_cli("quantize", tiny_model, "-o", mine, "--force", *common)
    assert code == 2 and "not a ptq export" in err and (mine / "notes.txt").read_text() == "keep me"

    # vLLM serves dynamic inputs per token whatever the checkpoint's strategy says (compressed_tensors_w8a8_fp8.py)
    per_tensor = tmp_path / "dynamic-per-tensor.yaml"
    per_tensor.write_text(
        "name: dpt\nweights: {format: e4m3}\ninputs: {format: e4m3, dynamic: true, granularity: tensor}\n"
    )
    code, _, err = ptq_cli(
        "quantize", tiny_model, "--recipe", per_tensor, "-o", tmp_path / "a", *common
    )
    assert (
        code == 2
        and "vLLM serves a compressed-tensors checkpoint's dynamic inputs per token" in err
    ), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "a").exists()

    tied = tmp_path / "tied.yaml"
    tied.write_text("name: all\nweights: {format: e4m3}\ninputs: {format: e4m3}\nignore: []\n")
    code, _, err = ptq_cli("quantize", tiny_model, "--recipe", tied, "-o", tmp_path / "b", *common)
    assert code == 2 and "tied" in err and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob(".*.tmp"))


# weight x input pairs as vLLM 0.32's compressed-tensors schemes serve them (compressed_tensors.py `_is_fp8_w8a8`,
# `_is_static_tensor_w8a8`, `_is_dynamic_token_w8a8`; schemes/compressed_tensors_w8a8_fp8.py)
E4M3, INT8, DYNAMIC = "{format: e4m3", "{format: int8", ", dynamic: true}"
BLOCK, CHANNEL = ", granularity: block, block_size: [{0}, {1}]}}", ", granularity: channel}"
GROUP = ", granularity: group, group_size: {0}, dynamic: true}}"
VLLM_PAIRS = [
    (E4M3 + "}", E4M3 + "}", None),  # fp8-e4m3
    (E4M3 + CHANNEL, E4M3 + DYNAMIC, None),  # fp8-dynamic
    (E4M3 + BLOCK.format(128, 128), E4M3 + GROUP.format(128), None),  # fp8-block
    (E4M3 + BLOCK.format(64, 64), E4M3 + GROUP.format(64), None),
    (INT8 + CHANNEL, INT8 + "}", None),  # int8
    (INT8 + CHANNEL, INT8 + DYNAMIC, None),
    # block weights with a static input scale: an assert at load
    (
        E4M3 + BLOCK.format(128, 128),
        E4M3 + "}",
        "vLLM refuses block weights with a static input scale",
    ),
    # block weights: inputs served in groups of block_structure[0], whatever the config names
    (E4M3 + BLOCK.format(128, 128), E4M3 + DYNAMIC, "groups of 1 x 128"),
    (E4M3 + BLOCK.format(128, 128), E4M3 + GROUP.format(64), "groups of 1 x 128"),
    (E4M3 + BLOCK.format(64, 128), E4M3 + GROUP.format(128), "groups of 1 x 64"),
    # per-tensor / per-channel weights: dynamic inputs served per token
    (E4M3 + CHANNEL, E4M3 + GROUP.format(128), "per token whatever the checkpoint names"),
    (INT8 + CHANNEL, INT8 + GROUP.format(128), "per token whatever the checkpoint names"),
    # int8 block weights: "No compressed-tensors compatible scheme"
    (INT8 + BLOCK.format(128, 128), INT8 + GROUP.format(128), "int8 block weights"),
]


@pytest.mark.parametrize("weights, inputs, refused", VLLM_PAIRS)
def test_only_pairs_vllm_serves_as_simulated_are_exportable(weights, inputs, refused, tmp_path):
    from ptq.errors import PtqError
    from ptq.export.format import check_exportable
    from ptq.quantization.recipes import load_recipe

    path = tmp_path / "pair.yaml"
    path.write_text(f"name: pair\nweights: {weights}\ninputs: {inputs}\n")
    recipe = load_recipe(str(path))
    if refused is None:
        check_exportable(recipe)
    else:
        with pytest.raises(PtqError, match=re.escape(refused)):
            check_exportable(recipe)


def test_force_replaces_an_earlier_export_and_an_interrupted_one_leaves_nothing(
    tiny_model, ptq_cli, text_file, tmp_path, monkeypatch
):
    from ptq.export import checkpoint as export

    out = tmp_path / "out"
    common = [
        tiny_model,
        "-o",
        out,
        "--data",
        text_file,
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--no-verify",
        "-q",
    ]
    assert ptq_cli("quantize", *common)[0] == 0
    first = (out / "ptq-export.json").read_text()
    assert (
        json.loads(first)["verification"] is None
        and "Not verified" in (out / "README.md").read_text()
    )

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "write_config", interrupted)
    code, _, _ = ptq_cli("quantize", *common, "--force")
    assert (
        code == 130 and (out / "ptq-export.json").read_text() == first
    )  # the earlier export is untouched
    assert not list(tmp_path.glob(".*.tmp"))
    monkeypatch.undo()
    assert ptq_cli("quantize", *common, "--force", "--recipe", "int8")[0] == 0
    assert json.loads((out / "ptq-export.json").read_text())["recipe"]["name"] == "int8"


ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_other_architectures_round_trip(arch, ptq_run, tmp_path):
    """A small random model of each architecture exports, reloads in transformers and matches the simulation."""
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    tokenizer = make_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    torch.manual_seed(0)
    source = tmp_path / arch
    getattr(transformers, model_name)(config).to(torch.bfloat16).save_pretrained(
        source
    )  # a 16-bit checkpoint
    tokenizer.save_pretrained(source)
    out = tmp_path / "out"
    code, stdout, err = ptq_run(
        "quantize", source, recipe="fp8-e4m3", o=out, samples=2, verify_windows=2
    )
    assert code == 0, err
    info = json.loads((out / "ptq-export.json").read_text())
    assert info["verification"]["passed"] and info["format"]["quantized_layers"] == 14
    tensors, original = read_checkpoint(out), read_checkpoint(source)
    assert all(
        tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], v)
        for k, v in original.items()
        if not k.endswith(".weight") or f"{k.removesuffix('.weight')}.weight_scale" not in tensors
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert info["size"]["bytes_saved"] > 0 and "saved" in stdout


def test_a_linear_only_recipe_has_nothing_to_export_in_gpt2(ptq_run, tmp_path):
    """GPT-2 builds its projections from Conv1D: a recipe that targets Linear layers only (lm_head left out)
    quantizes nothing there, and says so (the built-in recipes target Conv1D too: tests/test_families.py)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = make_tokenizer()
    source = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    ).save_pretrained(source)
    tokenizer.save_pretrained(source)
    recipe = tmp_path / "linear-only.yaml"
    recipe.write_text(
        "name: linear-only\ntargets: [Linear]\nweights: {format: e4m3}\ninputs: {format: e4m3}\n"
    )
    code, _, err = ptq_run("quantize", source, recipe=recipe, o=tmp_path / "out", samples=2)
    assert code == 2 and "quantizes no layer" in err and not (tmp_path / "out").exists()


PARTIAL_KV = (
    "name: partial-kv\nweights: {format: e4m3}\ninputs: {format: e4m3}\nkv_cache: {format: e4m3}\n"
)


@pytest.mark.parametrize(
    "family, recipe, message",
    [
        ("mixtral", "int8", "Unsupported FusedMoe scheme"),
        ("gpt_oss", "fp8-e4m3", "stored fused (3-D)"),
        ("gpt2", "fp8-e4m3+kv", "has no k_proj"),
        ("gpt2", "mxfp8", "has Conv1D layers"),
        ("bloom", "fp8-e4m3+kv", "BloomAttention computes attention in its own code"),
        ("llama", "partial-kv", "leaves the KV cache of 'model.layers.1.self_attn.kv_cache.key'"),
        # per-tensor weights with per-token inputs: vLLM's fused-MoE FP8 method asserts block weights at load
        ("mixtral", "tensor-token", "vLLM's fused-MoE FP8 method takes"),
        (
            "qwen3_moe",
            "block-64",
            "quantizes the experts of Qwen3MoeForCausalLM with per-block-64x64",
        ),
    ],
)
def test_pairs_no_loader_takes_are_refused_before_calibration(
    family, recipe, message, ptq_run, tmp_path, monkeypatch, capsys
):
    """int8 experts with static inputs (neither transformers nor vLLM loads them), experts a checkpoint keeps fused, a
    KV cache the checkpoint cannot name or that the plan leaves partly in 16 bits (a checkpoint's kv_cache_scheme
    covers every layer), group scales on Conv1D: one line, exit 2, before any calibration."""

    from ptq.commands import common

    model_dir = tmp_path / family
    families.build(family).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    capsys.readouterr()  # save_pretrained's progress bars
    if recipe == "partial-kv":  # the second layer's K and V left out
        recipe = tmp_path / "partial-kv.yaml"
        recipe.write_text(
            PARTIAL_KV
            + "ignore: [lm_head, 'model.layers.1.self_attn.key', 'model.layers.1.self_attn.value']\n"
        )
    custom = {
        "tensor-token": "weights: {format: e4m3}\ninputs: {format: e4m3, dynamic: true}\n",
        "block-64": "weights: {format: e4m3, granularity: block, block_size: [64, 64]}\n"
        "inputs: {format: e4m3, granularity: group, group_size: 64, dynamic: true}\n",
    }
    if (
        recipe in custom
    ):  # exportable on dense layers (test_only_pairs_vllm_serves_as_simulated_are_exportable)
        (tmp_path / f"{recipe}.yaml").write_text(f"name: {recipe}\n{custom[recipe]}")
        recipe = tmp_path / f"{recipe}.yaml"
    calibrated = []
    monkeypatch.setattr(common, "calibrate_on_text", lambda *a, **k: calibrated.append(1))
    code, _, err = ptq_run(
        "quantize", model_dir, recipe=recipe, samples=2, seq_len=16, o=tmp_path / "out"
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not calibrated and not (tmp_path / "out").exists()
    if (
        family == "mixtral"
    ):  # with the experts left out, transformers still cannot load the int8 checkpoint
        dense = tmp_path / "int8-dense.yaml"
        dense.write_text(
            "name: int8-dense\nweights: {format: int8, granularity: channel}\ninputs: {format: int8}\n"
            "ignore: [lm_head, '*.experts.*']\n"
        )
        code, _, err = ptq_run(
            "quantize", model_dir, samples=None, recipe=dense, seq_len=16, o=tmp_path / "out"
        )
        assert code == 2 and "transformers cannot load" in err and not calibrated


# -- Mixture-of-experts checkpoints: partly quantized experts, Qwen2-MoE's shared expert and its gate ---------


def quantize_cli(ptq_cli, source, recipe, out, text_file, *extra):
    """`ptq quantize` with the small settings of these tests (verified unless told otherwise)."""
    return ptq_cli(
        "quantize",
        source,
        "--recipe",
        recipe,
        "--data",
        text_file,
        "--samples",
        "4",
        "--seq-len",
        "64",
        "--verify-windows",
        "4",
        "-o",
        out,
        "-q",
        *extra,
    )


def test_checkpoint_names_answers_the_names_asked_for_only():
    """The expert stand-ins cover every projection; a caller asking for some expert weights gets those only."""

    from ptq.models.matmuls import linearize
    from ptq.models.names import checkpoint_names

    model = linearize(families.build("qwen3_moe"))
    asked = [
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert checkpoint_names(model, asked) == {name: name for name in asked}


def test_checkpoint_names_survive_a_split_that_squeezes_size_one_dimensions(monkeypatch):
    """transformers 5.17's revert of Mixtral's expert fusion squeezes a size-1 dimension away: the stand-ins are built so
    that their split still reads back 2-D (the name of every expert weight), under such a split too."""
    from transformers import core_model_loading

    from ptq.models.matmuls import linearize
    from ptq.models.names import checkpoint_names

    revert = core_model_loading.revert_weight_conversion

    def squeezing(model, state_dict):
        return {
            k: v.squeeze(-1) if v.shape[-1] == 1 else v
            for k, v in revert(model, state_dict).items()
        }

    model = linearize(families.build("mixtral"))
    asked = [
        "model.layers.0.block_sparse_moe.experts.1.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    names = checkpoint_names(model, asked)
    monkeypatch.setattr(core_model_loading, "revert_weight_conversion", squeezing)
    assert checkpoint_names(model, asked) == names


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "fp8-e4m3"])
def test_a_reload_that_holds_weights_in_16_bits_is_left_to_ptqs_reader(
    recipe, tiny_model, tmp_path, monkeypatch
):
    """Asked for float32, transformers 5.17 dequantizes fused experts into bfloat16: such a reload computes another
    model than the checkpoint's, so reload refuses it, and the check falls back to ptq's own reader with the reason,
    and with that reader's input rounding (dynamic scales; static ones are checked in the files)."""
    import transformers

    from ptq.export import reading as export

    exported = tmp_path / "out"
    common = ["--data", str(tmp_path / "t.txt"), "--samples", "2", "--seq-len", "32", "-q"]
    (tmp_path / "t.txt").write_text(TEXT * 3)
    from_pretrained = transformers.AutoModelForCausalLM.from_pretrained

    def narrowing(
        *args, **kwargs
    ):  # the reload of the export as transformers 5.17 makes it (not ptq's reader's)
        loaded = from_pretrained(*args, **kwargs)
        if Path(args[0]).parent == exported.parent and Path(args[0]).name.startswith(
            (".out", "out")
        ):
            loaded[0].model.layers[0].mlp.register_buffer(
                "held", torch.zeros(1, dtype=torch.bfloat16)
            )
        return loaded

    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setattr(
            sys,
            "argv",
            ["ptq", "quantize", str(tiny_model), "--recipe", recipe, "-o", str(exported), *common],
        )
        mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", narrowing)
        cli.main()
    progress.QUIET = False
    assert e.value.code == 0
    verification = json.loads((exported / "ptq-export.json").read_text())["verification"]
    assert verification["passed"] and "holds 1 tensor(s) in 16 bits" in verification["loader"]
    with pytest.raises(export.PtqError, match="in 16 bits"):
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", narrowing)
        export.reload(exported)


@pytest.mark.parametrize(
    "recipe, sizes",
    [
        ("fp8-dynamic-no-down", {}),  # the recipe leaves every down_proj out
        (
            "fp8-block",
            dict(hidden_size=128, intermediate_size=128, head_dim=32, moe_intermediate_size=200),
        ),
    ],
)
def test_partly_quantized_experts_export_and_verify(recipe, sizes, ptq_cli, text_file, tmp_path):
    """Experts whose down_proj is left out (by the recipe, or by its shape: 200 inputs are not whole 128-wide blocks)
    while gate/up are quantized: each expert's down_proj is written as in the source and named in `ignore`, and the
    checkpoint verifies (fp8-block: by ptq's reader, which transformers needs here)."""

    source = tmp_path / "qwen3-moe"
    families.build("qwen3_moe", **sizes).to(torch.bfloat16).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    if recipe == "fp8-dynamic-no-down":
        path = tmp_path / "no-down.yaml"
        path.write_text(
            "name: fp8-dynamic-no-down\ntargets: [Linear, Conv1D, Experts]\nignore: [lm_head, '*.down_proj']\n"
            "weights: {format: e4m3, granularity: channel}\ninputs: {format: e4m3, granularity: token, dynamic: true}\n"
        )
        recipe = path
    out = tmp_path / "out"
    # vLLM runs each experts module as one FusedMoE of one precision: refused for it, in one line, before any work
    code, _, err = quantize_cli(ptq_cli, source, recipe, out, text_file)
    assert (
        code == 2
        and "one fused layer of one precision" in err
        and "down_proj" in err
        and not out.exists()
    ), err
    assert err.count("error:") == 1 and err.strip().splitlines()[-1].startswith(
        "error:"
    )  # above: the source's saving
    code, _, err = quantize_cli(ptq_cli, source, recipe, out, text_file, "--target", "transformers")
    assert code == 0, err
    tensors, original = read_checkpoint(out), read_checkpoint(source)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for e in range(4):
        down, gate = (
            f"model.layers.1.mlp.experts.{e}.down_proj",
            f"model.layers.1.mlp.experts.{e}.gate_proj",
        )
        assert down in ignore and f"{down}.weight_scale" not in tensors
        assert tensors[f"{down}.weight"].dtype == torch.bfloat16
        assert torch.equal(tensors[f"{down}.weight"], original[f"{down}.weight"])
        assert gate not in ignore and tensors[f"{gate}.weight"].dtype == torch.float8_e4m3fn
        assert f"{gate}.weight_scale" in tensors
    ver = json.loads((out / "ptq-export.json").read_text())["verification"]
    assert ver["passed"] and ver["kl_div"] <= 1e-6 and not ver["tensors_differing"], ver["problems"]


def test_a_partly_quantized_fused_layer_is_refused_for_vllm(
    ptq_cli, tiny_model, text_file, tmp_path
):
    # ignore k_proj alone: q/k/v are one qkv_proj in vLLM, which refuses shards of different precision
    recipe = tmp_path / "no-k.yaml"
    recipe.write_text(
        "name: no-k\nignore: [lm_head, '*.k_proj']\nweights: {format: e4m3}\ninputs: {format: e4m3}\n"
    )
    code, _, err = quantize_cli(ptq_cli, tiny_model, recipe, tmp_path / "out", text_file)
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert "k_proj' would stay in 16 bits while" in err and "q_proj' is quantized" in err


def vllm_accepts_block_shape(output_partition_sizes: list[int], block_n: int = 128) -> bool:
    """vLLM's fp8_utils.validate_fp8_block_shape on one GPU, which compressed_tensors_w8a8_fp8.py calls for block
    weights: a merged layer (qkv_proj, gate_up_proj) whose parts but the last are not whole blocks of block_n rows
    raises "Weight output_partition_size = ... is not divisible by weight quantization block_n"."""
    return all(size % block_n == 0 for size in output_partition_sizes[:-1])


@pytest.mark.parametrize("target", ["vllm", "transformers"])
def test_fp8_block_leaves_out_fused_layers_whose_parts_vllm_cannot_block(target):
    """k_proj of 64 rows (2 KV heads of 32) and gate/up of 200 rows, with 128 inputs: vLLM cannot load q/k/v or
    gate/up as 128 x 128 blocks, so under --target vllm the plan leaves each such fused layer whole in 16 bits, with
    its reason (o_proj stays quantized); transformers runs each Linear alone and takes them all."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ptq.export.checkpoint import export_layers
    from ptq.models.matmuls import linearize
    from ptq.quantization.plan import resolve_plan
    from ptq.quantization.recipes import load_recipe

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=200,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    config.num_key_value_heads = 2
    model = linearize(LlamaForCausalLM(config))
    recipe = load_recipe("fp8-block")
    plan = resolve_plan(model, recipe, target)
    quantized, _, _ = export_layers(model, recipe, plan)
    prefix = "model.layers.0."
    for group in (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ):
        sizes = [model.get_submodule(prefix + n).out_features for n in group]
        assert not vllm_accepts_block_shape(sizes)
        done = [prefix + n in quantized for n in group]
        assert done == [target == "transformers"] * len(group)
    assert prefix + "self_attn.o_proj" in quantized
    if target == "vllm":
        reasons = {x["name"]: x["reason"] for x in plan.coverage()["left_out"]}
        assert "k_proj has 64 output rows" in reasons[prefix + "self_attn.v_proj"]
        assert "gate_proj has 200 output rows" in reasons[prefix + "mlp.up_proj"]


@pytest.fixture(scope="module")
def qwen2_moe_dynamic(tmp_path_factory):
    """A tiny Qwen2-MoE (its shared expert is fed [tokens, hidden] inputs, and gated by a Linear H -> 1) exported with
    fp8-dynamic and verified."""

    root = tmp_path_factory.mktemp("qwen2-moe")
    source, out, text = root / "source", root / "fp8-dynamic", root / "text.txt"
    families.build("qwen2_moe").save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    text.write_text(TEXT * 3)
    argv = ["ptq", "quantize", str(source), "--recipe", "fp8-dynamic", "--data", str(text)]
    argv += ["--samples", "4", "--seq-len", "64", "--verify-windows", "4", "-o", str(out), "-q"]
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setattr(sys, "argv", argv)
        cli.main()
    progress.QUIET = False
    assert e.value.code == 0
    return source, out


def test_the_reload_check_takes_compressed_tensors_token_scales_for_2d_and_4d_inputs(tiny_model):
    """compressed-tensors' dynamic "token" strategy scales a [tokens, features] input as one tensor, a [batch, tokens,
    features] one per token and a [batch, 1, tokens, features] one (DeepSeek-V3's kv_b_proj) per window. The layers the
    check marks so round exactly as compressed-tensors' own functions do, on each shape; the others keep ptq's (and
    vLLM's) per-token scales."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from ptq.export import verify as export
    from ptq.models.loading import load_model
    from ptq.quantization.recipes import load_recipe

    args = QuantizationArgs(
        num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True
    )

    def compressed_tensors(x):
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, torch.nn.Linear(64, 64))
        return fake_quantize(x, scale, zero_point, args)

    marked, plain = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"
    model = load_model(str(tiny_model)).model
    simulated = export.simulate_export(
        model, load_recipe("fp8-dynamic"), None, token_rule_inputs=[marked]
    )
    x = (
        torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
        * torch.logspace(-2, 1, 6)[:, None]
    )
    for shape in ((6, 64), (1, 6, 64), (2, 1, 3, 64), (3, 2, 1, 64)):
        v = x.reshape(shape)
        assert torch.equal(
            simulated.get_submodule(marked).quantize_input(v)[1], compressed_tensors(v)
        ), shape
    per_token = compressed_tensors(x[None])[0]
    assert torch.equal(simulated.get_submodule(plain).quantize_input(x)[1], per_token)
    assert not torch.equal(per_token, compressed_tensors(x))  # the two rules differ on this input
    assert not torch.equal(
        per_token, compressed_tensors(x.reshape(2, 1, 3, 64)).reshape(6, 64)
    )  # nor on 4-D


def test_qwen2_moe_fp8_dynamic_verifies_and_says_where_the_loader_differs(qwen2_moe_dynamic):
    """The shared expert's 2-D inputs: the reload check simulates compressed-tensors' one scale there, so the reloaded
    logits equal the simulation's, and ptq's own (vLLM's per-token) perplexity is reported next to it, with the
    layers named in ptq-export.json and the model card."""
    _, out = qwen2_moe_dynamic
    ver = json.loads((out / "ptq-export.json").read_text())["verification"]
    assert ver["passed"] and ver["kl_div"] == 0 and ver["top1_agreement"] == 1, ver["problems"]
    if ver["loader"].startswith(
        "ptq's dequantizing reader"
    ):  # transformers 5.17 (experts in bf16): no such rule
        assert "in 16 bits" in ver["loader"] and ver["loader_token_rule_layers"] == []
        return
    shared = [
        f"model.layers.{i}.mlp.shared_expert.{p}"
        for i in (0, 1)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert ver["loader_token_rule_layers"] == shared
    assert (
        "6 layer(s) fed inputs other than 3-D" in ver["ptq_rounding"]
        and shared[0] in ver["ptq_rounding"]
    )
    assert (
        ver["ptq_perplexity"] != ver["simulated_perplexity"]
    )  # per token is not one scale per input
    assert ver["ptq_rounding"] in (out / "README.md").read_text()


def test_qwen2_moe_shared_expert_gate_is_left_out_like_the_routers(qwen2_moe_dynamic):
    """vLLM's qwen2_moe.py keeps shared_expert_gate a plain nn.Linear: it stays as stored, in `ignore`, and the
    coverage names it with its reason (the shared expert's own projections are quantized)."""

    from ptq.models.matmuls import linearize
    from ptq.quantization.plan import resolve_plan
    from ptq.quantization.recipes import load_recipe

    source, out = qwen2_moe_dynamic
    tensors, original = read_checkpoint(out), read_checkpoint(source)
    info = json.loads((out / "ptq-export.json").read_text())
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    reasons = {x["name"]: x["reason"] for x in info["coverage"]["left_out"]}
    for i in (0, 1):
        gate = f"model.layers.{i}.mlp.shared_expert_gate"
        assert (
            gate in ignore
            and gate in info["format"]["ignored_layers"]
            and f"{gate}.weight_scale" not in tensors
        )
        assert torch.equal(tensors[f"{gate}.weight"], original[f"{gate}.weight"])
        assert reasons[f"{gate}.weight"].startswith("router (shared-expert gate")
        assert (
            tensors[f"model.layers.{i}.mlp.shared_expert.up_proj.weight"].dtype
            == torch.float8_e4m3fn
        )

    plan = resolve_plan(linearize(families.build("qwen2_moe")), load_recipe("fp8-e4m3"))
    assert not [name for name in plan.quantized if "shared_expert_gate" in name]
    left_out = {x["name"]: x["reason"] for x in plan.coverage()["left_out"]}
    assert left_out["model.layers.0.mlp.shared_expert_gate.weight"].startswith(
        "router (shared-expert gate"
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_routers_that_are_not_linear_layers_are_in_ignore(family, tmp_path):
    """transformers 5's routers are modules of their own (Qwen3MoeTopKRouter, MixtralTopKRouter), not nn.Linear; vLLM
    builds them as ReplicatedLinear, which the "Linear" target matches (qwen3_moe.py passes its quant_config to the
    gate), so a router missing from `ignore` is loaded as an FP8 layer without weight_scale. compressed-tensors lists
    them (get_vllm_module_type: Router / Gate classes count as Linear): every router it lists is in ptq's `ignore`,
    under the checkpoint's name (Mixtral's block_sparse_moe.gate), which vLLM matches, and under the module's name
    that compressed-tensors lists (Mixtral's mlp.gate)."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from ptq.export.checkpoint import plan_checkpoint
    from ptq.export.format import quantization_config
    from ptq.models.matmuls import linearize
    from ptq.quantization.recipes import load_recipe

    recipe = load_recipe("fp8-dynamic")
    model = families.build(family)
    model.save_pretrained(tmp_path / "source")
    on_disk = set(read_checkpoint(tmp_path / "source"))
    apply_quantization_config(model, quantization_config(recipe, ["lm_head"]))
    routers = [n for n in QuantizationConfig.from_pretrained(model).ignore if n != "lm_head"]
    assert routers and all(n.endswith(".mlp.gate") for n in routers)
    _, _, ignore = plan_checkpoint(
        linearize(families.build(family)), recipe, None, {}, target="vllm"
    )
    modules = {n for n, _ in model.named_modules()}
    assert all(
        f"{n}.weight" in on_disk or n in modules for n in ignore
    )  # the names vLLM loads, or transformers'
    for name in routers:  # model.layers.{i}.mlp.gate: that layer's router, as the checkpoint names it, and as its module
        layer = name.removesuffix(".mlp.gate") + "."
        assert sorted(n for n in ignore if n.startswith(layer) and n.endswith(".gate")) == sorted(
            {name, name.replace(".mlp.", ".block_sparse_moe.") if family == "mixtral" else name}
        )


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_exports_fp8_dynamic_and_its_reload_verifies(
    family, ptq_cli, text_file, tmp_path
):
    """Each supported family, a tiny random checkpoint on disk: `ptq quantize --recipe fp8-dynamic` writes it, and
    transformers' reload computes what ptq's simulation of the loader computes (KL 0 here: the same ops), every
    quantized tensor in the files bit for bit ptq's. Where the two loaders' names, attention implementations or input
    shapes differ from the plain case (GPT-NeoX's embed_out, PhiMoE's router, Gemma 2's soft-capped attention without
    sdpa, DeepSeek-V3's 4-D kv_b_proj input) this is what catches it. GPT-OSS, whose experts are stored fused with
    biases, is refused in one line before any work."""
    source = tmp_path / family
    families.build(family).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    out = tmp_path / "out"
    args = ("quantize", source, "--recipe", "fp8-dynamic", "--data", text_file, "--seq-len", "64")
    code, _, err = ptq_cli(*args, "--verify-windows", "2", "-o", out, "-q")
    if family == "gpt_oss":
        assert code == 2 and "have biases and are stored fused (3-D)" in err and not out.exists(), (
            err
        )
        return
    assert code == 0, err
    ver = json.loads((out / "ptq-export.json").read_text())["verification"]
    assert ver["passed"] and ver["kl_div"] == 0 and ver["top1_agreement"] == 1, ver["problems"]
    assert ver["tensors_checked_in_file"] > 0 and not ver["tensors_differing"]
    # the noise floor swaps the attention implementation: transformers 5.25 refuses sdpa for Gemma 2's soft-capped
    # attention, and ptq says so instead of a floor (5.17 runs it)
    if ver["noise_floor"] is None:
        assert family == "gemma2" and ver["no_noise_floor"].startswith(
            "sdpa attention cannot run this model"
        ), ver


@pytest.mark.parametrize("family", sorted(set(families.FAMILIES) - {"gpt_oss"}))
def test_the_loader_quantizes_exactly_the_layers_ptq_quantizes_in_every_family(family):
    """compressed-tensors (what transformers' loader runs) matches the checkpoint's `ignore` against transformers'
    module names, vLLM against the names in the files: where the two differ (GPT-NeoX's lm_head is embed_out in the
    files, PhiMoE's mlp.router is block_sparse_moe.gate), a left-out layer listed under one name only is quantized by
    the other loader, without a weight_scale. Under compressed-tensors' own matching, on the model as transformers
    builds it, the Linear layers the config quantizes are exactly those ptq quantizes (GPT-2's Conv1D layers are ptq's
    reader's; GPT-OSS is refused for export)."""
    from compressed_tensors.quantization import apply_quantization_config

    from ptq.export.checkpoint import plan_checkpoint
    from ptq.export.format import quantization_config
    from ptq.models.matmuls import linearize
    from ptq.quantization.recipes import load_recipe

    recipe = load_recipe("fp8-dynamic")
    _, quantized, ignore = plan_checkpoint(
        linearize(families.build(family)), recipe, None, {}, target="vllm"
    )
    model = families.build(family)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    apply_quantization_config(model, quantization_config(recipe, ignore))
    matched = {
        n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None
    }
    assert matched == set(quantized) & linear
    assert matched or family == "gpt2"


# -- ptq's own reader, remote code, pickle sources ----------------------------------------------------------


@pytest.mark.parametrize("hidden", [128, 256])
def test_ptq_reader_expands_block_scales_by_block_structure(hidden, ptq_cli, text_file, tmp_path):
    """Weights of 200 rows: 128 x 128 tiles, the last row of tiles 72 rows high ([2, 1] or [2, 2] scales). The reader's
    weights are the codes times their tile's scale, expanded here with numpy from the files and block_structure.
    For transformers: vLLM refuses gate/up of 200 rows as one merged layer of blocks (they stay 16-bit for it)."""
    from conftest import save_tiny_llama

    from ptq.export.reading import reload_dequantized

    source = save_tiny_llama(
        tmp_path / "llama", hidden_size=hidden, intermediate_size=200, tie_word_embeddings=False
    )
    out = tmp_path / "out"
    code, _, err = quantize_cli(
        ptq_cli, source, "fp8-block", out, text_file, "--target", "transformers"
    )
    assert code == 0, err
    assert json.loads((out / "ptq-export.json").read_text())["verification"]["passed"]
    rows, cols = json.loads((out / "config.json").read_text())["quantization_config"][
        "config_groups"
    ]["group_0"]["weights"]["block_structure"]
    model, _ = reload_dequantized(out)
    tensors = read_checkpoint(out)
    layers = [k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")]
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale"].shape == (2, hidden // 128)
    for layer in layers:
        codes = tensors[f"{layer}.weight"].float().numpy()
        scale = tensors[f"{layer}.weight_scale"].numpy()
        expanded = np.repeat(np.repeat(scale, rows, 0), cols, 1)[: codes.shape[0], : codes.shape[1]]
        assert np.array_equal(model.get_submodule(layer).weight.numpy(), codes * expanded), layer


REMOTE_CONFIG = "from transformers import LlamaConfig\n\n\nclass PtqTestConfig(LlamaConfig):\n    model_type = 'ptq_test_llama'\n"
REMOTE_MODELING = (
    "from transformers import LlamaForCausalLM\n\nfrom .configuration_ptqtest import PtqTestConfig\n"
    "from .ptqtest_helpers import NOTE\n\n\nclass PtqTestForCausalLM(LlamaForCausalLM):\n"
    "    config_class = PtqTestConfig\n    note = NOTE\n"
)


def test_remote_code_travels_with_the_checkpoint_and_runs_only_when_trusted(
    tiny_model, ptq_cli, text_file, tmp_path
):
    """A model with its own code (auto_map): the export carries the files auto_map names and those they import
    relatively (not the source's other Python files), and both reloads (transformers, ptq's reader) run it with
    --trust-remote-code; without it, the command stops in one line, as loading does."""
    import shutil

    from ptq.errors import PtqError
    from ptq.export.reading import reload_dequantized

    source = tmp_path / "ptq-remote-llama"
    shutil.copytree(tiny_model, source)
    (source / "configuration_ptqtest.py").write_text(REMOTE_CONFIG)
    (source / "modeling_ptqtest.py").write_text(REMOTE_MODELING)
    (source / "ptqtest_helpers.py").write_text("NOTE = 'relative import'\n")
    (source / "unrelated.py").write_text("raise RuntimeError('not part of the model')\n")
    config = json.loads((source / "config.json").read_text())
    config |= {
        "model_type": "ptq_test_llama",
        "architectures": ["PtqTestForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_ptqtest.PtqTestConfig",
            "AutoModelForCausalLM": "modeling_ptqtest.PtqTestForCausalLM",
        },
    }
    (source / "config.json").write_text(json.dumps(config))

    code, _, err = quantize_cli(ptq_cli, source, "fp8-dynamic", tmp_path / "refused", text_file)
    assert (
        code == 2
        and len(err.strip().splitlines()) == 1
        and "which ptq runs only with --trust-remote-code" in err
    ), err
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "ptq-remote-export"
    code, _, err = quantize_cli(
        ptq_cli, source, "fp8-dynamic", out, text_file, "--trust-remote-code"
    )
    assert code == 0, err
    for name in ("configuration_ptqtest.py", "modeling_ptqtest.py", "ptqtest_helpers.py"):
        assert (out / name).read_text() == (source / name).read_text()
    assert not (out / "unrelated.py").exists()
    info = json.loads((out / "ptq-export.json").read_text())
    ver = info["verification"]
    assert ver["passed"] and ver["loader"] == "transformers AutoModelForCausalLM.from_pretrained"
    assert ver["load"]["input_quantized_layers"] == 14
    model, read = reload_dequantized(out, trust_remote_code=True)
    assert type(model).__name__ == "PtqTestForCausalLM" and model.note == "relative import"
    assert read["input_quantized_layers"] == 14 and not read["missing_keys"]
    with pytest.raises(PtqError, match="custom code"):
        reload_dequantized(out)


def test_a_bf16_pickle_source_is_exported_in_bf16(tiny_model, ptq_cli, text_file, tmp_path):
    """A bf16 pytorch_model.bin (--allow-pickle): the tensors ptq does not quantize are written in bf16, as stored, and
    config.json says bfloat16."""
    import shutil

    from ptq.export.checkpoint import source_dtypes

    source = tmp_path / "pickled"
    shutil.copytree(tiny_model, source, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {
        k: v.to(torch.bfloat16)
        for k, v in safetensors.torch.load_file(str(tiny_model / "model.safetensors")).items()
    }
    torch.save(state, source / "pytorch_model.bin")
    assert source_dtypes(str(source)) == {k: torch.bfloat16 for k in state}
    out = tmp_path / "out"
    code, _, err = quantize_cli(ptq_cli, source, "fp8-dynamic", out, text_file, "--allow-pickle")
    assert code == 0, err
    tensors = read_checkpoint(out)
    kept = [
        k for k in tensors if not k.endswith("_scale") and tensors[k].dtype != torch.float8_e4m3fn
    ]
    assert "model.embed_tokens.weight" in kept and "model.norm.weight" in kept
    assert all(
        tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], state[k]) for k in kept
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "ptq-export.json").read_text())["verification"]["passed"]


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_static_input_scales_are_exported_under_the_recipes_observer(
    family, tiny_model, ptq_cli, ptq_run, tmp_path
):
    """A percentile observer clips each static input below its amax: the checkpoint's input_scale is that clip / 448,
    the scale the simulation (compare) uses, for dense layers and experts alike, and the export verifies; not the
    calibration's raw amax / 448."""

    if family == "llama":
        source = tiny_model
    else:
        source = tmp_path / family
        families.build(family).to(torch.bfloat16).save_pretrained(source)
        make_tokenizer().save_pretrained(source)
    recipe = tmp_path / "pct.yaml"
    recipe.write_text(
        "name: pct\ntargets: [Linear, Conv1D, Experts]\nignore: [lm_head]\nweights: {format: e4m3}\n"
        "inputs: {format: e4m3, observer: percentile, percentile: 99.0}\n"
    )
    calib = tmp_path / "calib.safetensors"
    code, _, err = ptq_run("calibrate", source, quiet=None, recipe=recipe, seq_len=64, o=calib)
    assert code == 0, err
    out = tmp_path / "out"
    code, _, err = ptq_cli(
        "quantize",
        source,
        "--recipe",
        recipe,
        "--calib",
        calib,
        "--target",
        "transformers",
        "-o",
        out,
        "-q",
        "--seq-len",
        "64",
        "--verify-windows",
        "4",
    )
    assert code == 0, err
    assert json.loads((out / "ptq-export.json").read_text())["verification"]["passed"]
    from transformers import AutoModelForCausalLM

    from ptq.models.matmuls import linearize
    from ptq.models.names import checkpoint_names

    amax = {
        k.removeprefix("input_amax/"): v
        for k, v in safetensors.torch.load_file(str(calib)).items()
        if "input_amax/" in k
    }
    disk = checkpoint_names(
        linearize(AutoModelForCausalLM.from_pretrained(source)), [f"{k}.weight" for k in amax]
    )
    raw = {
        disk[f"{k}.weight"].removesuffix(".weight"): v for k, v in amax.items()
    }  # by the checkpoint's names
    scales = {
        k.removesuffix(".input_scale"): v
        for k, v in read_checkpoint(out).items()
        if k.endswith(".input_scale")
    }
    assert len(scales) == (14 if family == "llama" else 32) and set(scales) <= set(raw)
    clipped = [k for k in scales if float(scales[k]) < float(raw[k]) / 448 * (1 - 1e-6)]
    assert len(clipped) == len(
        scales
    )  # each below its amax / 448: the 99th percentile, not the max


def test_an_fp8_source_is_exported_from_its_dequantized_weights_in_its_own_dtype(
    tiny_model, ptq_cli, text_file, tmp_path
):
    """An FP8 checkpoint (quant_method fp8: float8 codes, one float32 weight_scale_inv per weight, the rest bf16) is
    quantized from its dequantized weights (codes x scales, here by hand, then per-channel amax / 448). Its
    config.json says bfloat16, the dtype holding the checkpoint's values, not float32, the dtype of most of its
    tensors (the scales), and the tensors ptq does not quantize stay bf16."""
    from test_loading import save_fp8_checkpoint

    fp8 = save_fp8_checkpoint(tiny_model, tmp_path / "fp8")
    out = tmp_path / "out"
    code, _, err = quantize_cli(ptq_cli, fp8, "fp8-dynamic", out, text_file)
    assert code == 0, err
    source, tensors = read_checkpoint(fp8), read_checkpoint(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not [k for k in tensors if k.endswith("_scale_inv")]
    kept = [k for k in tensors if not k.endswith(("_proj.weight", "_scale"))]
    assert kept and all(
        tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], source[k]) for k in kept
    )
    key = "model.layers.1.mlp.down_proj.weight"
    w = source[key].float() * source[key + "_scale_inv"].repeat_interleave(32, 0).repeat_interleave(
        32, 1
    )
    scale = w.abs().amax(dim=1, keepdim=True) / 448  # per output channel
    assert torch.equal(tensors[key.replace(".weight", ".weight_scale")], scale)
    assert torch.equal(
        tensors[key].view(torch.uint8), (w / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    info = json.loads((out / "ptq-export.json").read_text())
    assert info["verification"]["passed"] and "fp8 checkpoint" in info["model"]["caveats"][0]


@pytest.mark.parametrize("target", ["vllm", "transformers"])
def test_a_reload_check_that_would_not_fit_keeps_the_checkpoint_unverified(
    target, tiny_model, ptq_run, tmp_path, monkeypatch
):
    """Memory for 1.5 float32 copies: the model loads, and the check fits under transformers (the reload, one copy) but
    not under vllm, where static FP8 inputs are also simulated as vLLM rounds them (a second copy): the checkpoint is
    then kept, unverified, with the reason, instead of running out of memory after it was written."""
    from ptq.runtime import resources

    free = int(resources.checkpoint_parameters(Path(tiny_model)) * 4 * 1.5)
    monkeypatch.setattr(resources, "available_memory", lambda device: free)
    out = tmp_path / target
    code, _, err = ptq_run("quantize", tiny_model, quiet=None, o=out, target=target, samples=2)
    assert code == 0, err
    info = json.loads((out / "ptq-export.json").read_text())
    if target == "vllm":
        assert info["verification"] is None and "two float32 copies" in info["verification_skipped"]
        assert "Not verified (reloading and comparing" in (out / "README.md").read_text()
    else:
        assert info["verification"]["passed"] and "verification_skipped" not in info
    assert read_checkpoint(out)  # written either way


MIXED_RECIPE = """\
name: mixed
targets: [Linear]
weights: {format: e4m3, granularity: tensor}
inputs: {format: e4m3, granularity: tensor}
overrides:
  - match: ["model.layers.0.mlp.*"]
    keep: bf16
  - match: ["model.layers.1.mlp.*", "model.layers.1.self_attn.o_proj"]
    scheme: fp8-dynamic
"""


def test_a_recipe_with_overrides_exports_a_config_group_per_scheme_and_verifies(
    tiny_model, ptq_run, tmp_path
):
    """fp8 static per-tensor for most layers, fp8-dynamic for some, bf16 for others: one checkpoint,
    a config group per scheme (the overrides' layers by name), reloaded by transformers and checked
    against the simulation; the layer-by-layer export writes the same files."""
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(MIXED_RECIPE)
    out, streamed = tmp_path / "out", tmp_path / "streamed"
    code, stdout, err = ptq_run("quantize", tiny_model, recipe=recipe, o=out, quiet=None, samples=2)
    assert code == 0, err
    assert "verification passed" in stdout and "input quantization in 11/11 layers" in stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = qc["config_groups"]
    assert sorted(groups) == ["group_0", "group_1"] and qc["format"] == "float-quantized"
    assert groups["group_0"]["targets"] == ["Linear"]
    assert groups["group_0"]["input_activations"]["strategy"] == "tensor"
    assert groups["group_1"]["targets"] == [
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    assert groups["group_1"]["weights"]["strategy"] == "channel"
    assert groups["group_1"]["input_activations"]["dynamic"] is True
    assert "model.layers.0.mlp.up_proj" in qc["ignore"] and "lm_head" in qc["ignore"]
    info = json.loads((out / "ptq-export.json").read_text())
    assert info["verification"]["passed"] and info["recipe"]["weights"].endswith(
        "overrides: bf16, e4m3 per-channel"
    )
    tensors = safetensors.torch.load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.up_proj.input_scale" not in tensors  # bf16
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype != torch.float8_e4m3fn
    assert "model.layers.1.mlp.up_proj.input_scale" not in tensors  # dynamic
    assert tensors["model.layers.1.mlp.up_proj.weight_scale"].shape == (128, 1)
    assert tensors["model.layers.1.self_attn.q_proj.input_scale"].shape == (1,)
    code, _, err = ptq_run(
        "quantize", tiny_model, recipe=recipe, o=streamed, samples=2, low_memory=True
    )
    assert code == 0, err
    assert json.loads((streamed / "config.json").read_text())["quantization_config"] == qc
    again = safetensors.torch.load_file(streamed / "model.safetensors")
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k].float(), tensors[k].float()) for k in tensors)


def test_a_recipe_whose_overrides_mix_checkpoint_formats_is_refused(tmp_path):
    from ptq.export.format import check_exportable

    recipe = parse_recipe(
        yaml.safe_load(MIXED_RECIPE.replace("scheme: fp8-dynamic", "scheme: int8")), "mixed.yaml"
    )
    with pytest.raises(
        PtqError, match="mixes float-quantized .'mixed'. and int-quantized .'int8'."
    ):
        check_exportable(recipe)
    bad = yaml.safe_load(MIXED_RECIPE.replace("scheme: fp8-dynamic", "scheme: fp8-e5m2"))
    with pytest.raises(PtqError, match="recipe 'fp8-e5m2' stores weights as e5m2"):
        check_exportable(parse_recipe(bad))
