"""The commands' work, one function each, so that cli.py only parses and prints.

calibrate: model + calibration text -> amax of every quantized tensor -> calibration file.
compare:   model + recipes (+ calibration) -> bf16 baseline and variants on held-out text -> report.
quantize:  model + recipe (+ calibration) -> compressed-tensors checkpoint, reloaded and verified.
"""

from __future__ import annotations

import copy
import datetime
import importlib.metadata
import json
import platform
from pathlib import Path

import torch

from ptq import __version__
from ptq.calibrate import Calibration, calibrate, load_calibration, save_calibration, summary_rows
from ptq.data import load_corpus, make_windows
from ptq.errors import PtqError
from ptq.evaluate import evaluate
from ptq.files import check_writable
from ptq.formats import get_format
from ptq.models import LoadedModel, load_model
from ptq.quantize import calibrated_layers, quantize_
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
    loaded = load_model(model, trust_remote_code)
    return _calibrate(loaded, data, samples, seq_len, loaded_recipes, output, force)


def _calibrate(loaded: LoadedModel, data: str | None, samples: int, seq_len: int, recipes: list[Recipe],
               output: Path | None, force: bool) -> Calibration:
    corpus = load_corpus(data, role="calibration")
    windows = make_windows(corpus, loaded.tokenizer, seq_len, samples)
    layers = sorted({name for r in recipes for name in calibrated_layers(loaded.model, r)})
    if not layers:
        raise PtqError(f"recipes {', '.join(r.name for r in recipes)} quantize no input with a scale: nothing to calibrate")
    calibration = calibrate(loaded.model, windows.input_ids, layers)
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
    loaded = load_model(model, trust_remote_code)
    eval_corpus = load_corpus(eval_data, role="evaluation")
    windows = make_windows(eval_corpus, loaded.tokenizer, seq_len, max_windows)

    needs_calibration = [r for r in variants if r.needs_calibration]
    if needs_calibration and calibration is None:
        calibration = _calibrate(loaded, calib_data, calib_samples, seq_len, needs_calibration, None, force)
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
    write_report(Path(out), results, force)
    return results


def recipe_summary(r: Recipe) -> dict:
    return {"name": r.name, "description": r.description, "weights": r.weights.describe(),
            "inputs": r.inputs.describe(), "ignore": list(r.ignore), "source": Path(r.source).name}


def protocol(windows, baseline: Recipe) -> list[str]:
    int8 = get_format("int8")
    return [
        f"Perplexity: {windows.description}. Each window is scored on its own tokens 2..{windows.seq_len} "
        f"({windows.seq_len - 1} predictions per window, stride {windows.seq_len}, no overlap); "
        f"{'a BOS token starts every window' if windows.bos else 'no BOS token (the tokenizer adds none)'}.",
        "Next-token accuracy: top-1 prediction equals the next token. KL: mean over predicted positions of "
        f"KL(p_{baseline.name} || p_variant) in nats. Top-1 agreement: the variant's top-1 token equals the baseline's.",
        f"Baseline `{baseline.name}`: {baseline.description}; matmuls accumulate in fp32. Embeddings, norms, attention "
        "and activations run in fp32 in every variant, so variants differ only in the Linear layers' weights and inputs.",
        "Quantized Linear: weights quantized once; inputs quantized on every forward with the static per-tensor "
        "scale from calibration; scale = amax / format max; round to nearest even, then saturate to the format's max; "
        "product in fp32. Linear layers a recipe leaves out (lm_head by default) run as in the baseline.",
        f"int8 is symmetric: scale = amax / {int8.max:g}, codes in [-{int8.max:g}, {int8.max:g}] (ModelOpt's convention).",
    ]


