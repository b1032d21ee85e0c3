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
