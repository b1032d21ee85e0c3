"""`python -m benchmarks.bench` on a GPU: ptq's evaluation, calibration and real FP8 matmuls on an 8B-shaped Llama,
printed as ratios measured in one run, each with its target and PASS/MISS (benchmarks/bench.py is the CPU bench).

The model is built directly in GPU memory with random weights, in bf16, with Llama-3-8B's shapes (hidden 4096,
MLP 14336, 32 heads, 8 KV heads, vocab 128256; `--layers` trims the depth to fit the time), nothing read from
disk; the windows are random token ids. Targets:

- bf16 evaluation >= 50% of the matmul roofline measured in the same run: 2 x matmul parameters x tokens/s
  against the FLOP/s of bf16 GEMMs of the model's own shapes (every Linear and the lm_head, at the
  evaluation's batch of tokens);
- simulated E4M3 evaluation <= 1.15x the bf16 evaluation (the same windows and batches, ptq's evaluation loop
  with its metrics);
- real FP8 evaluation (`--matmul fp8`, static per-tensor scales: torch._scaled_mm) >= 1.3x faster than bf16;
- calibration (fp8-e4m3's observers) <= 1.10x a bf16 forward over the same tokens.

    python -m benchmarks.bench [--layers 32] [--windows 16] [--seq-len 2048] [--batch-size 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ptq import progress
from ptq.calibration.calibrate import calibrate
from ptq.calibration.clips import quantize_variants
from ptq.evaluation.evaluate import evaluate
from ptq.quantization.plan import calibrated_layers
from ptq.quantization.recipes import load_recipe

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    num_hidden_layers=32,
)


def build_model(device: torch.device, seq_len: int, **shape) -> torch.nn.Module:
    """A Llama with random weights made in place on `device`, in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **(LLAMA_8B | shape),
        max_position_embeddings=max(8192, seq_len),
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, repeats: int, device: torch.device) -> tuple[float, int]:
    """(median seconds of `repeats` runs after one warm-up, peak memory allocated on the device in bytes)."""
    fn()  # warm-up: compilation, cuBLAS heuristics, the allocator
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return statistics.median(times), peak


def gemm_seconds(
    model: torch.nn.Module, tokens: int, repeats: int, device: torch.device
) -> tuple[float, int]:
    """Seconds of bf16 GEMMs of every Linear shape of the model (and the lm_head) at `tokens` rows, one forward's
    worth; and the FLOPs they do. Each distinct shape is timed once and counted as often as the model has it."""
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[(m.out_features, m.in_features)] = (
                shapes.get((m.out_features, m.in_features), 0) + 1
            )
    total, flops = 0.0, 0
    for (n, k), count in shapes.items():
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        seconds, _ = measure(lambda x=x, w=w: torch.matmul(x, w.t()), max(repeats, 5), device)
        total += count * seconds
        flops += count * 2 * tokens * n * k
        del x, w
    return total, flops


