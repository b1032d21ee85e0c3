"""Numerical faults in calibration, interruption and resume, determinism (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from ptq.calibration.calibrate import (
    TensorObserver,
    calibrate,
    checkpoint_path,
    fallback_amax,
    load_calibration,
    range_findings,
)
from ptq.commands.common import calibrate_on_text
from ptq.commands.options import CalibrationOptions
from ptq.commands.results import calibration_faults
from ptq.errors import PtqError
from ptq.evaluation.data import load_corpus
from ptq.models.loading import load_model
from ptq.numerics.formats import compute_scale, fake_quantize, get_format
from ptq.quantization.plan import calibration_targets, resolve_plans
from ptq.quantization.recipes import load_recipe
from ptq.reporting.report import faults_lines

REPO = Path(__file__).resolve().parent.parent
FLT_MAX = torch.finfo(torch.float32).max


def edited_model(src: Path, dst: Path, edit) -> Path:
    """A copy of the tiny model directory with `edit(tensors)` applied to its weights."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = safetensors.torch.load_file(str(src / "model.safetensors"))
    edit(tensors)
    safetensors.torch.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def one_error_line(err: str) -> bool:
    """A user-facing failure: exactly one 'error:' line and no traceback (transformers' own loading bar
    may also be on stderr)."""
    return (
        sum(line.startswith("error:") for line in err.splitlines()) == 1 and "Traceback" not in err
    )


def calib_args(model, text_file, out, *extra):
    return (
        "calibrate",
        str(model),
        "--data",
        str(text_file),
        "--samples",
        "24",
        "--seq-len",
        "16",
        "-o",
        str(out),
        "-q",
        *extra,
    )


# 1. Numerical faults -----------------------------------------------------------------------------


def test_nan_weight_is_named_with_its_index(tiny_model, text_file, tmp_path, ptq_cli):
    def poison(t):
        t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")

    model = edited_model(tiny_model, tmp_path / "m", poison)
    for policy in ("fail", "skip"):  # a broken checkpoint is an error under either policy
        code, _, err = ptq_cli(
            *calib_args(model, text_file, tmp_path / "c.st", "--on-nonfinite", policy)
        )
        assert code == 2 and one_error_line(err)
        assert (
            "weight of layer 'model.layers.0.mlp.up_proj' contains NaN (first at index [3, 5])"
            in err
        )
    assert not (tmp_path / "c.st").exists()


def test_nan_weight_without_calibration_is_named_when_quantized(tiny_model, tmp_path, ptq_run):
    # A recipe with dynamic inputs needs no calibration: the weight's own rounding finds the NaN.
    def poison(t):
        t["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")

    model = edited_model(tiny_model, tmp_path / "m", poison)
    code, _, err = ptq_run(
        "compare",
        model,
        calib_data=None,
        calib_samples=None,
        recipes="fp8-e4m3-dynamic",
        seq_len=16,
        max_windows=2,
        out=tmp_path / "r",
    )
    assert code == 2 and one_error_line(err)
    assert "the weight of layer 'model.layers.1.self_attn.o_proj' contains NaN or inf" in err
    assert not (tmp_path / "r" / "results.json").exists()


def test_inf_activation_fails_naming_layer_then_skip_falls_back(
    tiny_model, text_file, tmp_path, ptq_cli
):
    # A finite but huge norm weight (a damaged parameter is refused before any forward pass) makes
    # every input of layer 1 non-finite: each token has an element above 1 after the RMS norm.
    def poison(t):
        t["model.layers.1.input_layernorm.weight"][:] = FLT_MAX

    model = edited_model(tiny_model, tmp_path / "m", poison)
    out = tmp_path / "c.st"
    code, _, err = ptq_cli(*calib_args(model, text_file, out))
    assert code == 2 and one_error_line(err)
    # q_proj is the first layer to see it (the forward order, not the alphabetical one).
    assert (
        "input of layer 'model.layers.1.self_attn.q_proj' contains" in err
        and "calibration batch 0" in err
    )
    assert "--on-nonfinite skip" in err and not out.exists()

    code, _, err = ptq_cli(*calib_args(model, text_file, out, "--on-nonfinite", "skip"))
    assert code == 0, err
    calibration = load_calibration(out)
    m = calibration.metadata
    assert m["nonfinite_batches"]["model.layers.1.self_attn.q_proj"] == 6  # 24 windows / batch 4
    unseen = {u["layer"]: u for u in m["unseen_layers"]}
    assert "model.layers.1.self_attn.q_proj" in unseen
    assert "model.layers.*.self_attn.q_proj" in unseen["model.layers.1.self_attn.q_proj"]["rule"]
    # Its fallback is layer 0's q_proj amax, the only relative that saw finite data.
    assert (
        calibration.input_amax["model.layers.1.self_attn.q_proj"]
        == calibration.input_amax["model.layers.0.self_attn.q_proj"]
    )
    assert "received no calibration data" in err


