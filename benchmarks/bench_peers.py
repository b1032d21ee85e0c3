"""`make bench-peers`: ptq against llm-compressor, the tool users would pick instead, on the same model and the
same calibration tokens: FP8 E4M3 weights and inputs, static per-tensor scales, lm_head left out.

    python -m benchmarks.bench_peers [--model smollm2] [--windows 16] [--seq-len 512] [--peer-python .venv-peers/bin/python]

Each tool runs in a fresh process of its own environment: llm-compressor from .venv-peers (it pins its own
transformers and compressed-tensors; benchmarks/peer_llmcompressor.py), ptq from this one (`--worker`).
Both load the model in float32 outside the timed region, then time
  calibration + quantization in memory: llm-compressor `oneshot`  vs  ptq calibrate + quantize_
  writing the compressed-tensors checkpoint: `save_pretrained(save_compressed=True)`  vs  ptq's export
and each writes a checkpoint, from which both sides' weight_scale and input_scale are read the same way.
One run, not a median: llm-compressor takes minutes. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

import ptq
from ptq import progress
from ptq.errors import PtqError

RATIO_TARGET = 2.0  # ptq at least 2x faster than llm-compressor
# Tolerances for "the same scales (within rounding)"; both tools compute scale = amax / 448 in float32.
# Weight scales come from the same weights by the same max and the same division: they must be identical.
# Input scales come from activations that each tool computes with its own forward (llm-compressor runs the
# model layer by layer as traced subgraphs, in another transformers version): float32 summation order moves
# an activation by a few ulps, compounded over the layers. 1e-4 relative is ~800 float32 ulps and 1000x finer
# than E4M3's own step (12.5% relative), so a scale within it quantizes the same way up to rare ties.
WEIGHT_SCALE_RTOL = 0.0
INPUT_SCALE_RTOL = 1e-4
SCALE_KINDS = ("weight_scale", "input_scale")


# ----------------------------------------------------------------------------------------------
# Reading and comparing scales


def read_scales(directory: Path) -> dict[str, dict[str, float]]:
    """{layer: {"weight_scale": s, "input_scale": s}} of a compressed-tensors checkpoint with per-tensor scales
    (every *.safetensors file in `directory`, as float32 values whatever dtype they are stored in)."""
    scales: dict[str, dict[str, float]] = {}
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise PtqError(f"{directory} has no .safetensors files")
    for path in files:
        with safetensors.safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                layer, _, kind = key.rpartition(".")
                if kind not in SCALE_KINDS:
                    continue
                value = f.get_tensor(key)
                if value.numel() != 1:
                    raise PtqError(
                        f"{path.name}: {key} has {value.numel()} elements, not one per-tensor scale"
                    )
                scales.setdefault(layer, {})[kind] = float(value.float())
    return scales


@dataclass
class ScaleAgreement:
    layers: int  # layers with scales on both sides
    only_in_ours: list[str]
    only_in_theirs: list[str]
    max_rel_diff: dict[str, float]  # per kind, |ours - theirs| / |theirs|, max over layers
    worst_layer: dict[str, str]
    identical: dict[str, int]  # layers whose scale is bit-identical (as float32), per kind

    def agrees(self) -> bool:
        tolerance = {"weight_scale": WEIGHT_SCALE_RTOL, "input_scale": INPUT_SCALE_RTOL}
        return (
            self.layers > 0
            and not self.only_in_ours
            and not self.only_in_theirs
            and all(self.max_rel_diff[k] <= tolerance[k] for k in SCALE_KINDS)
        )


def compare_scales(
    ours: dict[str, dict[str, float]], theirs: dict[str, dict[str, float]]
) -> ScaleAgreement:
    common = sorted(set(ours) & set(theirs))
    max_rel, worst, identical = {}, {}, {}
    for kind in SCALE_KINDS:
        diffs = {}
        for layer in common:
            a, b = ours[layer].get(kind), theirs[layer].get(kind)
            if a is None or b is None:
                diffs[layer] = float("inf")  # a scale one side lacks is a disagreement
            else:
                diffs[layer] = abs(a - b) / abs(b) if b != 0 else (0.0 if a == 0 else float("inf"))
        worst[kind] = max(diffs, key=diffs.get) if diffs else ""
        max_rel[kind] = diffs[worst[kind]] if diffs else float("inf")
        identical[kind] = sum(1 for d in diffs.values() if d == 0)
    return ScaleAgreement(
        len(common),
        sorted(set(ours) - set(theirs)),
        sorted(set(theirs) - set(ours)),
        max_rel,
        worst,
        identical,
    )


# ----------------------------------------------------------------------------------------------
# The ptq side (run in a fresh process with --worker)


def run_ptq_side(model_dir: Path, windows: Path, out: Path, batch_size: int = 4) -> dict:
    """Calibrate and quantize as `ptq calibrate` + `ptq compare` / `ptq quantize` do, timing each step; write the
    checkpoint to out/checkpoint and the timings to out/timing.json."""
    import importlib.metadata

    import compressed_tensors.compressors  # noqa: F401  imported before the clock, as llm-compressor's process has it

    from ptq.calibration.calibrate import calibrate
    from ptq.calibration.clips import quantize_
    from ptq.export import checkpoint as export
    from ptq.models.loading import load_model
    from ptq.quantization.plan import calibrated_layers
    from ptq.quantization.recipes import load_recipe

    progress.QUIET = True
    start = time.perf_counter()
    loaded = load_model(str(model_dir))
    load_s = time.perf_counter() - start
    model = loaded.model
    ids = safetensors.torch.load_file(str(windows))["input_ids"]
    recipe = load_recipe("fp8-e4m3")

    start = time.perf_counter()
    calibration = calibrate(model, ids, calibrated_layers(model, recipe), batch_size=batch_size)
    calibrate_s = time.perf_counter() - start

    # The checkpoint is written from the unquantized model (as `ptq quantize` does), so before quantize_.
    start = time.perf_counter()
    checkpoint = out / "checkpoint"
    checkpoint.mkdir(parents=True)
    dtypes = export.source_dtypes(str(model_dir))
    entries, _, ignored = export.plan_checkpoint(model, recipe, calibration, dtypes)
    export.write_weights(entries, checkpoint, export.DEFAULT_SHARD_BYTES)
    export.write_config(model, recipe, ignored, dtypes, checkpoint)
    save_s = time.perf_counter() - start

    start = time.perf_counter()
    quantize_(model, recipe, calibration)
    quantize_s = time.perf_counter() - start

    # ptq's own version from the package: a checkout on PYTHONPATH (gpu_check.sh) has no installed metadata
    versions = {"ptq": ptq.__version__} | {
        name: importlib.metadata.version(name)
        for name in ("compressed-tensors", "transformers", "torch")
    }
    timing = {
        "load_s": load_s,
        "calibrate_s": calibrate_s,
        "quantize_s": calibrate_s + quantize_s,
        "save_s": save_s,
        "threads": torch.get_num_threads(),
        "batch_size": batch_size,
        "versions": versions,
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    return timing


# ----------------------------------------------------------------------------------------------
# The driver


def model_directory(spec: str) -> Path:
    """The plain Hugging Face directory both tools load: for the offline default, ptq's converted cache."""
    from ptq.models.loading import DEFAULT_MODEL, converted_gguf_dir, default_gguf_path

    if spec == DEFAULT_MODEL:
        return converted_gguf_dir(default_gguf_path())[0]
    if spec.endswith(".gguf"):
        return converted_gguf_dir(Path(spec))[0]
    if not (Path(spec) / "config.json").is_file():
        raise PtqError(
            f"bench-peers needs a local model directory (or 'smollm2' or a .gguf), not '{spec}'"
        )
    return Path(spec)


