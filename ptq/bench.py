"""`make bench`: speed and memory targets, printed as ratios measured in one run (median of several
repetitions), each with its target and PASS/MISS. Ratios, not seconds, so that they mean the same on
any machine; nothing here is a timed test.

    python -m ptq.bench [--model smollm2] [--windows 4] [--seq-len 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from ptq import progress
from ptq.calibrate import calibrate
from ptq.data import load_corpus, make_windows
from ptq.evaluate import evaluate
from ptq.formats import FORMATS, compute_scale, fake_quantize
from ptq.models import load_model
from ptq.quantize import calibrated_layers, quantize_
from ptq.recipes import load_recipe


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, caches, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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

    # 1. Simulated evaluation against the same evaluation of the unquantized model.
    variants = {r.name: quantize_(copy.deepcopy(model), r, calibration) for r in (e4m3, int8)}
    t_eval_plain = median_time(lambda: evaluate({"plain": model}, ids), args.repeats)
    t_eval = {name: median_time(lambda m=m: evaluate({name: m}, ids), args.repeats) for name, m in variants.items()}

    # 5. The E4M3 quantize-dequantize kernel on a large tensor, next to torch's cast round trip and a copy.
    x = torch.randn(64 * 1024 * 1024 // 4, device=next(model.parameters()).device)  # 64 MiB of float32
    scale = compute_scale(torch.tensor(4.0), FORMATS["e4m3"]).to(x.device)
    t_qdq = median_time(lambda: fake_quantize(x, scale, FORMATS["e4m3"]), args.repeats)
    t_cast = median_time(lambda: (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale, args.repeats)
    t_copy = median_time(lambda: x.clone(), args.repeats)

    print(line("simulated E4M3 evaluation / unquantized evaluation", t_eval["fp8-e4m3"] / t_eval_plain, 1.10))
    print(line("simulated int8 evaluation / unquantized evaluation", t_eval["int8"] / t_eval_plain, 1.10))
    print(line("calibration / plain no-grad forward over the same tokens", t_calib / t_plain_calib, 1.10))
    gbps = lambda t: 2 * x.numel() * 4 / t / 1e9  # read + write of float32
    print(f"INFO  E4M3 quantize-dequantize, 64 MiB: {gbps(t_qdq):.1f} GB/s; torch cast round trip {gbps(t_cast):.1f} GB/s; "
          f"copy {gbps(t_copy):.1f} GB/s (ratio to copy {t_qdq / t_copy:.1f}x)")


if __name__ == "__main__":
    main()