DAMAGED = {
    "model.layers.1.post_attention_layernorm.weight": [7],
    "model.norm.weight": [0],
    "model.embed_tokens.weight": [5, 3],
}


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "layer-by-layer"])
@pytest.mark.parametrize("command", ["calibrate", "quantize", "eval", "compare"])
@pytest.mark.parametrize("tensor", list(DAMAGED))
def test_a_damaged_parameter_is_named_before_any_forward_pass(
    tiny_model, tmp_path, ptq_run, command, low_memory, tensor
):
    """An inf in a parameter that is not a matmul weight (a norm, the embeddings) is named as itself
    with its first bad element, by every command, in memory and layer by layer, under
    --on-nonfinite skip too: never as a layer's non-finite input, never written to a checkpoint."""
    index = DAMAGED[tensor]

    def poison(t):
        t[tensor][tuple(index)] = float("inf")

    model = edited_model(tiny_model, tmp_path / "m", poison)
    out = tmp_path / "out"
    flags = {"o": out} if command in ("calibrate", "quantize") else {"out": out}
    if command in ("calibrate", "quantize"):
        flags["on_nonfinite"] = "skip"
    if command == "quantize":
        flags["recipe"] = "fp8-e4m3"
    if command == "compare":
        flags["recipes"] = "fp8-e4m3"
    code, _, err = ptq_run(command, model, low_memory=low_memory, **flags)
    assert code == 2 and one_error_line(err), err
    assert f"parameter '{tensor}' contains inf (first at index {index})" in err
    assert "input of layer" not in err
    assert not out.exists() or not any(out.iterdir())


def test_a_damaged_parameter_is_refused_by_a_quantize_that_runs_no_forward_pass(
    tiny_model, tmp_path, ptq_run
):
    """A recipe without calibration, layer by layer: no forward pass, each tensor read as it is
    written, and the damaged one refused there (not copied, not "verification passed")."""

    def poison(t):
        t["model.layers.0.input_layernorm.weight"][2] = float("nan")

    model = edited_model(tiny_model, tmp_path / "m", poison)
    for low_memory in (False, True):
        code, out, err = ptq_run(
            "quantize",
            model,
            data=None,
            samples=None,
            seq_len=None,
            recipe="fp8-e4m3-dynamic",
            low_memory=low_memory,
            o=tmp_path / f"q{low_memory}",
        )
        assert code == 2 and one_error_line(err), err
        assert (
            "parameter 'model.layers.0.input_layernorm.weight' contains NaN (first at index [2])"
            in err
        )
        assert "verification passed" not in out


def test_skip_leaves_exactly_the_bad_batches_out(tiny_model):
    loaded = load_model(str(tiny_model))
    model = loaded.model
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (12, 16))
    layer = "model.layers.0.mlp.down_proj"
    calls = []

    def inject(module, args):  # NaN in batch 1 only, upstream of the observer
        calls.append(1)
        return (args[0] * float("nan"),) if len(calls) == 2 else None

    handle = model.get_submodule(layer).register_forward_pre_hook(inject)
    try:
        with pytest.raises(
            PtqError, match=f"input of layer '{layer}' contains NaN in calibration batch 1"
        ):
            calibrate(model, ids, [layer])
        calls.clear()
        skipped = calibrate(model, ids, [layer], on_nonfinite="skip")
    finally:
        handle.remove()
    # Reference: the same layer calibrated on batches 0 and 2 only, with no fault at all.
    reference = calibrate(model, torch.cat([ids[:4], ids[8:]]), [layer])
    assert torch.equal(skipped.input_amax[layer], reference.input_amax[layer])
    assert skipped.metadata["nonfinite_batches"] == {layer: 1}


