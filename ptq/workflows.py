"""The commands' work, one function each, so that cli.py only parses and prints.

calibrate: model + calibration text -> amax of every quantized tensor -> calibration file.
compare:   model + recipes (+ calibration) -> bf16 baseline and variants on held-out text -> report.
eval:      model + one recipe (+ calibration) -> perplexity and task accuracy of that one configuration.
"""

from __future__ import annotations

import copy
import datetime
import functools
import importlib.metadata
import platform
from pathlib import Path

import numpy as np
import torch

from ptq import __version__, stats
from ptq.calibrate import Calibration, calibrate, load_calibration, save_calibration, summary_rows
from ptq.data import load_corpus, make_windows
from ptq.errors import PtqError
from ptq.evaluate import Scores, TaskRun, evaluate, evaluate_tasks
from ptq.files import check_writable
from ptq.formats import get_format
from ptq.models import LoadedModel, load_model
from ptq.quantize import calibrated_layers, quantize_
from ptq.recipes import Recipe, load_recipe
from ptq.report import render_eval_markdown, write_report
from ptq.tasks import Task, item_correct, load_tasks, parse_task_specs

BASELINE_RECIPE = "bf16"
DEFAULT_RECIPES = ("fp8-e4m3", "int8")
DEFAULT_MAX_ITEMS = 300  # per task; an evenly spaced subset keeps a CPU run to minutes


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
                out: Path, force: bool = False, batch_size: int = 4, trust_remote_code: bool = False,
                tasks: str | None = None, max_items: int | None = DEFAULT_MAX_ITEMS) -> dict:
    for name in ("report.md", "results.json"):
        check_writable(Path(out) / name, force)
    baseline = load_recipe(BASELINE_RECIPE)
    variants = [load_recipe(r) for r in recipes]
    if len({r.name for r in variants} | {baseline.name}) != len(variants) + 1:
        raise PtqError("each recipe may appear once, and not as the baseline 'bf16'")
    calibration = load_calibration(calib) if calib else None
    eval_corpus_once = functools.cache(lambda: load_corpus(eval_data, role="evaluation"))
    task_list = load_tasks(parse_task_specs(tasks), eval_corpus_once, max_items) if tasks else []
    loaded = load_model(model, trust_remote_code)
    eval_corpus = eval_corpus_once()
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
    task_run = evaluate_tasks(models, task_list, loaded.tokenizer, batch_size, _max_len(models)) if task_list else None

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
    results["baseline"].update(window_statistics(base))
    for r in variants:
        s = scores[r.name]
        results["variants"].append({
            "name": r.name, "recipe": recipe_summary(r),
            "perplexity": s.perplexity, "accuracy": s.accuracy,
            "ppl_delta_pct": 100 * (s.perplexity / base.perplexity - 1),
            "accuracy_delta": s.accuracy - base.accuracy,
            "kl_div": s.kl_div, "top1_agreement": s.top1_agreement, "window_nll": s.window_nll,
            **window_statistics(s, base),
        })
    results["statistics"] = stats.describe()
    if task_run is not None:
        results.update(task_results(task_list, task_run, batch_size))
        add_task_metrics(results["baseline"], task_list, task_run)
        for v in results["variants"]:
            add_task_metrics(v, task_list, task_run, baseline.name)
        results["protocol"] += task_protocol(task_list)
    if calibration is not None and needs_calibration:
        m = calibration.metadata
        results["calibration"] = {"source": calibration_source, "data": m.get("data"), "data_sha256": m.get("data_sha256"),
                                  "windows": m.get("windows"), "seq_len": m.get("seq_len"), "tokens": m.get("tokens"),
                                  "summary": summary_rows(calibration)}
    write_report(Path(out), results, force)
    return results


def run_eval(model: str | None, recipe: str, calib: Path | None, calib_data: str | None, calib_samples: int,
             eval_data: str | None, seq_len: int, max_windows: int | None, tasks: str | None,
             max_items: int | None, out: Path, force: bool = False, batch_size: int = 4,
             trust_remote_code: bool = False) -> dict:
    """One configuration (a recipe, bf16 by default): perplexity on the evaluation windows and accuracy
    on the tasks, each with its interval. No baseline, so no deltas: that is what compare is for."""
    for name in ("report.md", "results.json"):
        check_writable(Path(out) / name, force)
    config = load_recipe(recipe)
    calibration = load_calibration(calib) if calib else None
    eval_corpus_once = functools.cache(lambda: load_corpus(eval_data, role="evaluation"))
    task_list = load_tasks(parse_task_specs(tasks), eval_corpus_once, max_items) if tasks else []
    loaded = load_model(model, trust_remote_code)
    eval_corpus = eval_corpus_once()
    windows = make_windows(eval_corpus, loaded.tokenizer, seq_len, max_windows)
    calibration_source = f"Calibration file {calib}." if calib else ""
    if config.needs_calibration and calibration is None:
        calibration = _calibrate(loaded, calib_data, calib_samples, seq_len, [config], None, force)
        calibration_source = "Calibrated in this run (no --calib file)."
    device = str(next(loaded.model.parameters()).device)
    models = {config.name: quantize_(loaded.model, config, calibration)}
    s = evaluate(models, windows.input_ids, batch_size)[config.name]
    task_run = evaluate_tasks(models, task_list, loaded.tokenizer, batch_size, _max_len(models)) if task_list else None
    results = {
        "command": "eval",
        "model": {"name": loaded.name, "source": loaded.source, "caveats": list(loaded.caveats)},
        "device": device,
        "eval": {"data": eval_corpus.source, "data_sha256": eval_corpus.sha256, "seq_len": windows.seq_len,
                 "stride": windows.seq_len, "windows": len(windows.input_ids), "tokens": s.tokens,
                 "bos": windows.bos, "description": windows.description},
        "protocol": protocol(windows, config)[:1] + protocol(windows, config)[3:] + task_protocol(task_list),
        "config": {"name": config.name, "recipe": recipe_summary(config), "perplexity": s.perplexity,
                   "accuracy": s.accuracy, "window_nll": s.window_nll, **window_statistics(s)},
        "statistics": stats.describe(),
        "calibration": None,
        "versions": versions(),
        "created": now(),
    }
    if task_run is not None:
        results.update(task_results(task_list, task_run, batch_size))
        add_task_metrics(results["config"], task_list, task_run)
    if calibration is not None and config.needs_calibration:
        m = calibration.metadata
        results["calibration"] = {"source": calibration_source, "data": m.get("data"), "data_sha256": m.get("data_sha256"),
                                  "windows": m.get("windows"), "seq_len": m.get("seq_len"), "tokens": m.get("tokens"),
                                  "summary": summary_rows(calibration)}
    write_report(Path(out), results, force, render=render_eval_markdown)
    return results


