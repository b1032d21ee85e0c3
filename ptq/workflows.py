"""The commands' work, one function each, so that cli.py only parses and prints.

calibrate: model + calibration text -> amax of every quantized tensor -> calibration file.
compare:   model + recipes (+ calibration) -> bf16 baseline and variants on held-out text -> report.
"""

from __future__ import annotations

import copy
import datetime
import importlib.metadata
import platform
from pathlib import Path

import torch

from ptq import __version__
from ptq.calibrate import Calibration, calibrate, load_calibration, save_calibration, summary_rows
from ptq.data import Corpus, load_corpus, make_windows
from ptq.diagnostics import sqnr_table
from ptq.errors import PtqError
from ptq.evaluate import evaluate
from ptq.files import check_writable
from ptq.formats import get_format
from ptq.models import LoadedModel, load_model
from ptq.quantize import calibrated_layers, quantize_, smoothed_layers
from ptq.recipes import Recipe, load_recipe
from ptq.report import write_report

BASELINE_RECIPE = "bf16"
DEFAULT_RECIPES = ("fp8-e4m3", "int8")


def versions() -> dict[str, str]:
    return {"ptq": __version__, "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"), "python": platform.python_version()}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_calibrate(model: str | None, data: str | None, samples: int, seq_len: int, recipes: list[str],
                  output: Path, force: bool = False, trust_remote_code: bool = False) -> Calibration:
    check_writable(output, force)
    loaded_recipes = [load_recipe(r) for r in recipes]
    corpus = load_corpus(data, role="calibration")  # bad data fails before the (slow) model load
    loaded = load_model(model, trust_remote_code)
    return _calibrate(loaded, corpus, samples, seq_len, loaded_recipes, output, force)


def _calibrate(loaded: LoadedModel, corpus: Corpus, samples: int, seq_len: int, recipes: list[Recipe],
               output: Path | None, force: bool) -> Calibration:
    windows = make_windows(corpus, loaded.tokenizer, seq_len, samples)
    channels = sorted({name for r in recipes for name in smoothed_layers(loaded.model, r)})
    layers = sorted({name for r in recipes for name in calibrated_layers(loaded.model, r)} | set(channels))
    if not layers:
        raise PtqError(f"recipes {', '.join(r.name for r in recipes)} quantize no input with a scale: nothing to calibrate")
    calibration = calibrate(loaded.model, windows.input_ids, layers, channels=channels)
    calibration.metadata = {
        "model": loaded.name, "model_source": loaded.source,
        "data": corpus.source, "data_sha256": corpus.sha256,
        "windows": len(windows.input_ids), "seq_len": windows.seq_len, "tokens": windows.input_ids.numel(),
        "windows_description": windows.description,
        "recipes": [r.name for r in recipes], "layers": len(layers),
        "versions": versions(), "created": now(),
    }
    if output is not None:
        save_calibration(calibration, output, force)
    return calibration