class TinyMoE(nn.Module):
    """Three experts; the router sends every token to experts 0 and 1 (x and 2x), never to expert 2."""

    def __init__(self, width: int):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(width, width, bias=False) for _ in range(3)])

    def forward(self, x):
        return self.experts[0](x) + self.experts[1](2 * x)


def test_unseen_expert_gets_its_siblings_amax_and_is_listed(tiny_model, text_file):
    loaded = load_model(str(tiny_model))
    loaded.model.model.layers[0].mlp = TinyMoE(loaded.model.config.hidden_size)
    recipe = load_recipe("fp8-e4m3")
    corpus = load_corpus(str(text_file), "calibration")
    calibration = calibrate_on_text(
        loaded,
        corpus,
        resolve_plans(loaded.model, [recipe]),
        CalibrationOptions(samples=8, seq_len=16),
    )
    e0, e1, e2 = (f"model.layers.0.mlp.experts.{i}" for i in range(3))
    assert calibration.input_amax[e1] == 2 * calibration.input_amax[e0]
    assert (
        calibration.input_amax[e2] == calibration.input_amax[e1]
    )  # the largest sibling, not just any
    assert calibration.metadata["unseen_layers"] == [
        {
            "layer": e2,
            "input_amax": float(calibration.input_amax[e1]),
            "rule": "max input amax of 2 calibrated layer(s) matching model.layers.0.mlp.experts.*",
        }
    ]
    lines = faults_lines(calibration_faults(calibration.metadata))
    assert any(e2 in line and "no calibration data" in line for line in lines)
    with pytest.raises(
        PtqError,
        match=r"1 layer\(s\) received no calibration data, e.g. 'model.layers.0.mlp.experts.2'",
    ):
        calibrate_on_text(
            loaded,
            corpus,
            resolve_plans(loaded.model, [recipe]),
            CalibrationOptions(samples=8, seq_len=16, on_unseen="fail"),
        )