def line(verdict: bool, what: str, value: float, target: str) -> str:
    return f"{'PASS' if verdict else 'MISS'}  {what:<62} {value:6.2f}x  (target {target})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder blocks (32: Llama-3-8B)")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    for name in (
        "hidden",
        "intermediate",
        "vocab",
        "heads",
        "kv-heads",
    ):  # smaller shapes, for a check on a CPU
        parser.add_argument(f"--{name}", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    progress.QUIET = True
    device = torch.device(args.device)
    shape = {
        k: v
        for k, v in (
            ("hidden_size", args.hidden),
            ("intermediate_size", args.intermediate),
            ("vocab_size", args.vocab),
            ("num_attention_heads", args.heads),
            ("num_key_value_heads", args.kv_heads),
        )
        if v is not None
    }
    model = build_model(device, args.seq_len, num_hidden_layers=args.layers, **shape)
    config = model.config
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.windows, args.seq_len), generator=g)
    calib_ids = torch.randint(0, config.vocab_size, (args.windows, args.seq_len), generator=g)
    tokens = ids.numel()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"ptq bench (GPU): {name}; Llama, {args.layers} layers, hidden {config.hidden_size}, MLP "
        f"{config.intermediate_size}, vocab {config.vocab_size}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
        f"parameters ({matmul_params / 1e9:.2f}B in matmuls), bf16, random weights; {args.windows} windows x "
        f"{args.seq_len} tokens, batch {args.batch_size}, median of {args.repeats}; torch {torch.__version__}"
    )

    def forward(
        m, x
    ):  # a plain forward over the windows, batch by batch, as the evaluation runs them
        with torch.inference_mode():
            for batch in x.split(args.batch_size):
                m(input_ids=batch.to(device))

    e4m3 = load_recipe("fp8-e4m3")
    layers = calibrated_layers(model, e4m3)
    t_forward, m_forward = measure(lambda: forward(model, calib_ids), args.repeats, device)
    t_calib, m_calib = measure(
        lambda: calibrate(model, calib_ids, layers, batch_size=args.batch_size),
        args.repeats,
        device,
    )
    calibration = calibrate(model, calib_ids, layers, batch_size=args.batch_size)

    t_bf16, m_bf16 = measure(
        lambda: evaluate({"bf16": model}, ids, args.batch_size), args.repeats, device
    )
    simulated = quantize_variants(model, [e4m3], calibration, matmul="simulated")["fp8-e4m3"]
    t_sim, m_sim = measure(
        lambda simulated=simulated: evaluate({"sim": simulated}, ids, args.batch_size),
        args.repeats,
        device,
    )
    del simulated
    torch.cuda.empty_cache() if device.type == "cuda" else None
    real = quantize_variants(model, [e4m3], calibration, matmul="fp8")["fp8-e4m3"]
    t_fp8, m_fp8 = measure(
        lambda real=real: evaluate({"fp8": real}, ids, args.batch_size), args.repeats, device
    )
    del real

    rows = args.batch_size * args.seq_len
    t_gemm, flops = gemm_seconds(model, rows, args.repeats, device)
    batches = -(-args.windows // args.batch_size)
    gemm_flops_per_s = flops / t_gemm
    model_flops_per_s = 2 * matmul_params * tokens / t_bf16
    roofline = model_flops_per_s / gemm_flops_per_s

    print(
        line(
            roofline >= 0.5,
            "bf16 evaluation / matmul roofline (2 x params x tokens/s)",
            roofline,
            ">= 0.50x",
        )
    )
    print(
        line(
            t_sim / t_bf16 <= 1.15,
            "simulated E4M3 evaluation / bf16 evaluation",
            t_sim / t_bf16,
            "<= 1.15x",
        )
    )
    print(
        line(
            t_bf16 / t_fp8 >= 1.3,
            "real FP8 evaluation speed-up over bf16 (time bf16 / FP8)",
            t_bf16 / t_fp8,
            ">= 1.30x",
        )
    )
    print(
        line(
            t_calib / t_forward <= 1.10,
            "calibration / bf16 forward over the same tokens",
            t_calib / t_forward,
            "<= 1.10x",
        )
    )
    gib = 2**30
    print(
        f"INFO  bf16 GEMMs of the model's shapes at {rows} rows: {gemm_flops_per_s / 1e12:.0f} TFLOP/s "
        f"({t_gemm * 1e3:.1f} ms per forward, {batches} forwards per evaluation); the bf16 evaluation reached "
        f"{model_flops_per_s / 1e12:.0f} TFLOP/s"
    )
    for what, t, peak, n in (
        ("bf16 evaluation", t_bf16, m_bf16, tokens),
        ("simulated E4M3 evaluation", t_sim, m_sim, tokens),
        ("real FP8 evaluation", t_fp8, m_fp8, tokens),
        ("bf16 forward (calibration tokens)", t_forward, m_forward, tokens),
        ("calibration", t_calib, m_calib, tokens),
    ):
        print(
            f"INFO  {what:<36} {n / t:12,.0f} tokens/s  {t:8.2f} s  peak GPU memory {peak / gib:6.1f} GiB"
        )
