"""Data-parallel evaluation: `torchrun --nproc-per-node 2 -m ptq compare/eval` on the CPU (gloo) gives the numbers
of one process, and only the first process writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ptq.runtime import distributed

ARGS = [
    "--seq-len",
    "32",
    "--max-windows",
    "7",
    "--quiet",
]  # --tasks is refused under torchrun (test_harness.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node PROCESSES ARGS...` on the CPU (gloo); ARGS: `-m ptq ...`, or a script and its own."""
    env = dict(os.environ, PTQ_DEVICE="cpu", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            *map(str, args),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def numbers(entry: dict) -> dict:
    keys = ("perplexity", "accuracy", "window_nll", "kl_div", "top1_agreement", "snr_db")
    return {k: entry.get(k) for k in keys}


def test_shares_are_contiguous_cover_everything_and_the_first_holds_the_snr_windows(monkeypatch):
    for n in (0, 1, 3, 7, 10, 101):
        for size in (1, 2, 3, 8):
            shares = []
            for rank in range(size):
                monkeypatch.setenv("RANK", str(rank))
                monkeypatch.setenv("WORLD_SIZE", str(size))
                shares.append(distributed.share(n, first_at_least=4))
            assert [i for s in shares for i in s] == list(range(n))
            assert len(shares[0]) >= min(n, 4)
            assert max(map(len, shares[1:]), default=0) <= len(shares[0]) or len(shares[0]) == min(
                n, 4
            )


@pytest.mark.parametrize("calibration", ["file", "in the run"])
def test_compare_with_two_processes_gives_the_numbers_of_one(
    calibration, ptq_cli, ptq_run, tiny_model, text_file, tmp_path
):
    """With a calibration file, and calibrating in the run (each process on its share of the 3 batches of 4
    windows, the observers merged): the numbers of one process."""
    if calibration == "file":
        calib = ["--calib", tmp_path / "c.safetensors"]
        code, _, stderr = ptq_run("calibrate", tiny_model, o=calib[1])
        assert code == 0, stderr
    else:
        calib = ["--calib-data", text_file, "--calib-samples", "12"]
    code, _, stderr = ptq_cli(
        "compare", tiny_model, *calib, "--eval-data", text_file, "--out", tmp_path / "one", *ARGS
    )
    assert code == 0, stderr
    run = torchrun(
        "-m",
        "ptq",
        "compare",
        tiny_model,
        *calib,
        "--eval-data",
        text_file,
        "--out",
        tmp_path / "two",
        *ARGS,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert two["calibration"] == one["calibration"] and one["calibration"]["windows"] == (
        4 if calib[0] == "--calib" else 12
    )
    assert two["eval"] == one["eval"] and one["eval"]["windows"] == 7
    assert numbers(two["baseline"]) == numbers(one["baseline"])
    assert [numbers(v) for v in two["variants"]] == [numbers(v) for v in one["variants"]]
    assert two["variants"][0]["snr_db"]["inputs"]  # measured, on the first process's windows
    assert run.stdout.count("wrote") == 1  # one process printed, one wrote


def test_eval_with_two_processes_gives_the_numbers_of_one(ptq_cli, tiny_model, text_file, tmp_path):
    code, _, stderr = ptq_cli(
        "eval",
        tiny_model,
        "--eval-data",
        text_file,
        "--tasks",
        "",
        "--out",
        tmp_path / "one",
        *ARGS,
    )
    assert code == 0, stderr
    run = torchrun(
        "-m",
        "ptq",
        "eval",
        tiny_model,
        "--eval-data",
        text_file,
        "--tasks",
        "",
        "--out",
        tmp_path / "two",
        *ARGS,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert numbers(two["config"]) == numbers(one["config"])


@pytest.mark.parametrize("value", ["two"])
def test_a_broken_world_size_is_one_line(
    ptq_cli, tiny_model, text_file, tmp_path, monkeypatch, value
):
    monkeypatch.setenv("WORLD_SIZE", value)
    code, _, stderr = ptq_cli(
        "compare",
        tiny_model,
        "--eval-data",
        text_file,
        "--out",
        tmp_path / "x",
        "--seq-len",
        "32",
        "--max-windows",
        "4",
        "--quiet",
    )
    assert code == 2 and "WORLD_SIZE='two'" in stderr and len(stderr.strip().splitlines()) == 1


def test_the_memory_check_counts_a_copy_per_process_on_the_machine(tiny_model, monkeypatch):
    """Under torchrun every process loads its own float32 copy into the host's memory (from_pretrained): 8 processes
    on one machine need 8 copies, not one (a 70B model on 8 GPUs: 2.2 TB of host memory, not 280 GB)."""
    import torch

    from ptq.errors import PtqError
    from ptq.runtime import resources

    params = resources.checkpoint_parameters(tiny_model)
    free = {"cpu": params * 4 * 8 - 1, "cuda": params * 4 * 2}
    monkeypatch.setattr(resources, "available_memory", lambda device: free[device.type])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    resources.check_fits(tiny_model, 1, torch.device("cpu"), "model")  # one process: one copy
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")  # two machines of 8 processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(
        PtqError,
        match=r"x 4 bytes in float32 x 8 processes, each loading its own\) but only .* on cpu",
    ):
        resources.check_fits(tiny_model, 1, torch.device("cpu"), "model")
    free["cpu"] += 1
    resources.check_fits(tiny_model, 1, torch.device("cpu"), "model")
    resources.check_fits(
        tiny_model, 2, torch.device("cuda", 3), "model"
    )  # one process per GPU: 2 copies fit
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # two processes on each of the 8 GPUs
    with pytest.raises(
        PtqError, match=r"x 2 copies .* x 2 processes, each loading its own\) .* on cuda"
    ):
        resources.check_fits(tiny_model, 2, torch.device("cuda", 3), "model")
    monkeypatch.delenv(
        "LOCAL_WORLD_SIZE"
    )  # not set by the launcher: every process may be on this machine
    assert resources.processes_sharing(torch.device("cpu")) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(PtqError, match="LOCAL_WORLD_SIZE='eight' is not an integer"):
        resources.processes_sharing(torch.device("cpu"))


SHARED_CALIBRATION = """
import json, sys
from pathlib import Path
import torch
from ptq.calibration import calibrate as calibration_module
from ptq.errors import PtqError
from ptq.execution import batching
from ptq.runtime import distributed
from ptq.models.loading import load_model

distributed.setup()
rank = distributed.world()[0]
model = load_model(sys.argv[1]).model
windows = []
model.model.embed_tokens.register_forward_pre_hook(lambda module, args: windows.append(len(args[0])))
# an automatic batch size follows each GPU's free memory: here 2 windows on the first process, 3 on the second
batching.auto_batch_size = lambda *args, **kwargs: 2 + rank
if sys.argv[3] == "nan" and rank == 1:  # a fault in the second process's share only
    model.model.layers[0].register_forward_hook(lambda module, args, out: (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan"))
ids = torch.randint(0, 200, (5, 16), generator=torch.Generator().manual_seed(0))
layers = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
try:
    c = calibration_module.calibrate(model, ids, layers, batch_size=None, channels=layers[:1])
except PtqError as e:
    Path(sys.argv[2], f"{rank}.json").write_text(json.dumps({"error": str(e)}))
    raise SystemExit(2)
result = {
    "windows": windows,
    "amax": {k: float(v) for k, v in c.input_amax.items()},
    "hist": {k: v.tolist() for k, v in c.input_hist.items()},
    "channels": {k: v.tolist() for k, v in c.input_channel_amax.items()},
}
Path(sys.argv[2], f"{rank}.json").write_text(json.dumps(result))
import atexit, torch.distributed as dist
atexit._run_exitfuncs()  # what runs at exit, while the interpreter is whole
Path(sys.argv[2], f"{rank}.left").write_text(str(not dist.is_initialized()))
"""


def test_each_process_calibrates_its_share_and_all_hold_the_one_process_calibration(
    tiny_model, tmp_path
):
    """Under torchrun the calibration batches are split: one batch size for all (the smallest automatic one, 2
    here), the first process runs batches 0-1 (windows 0-3), the second batch 2 (window 4), and the merged
    observers give every process the calibration of one process that ran all three, bit for bit: amax, histograms,
    per-channel amax."""
    import torch

    from ptq.calibration.calibrate import calibrate
    from ptq.models.loading import load_model

    script = tmp_path / "calibrate.py"
    script.write_text(SHARED_CALIBRATION)
    run = torchrun(script, tiny_model, tmp_path, "clean")
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    assert (first["windows"], second["windows"]) == ([2, 2], [1])
    # each process leaves the process group at exit (gloo's threads can abort one that does not)
    assert [(tmp_path / f"{rank}.left").read_text() for rank in (0, 1)] == ["True", "True"]
    model = load_model(str(tiny_model)).model
    ids = torch.randint(0, 200, (5, 16), generator=torch.Generator().manual_seed(0))
    layers = list(first["amax"])
    alone = calibrate(model, ids, layers, batch_size=2, channels=layers[:1])
    expected = {
        "amax": {k: float(v) for k, v in alone.input_amax.items()},
        "hist": {k: v.tolist() for k, v in alone.input_hist.items()},
        "channels": {k: v.tolist() for k, v in alone.input_channel_amax.items()},
    }
    for key, value in expected.items():
        assert first[key] == second[key] == value, key


def test_a_fault_in_one_processs_share_stops_every_process_with_its_message(tiny_model, tmp_path):
    """A NaN in the second process's share (its batch 2, of all processes' batches) stops both processes with the
    same one-line message naming that batch, instead of leaving the first one waiting for the second's statistics."""
    script = tmp_path / "calibrate.py"
    script.write_text(SHARED_CALIBRATION)
    run = torchrun(script, tiny_model, tmp_path, "nan")
    assert run.returncode != 0
    first, second = (
        json.loads((tmp_path / f"{rank}.json").read_text())["error"] for rank in (0, 1)
    )
    assert first == second
    assert "contains NaN in calibration batch 2 (windows 4-5)" in first, first


@pytest.mark.parametrize("command", ["calibrate", "quantize"])
def test_calibrate_and_quantize_refuse_torchrun_before_any_work(
    command, ptq_cli, tiny_model, text_file, tmp_path, monkeypatch
):
    """Their output is one file or folder, which every process would compute and write alike: one line, exit 2,
    nothing written (no process group joined: WORLD_SIZE alone, no rendezvous, must not hang)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, _, stderr = ptq_cli(
        command, tiny_model, "--data", text_file, "-o", tmp_path / "out", "--quiet"
    )
    assert (
        code == 2
        and f"ptq {command} runs in one process" in stderr
        and len(stderr.strip().splitlines()) == 1
    )
    assert not (tmp_path / "out").exists()


def test_under_torchrun_a_model_too_big_for_the_copies_is_not_switched_to_layer_by_layer(
    monkeypatch,
):
    """Layer by layer runs in one process: under torchrun the automatic switch would only be refused after it; the
    memory check's own error (with its process count) is what the user sees instead."""
    from ptq.commands import common
    from ptq.commands.options import ModelOptions
    from ptq.execution import streaming

    monkeypatch.setattr(streaming, "too_big", lambda spec, copies=1: True)
    assert common.runs_layer_by_layer(ModelOptions(model="some/dir"), None) is True
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert common.runs_layer_by_layer(ModelOptions(model="some/dir"), None) is False
    assert (
        common.runs_layer_by_layer(ModelOptions(model="some/dir"), True) is True
    )  # asked for: _compute_info refuses it