def test_a_fallback_is_never_taken_from_another_unseen_layer():
    """Every batch non-finite in block 1 (--on-nonfinite skip): each of its experts falls back to the largest amax
    of that projection among the experts that were calibrated (block 0's four), and the rule says so; before, the
    second unseen expert of block 1 named the first, itself a fallback, as its '1 calibrated layer'."""
    import families

    from ptq.calibration.calibrate import calibrate
    from ptq.models.matmuls import linearize
    from ptq.quantization.plan import calibration_targets

    model = linearize(families.build("mixtral"))
    layers = [
        n
        for n in calibration_targets(resolve_plans(model, [load_recipe("fp8-e4m3")]).values())[0]
        if ".experts." in n
    ]

    def nan_into_block_1(module, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[0, 0, 0] = float("nan")
        return ((x, *args[1:]), kwargs) if args else (args, kwargs | {"hidden_states": x})

    hook = model.model.layers[1].register_forward_pre_hook(nan_into_block_1, with_kwargs=True)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    calibration = calibrate(model, ids, layers, on_nonfinite="skip")
    hook.remove()
    unseen = calibration.metadata["unseen_layers"]
    assert sorted(u["layer"] for u in unseen) == sorted(
        n for n in layers if n.startswith("model.layers.1.")
    )
    for u in unseen:
        projection = u["layer"].rpartition(".")[2]
        block_0 = [
            calibration.input_amax[f"model.layers.0.mlp.experts.{e}.{projection}"] for e in range(4)
        ]
        assert u["input_amax"] == float(max(block_0))
        assert (
            u["rule"]
            == f"max input amax of 4 calibrated layer(s) matching model.layers.*.mlp.experts.*.{projection}"
        )


def test_per_channel_amax_of_another_length_is_refused(tiny_model, tmp_path):
    """A calibration file whose per-channel input amax has another length than the layer's inputs (damaged, or
    edited) was used: a single value broadcast over every channel into SmoothQuant's factors, silently."""
    from ptq.calibration.calibrate import save_calibration
    from ptq.calibration.clips import quantize_

    model = load_model(str(tiny_model)).model
    recipe = load_recipe("int8-smoothquant")
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    layers, channels = calibration_targets(resolve_plans(model, [recipe]).values())
    layer = "model.layers.0.mlp.down_proj"
    calibration = calibrate(model, ids, layers, channels=channels)
    calibration.metadata |= {
        "data": "t",
        "data_sha256": "0",
        "windows": 4,
        "seq_len": 16,
        "tokens": 64,
    }
    calibration.check_model(model, layers)  # as made
    calibration.input_channel_amax[layer] = calibration.input_channel_amax[layer][:1].clone()
    save_calibration(calibration, tmp_path / "c.st")
    with pytest.raises(
        PtqError,
        match=f"1 per-channel input amax for layer '{layer}', which has 128 input channels: the file is damaged",
    ):
        quantize_(model, recipe, load_calibration(tmp_path / "c.st"))


def test_fallback_amax_prefers_close_relatives():
    seen = {
        "m.layers.0.experts.0.w": torch.tensor(1.0),
        "m.layers.1.experts.0.w": torch.tensor(5.0),
        "m.layers.0.attn.q": torch.tensor(9.0),
    }
    assert fallback_amax("m.layers.0.experts.3.w", seen)[0] == 1.0  # same block first
    value, rule = fallback_amax("m.layers.2.experts.3.w", seen)
    assert value == 5.0 and "m.layers.*.experts.*.w" in rule  # then that projection anywhere
    assert fallback_amax("m.other", seen)[0] == 9.0  # then everything


def test_observer_ignores_nonfinite_batches():
    obs = TensorObserver()
    for x in (
        torch.tensor([1.0, -3.0]),
        torch.tensor([float("inf")]),
        torch.tensor([2.0, float("nan")]),
    ):
        obs(None, (x,))
    assert obs.amax == 3.0 and int(obs.nonfinite) == 2 and obs.finite_batches() == 1


def test_fail_policy_never_lets_a_nonfinite_batch_through():
    """finish, whatever ran the batches: under --on-nonfinite fail a counted non-finite batch is an error, not a
    skipped batch (the layer-by-layer executor once left the lm_head's batches unchecked: they were skipped)."""
    from ptq.calibration.calibrate import finish

    def observers():
        obs = TensorObserver()
        for x in (torch.tensor([1.0]), torch.tensor([float("nan")])):
            obs.observe(x)
        return {"a": obs}

    assert finish(observers(), ["a"], {}, "skip", "fallback").metadata["nonfinite_batches"] == {
        "a": 1
    }
    with pytest.raises(
        PtqError, match=r"input of layer 'a' contains NaN or inf in 1 calibration batch\(es\)"
    ):
        finish(observers(), ["a"], {}, "fail", "fallback")


def test_the_per_batch_check_makes_nothing_for_observers_not_called(monkeypatch):
    """--on-nonfinite fail checks every observer after each batch (layer by layer: after each layer's batch). Those
    not called yet (experts no token reached, later layers) hold the count 0 as an int: the check made a tensor of
    each and, on CUDA, copied it to the GPU, some 10^4 copies per check for a large MoE."""
    from ptq.calibration.calibrate import _fail_on_nonfinite

    observers = {f"layer.{i}": TensorObserver(hist=False) for i in range(1000)}
    observers["layer.0"].observe(torch.tensor([1.0]))
    made = []
    real = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: made.append(1) or real(*a, **k))
    _fail_on_nonfinite(observers, 0, 4)
    assert not made
    observers["layer.7"].observe(torch.tensor([float("inf")]))
    with pytest.raises(
        PtqError, match="input of layer 'layer.7' contains inf in calibration batch 2 "
    ):
        _fail_on_nonfinite(observers, 2, 4)


def test_zero_and_tiny_amax_warn_and_stay_finite():
    e4m3, int8 = get_format("e4m3"), get_format("int8")
    warnings = range_findings(
        [
            ("l", "input", torch.tensor(0.0), e4m3),
            ("l", "weight", torch.tensor(1e-40), e4m3),
            ("l", "input", torch.tensor(2.0), e4m3),
        ]
    )
    assert (
        len(warnings) == 2 and "all zeros" in warnings[0] and "not a normal float32" in warnings[1]
    )
    # The rule's premise, checked directly: tiny and huge amax quantize to finite values within one amax.
    for fmt in (e4m3, get_format("e5m2"), int8):
        for a in (1e-45, 1e-40, 1e-36, 1.0, 1e38):
            x = torch.tensor([a, -a, a / 3, 0.0])
            y = fake_quantize(x, compute_scale(torch.tensor(a), fmt), fmt)
            assert torch.isfinite(y).all() and (y - x).abs().max() <= a


