"""The commands' work, one function each, so that cli.py only parses and prints.

calibrate: model + calibration text -> amax of every quantized tensor -> calibration file.
compare:   model + recipes (+ calibration) -> bf16 baseline and variants on held-out text -> report (+ gates).
report:    results.json (+ a previous one) -> markdown with verdict, gates, trend and plots.
inspect:   model + recipes -> what each recipe does to each Linear layer.
quantize:  model + recipe (+ calibration) -> compressed-tensors checkpoint, reloaded and verified.
eval:      model + one recipe (+ calibration) -> perplexity and task accuracy of that one configuration.
"""

from __future__ import annotations

import copy
import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

from ptq import __version__
from ptq.calibration.calibrate import (
    Calibration,
    calibrate,
    checkpoint_path,
    load_calibration,
    range_findings,
    save_calibration,
    summary_rows,
)
from ptq.calibration.diagnostics import sqnr_table
from ptq.errors import PtqError
from ptq.evaluation import stats
from ptq.evaluation.data import Corpus, load_corpus, make_windows
from ptq.evaluation.evaluate import Scores, TaskRun, evaluate, evaluate_tasks
from ptq.evaluation.layerstats import INPUT_SNR_WINDOWS, input_snr_db, layer_snr, weight_snr_db
from ptq.evaluation.tasks import Task, item_correct, load_tasks, parse_task_specs
from ptq.execution import batching, devices, distributed, streaming
from ptq.execution.devices import compute_dtype, default_device
from ptq.execution.placement import Placement, placed, placed_copy
from ptq.execution.placement import describe as describe_placement
from ptq.execution.placement import summary as placement_summary
from ptq.files import check_output_dir, check_writable
from ptq.models.loading import LoadedModel, linear_layers, load_model
from ptq.models.matmuls import describe_coverage, kind, unsupported_weights
from ptq.numerics.formats import get_format
from ptq.progress import stderr
from ptq.quantization.plan import calibration_targets, resolve_plan
from ptq.quantization.quantize import quantize_, quantize_variants, resolve_matmul
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.gates import Limits, gate_results
from ptq.reporting.report import (
    load_results,
    render_eval_markdown,
    render_markdown,
    report_outputs,
    write_markdown,
    write_report,
)

BASELINE_RECIPE = "bf16"
DEFAULT_RECIPES = ("fp8-e4m3", "int8")
DEFAULT_MAX_ITEMS = 300  # per task; an evenly spaced subset keeps a CPU run to minutes


def versions() -> dict[str, str]:
    return {"ptq": __version__, "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"), "python": platform.python_version()}


