"""Quantized checkpoints read as models (ptq's own exports, other tools'): a damaged one, or one whose
quantization_config does not say what its tensors hold, is refused in one line (exit 2) by every reader,
in memory and layer by layer (--low-memory), before any weight is used (ptq.models.quantized)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import TEXT

from ptq import cli, progress

LAYER = "model.layers.1.mlp.down_proj"
PATHS = ["--in-memory", "--low-memory"]


def export(source: Path, recipe: str, out: Path, text: Path) -> Path:
    argv = ["ptq", "quantize", str(source), "--recipe", recipe, "--data", str(text), "--samples", "4",
            "--seq-len", "32", "--no-verify", "-o", str(out), "-q"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setattr(sys, "argv", argv)
        cli.main()
    progress.QUIET = False
    assert e.value.code == 0
    return out


@pytest.fixture(scope="module")
def exports(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama exported by ptq quantize: fp8-e4m3 (per-tensor weights, static inputs), int8
    (per-channel weights)."""
    root = tmp_path_factory.mktemp("quantized-inputs")
    text = root / "text.txt"
    text.write_text(TEXT * 3)
    return {r: export(tiny_model, r, root / r, text) for r in ("fp8-e4m3", "int8")}


def damaged(source: Path, target: Path, change=None, config=None) -> Path:
    """A copy of `source` with its tensors changed by `change(dict)` and its quantization_config by
    `config(dict)`."""
    shutil.copytree(source, target)
    if change is not None:
        for f in target.glob("*.safetensors"):
            tensors = safetensors.torch.load_file(str(f))
            change(tensors)
            safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})
    if config is not None:
        data = json.loads((target / "config.json").read_text())
        config(data["quantization_config"])
        (target / "config.json").write_text(json.dumps(data))
    return target


def refused(ptq_run, model: Path, path: str, tmp_path: Path) -> str:
    """`ptq eval` of `model` on `path`: exit 2 with one error line on stderr (besides the notes on
    the run's options), which is returned."""
    code, _, err = ptq_run("eval", model, path, out=tmp_path / f"r{path}", force=True)
    lines = [line for line in err.strip().splitlines() if not line.startswith("note:")]
    err = "\n".join(lines)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return " ".join(err.split())


def scale(k: str = "weight_scale") -> str:
    return f"{LAYER}.{k}"


def set_scale(value: float):
    def change(t):
        t[scale()] = torch.full_like(t[scale()], value)

    return change


DAMAGES = {
    # loaded in memory with a scale of 1 (transformers' initial value): exit 0, wrong weights
    "missing": (lambda t: t.pop(scale()), f"has no '{scale()}'"),
    "negative": (lambda t: t.update({scale(): -t[scale()]}), "must be finite and > 0"),
    "zero": (set_scale(0.0), "holds 0, a scale of"),
    "nan": (set_scale(float("nan")), "holds nan"),
    "inf": (set_scale(float("inf")), "holds inf"),
    # a traceback on both paths (the dequantizer's broadcast)
    "wrong-shape": (
        lambda t: t.update({scale(): torch.cat([t[scale()], t[scale()]])}),
        "has shape [2], but",
    ),
    # static inputs: the layer would run without its input quantization
    "missing-input-scale": (
        lambda t: t.pop(scale("input_scale")),
        f"has no '{scale('input_scale')}'",
    ),
    "negative-input-scale": (
        lambda t: t.update({scale("input_scale"): -t[scale("input_scale")]}),
        "must be finite and > 0",
    ),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_scale_is_refused_in_one_line_by_every_reader(
    damage, path, exports, ptq_run, tmp_path
):
    change, message = DAMAGES[damage]
    model = damaged(exports["fp8-e4m3"], tmp_path / damage, change)
    err = refused(ptq_run, model, path, tmp_path)
    assert message in err and str(model / "model.safetensors") in err, err


@pytest.mark.parametrize("path", PATHS)
def test_a_per_channel_scale_of_the_wrong_shape_is_refused(path, exports, ptq_run, tmp_path):
    """int8 per-channel weights need [out, 1] scales: [out / 2, 1] is named, not broadcast."""
    model = damaged(
        exports["int8"], tmp_path / "int8", lambda t: t.update({scale(): t[scale()][::2].clone()})
    )
    err = refused(ptq_run, model, path, tmp_path)
    assert "has shape [32, 1], but" in err and "channel scales needs [64, 1]" in err, err


def drop_groups(qc):
    del qc["config_groups"]


def as_int(qc):
    qc["config_groups"]["group_0"]["weights"]["type"] = "int"
    qc["config_groups"]["group_0"]["input_activations"]["type"] = "int"
    qc["format"] = "int-quantized"


def token_weights(qc):
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "token"


def sparse_format(qc):
    qc["format"] = "marlin-24"


def four_bits(qc):
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 4


CONFIGS = {
    "no-config-groups": (drop_groups, "no config_groups"),
    "int-config-float-codes": (as_int, "holds F8_E4M3 codes but the quantization_config"),
    "token-weights": (token_weights, "weight strategy 'token', which ptq does not read"),
    "marlin-24": (sparse_format, "'marlin-24', which ptq does not read"),
    "4-bit-in-8-bit-format": (four_bits, "4-bit weights in the 8-bit format 'float-quantized'"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_config_that_does_not_say_what_the_tensors_hold_is_refused_in_one_line(
    case, path, exports, ptq_run, tmp_path
):
    """Other tools' schemes ptq does not read, and a quantization_config that disagrees with the
    tensors, are named in one line rather than misread."""
    config, message = CONFIGS[case]
    model = damaged(exports["fp8-e4m3"], tmp_path / case, config=config)
    assert message in refused(ptq_run, model, path, tmp_path)


def test_the_check_passes_every_layout_ptq_writes(exports):
    """ptq's own exports (per-tensor with static inputs, per-channel) pass the check as written."""
    from ptq.models.quantized import check_quantized_files

    for out in exports.values():
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        check_quantized_files(qc, sorted(out.glob("*.safetensors")), str(out))