def test_amax_beyond_reach_is_an_error():
    int8 = get_format("int8")
    # FLT_MAX / 127 rounds up, so 127 * scale overflows float32: the largest code dequantizes to inf.
    assert not torch.isfinite(
        fake_quantize(torch.tensor([FLT_MAX]), compute_scale(torch.tensor(FLT_MAX), int8), int8)
    ).all()
    with pytest.raises(
        PtqError, match="weight amax 3.403e\\+38 of layer 'x' is beyond int8's reach"
    ):
        range_findings([("x", "weight", torch.tensor(FLT_MAX), int8)])
    assert range_findings([("x", "weight", torch.tensor(FLT_MAX), get_format("e4m3"))]) == []


def test_all_zero_weight_warns_in_cli_and_file(tiny_model, text_file, tmp_path, ptq_cli):
    def zero(t):
        t["model.layers.0.self_attn.o_proj.weight"].zero_()

    model = edited_model(tiny_model, tmp_path / "m", zero)
    code, _, err = ptq_cli(*calib_args(model, text_file, tmp_path / "c.st"))
    assert code == 0, err
    assert (
        "warning: weight of layer 'model.layers.0.self_attn.o_proj' is all zeros (amax 0): scale 1 is used"
        in err
    )
    assert load_calibration(tmp_path / "c.st").metadata["warnings"] == [
        "weight of layer 'model.layers.0.self_attn.o_proj' is all zeros (amax 0): scale 1 is used"
    ]


# 2. Interruption and resume ----------------------------------------------------------------------

# Runs the CLI in a child process, slowed to 0.4 s per batch so that a test can kill it midway.
SLOW_CLI = """
import sys, time
import ptq.calibration.calibrate as c
forward = c.TensorObserver.__call__
first = []
def hook(self, module, args):
    if not first:
        first.append(module)
    if module is first[0]:  # once per batch
        time.sleep(0.4)
    forward(self, module, args)
c.TensorObserver.__call__ = hook
from ptq.cli import main
sys.argv = ["ptq", *sys.argv[1:]]
main()
"""


