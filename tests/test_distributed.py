"""Data-parallel evaluation: `torchrun --nproc-per-node 2 -m ptq compare/eval` on the CPU (gloo) gives the numbers
of one process, and only the first process writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ptq.execution import distributed

ARGS = ["--seq-len", "32", "--max-windows", "7", "--quiet"]  # --tasks is refused under torchrun (test_harness.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PTQ_DEVICE="cpu", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "ptq",
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
            assert max(map(len, shares[1:]), default=0) <= len(shares[0]) or len(shares[0]) == min(n, 4)


def test_compare_with_two_processes_gives_the_numbers_of_one(ptq_cli, tiny_model, text_file, tmp_path):
    calib = tmp_path / "c.safetensors"
    code, _, stderr = ptq_cli(
        "calibrate", tiny_model, "--data", text_file, "--samples", "4", "--seq-len", "32", "-o", calib, "--quiet"
    )
    assert code == 0, stderr
    code, _, stderr = ptq_cli(
        "compare", tiny_model, "--calib", calib, "--eval-data", text_file, "--out", tmp_path / "one", *ARGS
    )
    assert code == 0, stderr
    run = torchrun("compare", tiny_model, "--calib", calib, "--eval-data", text_file, "--out", tmp_path / "two", *ARGS)
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert two["eval"] == one["eval"] and one["eval"]["windows"] == 7
    assert numbers(two["baseline"]) == numbers(one["baseline"])
    assert [numbers(v) for v in two["variants"]] == [numbers(v) for v in one["variants"]]
    assert two["variants"][0]["snr_db"]["inputs"]  # measured, on the first process's windows
    assert run.stdout.count("wrote") == 1  # one process printed, one wrote


def test_eval_with_two_processes_gives_the_numbers_of_one(ptq_cli, tiny_model, text_file, tmp_path):
    code, _, stderr = ptq_cli(
        "eval", tiny_model, "--eval-data", text_file, "--tasks", "", "--out", tmp_path / "one", *ARGS
    )
    assert code == 0, stderr
    run = torchrun("eval", tiny_model, "--eval-data", text_file, "--tasks", "", "--out", tmp_path / "two", *ARGS)
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert numbers(two["config"]) == numbers(one["config"])


@pytest.mark.parametrize("value", ["two"])
def test_a_broken_world_size_is_one_line(ptq_cli, tiny_model, text_file, tmp_path, monkeypatch, value):
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
    from ptq.execution import resources

    params = resources.checkpoint_parameters(tiny_model)
    free = {"cpu": params * 4 * 8 - 1, "cuda": params * 4 * 2}
    monkeypatch.setattr(resources, "available_memory", lambda device: free[device.type])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    resources.check_fits(tiny_model, 1, torch.device("cpu"), "model")  # one process: one copy
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")  # two machines of 8 processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(
        PtqError, match=r"x 4 bytes in float32 x 8 processes, each loading its own\) but only .* on cpu"
    ):
        resources.check_fits(tiny_model, 1, torch.device("cpu"), "model")
    free["cpu"] += 1
    resources.check_fits(tiny_model, 1, torch.device("cpu"), "model")
    resources.check_fits(tiny_model, 2, torch.device("cuda", 3), "model")  # one process per GPU: 2 copies fit
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # two processes on each of the 8 GPUs
    with pytest.raises(PtqError, match=r"x 2 copies .* x 2 processes, each loading its own\) .* on cuda"):
        resources.check_fits(tiny_model, 2, torch.device("cuda", 3), "model")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not set by the launcher: every process may be on this machine
    assert resources.processes_sharing(torch.device("cpu")) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(PtqError, match="LOCAL_WORLD_SIZE='eight' is not an integer"):
        resources.processes_sharing(torch.device("cpu"))


FIRST_PROCESS_CALIBRATION = """
import json, sys
from pathlib import Path
import torch
from ptq.calibration.calibrate import calibrate
from ptq.execution import distributed
from ptq.models.loading import load_model

distributed.setup()
rank = distributed.world()[0]
model = load_model(sys.argv[1]).model
# other windows in each process: what other batches (an automatic batch size per GPU) do to the last bits of an amax
ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(rank))
calibration = calibrate(model, ids, ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"], batch_size=2)
amax = {k: float(v) for k, v in calibration.input_amax.items()}
Path(sys.argv[2], f"{rank}.json").write_text(json.dumps(amax))
"""


def test_every_process_uses_the_first_processs_calibration(tiny_model, tmp_path):
    """Under torchrun each process calibrates; when their batches differ (--batch-size auto follows each GPU's free
    memory), so can the last bits of their amax, and the variants each process scores would be different models
    merged into one score. The first process's calibration is used everywhere."""
    import torch

    from ptq.calibration.calibrate import calibrate
    from ptq.models.loading import load_model

    script = tmp_path / "calibrate.py"
    script.write_text(FIRST_PROCESS_CALIBRATION)
    env = dict(os.environ, PTQ_DEVICE="cpu", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(script),
            str(tiny_model),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    model = load_model(str(tiny_model)).model
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    alone = calibrate(model, ids, list(first), batch_size=2)
    assert first == second == {k: float(v) for k, v in alone.input_amax.items()}


@pytest.mark.parametrize("command", ["calibrate", "quantize"])
def test_calibrate_and_quantize_refuse_torchrun_before_any_work(
    command, ptq_cli, tiny_model, text_file, tmp_path, monkeypatch
):
    """Their output is one file or folder, which every process would compute and write alike: one line, exit 2,
    nothing written (no process group joined: WORLD_SIZE alone, no rendezvous, must not hang)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, _, stderr = ptq_cli(command, tiny_model, "--data", text_file, "-o", tmp_path / "out", "--quiet")
    assert code == 2 and f"ptq {command} runs in one process" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_under_torchrun_a_model_too_big_for_the_copies_is_not_switched_to_layer_by_layer(monkeypatch):
    """Layer by layer runs in one process: under torchrun the automatic switch would only be refused after it; the
    memory check's own error (with its process count) is what the user sees instead."""
    from ptq.commands import workflows
    from ptq.commands.options import ModelOptions
    from ptq.execution import streaming

    monkeypatch.setattr(streaming, "too_big", lambda spec, copies=1: True)
    assert workflows._streams(ModelOptions(model="some/dir"), None) is True
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert workflows._streams(ModelOptions(model="some/dir"), None) is False
    assert workflows._streams(ModelOptions(model="some/dir"), True) is True  # asked for: _compute_info refuses it