def _max_len(models: dict) -> int | None:
    config = getattr(next(iter(models.values())), "config", None)
    return getattr(config, "max_position_embeddings", None)


def window_statistics(s: Scores, base: Scores | None = None) -> dict:
    """Standard errors and 95% intervals over windows; against a baseline also the paired deltas."""
    ppl = stats.estimate(s.window_nll, np.exp)
    acc = stats.estimate(s.window_correct)
    out = {"perplexity_stderr": ppl["stderr"], "perplexity_ci": ppl["ci"],
           "accuracy_stderr": acc["stderr"], "accuracy_ci": acc["ci"]}
    if base is not None:
        kl, agree = stats.estimate(s.window_kl), stats.estimate(s.window_agree)
        ppl_delta = stats.paired_delta(base.window_nll, s.window_nll, stats.ratio_pct_of_exp)
        acc_delta = stats.paired_delta(base.window_correct, s.window_correct, stats.difference)
        out.update({"kl_div_stderr": kl["stderr"], "kl_div_ci": kl["ci"],
                    "top1_agreement_stderr": agree["stderr"], "top1_agreement_ci": agree["ci"],
                    "ppl_delta_pct_stderr": ppl_delta["stderr"], "ppl_delta_pct_ci": ppl_delta["ci"],
                    "ppl_delta_significant": ppl_delta["significant"],
                    "accuracy_delta_stderr": acc_delta["stderr"], "accuracy_delta_ci": acc_delta["ci"],
                    "accuracy_delta_significant": acc_delta["significant"]})
    return out


def add_task_metrics(entry: dict, tasks: list[Task], run: TaskRun, baseline: str | None = None) -> None:
    """entry["tasks"] = {task: {acc, acc_stderr, acc_ci, acc_norm?, ..., n}}; with a baseline also
    entry["task_deltas"] = {task: {metric: {delta, stderr, ci, significant, n}}}, paired on the same items."""
    entry["tasks"], deltas = {}, {}
    for task in tasks:
        correct = item_correct(task, run.scores[entry["name"]][task.name])
        row: dict = {}
        for metric, units in correct.items():
            e = stats.estimate(units)
            row.update({metric: e["value"], f"{metric}_stderr": e["stderr"], f"{metric}_ci": e["ci"]})
        entry["tasks"][task.name] = {**row, "n": len(task.items)}
        if baseline is not None:
            base = item_correct(task, run.scores[baseline][task.name])
            deltas[task.name] = {m: stats.paired_delta(base[m], correct[m], stats.difference) for m in correct}
    if baseline is not None:
        entry["task_deltas"] = deltas


def task_results(tasks: list[Task], run: TaskRun, batch_size: int) -> dict:
    items = sum(len(t.items) for t in tasks)
    return {"tasks": [t.describe() for t in tasks],
            "task_scoring": {"items": items, "batch_size": batch_size, "forward_passes": run.forward_passes,
                             "expected_forward_passes": -(-items // batch_size),
                             "packing_check_passes": run.check_passes}}


def task_protocol(tasks: list[Task]) -> list[str]:
    if not tasks:
        return []
    s = stats.describe()
    return [
        "Tasks, scored as lm-evaluation-harness scores them: a choice's log-likelihood is the sum over its "
        "continuation's tokens given the context (tokenized as the harness does: context alone, then the pair whole); "
        "acc = the highest sum is the labelled choice; acc_norm = the highest sum per character of the choice; "
        "greedy tasks (cloze, lambada_openai): acc = greedy decoding reproduces every token of the continuation.",
        "Batched scoring: one row per item (shared prefix once, each choice attending to it and to itself through a 4D "
        "attention mask), rows padded per batch; every variant scores the same batch before the next is made.",
        f"Intervals: {s['method']} ({s['resamples']} resamples, seed {s['seed']}) over windows (perplexity, next-token "
        f"accuracy, KL, agreement) or items (tasks), {100 * s['confidence']:.0f}%; deltas vs the baseline are paired "
        "(both computed on the same resampled windows/items) and marked significant when their interval excludes 0.",
    ]


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