def start_slow(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "SOURCE_DATE_EPOCH": "0"}
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint(proc, checkpoint: Path, timeout: float = 90) -> int:
    """Wait until the child has checkpointed at least one batch; return batches_done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if checkpoint.is_file():
            try:
                with safetensors.safe_open(str(checkpoint), framework="pt") as f:
                    return int(f.metadata()["batches_done"])
            except Exception:
                pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no checkpoint appeared")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_calibration_resumes_to_identical_bytes(
    sig, tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    out = tmp_path / "resumed.st"
    args = calib_args(tiny_model, text_file, out, "--checkpoint-every", "0")
    proc = start_slow(args, tmp_path)
    done = wait_for_checkpoint(proc, checkpoint_path(out))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "terminated" in err and "--resume" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    # Nothing that looks complete: no output; the checkpoint is of another kind, refused as a calibration.
    assert not out.exists()
    if sig == signal.SIGTERM:  # unwound normally: no temporary files either
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with safetensors.safe_open(str(checkpoint_path(out)), framework="pt") as f:
        batches_done = int(f.metadata()["batches_done"])
    assert done <= batches_done < 6
    with pytest.raises(PtqError, match="not a ptq calibration file"):
        load_calibration(checkpoint_path(out))

    code, _, err = ptq_cli(*args)  # a plain rerun refuses to clobber the checkpoint
    assert code == 2 and "--resume" in err

    seen = []
    forward = TensorObserver.__call__

    def counting(self, module, args):
        seen.append(1)
        forward(self, module, args)

    monkeypatch.setattr(TensorObserver, "__call__", counting)
    code, _, err = ptq_cli(*args, "--resume")
    assert code == 0, err
    assert len(seen) == 14 * (
        6 - batches_done
    )  # only the batches the checkpoint did not cover were run
    assert not checkpoint_path(out).exists()
    monkeypatch.setattr(TensorObserver, "__call__", forward)

    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, tmp_path / "straight.st"))
    assert code == 0, err
    assert out.read_bytes() == (tmp_path / "straight.st").read_bytes()


def test_resume_refuses_a_checkpoint_of_another_run(
    tiny_model, text_file, tmp_path, ptq_cli, ptq_run
):
    out = tmp_path / "c.st"
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, out, "--resume"))
    assert code == 2 and "no checkpoint to resume from" in err
    proc = start_slow(calib_args(tiny_model, text_file, out, "--checkpoint-every", "0"), tmp_path)
    wait_for_checkpoint(proc, checkpoint_path(out))
    proc.kill()
    proc.communicate(timeout=60)
    # calib_args but for --seq-len: another run
    code, _, err = ptq_run("calibrate", tiny_model, samples=24, seq_len=32, o=out, resume=True)
    assert code == 2 and "was made by a different run" in err
    checkpoint_path(out).write_bytes(b"garbage")
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, out, "--resume"))
    assert code == 2 and "not a readable calibration checkpoint" in err
    code, _, err = ptq_cli(
        *calib_args(tiny_model, text_file, out, "--force")
    )  # --force starts over
    assert code == 0 and not checkpoint_path(out).exists() and out.is_file()


def interrupted_calibration(ptq_cli, monkeypatch, args, after_batches: int) -> None:
    """Run `args` in-process with a checkpoint after every batch, interrupted (Ctrl-C) in batch after_batches + 1."""
    forward, seen = TensorObserver.__call__, []

    def interrupting(self, module, inputs):
        seen.append(1)
        if len(seen) > 14 * after_batches:  # the tiny model's 14 observed Linear layers per batch
            raise KeyboardInterrupt
        forward(self, module, inputs)

    with monkeypatch.context() as m:
        m.setattr(TensorObserver, "__call__", interrupting)
        code, _, err = ptq_cli(*args, "--checkpoint-every", "0")
    assert code == 130 and "--resume" in err, err


def test_resume_refuses_the_other_expert_setting_and_keeps_the_batch_size(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """--calibrate-all-experts and --routed-experts-only give different statistics: a checkpoint of one is not
    resumed with the other. An automatic --batch-size resumes with the checkpoint's; another explicit one is refused."""
    out = tmp_path / "c.st"
    args = calib_args(tiny_model, text_file, out, "--batch-size", "3")  # 24 windows: 8 batches of 3
    interrupted_calibration(ptq_cli, monkeypatch, args, 2)
    with safetensors.safe_open(str(checkpoint_path(out)), framework="pt") as f:
        assert f.metadata()["batches_done"] == "2" and f.metadata()["batch_size"] == "3"
    code, _, err = ptq_cli(*args, "--resume", "--routed-experts-only")
    assert code == 2 and one_error_line(err) and "was made by a different run" in err, err
    assert "--routed-experts-only" in err and not out.exists()
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, out, "--batch-size", "2", "--resume"))
    assert code == 2 and one_error_line(err) and "was made on batches of 3 windows, not 2" in err, (
        err
    )
    assert "--batch-size 3 (or auto)" in err
    code, _, err = ptq_cli(
        *calib_args(tiny_model, text_file, out, "--resume")
    )  # auto: the checkpoint's 3, not 4
    assert code == 0, err
    assert load_calibration(out).metadata["batch_size"] == 3 and not checkpoint_path(out).exists()

    routed = tmp_path / "routed.st"  # and the other way round
    args = calib_args(tiny_model, text_file, routed, "--routed-experts-only")
    interrupted_calibration(ptq_cli, monkeypatch, args, 1)
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, routed, "--resume"))
    assert code == 2 and one_error_line(err) and "was made by a different run" in err, err
    code, _, err = ptq_cli(*args, "--resume")
    assert code == 0, err
    assert load_calibration(routed).metadata["all_experts"] is False


