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
    for what in ("bf16 evaluation", "simulated E4M3 evaluation", "real FP8 evaluation", "calibration"):
        assert re.search(rf"^INFO  {what}\s+[\d,]+ tokens/s .* peak GPU memory", out, flags=re.M), what


def test_the_model_has_llama_3_8b_shapes_by_default():
    import torch

    model = bench_cuda.build_model(torch.device("meta"), 2048, num_hidden_layers=2)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.num_attention_heads, c.num_key_value_heads) == (
        4096,
        14336,
        128256,
        32,
        8,
    )
    assert next(model.parameters()).dtype == torch.bfloat16 and not c.tie_word_embeddings
