"""What compare and eval share: measuring models on held-out windows of text (and lm-eval tasks).

Both refuse what they cannot do before any work (task options, layer by layer's limits, the
report's files), read their inputs, then `prepare` the model once: loaded, its windows, each
recipe's plan and coverage, the calibration. The models are then scored either layer by layer from
disk (`score_layer_by_layer`: each part's variants made as it is read, MeasuredVariants) or whole,
placed over the devices (`score_whole`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from ptq.calibration.calibrate import Calibration, load_calibration
from ptq.calibration.clips import quantize_variants
from ptq.commands.common import (
    calibration_for,
    check_coverage,
    check_seq_len,
    compute_path,
    load_model_for,
    max_len,
    model_windows,
)
from ptq.commands.options import (
    DEFAULT_MAX_ITEMS,
    CalibrationOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
)
from ptq.errors import PtqError
from ptq.evaluation import harness
from ptq.evaluation.data import Corpus, Windows, load_corpus, shared_text, spec_source
from ptq.evaluation.evaluate import evaluate, gather_scores
from ptq.evaluation.layerstats import INPUT_SNR_WINDOWS, input_snr_db, weight_snr_db
from ptq.execution import batching, streaming
from ptq.execution.placement import Placement, placed
from ptq.execution.placement import summary as placement_summary
from ptq.files import check_outputs
from ptq.models.loading import LoadedModel, linear_layers
from ptq.quantization import engines
from ptq.quantization.plan import Plan, resolve_plans
from ptq.quantization.recipes import Recipe
from ptq.runtime import distributed

BASELINE_RECIPE = "bf16"
AUTO_TASKS = (
    "auto"  # eval's --tasks default: cloze where the model is whole in one process, else none
)


# ---- refused before any work


def check_task_options(data: DataOptions) -> None:
    """--tasks runs lm-evaluation-harness in one process; --num-fewshot and --limit are its
    options."""
    if not data.tasks and (data.num_fewshot is not None or data.limit is not None):
        raise PtqError("--num-fewshot and --limit apply to --tasks: give tasks too")
    if data.max_items is not None and not harness.scores_cloze(data.tasks):
        raise PtqError(
            "--max-items caps the cloze task's items, and this run scores no cloze task: add cloze "
            "to --tasks, or drop --max-items (--limit caps every task)"
        )
    if data.tasks and distributed.active():
        raise PtqError(
            "--tasks runs lm-evaluation-harness on each model in one process: start ptq without "
            "torchrun / accelerate launch (perplexity is data-parallel), or run the tasks in a run "
            "of their own"
        )
    limit = data.limit
    # lm-eval counts documents in integers: more than any task has
    if limit is not None and limit >= 2**53:
        raise PtqError(
            f"--limit {limit:g} is too large: give at most {2**53 - 1} documents per task"
        )
    if limit is not None and not (limit > 0 and (limit < 1 or float(limit).is_integer())):
        raise PtqError(
            "--limit takes a number of documents per task (e.g. 100) or a fraction below 1 "
            f"(e.g. 0.1), not {limit:g}"
        )
    if data.num_fewshot is not None and data.num_fewshot < 0:
        raise PtqError(f"--num-fewshot must be 0 or more, not {data.num_fewshot}")


def checked_compute_path(
    model: ModelOptions, compute: ComputeOptions, data: DataOptions, streamed: bool
) -> dict:
    """compute_path, with what a layer-by-layer run cannot do refused before anything is loaded."""
    engines.check_target(compute.target)
    info = compute_path(model.dtype, compute.matmul, streamed, model.placement)
    if streamed and data.tasks:
        raise PtqError(
            "--tasks needs the whole model in memory: it is not available with "
            f"{streaming.LOW_MEMORY_FLAG}"
        )
    if streamed and distributed.active():
        raise PtqError(
            f"{streaming.LOW_MEMORY_FLAG} runs in one process: start ptq without torchrun / "
            "accelerate launch"
        )
    return info


def check_report_outputs(
    output: OutputOptions,
    model: ModelOptions,
    data: DataOptions,
    calibration: CalibrationOptions,
    recipes: list[Recipe],
) -> None:
    """report.md, results.json and the plots in output.path (drawn, or an earlier run's, which are
    removed), before any work (ptq.files.check_outputs): none of the run's inputs nor within one
    (the model's folder), replaced only with --force, the folder checked, claimed for this run."""
    from ptq.reporting.plots import plot_paths

    out = Path(output.path)
    inputs = {
        "the model": model.model,
        "the evaluation text": spec_source(data.data),
        "the calibration text": spec_source(calibration.data),
        "the calibration file": calibration.file,
        "the task file": harness.task_paths(data.tasks),
        "the recipe": [r.source for r in recipes],
    }
    check_outputs(
        [out / "report.md", out / "results.json", *plot_paths(out / "report.md").values()],
        inputs,
        output.force,
        claim=distributed.is_main(),  # the process that writes them
    )


# ---- the inputs


class Texts(NamedTuple):
    """What a run reads before the model, so that a bad one fails first."""

    calibration_file: Calibration | None  # --calib
    calibration_text: Corpus | None  # where a recipe needs a calibration and no file gives it
    evaluation: Corpus


def read_texts(calibration: CalibrationOptions, data: DataOptions, needed: list[Recipe]) -> Texts:
    """The calibration file (--calib), the calibration text where `needed` recipes need a
    calibration and no file gives it, and the evaluation text."""
    reused = load_calibration(calibration.file) if calibration.file else None
    calib_corpus = (
        load_corpus(calibration.data, role="calibration") if needed and reused is None else None
    )
    eval_corpus = load_corpus(data.data, role="evaluation")
    return Texts(reused, calib_corpus, eval_corpus)


def task_suite(data: DataOptions, eval_corpus: Corpus):
    """The lm-eval tasks of --tasks (ptq.evaluation.harness.prepare), loaded once so that a bad task
    stops before the model, and the temporary folder of the task files ptq generates (cloze items,
    local copies), removed at exit: the caller holds it while the tasks run."""
    if not data.tasks:
        return None, None
    work = tempfile.TemporaryDirectory(prefix="ptq-tasks-")
    suite = harness.prepare(
        data.tasks,
        lambda: eval_corpus,
        Path(work.name),
        max_items=data.max_items or DEFAULT_MAX_ITEMS,
        num_fewshot=data.num_fewshot,
        limit=data.limit,
    )
    return work, suite


# ---- the model, once


@dataclasses.dataclass
class Prepared:
    """The model loaded and what the measurement needs of it."""

    loaded: LoadedModel
    windows: Windows
    plans: dict[str, Plan]  # the one plan per recipe
    coverages: dict[str, dict]
    calibration: Calibration | None  # None: no recipe needs one
    calibration_source: str
    layer_order: list[str]  # the model's Linear layers, in its order


def prepare(
    model: ModelOptions,
    data: DataOptions,
    calibration: CalibrationOptions,
    compute: ComputeOptions,
    recipes: list[Recipe],
    needed: list[Recipe],
    texts: Texts,
    *,
    streamed: bool,
    dtype: torch.dtype,
    copies: float = 1,
) -> Prepared:
    """Load the model (`copies`: the float32 copies its memory check counts), cut the evaluation
    text (`texts`: read_texts) into windows, resolve each recipe's plan and its coverage, and
    calibrate for the `needed` recipes (or check the file's calibration against them)."""
    reused, calib_corpus, eval_corpus = texts
    loaded = load_model_for(model, streamed, dtype=dtype, copies=copies)
    check_seq_len(loaded, data.seq_len)
    windows = model_windows(eval_corpus, loaded, data.seq_len, data.windows)
    plans = resolve_plans(loaded.model, recipes, compute.target)
    coverages = check_coverage(plans, model.strict_coverage)
    calib, calibration_source = calibration_for(
        loaded,
        calibration,
        {r.name: plans[r.name] for r in needed},
        reused,
        calib_corpus,
        batch_size=compute.batch_size,
        placement=model.placement,
    )
    _record_shared_text(calib if needed else None, calib_corpus, eval_corpus)
    layer_order = list(linear_layers(loaded.model))
    return Prepared(loaded, windows, plans, coverages, calib, calibration_source, layer_order)


def _record_shared_text(
    calib: Calibration | None, calib_corpus: Corpus | None, eval_corpus: Corpus
) -> None:
    """When the calibration the recipes use (`calib`, calibrated here on `calib_corpus` or read from
    a file, whose text's sha256 is all that is known) shares text with the evaluation text
    (ptq.evaluation.data.shared_text), say so among its warnings: calibration.faults.warnings in
    results.json, a "Warning:" line in the report, one line on stderr (as the range rule's
    warnings)."""
    shared = (
        shared_text(calib_corpus, eval_corpus, calib.metadata.get("data_sha256")) if calib else None
    )
    if shared:
        calib.metadata = {
            **calib.metadata,
            "warnings": [*calib.metadata.get("warnings", []), shared],
        }


# ---- scoring layer by layer from disk


def score_layer_by_layer(
    prepared: Prepared,
    baseline: Recipe,
    variants: list[Recipe],
    matmul: str,
    target: str,
    batch_size: int | None,
) -> tuple[dict, dict[str, dict], dict[str, dict]]:
    """The scores of `baseline` and each of `variants` (eval: its one configuration as the
    baseline, no variants), made of each part of the model as it is read from disk, and the
    variants' weight and input SNR."""
    weight_snr, input_snr = {r.name: {} for r in variants}, {r.name: {} for r in variants}
    windows = prepared.windows
    parts = MeasuredVariants(
        baseline,
        variants,
        prepared.calibration,
        matmul,
        weight_snr,
        input_snr,
        target,
        prepared.plans,
        windows.input_ids.shape[1],
    )
    run = streaming.LayerByLayer(
        prepared.loaded.model, parts, [baseline.name, *(r.name for r in variants)]
    )
    scores = evaluate(run, windows.input_ids, batch_size)
    return scores, weight_snr, input_snr


class MeasuredVariants:
    """compare's variants of each part of a model run layer by layer
    (ptq.execution.streaming.LayerByLayer's `parts`, called with each part as it is read): the
    baseline and each recipe's variant of the part (quantize_variants), their weight SNR added to
    `weight_snr` and, once the part has run, their input SNR to `input_snr`, as compare measures
    the whole model. The part itself is not kept once its variants are made."""

    def __init__(
        self,
        baseline: Recipe,
        variants: list[Recipe],
        calibration: Calibration | None,
        matmul: str,
        weight_snr: dict[str, dict],
        input_snr: dict[str, dict],
        target: str,
        plans: dict[str, Plan],
        window_tokens: int,
    ):
        self.recipes, self.variants, self.calibration, self.matmul = (
            [baseline, *variants],
            variants,
            calibration,
            matmul,
        )
        self.weight_snr, self.input_snr, self.target, self.plans = (
            weight_snr,
            input_snr,
            target,
            plans,
        )
        # the evaluation windows' length, for input SNR's share of each layer
        self.window_tokens = window_tokens

    def __call__(self, part: torch.nn.Module) -> _Measured:
        # a part is the trunk or one decoder layer, under its names in the whole model: the whole
        # model's plans, restricted to it (each fused group, q/k/v, gate/up, a layer's experts, is
        # whole in one part)
        plans = {name: plan.within(part) for name, plan in self.plans.items()}
        models = quantize_variants(
            part, self.recipes, self.calibration, self.matmul, self.target, plans
        )
        quantized = {r.name: models[r.name] for r in self.variants}
        for name, m in quantized.items():
            self.weight_snr[name] |= weight_snr_db(part, m)
        return _Measured(models, input_snr_db(quantized, self.window_tokens), self.input_snr)


class _Measured:
    """Gives the variants of one part with input SNR measured on them while the part runs."""

    def __init__(
        self, models: dict, snr: contextlib.AbstractContextManager, input_snr: dict[str, dict]
    ):
        self.models, self.snr, self.input_snr = models, snr, input_snr

    def __enter__(self) -> dict:
        self.measured = self.snr.__enter__()
        # held by the executor while the part runs, not here
        models, self.models = self.models, None
        return models

    def __exit__(self, *exc) -> bool:
        self.snr.__exit__(*exc)
        for name, values in self.measured.items():
            self.input_snr[name] |= values
        return False


# ---- scoring the whole models


def score_whole(
    models: dict,
    quantized: dict | None,
    prepared: Prepared,
    suite: harness.Suite | None,
    batch_size: int | None,
    placement: Placement | None,
    compute_info: dict,
) -> tuple[dict, dict[str, dict] | None, harness.HarnessRun | None]:
    """The scores of `models`, placed over the devices with a placement (each one's summary added to
    compute_info), their windows shared among the torchrun processes; the input SNR of the
    `quantized` variants (compare; None: not measured), and lm-eval's run of the tasks of `suite`
    (None: no tasks)."""
    input_ids, input_snr, task_run = prepared.windows.input_ids, None, None
    with placed(models, placement) as models:
        if placement:
            compute_info["placement"] = {name: placement_summary(m) for name, m in models.items()}
        if quantized is None:
            mine = distributed.share(len(input_ids))  # all of them in one process
            scores = gather_scores(evaluate(models, input_ids[mine.start : mine.stop], batch_size))
        else:
            # all of them in one process
            mine = distributed.share(len(input_ids), INPUT_SNR_WINDOWS)
            with input_snr_db(quantized, input_ids.shape[1]) as input_snr:
                scores = gather_scores(
                    evaluate(models, input_ids[mine.start : mine.stop], batch_size)
                )
            # the first process's share starts with the measured windows
            input_snr = distributed.gather(input_snr)[0]
        if suite is not None:
            task_run = harness.run(
                models, prepared.loaded.tokenizer, suite, _task_batch_size(models, batch_size)
            )
    return scores, input_snr, task_run


def _task_batch_size(models: dict, batch_size: int | None) -> int:
    """Documents per forward pass for lm-eval: --batch-size, or ptq's automatic choice for one model
    at a time over the model's context (ptq.execution.batching), the smallest over the models (a
    variant may compute attention eagerly)."""
    if batch_size is not None:
        return batch_size
    context = min(max_len(models) or 2048, 2048)
    return batching.auto_batch_size(list(models.values()), context, batching.MAX_AUTO_BATCH_SIZE, 1)