def run_quantize(model: str | None, recipe: str, calib: Path | None, data: str | None, samples: int, seq_len: int,
                 output: Path, force: bool = False, verify: bool = True, verify_windows: int = 8,
                 shard_size_mb: float = 1000.0, compare_results: Path | None = None, batch_size: int = 4,
                 trust_remote_code: bool = False) -> dict:
    """quantize: model + recipe (+ calibration) -> compressed-tensors checkpoint in `output`, reloaded with
    transformers and checked against ptq's simulation before it is renamed into place."""
    from ptq import export
    from ptq.files import atomic_dir
    from ptq.progress import progress
    from ptq.report import render_model_card

    output = Path(output)
    check_export_target(output, force)
    r = load_recipe(recipe)
    export.check_exportable(r)
    compare = load_compare_results(compare_results, r.name) if compare_results else None
    calibration = load_calibration(calib) if calib else None
    loaded = load_model(model, trust_remote_code)
    export.export_layers(loaded.model, r)  # refuse an unexportable model before calibrating it
    if calibration is None:
        calibration = _calibrate(loaded, data, samples, seq_len, [r], None, force)
        calibration_source = "calibrated in this run"
    else:
        calibration_source = f"calibration file {Path(calib).name}"
    dtypes = export.source_dtypes(loaded.model.config._name_or_path)
    entries, quantized, ignored = export.plan_checkpoint(loaded.model, r, calibration, dtypes)
    m = calibration.metadata
    info = {
        "kind": "ptq-export/1",
        "model": {"name": loaded.name, "source": loaded.source, "caveats": list(loaded.caveats),
                  "architecture": type(loaded.model).__name__},
        "recipe": recipe_summary(r),
        "format": {"quant_method": "compressed-tensors", "format": export.quantization_config(r, ignored).format,
                   "compressed_tensors": importlib.metadata.version("compressed-tensors"),
                   "quantized_layers": len(quantized), "ignored_layers": ignored},
        "calibration": {"source": calibration_source, "data": m.get("data"), "data_sha256": m.get("data_sha256"),
                        "windows": m.get("windows"), "seq_len": m.get("seq_len"), "tokens": m.get("tokens")},
        "size": export.checkpoint_bytes(entries, quantized),
        "verification": None,
        "compare": compare,
        "versions": versions() | {"compressed-tensors": importlib.metadata.version("compressed-tensors")},
        "created": now(),
    }
    with atomic_dir(output) as tmp:
        with progress("writing", len(entries)) as advance:
            written = export.write_weights(entries, tmp, int(shard_size_mb * 1e6), advance)
        del entries
        info["size"] |= written
        export.write_config(loaded.model, r, ignored, dtypes, tmp)
        loaded.tokenizer.save_pretrained(tmp)
        if verify:
            corpus = load_corpus(data, role="evaluation")
            windows = make_windows(corpus, loaded.tokenizer, seq_len, verify_windows)
            # int8 inputs: the loaders round them over [-128, 127], ptq over [-127, 127]; check the logits against
            # the simulation of what the loader computes, and the perplexity against ptq's own too.
            own = (export.simulate_export(copy.deepcopy(loaded.model), r, calibration, loader_int8_inputs=False)
                   if r.inputs.format.kind == "int" else None)
            simulated = export.simulate_export(loaded.model, r, calibration)
            reloaded, load_info = export.reload(tmp)
            info["verification"] = export.verify(simulated, reloaded, load_info, len(quantized), windows.input_ids,
                                                 batch_size, ptq_simulated=own)
            info["verification"] |= {"data": corpus.source, "data_sha256": corpus.sha256, "description": windows.description}
            del reloaded
            if not info["verification"]["passed"]:
                raise export.VerificationFailed(info)
        (tmp / export.EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        (tmp / "README.md").write_text(render_model_card(info), encoding="utf-8")
    return info


def check_export_target(output: Path, force: bool) -> None:
    """Refuse an existing output without --force; with it, replace only an earlier ptq export or an empty
    directory, never a directory that ptq did not write."""
    from ptq.export import EXPORT_INFO

    check_writable(output, force)
    if output.exists():
        if not output.is_dir():
            raise PtqError(f"{output} exists and is not a directory")
        if any(output.iterdir()) and not (output / EXPORT_INFO).is_file():
            raise PtqError(f"{output} is not a ptq export (no {EXPORT_INFO}): not replacing it, even with --force")


def load_compare_results(path: Path, recipe: str) -> dict:
    """The rows of a `ptq compare` results.json (a file or its directory) for the model card."""
    path = Path(path)
    path = path / "results.json" if path.is_dir() else path
    try:
        r = json.loads(path.read_text(encoding="utf-8"))
        variant = next((v for v in r["variants"] if v["name"] == recipe), None)
        base, ev = r["baseline"], r["eval"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PtqError(f"{path} is not a readable `ptq compare` results.json ({type(e).__name__}: {e})") from None
    if variant is None:
        raise PtqError(f"{path} has no results for recipe '{recipe}' (it compares {', '.join(v['name'] for v in r['variants']) or 'nothing'})")
    return {"file": str(path), "model": r["model"]["name"], "eval": ev.get("description") or ev.get("data"),
            "eval_data": ev.get("data"), "eval_sha256": ev.get("data_sha256"),
            "baseline": {k: base.get(k) for k in ("name", "perplexity", "accuracy")} | {"recipe": base.get("recipe")},
            "variant": {k: variant.get(k) for k in ("name", "perplexity", "accuracy", "ppl_delta_pct", "accuracy_delta",
                                                    "kl_div", "top1_agreement")} | {"recipe": variant.get("recipe")}}