def run_compare(model: str | None, recipes: list[str], calib: Path | None, calib_data: str | None,
                calib_samples: int, eval_data: str | None, seq_len: int, max_windows: int | None,
                out: Path, force: bool = False, batch_size: int = 4, trust_remote_code: bool = False) -> dict:
    for name in ("report.md", "results.json"):
        check_writable(Path(out) / name, force)
    baseline = load_recipe(BASELINE_RECIPE)
    variants = [load_recipe(r) for r in recipes]
    if len({r.name for r in variants} | {baseline.name}) != len(variants) + 1:
        raise PtqError("each recipe may appear once, and not as the baseline 'bf16'")
    calibration = load_calibration(calib) if calib else None
    needs_calibration = [r for r in variants if r.needs_calibration]
    calib_corpus = load_corpus(calib_data, role="calibration") if needs_calibration and calibration is None else None
    eval_corpus = load_corpus(eval_data, role="evaluation")
    loaded = load_model(model, trust_remote_code)
    windows = make_windows(eval_corpus, loaded.tokenizer, seq_len, max_windows)

    if calib_corpus is not None:
        calibration = _calibrate(loaded, calib_corpus, calib_samples, seq_len, needs_calibration, None, force)
        calibration_source = "Calibrated in this run (no --calib file)."
    else:
        calibration_source = f"Calibration file {calib}." if calib else ""

    # Each variant is a quantized copy of the float32 model; the original is then released.
    device = str(next(loaded.model.parameters()).device)
    models = {r.name: quantize_(copy.deepcopy(loaded.model), r, calibration) for r in [baseline, *variants]}
    del loaded.model
    scores = evaluate(models, windows.input_ids, batch_size)

    base = scores[baseline.name]
    results = {
        "model": {"name": loaded.name, "source": loaded.source, "caveats": list(loaded.caveats)},
        "device": device,
        "eval": {"data": eval_corpus.source, "data_sha256": eval_corpus.sha256, "seq_len": windows.seq_len,
                 "stride": windows.seq_len, "windows": len(windows.input_ids), "tokens": base.tokens,
                 "bos": windows.bos, "description": windows.description},
        "protocol": protocol(windows, baseline),
        "baseline": {"name": baseline.name, "recipe": recipe_summary(baseline),
                     "perplexity": base.perplexity, "accuracy": base.accuracy, "window_nll": base.window_nll},
        "variants": [],
        "calibration": None,
        "versions": versions(),
        "created": now(),
    }
    for r in variants:
        s = scores[r.name]
        results["variants"].append({
            "name": r.name, "recipe": recipe_summary(r),
            "perplexity": s.perplexity, "accuracy": s.accuracy,
            "ppl_delta_pct": 100 * (s.perplexity / base.perplexity - 1),
            "accuracy_delta": s.accuracy - base.accuracy,
            "kl_div": s.kl_div, "top1_agreement": s.top1_agreement, "window_nll": s.window_nll,
        })
    if calibration is not None and needs_calibration:
        m = calibration.metadata
        results["calibration"] = {"source": calibration_source, "data": m.get("data"), "data_sha256": m.get("data_sha256"),
                                  "windows": m.get("windows"), "seq_len": m.get("seq_len"), "tokens": m.get("tokens"),
                                  "summary": summary_rows(calibration)}
        results["diagnostics"] = sqnr_table(calibration)
    write_report(Path(out), results, force)
    return results


def recipe_summary(r: Recipe) -> dict:
    return {"name": r.name, "description": r.description, "weights": r.weights.describe(),
            "inputs": r.inputs.describe(), "ignore": list(r.ignore), "source": Path(r.source).name,
            "attention": r.attention.describe() + f" ({', '.join(r.attention_tensors)})" if r.attention else None,
            "kv_cache": r.kv_cache.describe() if r.kv_cache else None, "smoothquant_alpha": r.smoothquant,
            "residual": r.residual.describe() if r.residual else None}


def protocol(windows, baseline: Recipe) -> list[str]:
    int8 = get_format("int8")
    return [
        f"Perplexity: {windows.description}. Each window is scored on its own tokens 2..{windows.seq_len} "
        f"({windows.seq_len - 1} predictions per window, stride {windows.seq_len}, no overlap); "
        f"{'a BOS token starts every window' if windows.bos else 'no BOS token (the tokenizer adds none)'}.",
        "Next-token accuracy: top-1 prediction equals the next token. KL: mean over predicted positions of "
        f"KL(p_{baseline.name} || p_variant) in nats. Top-1 agreement: the variant's top-1 token equals the baseline's.",
        f"Baseline `{baseline.name}`: {baseline.description}; matmuls accumulate in fp32. Embeddings, norms, attention "
        "and activations run in fp32 in every variant, so variants differ only in the Linear layers' weights and inputs, "
        "except where a recipe also quantizes attention's batched-matmul inputs (Q, K, V, softmax output) or the KV cache "
        "(its `attention` / `kv_cache` entries): such variants compute attention the eager way with those inputs rounded.",
        "Quantized Linear: weights quantized once; inputs quantized on every forward with the static per-tensor "
        "scale from calibration; scale = amax / format max; round to nearest even, then saturate to the format's max; "
        "product in fp32. Linear layers a recipe leaves out (lm_head by default) run as in the baseline.",
        f"int8 is symmetric: scale = amax / {int8.max:g}, codes in [-{int8.max:g}, {int8.max:g}] (ModelOpt's convention).",
    ]