def run_side(name: str, command: list[str], out: Path) -> dict:
    """Run one side in its own process; its output goes to out/NAME.log (llm-compressor is chatty)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out.parent / f"{name}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise PtqError(f"the {name} run failed (exit {code}); see {out.parent / f'{name}.log'}")
    timing = json.loads((out / "timing.json").read_text())
    timing["process_s"] = time.perf_counter() - start
    return timing


def verdict(ratio: float) -> str:
    return f"{'PASS' if ratio >= RATIO_TARGET else 'MISS'}  ratio {ratio:5.2f} (target >= {RATIO_TARGET:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=16, help="calibration windows (default 16)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument(
        "--batch-size", type=int, default=4, help="windows per forward, the same for both tools"
    )
    parser.add_argument(
        "--peer-python",
        default=".venv-peers/bin/python",
        help="the python of llm-compressor's venv",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="keep the checkpoints and logs here (default: a temp dir)",
    )
    parser.add_argument(
        "--worker", nargs=3, metavar=("MODEL_DIR", "WINDOWS", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        run_ptq_side(
            Path(args.worker[0]), Path(args.worker[1]), Path(args.worker[2]), args.batch_size
        )
        return
    peer_script = Path(__file__).resolve().parent / "peer_llmcompressor.py"
    if not Path(args.peer_python).is_file():
        raise SystemExit(f"error: {args.peer_python} not found: `make bench-peers` creates it")

    from transformers import AutoTokenizer

    from ptq.evaluation.data import load_corpus, make_windows

    model_dir = model_directory(args.model)
    corpus = load_corpus(None, "calibration")
    windows = make_windows(
        corpus, AutoTokenizer.from_pretrained(model_dir), args.seq_len, args.windows
    )
    tmp = args.out or Path(tempfile.mkdtemp(prefix="ptq-bench-peers-"))
    tmp.mkdir(parents=True, exist_ok=True)
    ids_file = tmp / "windows.safetensors"
    safetensors.torch.save_file({"input_ids": windows.input_ids.contiguous()}, str(ids_file))
    print(
        f"ptq bench-peers: {args.model} ({model_dir}), float32 on CPU, {torch.get_num_threads()} threads, batch {args.batch_size}"
    )
    print(f"calibration: {corpus.source}; {windows.description}")

    side_args = [str(model_dir), str(ids_file)]
    theirs = run_side(
        "llm-compressor",
        [
            args.peer_python,
            str(peer_script),
            *side_args,
            str(tmp / "llm-compressor"),
            "--batch-size",
            str(args.batch_size),
        ],
        tmp / "llm-compressor",
    )
    ours = run_side(
        "ptq",
        [
            sys.executable,
            "-m",
            "benchmarks.bench_peers",
            "--batch-size",
            str(args.batch_size),
            "--worker",
            *side_args,
            str(tmp / "ptq"),
        ],
        tmp / "ptq",
    )

    def versions(t: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in t["versions"].items())

    print(f"llm-compressor: {versions(theirs)}")
    print(f"ptq:            {versions(ours)}")
    print("seconds (model load excluded from both)   llm-compressor      ptq")
    print(
        f"  model load (not timed in the ratios)     {theirs['load_s']:14.1f} {ours['load_s']:8.1f}"
    )
    print(
        f"  calibration + quantization in memory     {theirs['quantize_s']:14.1f} {ours['quantize_s']:8.1f}"
        f"   (ptq: calibrate {ours['calibrate_s']:.1f} + quantize_ {ours['quantize_s'] - ours['calibrate_s']:.1f})"
    )
    print(
        f"  writing the compressed-tensors checkpoint {theirs['save_s']:13.1f} {ours['save_s']:8.1f}"
    )
    in_memory = theirs["quantize_s"] / ours["quantize_s"]
    with_save = (theirs["quantize_s"] + theirs["save_s"]) / (ours["quantize_s"] + ours["save_s"])
    print(f"{verdict(in_memory)}  llm-compressor / ptq: calibration + quantization")
    print(
        f"{verdict(with_save)}  llm-compressor / ptq: calibration + quantization + writing the checkpoint"
    )

    agreement = compare_scales(
        read_scales(tmp / "ptq" / "checkpoint"), read_scales(tmp / "llm-compressor" / "checkpoint")
    )
    for kind, rtol in (("weight_scale", WEIGHT_SCALE_RTOL), ("input_scale", INPUT_SCALE_RTOL)):
        print(
            f"  {kind:<12} {agreement.identical[kind]:3d}/{agreement.layers} layers bit-identical; max relative "
            f"difference {agreement.max_rel_diff[kind]:.2e} ({agreement.worst_layer[kind]}); tolerance {rtol:.0e}"
        )
    missing = agreement.only_in_ours + agreement.only_in_theirs
    if missing:
        print(
            f"  layers with scales on one side only: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    print(
        f"{'PASS' if agreement.agrees() else 'MISS'}  same scales within rounding: {agreement.layers} Linear layers, "
        "ptq amax/448 vs llm-compressor weight_scale and input_scale"
    )
    print(f"checkpoints and logs: {tmp}")


if __name__ == "__main__":
    try:
        main()
    except PtqError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
