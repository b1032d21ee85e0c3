"""ptq eval: model + one recipe (+ calibration) -> perplexity and task accuracy of that one
configuration.

No baseline, so no deltas: that is what compare is for. By default (--tasks auto) the cloze task
built from the evaluation text is scored where lm-eval can run, the model whole in one process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ptq.calibration.clips import quantize_
from ptq.commands.common import (
    now,
    refuse_resume,
    refuse_unused_calibration,
    runs_layer_by_layer,
    versions,
)
from ptq.commands.measure import (
    AUTO_TASKS,
    BASELINE_RECIPE,
    Prepared,
    check_report_outputs,
    check_task_options,
    checked_compute_path,
    prepare,
    read_texts,
    score_layer_by_layer,
    score_whole,
    task_suite,
)
from ptq.commands.options import (
    CalibrationOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
    refuse_unused,
)
from ptq.commands.results import build_results
from ptq.errors import PtqError
from ptq.evaluation import harness
from ptq.evaluation.data import Corpus
from ptq.evaluation.tasks import cloze_items, no_cloze_items
from ptq.execution import streaming
from ptq.execution.placement import Placement
from ptq.files import writes_outputs
from ptq.progress import stderr
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.report import write_report
from ptq.reporting.results import EvalResults
from ptq.runtime import distributed


@writes_outputs
def run_eval(
    recipe: str = BASELINE_RECIPE,
    *,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> EvalResults:
    """One configuration (a recipe, bf16 by default): perplexity on the evaluation windows and
    accuracy on the tasks, each with its interval; report written to output.path.
    compute.low_memory: layer by layer from disk (ptq.execution.streaming); None: when the model
    does not fit in memory. model.placement (--device-map): loaded and quantized on the CPU, then
    placed over the GPUs (ptq.execution.placement)."""
    refuse_resume("eval", calibration)
    refuse_unused("eval", output, limits="a gate (they compare with a baseline: use ptq compare)")
    auto_tasks = data.tasks == AUTO_TASKS
    if not auto_tasks:  # tasks given: checked before torch.distributed starts
        check_task_options(data)
    distributed.setup()
    streamed = runs_layer_by_layer(
        model,
        compute.low_memory,
        note=(
            f"note: model '{model.model}' does not fit in memory: evaluating layer by layer from "
            f"disk ({streaming.LOW_MEMORY_FLAG})"
        ),
    )
    if auto_tasks:
        data = _default_tasks(data, streamed)
        check_task_options(data)
    compute_info = checked_compute_path(model, compute, data, streamed)
    config = load_recipe(recipe)
    check_report_outputs(output, model, data, calibration, [config])
    if streamed:
        streaming.check_compare_recipes([config])
    refuse_unused_calibration(
        calibration,
        config.needs_calibration,
        f"recipe {config.name} needs no calibration",
        "--calib-data",
    )
    needed = [config] if config.needs_calibration else []
    texts = read_texts(calibration, data, needed)
    if auto_tasks and data.tasks == "cloze" and not cloze_items(texts.evaluation):
        data = _without_cloze(data, texts.evaluation)
    task_work, suite = task_suite(data, texts.evaluation)  # fail before the model
    prepared = prepare(
        model,
        data,
        calibration,
        compute,
        [config],
        needed,
        texts,
        streamed=streamed,
        dtype=getattr(torch, compute_info["dtype"]),
    )
    scores, task_run = _score(
        prepared, config, suite, streamed, compute, model.placement, compute_info
    )
    results = build_results(
        loaded=prepared.loaded,
        compute=compute_info,
        corpus=texts.evaluation,
        windows=prepared.windows,
        scores={config.name: scores[config.name]},
        recipes=[config],
        coverages={config.name: prepared.coverages[config.name]},
        target=compute.target,
        versions=versions(),
        created=now(),
        tasks=(task_run, suite) if task_run is not None else None,
        calibration=prepared.calibration if config.needs_calibration else None,
        calibration_source=prepared.calibration_source,
        layer_order=prepared.layer_order,
    )
    if distributed.is_main():
        write_report(Path(output.path), results, output.force, plots=False)
    return results


def _default_tasks(data: DataOptions, streamed: bool) -> DataOptions:
    """eval's default tasks: the cloze task, where lm-eval can run (the model whole, one process);
    else none, said in a note."""
    whole = not streamed and not distributed.active()
    data = dataclasses.replace(data, tasks="cloze" if whole else None)
    if not whole and distributed.is_main():
        where = f"layer by layer ({streaming.LOW_MEMORY_FLAG})" if streamed else "under torchrun"
        stderr.print(
            f"note: no task accuracy {where}: lm-eval needs the whole model in one process; "
            "perplexity only",
            highlight=False,
            soft_wrap=True,
        )
    return data


def _without_cloze(data: DataOptions, eval_corpus: Corpus) -> DataOptions:
    """The default cloze task, where the evaluation text gives no items: not asked for, so a note
    rather than an error, unless a task option was given (it would go unused)."""
    if data.limit is not None or data.num_fewshot is not None or data.max_items is not None:
        raise PtqError(
            "--limit, --num-fewshot and --max-items apply to task accuracy, and this run scores "
            f"none: the default task, cloze, has no items ({no_cloze_items(eval_corpus)}); name "
            "tasks with --tasks"
        )
    stderr.print(
        f"note: no cloze accuracy ({no_cloze_items(eval_corpus)}): perplexity only; --tasks names "
        "other tasks",
        highlight=False,
        soft_wrap=True,
    )
    return dataclasses.replace(data, tasks=None)


def _score(
    prepared: Prepared,
    config: Recipe,
    suite: harness.Suite | None,
    streamed: bool,
    compute: ComputeOptions,
    placement: Placement | None,
    compute_info: dict,
) -> tuple[dict, harness.HarnessRun | None]:
    """The scores of the one configuration, made layer by layer from disk or of the whole model
    quantized, and lm-eval's run of the tasks (None: no tasks, or layer by layer)."""
    matmul = compute_info["matmul"]
    if streamed:
        scores, _, _ = score_layer_by_layer(
            prepared, config, [], matmul, compute.target, compute.batch_size
        )
        return scores, None
    models = {
        config.name: quantize_(
            prepared.loaded.model,
            config,
            prepared.calibration,
            matmul=matmul,
            target=compute.target,
            plan=prepared.plans[config.name],
        )
    }
    scores, _, task_run = score_whole(
        models, None, prepared, suite, compute.batch_size, placement, compute_info
    )
    return scores, task_run