def now() -> str:
    """The `created` timestamp, the one field that differs between two identical runs. SOURCE_DATE_EPOCH
    (the reproducible-builds convention) pins it, which makes outputs byte-identical."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is not None:
        try:
            moment = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        except (ValueError, OverflowError, OSError):
            raise PtqError(f"SOURCE_DATE_EPOCH must be an integer number of seconds, not {epoch!r}") from None
    else:
        moment = datetime.datetime.now(datetime.UTC)
    return moment.isoformat(timespec="seconds")


def run_calibrate(model: str | None, data: str | None, samples: int, seq_len: int, recipes: list[str],
                  output: Path, force: bool = False, trust_remote_code: bool = False, *, resume: bool = False,
                  checkpoint_every: float = 60.0, on_nonfinite: str = "fail", on_unseen: str = "fallback",
                  allow_pickle: bool = False, memory_check: bool = True, low_memory: bool | None = None,
                  all_experts: bool = True, strict_coverage: bool = False,
                  batch_size: int | str | None = None, placement: Placement | None = None) -> Calibration:
    """Calibrate and save; a checkpoint (OUTPUT.checkpoint) is kept while running and removed at the end.
    low_memory: block by block from disk (ptq.execution.streaming); None: when the model does not fit in memory.
    batch_size: windows per forward pass, None or "auto" for the automatic choice (see _calibrate).
    placement: the model placed over the GPUs and offloaded (ptq.execution.placement, --device-map)."""
    batch_size = batching.parse_batch_size(batch_size)
    check_placement(placement, low_memory)
    if low_memory and resume:
        raise PtqError("--resume is not available with --low-memory (block-by-block calibration keeps no checkpoint)")
    check_writable(output, force)
    checkpoint = checkpoint_path(output)
    if checkpoint.exists() and not (resume or force):
        raise PtqError(f"{checkpoint} is left from an interrupted run: pass --resume to continue it, or --force to start over")
    check_output_dir(Path(output).parent)
    loaded_recipes = [load_recipe(r) for r in recipes]
    corpus = load_corpus(data, role="calibration")  # bad data fails before the (slow) model load
    loaded = _load(model, trust_remote_code, allow_pickle, memory_check, False if resume or placement else low_memory,
                   torch.device("cpu") if placement else None)
    check_coverage(loaded.model, loaded_recipes, strict_coverage)
    calibration = _calibrate(loaded, corpus, samples, seq_len, loaded_recipes, output, force, on_nonfinite=on_nonfinite,
                             on_unseen=on_unseen, checkpoint=checkpoint, checkpoint_every=checkpoint_every, resume=resume,
                             all_experts=all_experts, batch_size=batch_size, placement=placement)
    checkpoint.unlink(missing_ok=True)
    return calibration


def _calibrate(loaded: LoadedModel, corpus: Corpus, samples: int, seq_len: int, recipes: list[Recipe],
               output: Path | None, force: bool, *, on_nonfinite: str = "fail", on_unseen: str = "fallback",
               checkpoint: Path | None = None, checkpoint_every: float = 60.0, resume: bool = False,
               all_experts: bool = True, batch_size: int | None = None, placement: Placement | None = None) -> Calibration:
    """batch_size: windows per forward pass, None for automatic (ptq.calibration.calibrate.calibrate: on CUDA from the free
    memory, halved with a restart from the first batch when a batch does not fit; 4 on the CPU and block by block).
    placement (--device-map): a copy of the model placed over the devices runs; the weight amax come from the model
    itself, in CPU memory."""
    windows = make_windows(corpus, loaded.tokenizer, seq_len, samples)
    layers, channels = calibration_targets(loaded.model, recipes)
    if not layers:
        raise PtqError(f"recipes {', '.join(r.name for r in recipes)} quantize no input with a scale: nothing to calibrate")
    if streaming.is_streamed(loaded.model):
        size = batch_size or batching.CPU_BATCH_SIZE
        with devices.gpu_memory(f"calibrating block by block on batches of {size} window(s) of {windows.seq_len} tokens"):
            calibration = streaming.calibrate_blocks(loaded.model, windows.input_ids, layers, batch_size=size,
                                                     on_nonfinite=on_nonfinite, on_unseen=on_unseen, channels=channels)
        calibration.metadata["batch_size"] = size
    else:
        # A batch that does not fit: calibrate backs off (automatic size) or stops with one line naming the size
        with placed({"original": placed_copy(loaded.model) if placement else loaded.model}, placement) as runner:
            calibration = calibrate(runner["original"], windows.input_ids, layers, batch_size, on_nonfinite=on_nonfinite,
                                    on_unseen=on_unseen, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                                    resume=resume, channels=channels, all_experts=all_experts, weights_of=loaded.model)
        del runner
        devices.release()  # a placed copy's GPU memory
    faults = calibration.metadata
    warnings = check_ranges(calibration, recipes, loaded.model)
    calibration.metadata = {**faults, **({"warnings": warnings} if warnings else {}),
        "model": loaded.name, "model_source": loaded.source,
        "data": corpus.source, "data_sha256": corpus.sha256,
        "windows": len(windows.input_ids), "seq_len": windows.seq_len, "tokens": windows.input_ids.numel(),
        "windows_description": windows.description,
        "recipes": [r.name for r in recipes], "layers": len(layers), "all_experts": all_experts,
        "versions": versions(), "created": now(),
    }
    if output is not None:
        save_calibration(calibration, output, force)
    return calibration


def _load(model: str | None, trust_remote_code: bool, allow_pickle: bool, memory_check: bool,
          low_memory: bool | None, device: torch.device | None = None) -> LoadedModel:
    """The whole model (ptq.models.loading), or with low_memory its meta-device skeleton to stream from disk
    (ptq.execution.streaming); low_memory None streams a local Llama checkpoint whose float32 weights do not fit."""
    if low_memory is None:
        low_memory = memory_check and streaming.too_big(model)
        if low_memory:
            stderr.print(f"note: model '{model}' does not fit in memory in float32: working block by block from disk "
                         "(--low-memory)", highlight=False, soft_wrap=True)
    if low_memory:
        return streaming.load_streamed(model, trust_remote_code)
    with devices.gpu_memory(f"loading model '{model}'"):
        return load_model(model, trust_remote_code, device, allow_pickle=allow_pickle, memory_check=memory_check)


def check_ranges(calibration: Calibration, recipes: list[Recipe], model) -> list[str]:
    """The range rule (ptq.calibration.calibrate.range_findings) for every amax a recipe turns into a scale."""
    checks = []
    for r in recipes:
        for name, m in resolve_plan(model, r).matmuls.items():
            weights, inputs = m.weights, m.inputs
            if name in calibration.input_amax and inputs.format.scaled:
                checks.append((name, "input", calibration.input_amax[name], inputs.format))
            if name in calibration.weight_amax and weights.format.scaled:
                checks.append((name, "weight", calibration.weight_amax[name], weights.format))
    return range_findings(checks)


def check_coverage(model, recipes: list[Recipe], strict: bool = False) -> dict[str, dict]:
    """Each recipe's coverage of the model's matmul weights (its plan's coverage); weights that no recipe could
    quantize for lack of support get a one-line warning naming them, or with `strict` (--strict-coverage) stop
    the run before any work."""
    coverages = {r.name: resolve_plan(model, r).coverage() for r in recipes}
    missing = {x["name"]: x for cov in coverages.values() for x in unsupported_weights(cov)}
    if missing:
        items = list(missing.values())
        names = ", ".join(f"'{x['name']}'" for x in items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")
        message = (f"{len(items)} matmul weight(s) ptq cannot quantize stay in the compute dtype: {names} "
                   f"({items[0]['reason']})")
        if strict:
            raise PtqError(f"{message}; --strict-coverage refuses a partial answer")
        if distributed.is_main():  # once, not once per torchrun process
            stderr.print(f"warning: {message}; every report lists them", highlight=False, soft_wrap=True)
    return coverages


def calibration_faults(metadata: dict) -> dict:
    """What calibration had to work around, for reports: unseen layers and their fallback, skipped
    non-finite batches, and range warnings."""
    return {"on_nonfinite": metadata.get("on_nonfinite", "fail"), "unseen_layers": metadata.get("unseen_layers", []),
            "nonfinite_batches": metadata.get("nonfinite_batches", {}), "warnings": metadata.get("warnings", [])}


def compute_path(dtype: str | None, matmul: str, low_memory: bool = False, placement: Placement | None = None) -> dict:
    """Where and how the models run: {"device", "dtype", "matmul", "low_memory"} (see devices.compute_dtype,
    quantize.resolve_matmul and streaming), checked before anything is loaded; with a placement (--device-map),
    "placement" is filled in once the models are placed (ptq.execution.placement.summary of each)."""
    device = default_device()
    check_placement(placement, low_memory)
    if low_memory and dtype not in (None, "float32"):
        raise PtqError(f"{streaming.LOW_MEMORY_FLAG} computes in float32 (each block is read in float32), not {dtype}")
    return {"device": str(device), "dtype": str(compute_dtype("float32" if low_memory else dtype, device)).removeprefix("torch."),
            "matmul": resolve_matmul(matmul, device), "low_memory": low_memory}


def check_placement(placement: Placement | None, low_memory: bool | None) -> None:
    """--device-map is refused with --low-memory and under torchrun (one process places over all the GPUs)."""
    if placement is not None and low_memory:
        raise PtqError(f"{streaming.LOW_MEMORY_FLAG} and --device-map are two ways to run a model larger than one GPU: "
                       "choose one")
    if placement is not None and distributed.active():
        raise PtqError("--device-map places one copy of the model over all the GPUs: start ptq in one process, without "
                       "torchrun / accelerate launch")


def describe_compute(compute: dict) -> str:
    """One line for reports."""
    matmul = ("FP8 layers with per-tensor or per-row scales as real FP8 matmuls (torch._scaled_mm); group and block "
              "scales, and the others, simulated" if compute["matmul"] == "fp8"
              else "quantized layers simulated (rounded operands, dequantized, multiplied in the compute dtype)")
    blocks = "; block by block from disk (--low-memory)" if compute.get("low_memory") else ""
    placed_text = f"; {describe_placement(compute['placement'])}" if compute.get("placement") else ""
    return f"{compute['device']}, {compute['dtype']} compute; {matmul}{blocks}{placed_text}"


def run_compare(model: str | None, recipes: list[str], calib: Path | None, calib_data: str | None,
                calib_samples: int, eval_data: str | None, seq_len: int, max_windows: int | None,
                out: Path, force: bool = False, batch_size: int | str | None = None, trust_remote_code: bool = False,
                limits: Limits | None = None, plots: bool = True, *, on_nonfinite: str = "fail", on_unseen: str = "fallback",
                allow_pickle: bool = False, memory_check: bool = True, tasks: str | None = None,
                max_items: int | None = DEFAULT_MAX_ITEMS, dtype: str | None = None, matmul: str = "auto",
                low_memory: bool | None = None, all_experts: bool = True, strict_coverage: bool = False,
                placement: Placement | None = None) -> dict:
    """The bf16 baseline and each recipe on the same windows, report written. low_memory: block by block from
    disk (ptq.execution.streaming); None: when the model and its variants' weight codes do not fit in memory.
    batch_size: windows per forward pass, None or "auto" for ptq.execution.batching's choice. placement (--device-map): the
    model loaded and quantized on the CPU, each variant then placed over the GPUs and offloaded (ptq.execution.placement)."""
    batch_size = batching.parse_batch_size(batch_size)
    distributed.setup()
    # Peak memory, in float32 copies of the model: the original in the compute dtype plus, per variant and for
    # the baseline, weight codes of 2 bytes at most.
    copies = torch.finfo(compute_dtype(dtype, default_device())).bits / 32 + 0.5 * (len(recipes) + 1)
    streamed = low_memory if low_memory is not None else placement is None and memory_check and streaming.too_big(model, copies)
    compute = compute_path(dtype, matmul, streamed, placement)
    if streamed and tasks:
        raise PtqError(f"--tasks needs the whole model in memory: it is not available with {streaming.LOW_MEMORY_FLAG}")
    if streamed and distributed.active():
        raise PtqError(f"{streaming.LOW_MEMORY_FLAG} runs in one process: start ptq without torchrun / accelerate launch")
    for name in ("report.md", "results.json"):
        check_writable(Path(out) / name, force)
    if plots:
        from ptq.reporting.plots import plot_paths

        for path in plot_paths(Path(out) / "report.md").values():
            check_writable(path, force)
    check_output_dir(Path(out))
    baseline = load_recipe(BASELINE_RECIPE)
    variants = [load_recipe(r) for r in recipes]
    if len({r.name for r in variants} | {baseline.name}) != len(variants) + 1:
        raise PtqError("each recipe may appear once, and not as the baseline 'bf16'")
    if streamed:
        streaming.check_compare_recipes(variants)
    calibration = load_calibration(calib) if calib else None
    needs_calibration = [r for r in variants if r.needs_calibration]
    calib_corpus = load_corpus(calib_data, role="calibration") if needs_calibration and calibration is None else None
    eval_corpus = load_corpus(eval_data, role="evaluation")
    task_list = load_tasks(parse_task_specs(tasks), lambda: eval_corpus, max_items) if tasks else []  # fail before the model
    if streamed:
        if low_memory is None:
            stderr.print(f"note: model '{model}' and {len(recipes) + 1} variants of it do not fit in memory: comparing "
                         f"block by block from disk ({streaming.LOW_MEMORY_FLAG})", highlight=False, soft_wrap=True)
        loaded = streaming.load_streamed(model, trust_remote_code)
    else:
        with devices.gpu_memory(f"loading model '{model}'"):
            loaded = load_model(model, trust_remote_code, torch.device("cpu") if placement else None, allow_pickle=allow_pickle,
                                memory_check=memory_check, dtype=getattr(torch, compute["dtype"]), copies=copies)
    windows = make_windows(eval_corpus, loaded.tokenizer, seq_len, max_windows)
    coverages = check_coverage(loaded.model, [baseline, *variants], strict_coverage)

    if calib_corpus is not None:
        calibration = _calibrate(loaded, calib_corpus, calib_samples, seq_len, needs_calibration, None, force,
                                 on_nonfinite=on_nonfinite, on_unseen=on_unseen, all_experts=all_experts,
                                 batch_size=batch_size, placement=placement)
        calibration_source = "Calibrated in this run (no --calib file)."
    else:
        calibration_source = f"Calibration file {calib}." if calib else ""
        if calibration is not None:
            check_ranges(calibration, needs_calibration, loaded.model)

    layer_order = list(linear_layers(loaded.model))
    task_run = None
    if streamed:
        scores, weight_snr, input_snr = streaming.compare_blocks(loaded.model, [baseline, *variants], calibration,
                                                                 windows.input_ids, batch_size or batching.CPU_BATCH_SIZE,
                                                                 compute["matmul"])
    else:
        # Each variant is a quantized copy of the model, sharing with the others what it does not quantize;
        # the original is then released.
        with devices.gpu_memory(f"building {len(variants) + 1} variants of the model (the baseline and each recipe)"):
            models = quantize_variants(loaded.model, [baseline, *variants], calibration, compute["matmul"])
            quantized = {r.name: models[r.name] for r in variants}
            weight_snr = {name: weight_snr_db(loaded.model, m) for name, m in quantized.items()}
        del loaded.model
        devices.release()  # the original's memory, before the evaluation's batches
        with placed(models, placement) as models:
            if placement:
                compute["placement"] = {name: placement_summary(m) for name, m in models.items()}
            mine = distributed.share(len(windows.input_ids), INPUT_SNR_WINDOWS)  # all of them in one process
            with input_snr_db(quantized) as input_snr:
                scores = distributed.gather_scores(evaluate(models, windows.input_ids[mine.start:mine.stop], batch_size))
            input_snr = distributed.gather(input_snr)[0]  # the first process's share starts with the measured windows
            if task_list:
                task_run = _tasks(models, task_list, loaded.tokenizer, batch_size)
    snr = layer_snr(weight_snr, input_snr)

    base = scores[baseline.name]
    results = {
        "model": {"name": loaded.name, "source": loaded.source, "caveats": list(loaded.caveats)},
        "device": describe_compute(compute),
        "compute": compute,
        "eval": {"data": eval_corpus.source, "data_sha256": eval_corpus.sha256, "seq_len": windows.seq_len,
                 "stride": windows.seq_len, "windows": len(windows.input_ids), "tokens": base.tokens,
                 "bos": windows.bos, "description": windows.description},
        "protocol": protocol(windows, baseline, compute),
        "baseline": {"name": baseline.name, "recipe": recipe_summary(baseline),
                     "perplexity": base.perplexity, "accuracy": base.accuracy, "window_nll": base.window_nll,
                     "coverage": coverages[baseline.name]},
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
            "snr_db": snr[r.name], "coverage": coverages[r.name],
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
                                  "batch_size": m.get("batch_size"), "summary": summary_rows(calibration), "faults": calibration_faults(m),
                                  "layers": [{"layer": name, "input_amax": float(calibration.input_amax[name]),
                                              "weight_amax": float(calibration.weight_amax[name])}
                                             for name in layer_order if name in calibration.input_amax]}
        results["diagnostics"] = sqnr_table(calibration)
    results["gates"] = gate_results(results, limits or Limits())
    if distributed.is_main():
        write_report(Path(out), results, force, plots)
    return results


def _tasks(models: dict, task_list: list[Task], tokenizer, batch_size: int | None) -> TaskRun:
    """evaluate_tasks, each process on its share of the items under torchrun (ptq.execution.distributed)."""
    if not distributed.active():
        return evaluate_tasks(models, task_list, tokenizer, batch_size, _max_len(models))
    run = evaluate_tasks(models, task_list, tokenizer, batch_size, _max_len(models), share=distributed.share)
    return distributed.gather_tasks(run)


def run_eval(model: str | None, recipe: str, calib: Path | None, calib_data: str | None, calib_samples: int,
             eval_data: str | None, seq_len: int, max_windows: int | None, tasks: str | None,
             max_items: int | None, out: Path, force: bool = False, batch_size: int | str | None = None,
             trust_remote_code: bool = False, dtype: str | None = None, matmul: str = "auto",
             all_experts: bool = True, strict_coverage: bool = False, placement: Placement | None = None) -> dict:
    """One configuration (a recipe, bf16 by default): perplexity on the evaluation windows and accuracy
    on the tasks, each with its interval. No baseline, so no deltas: that is what compare is for.
    placement (--device-map): loaded and quantized on the CPU, then placed over the GPUs (ptq.execution.placement)."""
    batch_size = batching.parse_batch_size(batch_size)
    distributed.setup()
    compute = compute_path(dtype, matmul, placement=placement)
    for name in ("report.md", "results.json"):
        check_writable(Path(out) / name, force)
    config = load_recipe(recipe)
    check_output_dir(Path(out))
    calibration = load_calibration(calib) if calib else None
    calib_corpus = load_corpus(calib_data, role="calibration") if config.needs_calibration and calibration is None else None
    eval_corpus = load_corpus(eval_data, role="evaluation")
    task_list = load_tasks(parse_task_specs(tasks), lambda: eval_corpus, max_items) if tasks else []  # fail before the model
    with devices.gpu_memory(f"loading model '{model}'"):
        loaded = load_model(model, trust_remote_code, torch.device("cpu") if placement else None,
                            dtype=getattr(torch, compute["dtype"]))
    windows = make_windows(eval_corpus, loaded.tokenizer, seq_len, max_windows)
    config_coverage = check_coverage(loaded.model, [config], strict_coverage)[config.name]
    calibration_source = f"Calibration file {calib}." if calib else ""
    if calib_corpus is not None:
        calibration = _calibrate(loaded, calib_corpus, calib_samples, seq_len, [config], None, force, all_experts=all_experts,
                                 batch_size=batch_size, placement=placement)
        calibration_source = "Calibrated in this run (no --calib file)."
    models = {config.name: quantize_(loaded.model, config, calibration, matmul=compute["matmul"])}
    with placed(models, placement) as models:
        if placement:
            compute["placement"] = {name: placement_summary(m) for name, m in models.items()}
        mine = distributed.share(len(windows.input_ids))  # all of them in one process
        s = distributed.gather_scores(evaluate(models, windows.input_ids[mine.start:mine.stop], batch_size))[config.name]
        task_run = _tasks(models, task_list, loaded.tokenizer, batch_size) if task_list else None
    results = {
        "command": "eval",
        "model": {"name": loaded.name, "source": loaded.source, "caveats": list(loaded.caveats)},
        "device": describe_compute(compute),
        "compute": compute,
        "eval": {"data": eval_corpus.source, "data_sha256": eval_corpus.sha256, "seq_len": windows.seq_len,
                 "stride": windows.seq_len, "windows": len(windows.input_ids), "tokens": s.tokens,
                 "bos": windows.bos, "description": windows.description},
        "protocol": protocol(windows, config, compute)[:1] + protocol(windows, config, compute)[3:] + task_protocol(task_list),
        "config": {"name": config.name, "recipe": recipe_summary(config), "perplexity": s.perplexity,
                   "accuracy": s.accuracy, "window_nll": s.window_nll, "coverage": config_coverage, **window_statistics(s)},
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
                                  "batch_size": m.get("batch_size"), "summary": summary_rows(calibration)}
    if distributed.is_main():
        write_report(Path(out), results, force, plots=False, render=render_eval_markdown)
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


def task_results(tasks: list[Task], run: TaskRun, batch_size: int | None) -> dict:
    items = sum(len(t.items) for t in tasks)
    batch_size = run.batch_size or batch_size or batching.CPU_BATCH_SIZE
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
            "inputs": r.inputs.describe(), "ignore": list(r.ignore), "source": Path(r.source).name,
            "attention": r.attention.describe() + f" ({', '.join(r.attention_tensors)})" if r.attention else None,
            "kv_cache": r.kv_cache.describe() if r.kv_cache else None, "smoothquant_alpha": r.smoothquant,
            "residual": r.residual.describe() if r.residual else None}


def protocol(windows, baseline: Recipe, compute: dict) -> list[str]:
    int8 = get_format("int8")
    dtype = "fp32" if compute["dtype"] == "float32" else compute["dtype"]
    product = ("product in fp32" if dtype == "fp32" else
               f"operands dequantized to {dtype} (one {dtype} rounding of each), product accumulated in fp32")
    if compute["matmul"] == "fp8":
        product += ("; layers with FP8 weights and inputs multiply their float8 codes for real (torch._scaled_mm: "
                    "fp32 accumulation, both scales applied in fp32)")
    return [
        f"Perplexity: {windows.description}. Each window is scored on its own tokens 2..{windows.seq_len} "
        f"({windows.seq_len - 1} predictions per window, stride {windows.seq_len}, no overlap); "
        f"{'a BOS token starts every window' if windows.bos else 'no BOS token (the tokenizer adds none)'}.",
        "Next-token accuracy: top-1 prediction equals the next token. KL: mean over predicted positions of "
        f"KL(p_{baseline.name} || p_variant) in nats. Top-1 agreement: the variant's top-1 token equals the baseline's.",
        f"Baseline `{baseline.name}`: {baseline.description}; matmuls accumulate in fp32. Embeddings, norms, attention "
        f"and activations run in {dtype} in every variant, so variants differ only in the Linear layers' weights and inputs, "
        "except where a recipe also quantizes attention's batched-matmul inputs (Q, K, V, softmax output) or the KV cache "
        "(its `attention` / `kv_cache` entries): such variants compute attention the eager way with those inputs rounded.",
        "Quantized Linear: weights quantized once (one scale per tensor, output channel, 128 x 128 tile or group of the "
        "input dimension, as the recipe says); inputs quantized on every forward with the static per-tensor scale from "
        "calibration, or dynamic scales per token or per input group computed from the input itself; scale = amax / "
        "format max (MX: the smallest power of two with which the amax does not clip, E8M0); round to nearest even, "
        "then saturate to the format's max; "
        f"{product}. Linear layers a recipe leaves out (lm_head by default) run as in the baseline.",
        f"int8 is symmetric: scale = amax / {int8.max:g}, codes in [-{int8.max:g}, {int8.max:g}] (ModelOpt's convention).",
    ]


def run_report(results_file: Path, previous_file: Path | None = None, output: Path | None = None,
               limits: Limits | None = None, plots: bool = True, force: bool = False) -> tuple[dict, str]:
    """Render a results file (gates from `limits` if any are given, else those stored by compare) as markdown;
    write it (and its plots) to `output` if given. Returns the results as judged and the markdown."""
    results = load_results(results_file)
    previous = load_results(previous_file, "previous results file") if previous_file else None
    if limits is not None and limits.any():
        results = results | {"gates": gate_results(results, limits)}
    if output is None:
        return results, render_markdown(results, previous)
    for path in report_outputs(Path(output), results, plots):
        check_writable(path, force)
    write_markdown(Path(output), results, previous, plots, force=True)
    return results, Path(output).read_text(encoding="utf-8")


def run_inspect(model: str | None, recipes: list[str], trust_remote_code: bool = False) -> dict:
    """Every Linear layer of the model with its shape, and what each recipe does to its weights and inputs."""
    loaded_recipes = [load_recipe(r) for r in recipes]
    loaded = load_model(model, trust_remote_code, device=torch.device("cpu"))
    layers = linear_layers(loaded.model)
    plans = {r.name: resolve_plan(loaded.model, r) for r in loaded_recipes}
    rows = []
    for name, m in layers.items():
        row = {"layer": name, "kind": kind(m), "shape": [m.out_features, m.in_features], "parameters": m.weight.numel(),
               "recipes": {}}
        for r in loaded_recipes:
            entry = plans[r.name].matmuls[name]
            row["recipes"][r.name] = {"quantized": entry.quantized, "weights": entry.weights.describe(),
                                      "inputs": entry.inputs.describe(), "calibrated": entry.quantized and entry.inputs.static,
                                      "reason": entry.reason}
        rows.append(row)
    total = sum(row["parameters"] for row in rows)
    coverages = check_coverage(loaded.model, loaded_recipes)
    summary = {r.name: {"layers": sum(row["recipes"][r.name]["quantized"] for row in rows),
                        "parameters": sum(row["parameters"] for row in rows if row["recipes"][r.name]["quantized"]),
                        "description": r.description, "coverage": coverages[r.name],
                        "coverage_line": describe_coverage(coverages[r.name])}
               for r in loaded_recipes}
    return {"model": {"name": loaded.name, "source": loaded.source}, "linear_layers": len(rows),
            "linear_parameters": total, "recipes": summary, "layers": rows}


def run_quantize(model: str | None, recipe: str, calib: Path | None, data: str | None, samples: int, seq_len: int,
                 output: Path, force: bool = False, verify: bool = True, verify_windows: int = 8,
                 shard_size_mb: float = 1000.0, compare_results: Path | None = None, batch_size: int | str | None = None,
                 trust_remote_code: bool = False, low_memory: bool | None = None, all_experts: bool = True,
                 strict_coverage: bool = False, placement: Placement | None = None) -> dict:
    """quantize: model + recipe (+ calibration) -> compressed-tensors checkpoint in `output`, reloaded with
    transformers and checked against ptq's simulation before it is renamed into place.
    low_memory: block by block from disk (ptq.execution.streaming), unverified (the model is never whole in memory);
    None: when the model does not fit in memory. placement (--device-map): the model loaded and exported from
    CPU memory; calibration and the verification's models placed over the devices (ptq.execution.placement)."""
    from ptq.export import checkpoint as export
    from ptq.files import atomic_dir
    from ptq.progress import progress
    from ptq.reporting.report import render_model_card

    output = Path(output)
    batch_size = batching.parse_batch_size(batch_size)
    check_export_target(output, force)
    check_placement(placement, low_memory)
    r = load_recipe(recipe)
    export.check_exportable(r)
    compare = load_compare_results(compare_results, r.name) if compare_results else None
    calibration = load_calibration(calib) if calib else None
    check_output_dir(output.parent)
    calib_corpus = load_corpus(data, role="calibration") if calibration is None else None
    loaded = _load(model, trust_remote_code, False, True, False if placement else low_memory,
                   torch.device("cpu") if placement else None)
    streamed = streaming.is_streamed(loaded.model)
    export.export_layers(loaded.model, r)  # refuse an unexportable model before calibrating it
    checkpoint_coverage = check_coverage(loaded.model, [r], strict_coverage)[r.name]
    if calibration is None and not r.needs_calibration:
        calibration_source = "none: the recipe's scales come from the weights and, on the fly, from the inputs"
    elif calibration is None:
        calibration = _calibrate(loaded, calib_corpus, samples, seq_len, [r], None, force, all_experts=all_experts,
                                 batch_size=batch_size, placement=placement)
        calibration_source = "calibrated in this run"
    else:
        calibration_source = f"calibration file {Path(calib).name}"
    if streamed:
        dtypes = export.source_dtypes(str(loaded.model.ptq_checkpoint.directory))
        entries, quantized, ignored = streaming.plan_checkpoint(loaded.model, r, calibration)
    else:
        dtypes = export.source_dtypes(loaded.model.config._name_or_path)
        entries, quantized, ignored = export.plan_checkpoint(loaded.model, r, calibration, dtypes)
    m = calibration.metadata if calibration is not None else {}
    info = {
        "kind": "ptq-export/1",
        "model": {"name": loaded.name, "source": loaded.source, "caveats": list(loaded.caveats),
                  "architecture": type(loaded.model).__name__},
        "recipe": recipe_summary(r),
        "format": {"quant_method": "compressed-tensors", "format": export.quantization_config(r, ignored).format,
                   "compressed_tensors": importlib.metadata.version("compressed-tensors"),
                   "quantized_layers": len(quantized), "ignored_layers": ignored},
        "calibration": {"source": calibration_source, "data": m.get("data"), "data_sha256": m.get("data_sha256"),
                        "windows": m.get("windows"), "seq_len": m.get("seq_len"), "tokens": m.get("tokens"),
                        "batch_size": m.get("batch_size")},
        "size": export.checkpoint_bytes(entries, quantized),
        "coverage": checkpoint_coverage,
        "verification": None,
        "low_memory": streamed,
        "compare": compare,
        "versions": versions() | {"compressed-tensors": importlib.metadata.version("compressed-tensors")},
        "created": now(),
    }
    with atomic_dir(output) as tmp, devices.gpu_memory("exporting and verifying the checkpoint"):
        with progress("writing", len(entries)) as advance:
            written = export.write_weights(entries, tmp, int(shard_size_mb * 1e6), advance)
        del entries
        info["size"] |= written
        export.write_config(loaded.model, r, ignored, dtypes, tmp)
        loaded.tokenizer.save_pretrained(tmp)
        conv1d = [name for name in quantized if kind(loaded.model.get_submodule(name)) == "Conv1D"]
        if verify and streamed:
            info["verification_skipped"] = ("exported block by block with `--low-memory`: the model was never whole in "
                                            "memory to be reloaded and compared")
        elif verify and placement:  # transformers 5 with compressed-tensors 0.20 fails to run such a checkpoint offloaded
            info["verification_skipped"] = ("exported with `--device-map`: the checkpoint is not reloaded and compared, "
                                            "since transformers cannot run a compressed-tensors checkpoint offloaded by "
                                            "accelerate; reload it where it fits, or serve it with vLLM")
        elif verify:
            corpus = load_corpus(data, role="evaluation")
            windows = make_windows(corpus, loaded.tokenizer, seq_len, verify_windows)
            # int8 inputs: the loaders round them over [-128, 127], ptq over [-127, 127]; check the logits against
            # the simulation of what the loader computes, and the perplexity against ptq's own too.
            # Layers whose input scales the reloading loader does not apply (experts in transformers; every layer where
            # transformers cannot load Conv1D quantized and ptq's own dequantizing reader stands in) are simulated with
            # their inputs as they are, and their input scales are checked in the files instead.
            unrounded = export.unapplied_input_layers(loaded.model, quantized, conv1d=bool(conv1d), dynamic=r.inputs.dynamic)
            own = (export.simulate_export(copy.deepcopy(loaded.model), r, calibration, loader_int8_inputs=False,
                                          unrounded_inputs=unrounded)
                   if r.inputs.format.kind == "int" else None)
            scales = export.unapplied_scales(loaded.model, unrounded, calibration, r)
            simulated = export.simulate_export(loaded.model, r, calibration, unrounded_inputs=unrounded)
            reloaded, load_info = export.reload_or_read(tmp, conv1d=bool(conv1d))
            reloaded.to(next(simulated.parameters()).device)  # reloaded as a user would: on the CPU
            info["verification"] = export.verify(simulated, reloaded, load_info, len(quantized) - len(unrounded),
                                                 windows.input_ids, batch_size, ptq_simulated=own,
                                                 unapplied_input_scales=scales, directory=tmp)
            info["verification"]["loader"] = load_info.get("loader", "transformers AutoModelForCausalLM.from_pretrained")
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
    from ptq.export.checkpoint import EXPORT_INFO

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