def test_resume_refuses_another_model_whose_calibrated_weights_are_the_same(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """The fingerprint held the calibrated layers' weight amax only: a copy with other norm weights (a fine-tune that
    kept them), or another rope_theta, resumed the first model's checkpoint and mixed the two models' statistics."""
    from safetensors.torch import load_file, save_file
    from test_safety import copy_model

    norms = copy_model(tiny_model, tmp_path / "norms")
    state = load_file(str(norms / "model.safetensors"))
    for name in state:
        if name.endswith("input_layernorm.weight"):
            state[name] = state[name] * 3
    save_file(state, str(norms / "model.safetensors"), metadata={"format": "pt"})
    rope = copy_model(tiny_model, tmp_path / "rope")
    config = json.loads((rope / "config.json").read_text())
    config.setdefault("rope_parameters", {})["rope_theta"] = 100.0
    config["rope_theta"] = 100.0
    (rope / "config.json").write_text(json.dumps(config))
    out = tmp_path / "c.st"
    interrupted_calibration(ptq_cli, monkeypatch, calib_args(tiny_model, text_file, out), 2)
    for other in (norms, rope):
        code, _, err = ptq_cli(*calib_args(other, text_file, out, "--resume"))
        assert code == 2 and one_error_line(err) and "was made by a different run (model," in err, (
            other,
            err,
        )
        assert checkpoint_path(out).exists() and not out.exists()
    code, _, err = ptq_cli(
        *calib_args(tiny_model, text_file, out, "--resume")
    )  # its own model resumes
    assert code == 0 and not checkpoint_path(out).exists(), err


def test_low_memory_calibration_refuses_checkpoint_options_and_says_how_a_leftover_resumes(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """Layer by layer keeps no checkpoint: --checkpoint-every was silently ignored with --low-memory, and a checkpoint
    left by an in-memory run said "pass --resume", which --low-memory then refused. Each is one line that holds."""
    out = tmp_path / "c.st"
    for flag in (("--resume",), ("--checkpoint-every", "5")):
        code, _, err = ptq_cli(*calib_args(tiny_model, text_file, out, "--low-memory", *flag))
        assert (
            code == 2
            and one_error_line(err)
            and f"{flag[0]} is not available with --low-memory" in err
        ), err
    interrupted_calibration(ptq_cli, monkeypatch, calib_args(tiny_model, text_file, out), 2)
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, out, "--low-memory"))
    assert (
        code == 2
        and one_error_line(err)
        and "run without --low-memory and with --resume to continue" in err
    ), err
    code, _, err = ptq_cli(
        *calib_args(tiny_model, text_file, out, "--resume")
    )  # as it says: resumes
    assert code == 0 and out.exists() and not checkpoint_path(out).exists(), err


# 3. Determinism ----------------------------------------------------------------------------------


def test_same_command_gives_identical_bytes(
    tiny_model, text_file, tmp_path, ptq_cli, ptq_run, monkeypatch
):
    def compare(out):
        code, _, err = ptq_run("compare", tiny_model, calib_samples=8, out=out)
        assert code == 0, err

    compare(tmp_path / "a")
    compare(tmp_path / "b")
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert a.pop("created") is not None and b.pop("created") is not None
    assert a == b  # without SOURCE_DATE_EPOCH, only the timestamp may differ
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    compare(tmp_path / "c")
    compare(tmp_path / "d")
    for name in ("results.json", "report.md"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "d" / name).read_bytes()
    assert (
        json.loads((tmp_path / "c" / "results.json").read_text())["created"]
        == "2023-11-14T22:13:20+00:00"
    )
    for name in ("x.st", "y.st"):
        assert ptq_cli(*calib_args(tiny_model, text_file, tmp_path / name))[0] == 0
    assert (tmp_path / "x.st").read_bytes() == (tmp_path / "y.st").read_bytes()


def test_safetensors_header_is_canonical(tmp_path):
    """The safetensors library writes metadata in a random order per process; ours is sorted."""
    code = (
        "import torch, sys; from ptq.files import save_safetensors; from pathlib import Path; "
        "save_safetensors({'b': torch.ones(2), 'a': torch.zeros(())}, Path(sys.argv[1]), "
        "{'kind': 'k', 'zz': '1', 'metadata': '{}', 'aa': '2', 'm': '3'})"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for i in range(3):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{i}.st")], env=env, check=True)
    assert len({(tmp_path / f"{i}.st").read_bytes() for i in range(3)}) == 1
    loaded = safetensors.torch.load_file(str(tmp_path / "0.st"))
    assert torch.equal(loaded["b"], torch.ones(2)) and loaded["a"].shape == ()
    with safetensors.safe_open(str(tmp_path / "0.st"), framework="pt") as f:
        assert f.metadata() == {"kind": "k", "zz": "1", "metadata": "{}", "aa": "2", "m": "3"}
