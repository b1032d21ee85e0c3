"""The commands' work, one function each, so that cli.py only parses and prints. Each is given what it is told as
options objects (ptq.commands.options), built once by the CLI.

calibrate: model + calibration text -> amax of every quantized tensor -> calibration file.
compare:   model + recipes (+ calibration) -> bf16 baseline and variants on held-out text -> report (+ gates).
report:    results.json (+ a previous one) -> markdown with verdict, gates, trend and plots.
inspect:   model + recipes -> what each recipe does to each Linear layer.
quantize:  model + recipe (+ calibration) -> compressed-tensors checkpoint, reloaded and verified.
eval:      model + one recipe (+ calibration) -> perplexity and task accuracy of that one configuration.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import torch

from ptq import __version__
from ptq.calibration.calibrate import (
    Calibration,
    calibrate,
    checkpoint_path,
    load_calibration,
    range_findings,
    save_calibration,
)
from ptq.calibration.clips import quantize_, quantize_variants
from ptq.commands.options import (
    DEFAULT_MAX_ITEMS,
    CalibrationOptions,
    CheckpointOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
    refuse_unused,
)
from ptq.commands.results import build_results, calibration_faults, recipe_summary
from ptq.errors import PtqError
from ptq.evaluation import harness
from ptq.evaluation.data import Corpus, load_corpus, make_windows, shared_text, spec_source
from ptq.evaluation.evaluate import evaluate, gather_scores
from ptq.evaluation.layerstats import INPUT_SNR_WINDOWS, input_snr_db, layer_snr, weight_snr_db
from ptq.evaluation.tasks import cloze_items, no_cloze_items
from ptq.execution import batching, streaming
from ptq.execution.placement import Placement, placed, placed_copy
from ptq.execution.placement import summary as placement_summary
from ptq.export import hub
from ptq.files import check_not_an_input, check_output_dir, check_writable
from ptq.models.loading import LoadedModel, hub_repo, linear_layers, load_model, load_structure
from ptq.models.matmuls import kind, unsupported_weights
from ptq.numerics.granularity import PerToken
from ptq.progress import note_at_end, stderr
from ptq.quantization import engines
from ptq.quantization.plan import Plan, calibration_targets, resolve_plans
from ptq.quantization.quantize import blockwise_unavailable, resolve_matmul
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.coverage import describe_coverage
from ptq.reporting.gates import Limits, gate_results, refuse_unmeasured_gates, rejudged, task_scores
from ptq.reporting.report import (
    render_markdown,
    report_outputs,
    write_markdown,
    write_report,
)
from ptq.reporting.results import CompareResults, EvalResults, load_compare, to_json
from ptq.runtime import devices, distributed
from ptq.runtime.devices import compute_dtype, cpu_model, default_device

BASELINE_RECIPE = "bf16"
DEFAULT_RECIPES = ("fp8-e4m3", "int8")


def versions() -> dict[str, str]:
    """What shaped the numbers: the model's code (torch, transformers), its windows (tokenizers) and the intervals'
    resampling (numpy)."""
    return {
        "ptq": __version__,
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "tokenizers": importlib.metadata.version("tokenizers"),
        "numpy": importlib.metadata.version("numpy"),
        "python": platform.python_version(),
    }


def now() -> str:
    """The `created` timestamp, the one field that differs between two identical runs. SOURCE_DATE_EPOCH
    (the reproducible-builds convention) pins it, which makes outputs byte-identical."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is not None:
        try:
            moment = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        except (ValueError, OverflowError, OSError):
            raise PtqError(
                f"SOURCE_DATE_EPOCH must be an integer number of seconds, not {epoch!r}"
            ) from None
    else:
        moment = datetime.datetime.now(datetime.UTC)
    return moment.isoformat(timespec="seconds")


def run_calibrate(
    recipes: list[str],
    *,
    model: ModelOptions = ModelOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> Calibration:
    """Calibrate for `recipes` and save to output.path; a checkpoint (OUTPUT.checkpoint) is kept while running and
    removed at the end. compute.low_memory: layer by layer from disk (ptq.execution.streaming); None: when the model
    does not fit in memory. model.placement: the model placed over the GPUs and offloaded (ptq.execution.placement)."""
    _refuse_torchrun("calibrate")
    refuse_unused("calibrate", model, dtype="--dtype")
    refuse_unused("calibrate", calibration, file="--calib")
    refuse_unused("calibrate", compute, matmul="--matmul")
    refuse_unused("calibrate", output, limits="a gate")
    check_placement(model.placement, compute.low_memory)
    # layer by layer, every batch is in flight until the last layer: there is no point between batches to save at
    for flag, given in (
        ("--resume", calibration.resume),
        ("--checkpoint-every", calibration.checkpoint_every != CalibrationOptions.checkpoint_every),
    ):
        if compute.low_memory and given:
            raise PtqError(
                f"{flag} is not available with --low-memory (layer-by-layer calibration keeps no checkpoint)"
            )
    check_writable(output.path, output.force)
    check_not_an_input(
        output.path,
        {"the model": model.model, "the calibration text": spec_source(calibration.data)},
    )
    checkpoint = checkpoint_path(output.path)
    if checkpoint.exists() and not (calibration.resume or output.force):
        resume = (
            "run without --low-memory and with --resume" if compute.low_memory else "pass --resume"
        )
        raise PtqError(
            f"{checkpoint} is left from an interrupted run: {resume} to continue it, or --force to start over"
        )
    check_output_dir(Path(output.path).parent)
    loaded_recipes = [load_recipe(r) for r in recipes]
    if not loaded_recipes:
        raise PtqError(
            "no recipe given: --recipe names the recipe(s) to calibrate for, comma-separated"
        )
    if not any(
        r.needs_calibration for r in loaded_recipes
    ):  # known from the recipes: before the (slow) model load
        raise PtqError(
            f"recipe(s) {', '.join(r.name for r in loaded_recipes)} need no calibration (no static input scale, no "
            "SmoothQuant): nothing to calibrate"
        )
    corpus = load_corpus(
        calibration.data, role="calibration"
    )  # bad data fails before the (slow) model load
    streamed = not calibration.resume and _streams(
        model,
        compute.low_memory,
        note=(
            f"note: model '{model.model}' does not fit in memory in float32: working layer by layer from disk (--low-memory)"
        ),
    )
    loaded = _load(model, streamed)
    check_seq_len(loaded, calibration.seq_len)
    plans = resolve_plans(loaded.model, loaded_recipes)
    check_coverage(plans, model.strict_coverage)
    result = _calibrate(
        loaded,
        corpus,
        plans,
        calibration,
        batch_size=compute.batch_size,
        placement=model.placement,
        output=output.path,
        force=output.force,
        checkpoint=checkpoint,
    )
    checkpoint.unlink(missing_ok=True)
    return result


def _calibrate(
    loaded: LoadedModel,
    corpus: Corpus,
    plans: dict[str, Plan],
    options: CalibrationOptions,
    *,
    batch_size: int | None = None,
    placement: Placement | None = None,
    output: Path | None = None,
    force: bool = False,
    checkpoint: Path | None = None,
) -> Calibration:
    """Calibrate `loaded` for the recipes of `plans` (resolve_plans) on options.samples windows of options.seq_len
    tokens of `corpus`, with its policies; saved
    to `output` if given (a checkpoint kept at `checkpoint` meanwhile, with options.resume continuing from it).
    batch_size: windows per forward pass, None for automatic (ptq.calibration.calibrate.calibrate: on CUDA from the
    free memory, halved with a restart from the first batch when a batch does not fit; 4 on the CPU and layer by
    layer). placement (--device-map): a copy of the model placed over the devices runs; the weight amax come from
    the model itself, in CPU memory."""
    windows = model_windows(corpus, loaded, options.seq_len, options.samples)
    if (
        len(windows.input_ids) < options.samples and distributed.is_main()
    ):  # fewer than asked: said, not silent
        stderr.print(
            f"note: {corpus.source} holds {len(windows.input_ids)} windows of {windows.seq_len} tokens: calibrating on "
            f"{len(windows.input_ids)}, not the {options.samples} asked for",
            highlight=False,
            soft_wrap=True,
        )
    layers, channels = calibration_targets(plans.values())
    if not layers:
        raise PtqError(
            f"recipes {', '.join(plans)} quantize no input with a scale: nothing to calibrate"
        )
    policies = dict(
        on_nonfinite=options.on_nonfinite,
        on_unseen=options.on_unseen,
        channels=channels,
        all_experts=options.all_experts,
    )
    if streaming.is_streamed(
        loaded.model
    ):  # one decoder layer at a time from disk; a batch that does not fit: as below
        calibration = calibrate(
            loaded.model,
            windows.input_ids,
            layers,
            batch_size,
            layer_by_layer=streaming.LayerByLayer(loaded.model),
            **policies,
        )
    else:
        # A batch that does not fit: calibrate backs off (automatic size) or stops with one line naming the size
        with placed(
            {"original": placed_copy(loaded.model) if placement else loaded.model}, placement
        ) as runner:
            calibration = calibrate(
                runner["original"],
                windows.input_ids,
                layers,
                batch_size,
                checkpoint=checkpoint,
                checkpoint_every=options.checkpoint_every,
                resume=options.resume,
                weights_of=loaded.model,
                **policies,
            )
        del runner
        devices.release()  # a placed copy's GPU memory
    faults = calibration.metadata
    warnings = check_ranges(calibration, plans)
    calibration.metadata = {
        **faults,
        **({"warnings": warnings} if warnings else {}),
        "model": loaded.name,
        "model_source": loaded.source,
        "data": corpus.source,
        "data_sha256": corpus.sha256,
        "windows": len(windows.input_ids),
        "seq_len": windows.seq_len,
        "tokens": windows.input_ids.numel(),
        "windows_description": windows.description,
        "recipes": list(plans),
        "layers": len(layers),
        "all_experts": options.all_experts,
        "versions": versions(),
        "created": now(),
    }
    if output is not None:
        save_calibration(calibration, output, force)
    return calibration


def _calibration(
    loaded: LoadedModel,
    options: CalibrationOptions,
    plans: dict[str, Plan],
    calibration: Calibration | None,
    corpus: Corpus | None,
    *,
    batch_size: int | None,
    placement: Placement | None,
) -> tuple[Calibration | None, str]:
    """The calibration a command uses for the recipes of `plans`, and its source for reports: `calibration`, read from
    options.file, with the range rule applied to these recipes (its warnings join the file's, so that they are
    reported as for a calibration made here); else calibrated here on `corpus`; else (no recipe needs one) None."""
    if calibration is not None:
        warnings = [
            w
            for w in check_ranges(calibration, plans)
            if w not in calibration.metadata.get("warnings", [])
        ]
        if warnings:
            calibration.metadata = {
                **calibration.metadata,
                "warnings": [*calibration.metadata.get("warnings", []), *warnings],
            }
        return calibration, f"Calibration file {options.file}."
    if corpus is None:
        return None, ""
    return (
        _calibrate(loaded, corpus, plans, options, batch_size=batch_size, placement=placement),
        "Calibrated in this run (no --calib file).",
    )


def _streams(
    model: ModelOptions, low_memory: bool | None, copies: float = 1, note: str = ""
) -> bool:
    """Whether the model runs layer by layer from disk (ptq.execution.streaming): `low_memory` as given; None (automatic)
    when `copies` float32 copies of a local checkpoint do not fit in memory, never with --device-map or
    --no-memory-check; `note` is printed then."""
    if low_memory is not None:
        return low_memory
    if (
        distributed.active()
    ):  # layer by layer runs in one process: the memory check's own error says what to do
        return False
    streamed = (
        model.placement is None and model.memory_check and streaming.too_big(model.model, copies)
    )
    if streamed and note:
        stderr.print(note, highlight=False, soft_wrap=True)
    return streamed


def _load(
    model: ModelOptions,
    streamed: bool = False,
    *,
    dtype: torch.dtype = torch.float32,
    copies: float = 1,
) -> LoadedModel:
    """The whole model (ptq.models.loading), in `dtype`, on the CPU with a placement (placed later), its size checked
    against the memory as `copies` float32 copies; or when `streamed` its meta-device skeleton to stream from disk
    (ptq.execution.streaming)."""
    if streamed:
        return streaming.load_streamed(model.model, model.trust_remote_code, model.memory_check)
    with devices.gpu_memory(f"loading model '{model.model}'"):
        return load_model(
            model.model,
            model.trust_remote_code,
            torch.device("cpu") if model.placement else None,
            allow_pickle=model.allow_pickle,
            memory_check=model.memory_check,
            dtype=dtype,
            copies=copies,
            reader=streaming.whole_reader(model.model, model.trust_remote_code, dtype),
        )


def model_windows(corpus: Corpus, loaded: LoadedModel, seq_len: int, count: int | None):
    """make_windows with the model's tokenizer, refused in one line where the tokenizer gives a token id the model's
    embedding has no row for (a tokenizer of another model: an IndexError deep in the first forward otherwise)."""
    windows = make_windows(corpus, loaded.tokenizer, seq_len, count)
    embedding = (
        loaded.model.get_input_embeddings()
        if hasattr(loaded.model, "get_input_embeddings")
        else None
    )
    rows = getattr(embedding, "num_embeddings", None)
    largest = int(windows.input_ids.max()) if windows.input_ids.numel() else -1
    if rows is not None and largest >= rows:
        raise PtqError(
            f"the tokenizer of model '{loaded.name}' gives token id {largest}, but its embedding has {rows} rows "
            f"(vocab_size {getattr(loaded.model.config, 'vocab_size', rows)}): the tokenizer is not this model's"
        )
    return windows


def check_seq_len(loaded: LoadedModel, seq_len: int) -> None:
    """--seq-len against the model's context: refused beyond a learned position table (an embedding with one row
    per position, GPT-2's wpe: a longer window indexes past it), warned about beyond a rotary or other computed
    position encoding's trained range (it runs, extrapolated)."""
    limit = _max_len({"model": loaded.model})
    if not limit or seq_len <= limit:
        return
    inputs = (
        loaded.model.get_input_embeddings()
        if hasattr(loaded.model, "get_input_embeddings")
        else None
    )
    learned = [
        name
        for name, m in loaded.model.named_modules()
        if isinstance(m, torch.nn.Embedding)
        and m is not inputs
        and ("pos" in name.lower() or name.endswith("wpe"))
    ]
    if learned:
        raise PtqError(
            f"--seq-len {seq_len} is longer than model '{loaded.name}' can take: its learned position table "
            f"('{learned[0]}') has {limit} positions"
        )
    stderr.print(
        f"warning: --seq-len {seq_len} is beyond the context model '{loaded.name}' was trained on ({limit} "
        "positions): its positions are extrapolated, and the numbers may not mean much",
        highlight=False,
        soft_wrap=True,
    )


def check_ranges(calibration: Calibration, plans: dict[str, Plan]) -> list[str]:
    """The range rule (ptq.calibration.calibrate.range_findings) for every amax a recipe's plan turns into a scale."""
    checks = []
    for plan in plans.values():
        for name, m in plan.matmuls.items():
            weights, inputs = m.weights, m.inputs
            if name in calibration.input_amax and inputs.format.scaled:
                checks.append((name, "input", calibration.input_amax[name], inputs.format))
            if name in calibration.weight_amax and weights.format.scaled:
                checks.append((name, "weight", calibration.weight_amax[name], weights.format))
    return range_findings(checks)


def check_coverage(
    plans: dict[str, Plan], strict: bool = False, refuse_empty: bool = True
) -> dict[str, dict]:
    """Each recipe's coverage of the model's matmul weights (its plan's coverage); weights that no recipe could
    quantize for lack of support get a one-line warning naming them, or with `strict` (--strict-coverage) stop
    the run before any work. A recipe that quantizes nothing of this model stops it too (`refuse_empty`; inspect,
    which shows the plans, does not): its numbers would be the 16-bit model's, under the recipe's name."""
    for name, plan in plans.items():
        why = plan.quantizes_nothing() if refuse_empty else None
        if why:
            raise PtqError(f"recipe '{name}' quantizes no layer of this model ({why})")
    coverages = {name: plan.coverage() for name, plan in plans.items()}
    weights = {x["name"]: x for cov in coverages.values() for x in unsupported_weights(cov)}
    layers = {  # attention layers whose inputs or KV cache a recipe asks for and ptq cannot quantize
        x["name"]: x
        for cov in coverages.values()
        for x in cov["attention_left_out"]
        if x["reason"].startswith("not supported")
    }
    for what, missing in (
        ("matmul weight(s)", weights),
        ("attention layer(s) whose inputs and KV cache", layers),
    ):
        if not missing:
            continue
        items = list(missing.values())
        names = ", ".join(f"'{x['name']}'" for x in items[:3]) + (
            f" and {len(items) - 3} more" if len(items) > 3 else ""
        )
        message = f"{len(items)} {what} ptq cannot quantize stay in the compute dtype: {names} ({items[0]['reason']})"
        if strict:
            raise PtqError(f"{message}; --strict-coverage refuses a partial answer")
        if distributed.is_main():  # once, not once per torchrun process
            stderr.print(
                f"warning: {message}; every report lists them", highlight=False, soft_wrap=True
            )
    return coverages


def compute_path(
    dtype: str | None, matmul: str, low_memory: bool = False, placement: Placement | None = None
) -> dict:
    """Where and how the models run: {"device", "dtype", "matmul", "low_memory"} (see devices.compute_dtype,
    quantize.resolve_matmul and streaming) and on a CPU "cpu_kernels" (the instruction set of torch's kernels: AVX2,
    AVX512, ...) and "cpu" (the processor, devices.cpu_model), checked before anything is loaded; with a placement (--device-map),
    "placement" is filled in once the models are placed (ptq.execution.placement.summary of each)."""
    device = default_device()
    check_placement(placement, low_memory)
    if low_memory and dtype not in (None, "float32"):
        raise PtqError(
            f"{streaming.LOW_MEMORY_FLAG} computes in float32 (each layer is read in float32), not {dtype}"
        )
    info = {
        "device": str(device),
        "dtype": str(compute_dtype("float32" if low_memory else dtype, device)).removeprefix(
            "torch."
        ),
        "matmul": resolve_matmul(matmul, device),
        "low_memory": low_memory,
    }
    if (
        device.type == "cpu"
    ):  # torch's CPU kernels round apart between instruction sets (AVX2, AVX-512) and processors
        info["cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
        info["cpu"] = cpu_model()
    if info["matmul"] == "fp8":  # 128 x 128 blocks: real where torch has the kernel, else why not
        info["blockwise_simulated"] = blockwise_unavailable(device, getattr(torch, info["dtype"]))
        if (
            info["blockwise_simulated"] is None
        ):  # layers whose out_features is not a multiple of 128: tried apart
            info["blockwise_partial_simulated"] = blockwise_unavailable(
                device, getattr(torch, info["dtype"]), False
            )
    return info


def check_placement(placement: Placement | None, low_memory: bool | None) -> None:
    """--device-map is refused with --low-memory and under torchrun (one process places over all the GPUs)."""
    if placement is not None and low_memory:
        raise PtqError(
            f"{streaming.LOW_MEMORY_FLAG} and --device-map are two ways to run a model larger than one GPU: choose one"
        )
    if placement is not None and distributed.active():
        raise PtqError(
            "--device-map places one copy of the model over all the GPUs: start ptq in one process, without "
            "torchrun / accelerate launch"
        )


class MeasuredVariants:
    """compare's variants of each part of a model run layer by layer (ptq.execution.streaming.LayerByLayer's
    `parts`, called with each part as it is read): the baseline and each recipe's variant of the part
    (quantize_variants), their weight SNR added to `weight_snr` and, once the part has run, their input SNR to
    `input_snr`, as compare measures the whole model. The part itself is not kept once its variants are made."""

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
        self.window_tokens = (
            window_tokens  # the evaluation windows' length, for input SNR's share of each layer
        )

    def __call__(self, part: torch.nn.Module) -> _Measured:
        # a part is the trunk or one decoder layer, under its names in the whole model: the whole model's plans,
        # restricted to it (each fused group, q/k/v, gate/up, a layer's experts, is whole in one part)
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
        models, self.models = (
            self.models,
            None,
        )  # held by the executor while the part runs, not here
        return models

    def __exit__(self, *exc) -> bool:
        self.snr.__exit__(*exc)
        for name, values in self.measured.items():
            self.input_snr[name] |= values
        return False


def _record_shared_text(
    calib: Calibration | None, calib_corpus: Corpus | None, eval_corpus: Corpus
) -> None:
    """When the calibration the recipes use (`calib`, calibrated here on `calib_corpus` or read from a file, whose
    text's sha256 is all that is known) shares text with the evaluation text (ptq.evaluation.data.shared_text), say so
    among its warnings: calibration.faults.warnings in results.json, a "Warning:" line in the report, one line on
    stderr (as the range rule's warnings)."""
    shared = (
        shared_text(calib_corpus, eval_corpus, calib.metadata.get("data_sha256")) if calib else None
    )
    if shared:
        calib.metadata = {
            **calib.metadata,
            "warnings": [*calib.metadata.get("warnings", []), shared],
        }


def run_compare(
    recipes: list[str],
    *,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> CompareResults:
    """The bf16 baseline and each recipe on the same windows, report written to output.path. compute.low_memory: layer
    by layer from disk (ptq.execution.streaming); None: when the model and its variants' weight codes do not fit in
    memory. model.placement (--device-map): the model loaded and quantized on the CPU, each variant then placed over
    the GPUs and offloaded (ptq.execution.placement)."""
    _refuse_resume("compare", calibration)
    check_task_options(data)
    distributed.setup()
    # Peak memory, in float32 copies of the model: the original in the compute dtype plus, per variant and for
    # the baseline, weight codes of 2 bytes at most.
    copies = torch.finfo(compute_dtype(model.dtype, default_device())).bits / 32 + 0.5 * (
        len(recipes) + 1
    )
    streamed = _streams(
        model,
        compute.low_memory,
        copies,
        note=(
            f"note: model '{model.model}' and {len(recipes) + 1} variants of it do not fit in memory: comparing "
            f"layer by layer from disk ({streaming.LOW_MEMORY_FLAG})"
        ),
    )
    compute_info = _compute_info(model, compute, data, streamed)
    _check_report_outputs(output)
    baseline = load_recipe(BASELINE_RECIPE)
    variants = [load_recipe(r) for r in recipes]
    if (
        not variants
    ):  # `--recipes "$EMPTY"`: a baseline alone, whose gates would pass with nothing to judge
        raise PtqError(
            "no recipe given: --recipes names the recipe(s) to compare with the bf16 baseline, comma-separated"
        )
    names = [baseline.name] + [r.name for r in variants]
    if clash := next((n for i, n in enumerate(names) if n in names[:i]), None):
        where = ", ".join(r.source or r.name for r in variants if r.name == clash)
        if clash == baseline.name:
            raise PtqError(
                f"recipe name '{clash}' is the baseline's ({where}): every compare has the baseline; a variant needs "
                "a name of its own"
            )
        raise PtqError(
            f"recipe name '{clash}' is given twice ({where}): each recipe may appear once (a report row and a gate "
            "are named by it)"
        )
    if streamed:
        streaming.check_compare_recipes(variants)
    needs_calibration = [r for r in variants if r.needs_calibration]
    _refuse_unused_calibration(
        calibration,
        bool(needs_calibration),
        f"recipe(s) {', '.join(r.name for r in variants)} need no calibration",
        "--calib-data",
    )
    reused = load_calibration(calibration.file) if calibration.file else None
    calib_corpus = (
        load_corpus(calibration.data, role="calibration")
        if needs_calibration and reused is None
        else None
    )
    eval_corpus = load_corpus(data.data, role="evaluation")
    task_work, suite = _task_suite(data, eval_corpus)  # fail before the model
    refuse_unmeasured_gates(output.limits, suite.scored if suite else set())
    loaded = _load(model, streamed, dtype=getattr(torch, compute_info["dtype"]), copies=copies)
    check_seq_len(loaded, data.seq_len)
    windows = model_windows(eval_corpus, loaded, data.seq_len, data.windows)
    plans = resolve_plans(
        loaded.model, [baseline, *variants], compute.target
    )  # the one plan per recipe
    coverages = check_coverage(plans, model.strict_coverage)
    calib, calibration_source = _calibration(
        loaded,
        calibration,
        {r.name: plans[r.name] for r in needs_calibration},
        reused,
        calib_corpus,
        batch_size=compute.batch_size,
        placement=model.placement,
    )
    _record_shared_text(calib if needs_calibration else None, calib_corpus, eval_corpus)

    layer_order = list(linear_layers(loaded.model))
    task_run = None
    batch_size, placement = compute.batch_size, model.placement
    if streamed:
        # The same variants and measurements, made of each part of the model as it is read from disk
        weight_snr, input_snr = {r.name: {} for r in variants}, {r.name: {} for r in variants}
        parts = MeasuredVariants(
            baseline,
            variants,
            calib,
            compute_info["matmul"],
            weight_snr,
            input_snr,
            compute.target,
            plans,
            windows.input_ids.shape[1],
        )
        run = streaming.LayerByLayer(
            loaded.model, parts, [baseline.name, *(r.name for r in variants)]
        )
        scores = evaluate(run, windows.input_ids, batch_size)
    else:
        # Each variant is a quantized copy of the model, sharing with the others what it does not quantize;
        # the original is then released.
        with devices.gpu_memory(
            f"building {len(variants) + 1} variants of the model (the baseline and each recipe)"
        ):
            models = quantize_variants(
                loaded.model,
                [baseline, *variants],
                calib,
                compute_info["matmul"],
                compute.target,
                plans,
            )
            quantized = {r.name: models[r.name] for r in variants}
            weight_snr = {name: weight_snr_db(loaded.model, m) for name, m in quantized.items()}
        del loaded.model
        devices.release()  # the original's memory, before the evaluation's batches
        with placed(models, placement) as models:
            if placement:
                compute_info["placement"] = {
                    name: placement_summary(m) for name, m in models.items()
                }
            mine = distributed.share(
                len(windows.input_ids), INPUT_SNR_WINDOWS
            )  # all of them in one process
            with input_snr_db(quantized, windows.input_ids.shape[1]) as input_snr:
                scores = gather_scores(
                    evaluate(models, windows.input_ids[mine.start : mine.stop], batch_size)
                )
            input_snr = distributed.gather(input_snr)[
                0
            ]  # the first process's share starts with the measured windows
            if suite is not None:
                task_run = harness.run(
                    models, loaded.tokenizer, suite, _task_batch_size(models, batch_size)
                )
    snr = layer_snr(weight_snr, input_snr)

    results = build_results(
        loaded=loaded,
        compute=compute_info,
        corpus=eval_corpus,
        windows=windows,
        scores=scores,
        recipes=variants,
        coverages=coverages,
        target=compute.target,
        versions=versions(),
        created=now(),
        baseline=baseline,
        snr=snr,
        tasks=(task_run, suite) if task_run is not None else None,
        calibration=calib if needs_calibration else None,
        calibration_source=calibration_source,
        layer_order=layer_order,
        limits=output.limits,
    )
    if distributed.is_main():
        write_report(Path(output.path), results, output.force, output.plots)
    return results


def _refuse_unused_calibration(
    calibration: CalibrationOptions, needs: bool, why: str, data_flag: str | None
) -> None:
    """--calib and the calibration text (`data_flag`) when no recipe of the run needs a calibration: refused in one
    line rather than dropped (a missing file, or a calibration of another model, would otherwise pass unnoticed);
    the options of a calibration run here, where none runs, named in a note."""
    if not needs:
        given = [
            flag
            for flag, value in (("--calib", calibration.file), (data_flag, calibration.data))
            if flag and value
        ]
        if given:
            raise PtqError(f"{given[0]} is not used: {why} (leave it out)")
    # how to calibrate here, where nothing is calibrated (a file is reused, or no recipe needs it): said once the
    # command has run, not dropped
    if calibration.file or not needs:
        flags = {
            "samples": "--calib-samples" if data_flag == "--calib-data" else "--samples",
            "on_nonfinite": "--on-nonfinite",
            "on_unseen": "--on-unseen",
            "all_experts": "--routed-experts-only",
        }
        default = CalibrationOptions()
        unused = [
            flag
            for name, flag in flags.items()
            if getattr(calibration, name) != getattr(default, name)
        ]
        if unused and distributed.is_main():
            reason = f"the calibration is read from {calibration.file}" if calibration.file else why
            note_at_end(f"{', '.join(unused)} not used: {reason}")


def _refuse_resume(command: str, calibration: CalibrationOptions) -> None:
    refuse_unused(command, calibration, resume="--resume", checkpoint_every="--checkpoint-every")


def _refuse_torchrun(command: str) -> None:
    """calibrate and quantize run in one process (their outputs are one file or folder, which every torchrun process
    would compute and write alike): refused under torchrun, before any work."""
    if distributed.active():
        raise PtqError(
            f"ptq {command} runs in one process: start it without torchrun / accelerate launch (compare and eval "
            "spread their windows over the processes)"
        )


def _compute_info(
    model: ModelOptions, compute: ComputeOptions, data: DataOptions, streamed: bool
) -> dict:
    """compute_path, with what a layer-by-layer run cannot do refused before anything is loaded."""
    engines.check_target(compute.target)
    info = compute_path(model.dtype, compute.matmul, streamed, model.placement)
    if streamed and data.tasks:
        raise PtqError(
            f"--tasks needs the whole model in memory: it is not available with {streaming.LOW_MEMORY_FLAG}"
        )
    if streamed and distributed.active():
        raise PtqError(
            f"{streaming.LOW_MEMORY_FLAG} runs in one process: start ptq without torchrun / accelerate launch"
        )
    return info


def _check_report_outputs(output: OutputOptions) -> None:
    """report.md, results.json and the plots in output.path (drawn, or an earlier run's, which are removed): refused
    if they exist without --force, the folder checked, before any work."""
    from ptq.reporting.plots import plot_paths

    out = Path(output.path)
    for path in [out / "report.md", out / "results.json", *plot_paths(out / "report.md").values()]:
        check_writable(path, output.force)
    check_output_dir(out)


AUTO_TASKS = (
    "auto"  # eval's --tasks default: cloze where the model is whole in one process, else none
)


def check_task_options(data: DataOptions) -> None:
    """--tasks runs lm-evaluation-harness in one process; --num-fewshot and --limit are its options."""
    if not data.tasks and (data.num_fewshot is not None or data.limit is not None):
        raise PtqError("--num-fewshot and --limit apply to --tasks: give tasks too")
    if data.max_items is not None and not harness.scores_cloze(data.tasks):
        raise PtqError(
            "--max-items caps the cloze task's items, and this run scores no cloze task: add cloze to --tasks, or "
            "drop --max-items (--limit caps every task)"
        )
    if data.tasks and distributed.active():
        raise PtqError(
            "--tasks runs lm-evaluation-harness on each model in one process: start ptq without torchrun / "
            "accelerate launch (perplexity is data-parallel), or run the tasks in a run of their own"
        )
    limit = data.limit
    if (
        limit is not None and limit >= 2**53
    ):  # lm-eval counts documents in integers: more than any task has
        raise PtqError(
            f"--limit {limit:g} is too large: give at most {2**53 - 1} documents per task"
        )
    if limit is not None and not (limit > 0 and (limit < 1 or float(limit).is_integer())):
        raise PtqError(
            f"--limit takes a number of documents per task (e.g. 100) or a fraction below 1 (e.g. 0.1), not {limit:g}"
        )
    if data.num_fewshot is not None and data.num_fewshot < 0:
        raise PtqError(f"--num-fewshot must be 0 or more, not {data.num_fewshot}")


def _task_suite(data: DataOptions, eval_corpus: Corpus):
    """The lm-eval tasks of --tasks (ptq.evaluation.harness.prepare), loaded once so that a bad task stops before the
    model, and the temporary folder of the task files ptq generates (cloze items, local copies), removed at exit."""
    import tempfile

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


def _task_batch_size(models: dict, batch_size: int | None) -> int:
    """Documents per forward pass for lm-eval: --batch-size, or ptq's automatic choice for one model at a time
    over the model's context (ptq.execution.batching), the smallest over the models (a variant may compute attention
    eagerly)."""
    if batch_size is not None:
        return batch_size
    context = min(_max_len(models) or 2048, 2048)
    return batching.auto_batch_size(list(models.values()), context, batching.MAX_AUTO_BATCH_SIZE, 1)


def run_eval(
    recipe: str = BASELINE_RECIPE,
    *,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
) -> EvalResults:
    """One configuration (a recipe, bf16 by default): perplexity on the evaluation windows and accuracy on the tasks,
    each with its interval; report written to output.path. No baseline, so no deltas: that is what compare is for.
    compute.low_memory: layer by layer from disk (ptq.execution.streaming); None: when the model does not fit in
    memory. model.placement (--device-map): loaded and quantized on the CPU, then placed over the GPUs
    (ptq.execution.placement)."""
    _refuse_resume("eval", calibration)
    refuse_unused("eval", output, limits="a gate (they compare with a baseline: use ptq compare)")
    auto_tasks = data.tasks == AUTO_TASKS
    if not auto_tasks:  # tasks given: checked before torch.distributed starts
        check_task_options(data)
    distributed.setup()
    streamed = _streams(
        model,
        compute.low_memory,
        note=(
            f"note: model '{model.model}' does not fit in memory: evaluating layer by layer from disk "
            f"({streaming.LOW_MEMORY_FLAG})"
        ),
    )
    if (
        auto_tasks
    ):  # eval's default: the cloze task, where lm-eval can run (the model whole, one process)
        whole = not streamed and not distributed.active()
        data = dataclasses.replace(data, tasks="cloze" if whole else None)
        if not whole and distributed.is_main():
            where = (
                f"layer by layer ({streaming.LOW_MEMORY_FLAG})" if streamed else "under torchrun"
            )
            stderr.print(
                f"note: no task accuracy {where}: lm-eval needs the whole model in one process; perplexity only",
                highlight=False,
                soft_wrap=True,
            )
        check_task_options(data)
    compute_info = _compute_info(model, compute, data, streamed)
    _check_report_outputs(output)
    config = load_recipe(recipe)
    if streamed:
        streaming.check_compare_recipes([config])
    _refuse_unused_calibration(
        calibration,
        config.needs_calibration,
        f"recipe {config.name} needs no calibration",
        "--calib-data",
    )
    reused = load_calibration(calibration.file) if calibration.file else None
    needed = [config] if config.needs_calibration else []
    calib_corpus = (
        load_corpus(calibration.data, role="calibration") if needed and reused is None else None
    )
    eval_corpus = load_corpus(data.data, role="evaluation")
    if (
        auto_tasks and data.tasks == "cloze" and not cloze_items(eval_corpus)
    ):  # not asked for: a note, not an error
        if data.limit is not None or data.num_fewshot is not None or data.max_items is not None:
            raise PtqError(  # ...unless a task option was: it would go unused
                f"--limit, --num-fewshot and --max-items apply to task accuracy, and this run scores none: the default "
                f"task, cloze, has no items ({no_cloze_items(eval_corpus)}); name tasks with --tasks"
            )
        stderr.print(
            f"note: no cloze accuracy ({no_cloze_items(eval_corpus)}): perplexity only; --tasks names other tasks",
            highlight=False,
            soft_wrap=True,
        )
        data = dataclasses.replace(data, tasks=None)
    task_work, suite = _task_suite(data, eval_corpus)  # fail before the model
    loaded = _load(model, streamed, dtype=getattr(torch, compute_info["dtype"]))
    check_seq_len(loaded, data.seq_len)
    windows = model_windows(eval_corpus, loaded, data.seq_len, data.windows)
    plans = resolve_plans(loaded.model, [config], compute.target)  # the one plan
    config_coverage = check_coverage(plans, model.strict_coverage)[config.name]
    calib, calibration_source = _calibration(
        loaded,
        calibration,
        plans if needed else {},
        reused,
        calib_corpus,
        batch_size=compute.batch_size,
        placement=model.placement,
    )
    _record_shared_text(calib if needed else None, calib_corpus, eval_corpus)
    layer_order = list(linear_layers(loaded.model))
    batch_size, task_run = compute.batch_size, None
    if streamed:
        parts = MeasuredVariants(
            config,
            [],
            calib,
            compute_info["matmul"],
            {},
            {},
            compute.target,
            plans,
            windows.input_ids.shape[1],
        )
        s = evaluate(
            streaming.LayerByLayer(loaded.model, parts, [config.name]),
            windows.input_ids,
            batch_size,
        )[config.name]
    else:
        models = {
            config.name: quantize_(
                loaded.model,
                config,
                calib,
                matmul=compute_info["matmul"],
                target=compute.target,
                plan=plans[config.name],
            )
        }
        with placed(models, model.placement) as models:
            if model.placement:
                compute_info["placement"] = {
                    name: placement_summary(m) for name, m in models.items()
                }
            mine = distributed.share(len(windows.input_ids))  # all of them in one process
            s = gather_scores(
                evaluate(models, windows.input_ids[mine.start : mine.stop], batch_size)
            )[config.name]
            task_run = (
                harness.run(models, loaded.tokenizer, suite, _task_batch_size(models, batch_size))
                if suite
                else None
            )
    results = build_results(
        loaded=loaded,
        compute=compute_info,
        corpus=eval_corpus,
        windows=windows,
        scores={config.name: s},
        recipes=[config],
        coverages={config.name: config_coverage},
        target=compute.target,
        versions=versions(),
        created=now(),
        tasks=(task_run, suite) if task_run is not None else None,
        calibration=calib if config.needs_calibration else None,
        calibration_source=calibration_source,
        layer_order=layer_order,
    )
    if distributed.is_main():
        write_report(Path(output.path), results, output.force, plots=False)
    return results


def _max_len(models: dict) -> int | None:
    config = getattr(next(iter(models.values())), "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def run_report(
    results_file: Path,
    previous_file: Path | None = None,
    output: Path | None = None,
    limits: Limits | None = None,
    plots: bool = True,
    force: bool = False,
) -> tuple[CompareResults, CompareResults | None, str]:
    """Render a compare results file (gates from `limits` if any are given, else the limits stored by compare, judged
    anew on the numbers) as markdown, with a trend against `previous_file`; write it (and its plots) to `output` if
    given. Returns the results as judged (their `gates` are what the markdown shows and the exit code follows), the
    previous results and the markdown."""
    if output is None and (
        force or not plots
    ):  # they apply to written files: without --output, none is written
        raise PtqError(
            f"{'--force' if force else '--no-plots'} applies with --output (the report is printed, not written)"
        )
    results = load_compare(results_file)
    previous = load_compare(previous_file, "previous results file") if previous_file else None
    if limits is not None and limits.any():
        refuse_unmeasured_gates(limits, set(task_scores(results.baseline)), str(results_file))
        results = dataclasses.replace(results, gates=gate_results(results, limits))
    elif results.gates is not None:
        stored = results.gates.passed
        results = rejudged(results)
        if stored != results.gates.passed:
            stderr.print(
                f"warning: {results_file} stores gates.passed {str(stored).lower()}, but its numbers "
                f"{'pass' if results.gates.passed else 'fail'} its limits: judged on the numbers",
                highlight=False,
                soft_wrap=True,
            )
    if output is None:
        return results, previous, render_markdown(results, previous)
    inputs = {Path(f).resolve(): f for f in (results_file, previous_file) if f is not None}
    for path in report_outputs(Path(output), results, plots):
        if (
            Path(path).resolve() in inputs
        ):  # --force would replace the file being read with its own rendering
            raise PtqError(
                f"--output {path} is the input {inputs[Path(path).resolve()]}: write the report elsewhere"
            )
        check_writable(path, force)
    write_markdown(Path(output), results, previous, plots, force=True)
    return results, previous, Path(output).read_text(encoding="utf-8")


def run_inspect(
    model: str | None, recipes: list[str], trust_remote_code: bool = False, target: str = "vllm"
) -> dict:
    """Every Linear layer of the model with its shape, and what each recipe does to its weights and inputs, as
    `target` serves them (the plans compare and quantize resolve: vLLM's int8 range, its shared scales)."""
    loaded_recipes = [load_recipe(r) for r in recipes]
    if not loaded_recipes:
        raise PtqError("no recipe given: --recipe names the recipe(s) to show, comma-separated")
    target = engines.check_target(target)
    loaded = load_structure(
        model, trust_remote_code
    )  # shapes only: no weights read, nor downloaded
    layers = linear_layers(loaded.model)
    plans = resolve_plans(loaded.model, loaded_recipes, target)
    rows = []
    for name, m in layers.items():
        row = {
            "layer": name,
            "kind": kind(m),
            "shape": [m.out_features, m.in_features],
            "parameters": m.weight.numel(),
            "recipes": {},
        }
        for r in loaded_recipes:
            entry = plans[r.name].matmuls[name]
            row["recipes"][r.name] = {
                "quantized": entry.quantized,
                "weights": entry.weights.describe(),
                "inputs": entry.inputs.describe(),
                "calibrated": entry.quantized and entry.inputs.static,
                "reason": entry.reason,
                "shares_scale_with": sorted({*entry.weight_group, *entry.input_group} - {name})
                or None,
            }
        rows.append(row)
    total = sum(row["parameters"] for row in rows)
    coverages = check_coverage(plans, refuse_empty=False)
    summary = {
        r.name: {
            "layers": sum(row["recipes"][r.name]["quantized"] for row in rows),
            "parameters": sum(
                row["parameters"] for row in rows if row["recipes"][r.name]["quantized"]
            ),
            "description": r.description,
            "coverage": coverages[r.name],
            "coverage_line": describe_coverage(coverages[r.name]),
        }
        for r in loaded_recipes
    }
    return {
        "model": {"name": loaded.name, "source": loaded.source},
        "target": target,
        "linear_layers": len(rows),
        "linear_parameters": total,
        "recipes": summary,
        "layers": rows,
    }


def run_quantize(
    recipe: str,
    *,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(windows=8),
    calibration: CalibrationOptions = CalibrationOptions(),
    compute: ComputeOptions = ComputeOptions(),
    output: OutputOptions,
    checkpoint: CheckpointOptions = CheckpointOptions(),
) -> dict:
    """quantize: model + recipe (+ calibration) -> compressed-tensors checkpoint in output.path, reloaded with
    transformers and checked against ptq's simulation on `data`'s windows before it is renamed into place.
    compute.low_memory: layer by layer from disk (ptq.execution.streaming), unverified (the model is never whole in
    memory); None: when the model does not fit in memory. model.placement (--device-map): the model loaded and
    exported from CPU memory; calibration and the verification's models placed over the devices
    (ptq.execution.placement)."""
    from ptq.export import checkpoint as export
    from ptq.files import atomic_dir
    from ptq.progress import progress
    from ptq.reporting.report import render_model_card

    _refuse_torchrun("quantize")
    refuse_unused("quantize", model, dtype="--dtype")
    refuse_unused("quantize", data, tasks="--tasks")
    refuse_unused("quantize", compute, matmul="--matmul")
    refuse_unused("quantize", output, limits="a gate")
    _refuse_resume("quantize", calibration)
    if not 0 < checkpoint.shard_size_mb < 1e12:  # inf and nan too
        raise PtqError(
            f"--shard-size must be a number of MB above 0 and below 1e12, not {checkpoint.shard_size_mb:g}"
        )
    out, force, batch_size, placement = (
        Path(output.path),
        output.force,
        compute.batch_size,
        model.placement,
    )
    check_export_target(out, force)
    inputs = {
        "the model": model.model,
        "the calibration text": spec_source(calibration.data),
        "the calibration file": calibration.file,
        "the compare results": checkpoint.compare_results,
        "the verification text": spec_source(data.data),
    }
    check_not_an_input(out, inputs, replaced=True)
    if checkpoint.push_to_hub:
        hub.check_push(checkpoint.push_to_hub, force)  # before the long work, as the folder is
    elif checkpoint.private:
        raise PtqError("--private applies with --push-to-hub (the repository it creates)")
    target = engines.check_target(compute.target)
    check_placement(placement, compute.low_memory)
    r = load_recipe(recipe)
    export.check_exportable(r)
    _refuse_unused_calibration(
        calibration, r.needs_calibration, f"recipe {r.name} needs no calibration", None
    )
    compare = (
        load_compare_results(checkpoint.compare_results, r, target)
        if checkpoint.compare_results
        else None
    )
    reused = load_calibration(calibration.file) if calibration.file else None
    check_output_dir(out.parent)
    needed = [r] if r.needs_calibration else []
    calib_corpus = (
        load_corpus(calibration.data, role="calibration") if reused is None else None
    )  # checked early
    streamed = _streams(
        model,
        compute.low_memory,
        note=(
            f"note: model '{model.model}' does not fit in memory in float32: working layer by layer from disk (--low-memory)"
        ),
    )
    loaded = _load(model, streamed)
    check_seq_len(loaded, data.seq_len)
    if compare is not None:
        check_compare_model(compare, loaded)
    plans = resolve_plans(loaded.model, [r], target)  # the one plan
    export.export_layers(
        loaded.model, r, plans[r.name]
    )  # refuse an unexportable model before calibrating it
    checkpoint_coverage = check_coverage(plans, model.strict_coverage)[r.name]
    calib, _ = _calibration(
        loaded,
        calibration,
        plans if needed else {},
        reused,
        calib_corpus if needed else None,
        batch_size=batch_size,
        placement=placement,
    )
    if compare is not None and needed:
        check_compare_calibration(compare, calib)
    if reused is not None:
        calibration_source = f"calibration file {Path(calibration.file).name}"
    elif needed:
        calibration_source = "calibrated in this run"
    else:
        calibration_source = (
            "none: the recipe's scales come from the weights and, on the fly, from the inputs"
        )
    if streamed:
        dtypes = export.source_dtypes(str(loaded.model.ptq_checkpoint.directory))
        entries, quantized, ignored = export.plan_checkpoint(
            loaded.model,
            r,
            calib,
            dtypes,
            target,
            read=loaded.model.ptq_checkpoint.read_one,
            plan=plans[r.name],
        )
    else:
        dtypes = export.source_dtypes(loaded.model.config._name_or_path)
        entries, quantized, ignored = export.plan_checkpoint(
            loaded.model, r, calib, dtypes, target, plan=plans[r.name]
        )
    m = calib.metadata if calib is not None else {}
    info = {
        "kind": "ptq-export/1",
        "model": {
            "name": loaded.name,
            "source": loaded.source,
            "caveats": list(loaded.caveats),
            "architecture": type(loaded.model).__name__,
            "hub_id": hub_repo(loaded.name),  # the model card's base_model: the Hub links the two
        },
        "recipe": to_json(recipe_summary(r)),
        "target": target,
        "target_rules": engines.describe(target),
        "format": {
            "quant_method": "compressed-tensors",
            "format": export.quantization_config(r, ignored).format,
            "compressed_tensors": importlib.metadata.version("compressed-tensors"),
            "quantized_layers": len(quantized),
            "ignored_layers": ignored,
        },
        "calibration": {
            "source": calibration_source,
            "data": m.get("data"),
            "data_sha256": m.get("data_sha256"),
            "windows": m.get("windows"),
            "seq_len": m.get("seq_len"),
            "tokens": m.get("tokens"),
            "batch_size": m.get("batch_size"),
            "faults": to_json(calibration_faults(m)),
        },
        "size": export.checkpoint_bytes(entries, quantized),
        "coverage": checkpoint_coverage,
        "verification": None,
        "low_memory": streamed,
        "compare": None
        if compare is None
        else compare | {"calibration": _without_amax(compare["calibration"])},
        "versions": versions()
        | {"compressed-tensors": importlib.metadata.version("compressed-tensors")},
        "created": now(),
    }
    with atomic_dir(out) as tmp, devices.gpu_memory("exporting and verifying the checkpoint"):
        with progress("writing", len(entries)) as advance:
            written = export.write_weights(
                entries, tmp, int(checkpoint.shard_size_mb * 1e6), advance
            )
        del entries
        info["size"] |= written
        export.write_config(loaded.model, r, ignored, dtypes, tmp)
        loaded.tokenizer.save_pretrained(tmp)
        conv1d = [name for name in quantized if kind(loaded.model.get_submodule(name)) == "Conv1D"]
        if checkpoint.verify and streamed:
            info["verification_skipped"] = (
                "exported layer by layer with `--low-memory`: the model was never whole in "
                "memory to be reloaded and compared"
            )
        elif (
            checkpoint.verify and placement
        ):  # transformers 5 with compressed-tensors 0.20 fails to run such a checkpoint offloaded
            info["verification_skipped"] = (
                "exported with `--device-map`: the checkpoint is not reloaded and compared, "
                "since transformers cannot run a compressed-tensors checkpoint offloaded by "
                "accelerate; reload it where it fits, or serve it with vLLM"
            )
        elif (
            checkpoint.verify
            and model.memory_check
            and (short := _verification_shortfall(loaded.model, r, target))
        ):
            info["verification_skipped"] = short
        elif checkpoint.verify:
            corpus = load_corpus(data.data, role="evaluation")
            windows = model_windows(corpus, loaded, data.seq_len, data.windows)
            # Inputs the loader rounds otherwise than ptq's simulation of the target (int8: the loaders over
            # [-128, 127], ptq over [-127, 127]; static FP8 under vllm: transformers divides by the scale, vLLM
            # multiplies by its reciprocal): check the logits against the simulation of what the loader computes, and
            # the perplexity against ptq's own too.
            # Layers whose input scales the reloading loader does not apply (experts in transformers; every layer where
            # transformers cannot load Conv1D quantized and ptq's own dequantizing reader stands in) are simulated with
            # their inputs as they are, and their input scales are checked in the files instead.
            unrounded = export.unapplied_input_layers(
                loaded.model, quantized, conv1d=bool(conv1d), dynamic=r.inputs.dynamic
            )
            # The loader first, so that the simulation computes its arithmetic: compressed-tensors in transformers takes
            # one dynamic "token" scale for a whole 2-D input (ptq's reader, and vLLM, scale each token).
            reloaded, load_info = export.reload_or_read(
                tmp, conv1d=bool(conv1d), trust_remote_code=model.trust_remote_code
            )
            if (
                "loader" in load_info and not conv1d
            ):  # ptq's reader stood in for transformers: its input rounding
                unrounded = export.unapplied_input_layers(
                    loaded.model, quantized, conv1d=True, dynamic=r.inputs.dynamic
                )
            token_rule = (
                []
                if "loader" in load_info
                else export.token_rule_layers(
                    loaded.model, r, [n for n in quantized if n not in unrounded], windows.input_ids
                )
            )
            own_rounding = "; ".join(
                filter(
                    None,
                    (
                        engines.unlike_reload_loader(r.inputs, target),
                        export.describe_token_rule(token_rule),
                    ),
                )
            )
            own = (
                (
                    own_rounding,
                    export.simulate_export(
                        copy.deepcopy(loaded.model),
                        r,
                        calib,
                        loader_inputs=False,
                        unrounded_inputs=unrounded,
                        target=target,
                    ),
                )
                if own_rounding
                else None
            )
            disk = export.checkpoint_names(loaded.model, [f"{name}.weight" for name in quantized])
            scales = export.unapplied_scales(loaded.model, unrounded, calib, plans[r.name])
            simulated = export.simulate_export(
                loaded.model,
                r,
                calib,
                unrounded_inputs=unrounded,
                target=target,
                token_rule_inputs=token_rule,
                kv_cache=load_info.get("kv_cache_quantized", False),
            )
            expected = export.simulated_tensors(simulated, disk, conv1d)
            # the experts' input scales as the target engine has them (vllm: one per layer, the largest)
            scales = {k: expected.get(k, v) for k, v in scales.items()}
            reloaded.to(next(simulated.parameters()).device)  # reloaded as a user would: on the CPU
            info["verification"] = export.verify(
                simulated,
                reloaded,
                load_info,
                len(quantized) - len(unrounded),
                windows.input_ids,
                batch_size,
                ptq_own=own,
                unapplied_input_scales=scales,
                directory=tmp,
                expected_tensors=expected,
            )
            info["verification"]["loader"] = load_info.get(
                "loader", "transformers AutoModelForCausalLM.from_pretrained"
            )
            if (
                "bfloat16" in load_info
            ):  # transformers failed in float32: how it does in bfloat16 (bfloat16_check)
                info["verification"]["transformers_bfloat16"] = load_info["bfloat16"]
            info["verification"] |= {
                "loader_token_rule_layers": token_rule,  # export.token_rule_layers: so in the check's simulation only
                "data": corpus.source,
                "data_sha256": corpus.sha256,
                "description": windows.description,
            }
            del reloaded
            if not info["verification"]["passed"]:
                raise export.VerificationFailed(info)
        (tmp / export.EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        (tmp / "README.md").write_text(render_model_card(info), encoding="utf-8")
    if checkpoint.push_to_hub:
        message = f"ptq {__version__}: {r.name} of {loaded.name}" + (
            "" if info["verification"] else " (unverified)"
        )
        info["hub"] = hub.push(out, checkpoint.push_to_hub, checkpoint.private, message)
    return info


def _verification_shortfall(model: torch.nn.Module, recipe: Recipe, target: str) -> str | None:
    """Why reloading and comparing the checkpoint would not fit in memory (None: it fits, or memory is unknown). The
    check holds, next to the model, the checkpoint reloaded in float32 (read on the host, then moved to the model's
    device) and, where the target rounds inputs unlike the reload's loader, a float32 copy of the model for ptq's own
    simulation. Checked before the check starts: running out of memory there would throw away a checkpoint written
    correctly; this way it is kept, unverified, and the card says why."""
    from ptq.runtime.resources import parameters_shortfall, size_text

    params = sum(p.numel() for p in model.parameters())
    own_copy = engines.unlike_reload_loader(recipe.inputs, target) is not None or (
        recipe.inputs.dynamic and isinstance(recipe.inputs.granularity, PerToken)
    )
    device = next(model.parameters()).device
    copies = {device: 2 if own_copy else 1}
    if device.type != "cpu":
        copies[torch.device("cpu")] = 1  # from_pretrained reads it on the host first
    for where, n in copies.items():
        short = parameters_shortfall(params, n, where)
        if short is not None:
            return (
                f"reloading and comparing the checkpoint needs about {size_text(short[1])} on {where.type} beside the "
                f"model ({'two float32 copies' if n == 2 else 'a float32 copy'} of the model) and {size_text(short[2])} "
                "is free: the checkpoint is written but not verified; compare it where it fits (`ptq compare "
                "CHECKPOINT`), or serve it with vLLM"
            )
    return None


def check_export_target(output: Path, force: bool) -> None:
    """Refuse an existing output without --force; with it, replace only an earlier ptq export or an empty
    directory, never a directory that ptq did not write."""
    from ptq.export.checkpoint import EXPORT_INFO

    check_writable(output, force, directory=True)
    if output.exists():
        if not output.is_dir():
            raise PtqError(f"{output} exists and is not a directory")
        if any(output.iterdir()) and not (output / EXPORT_INFO).is_file():
            raise PtqError(
                f"{output} is not a ptq export (no {EXPORT_INFO}): not replacing it, even with --force"
            )


def check_compare_model(compare: dict, loaded: LoadedModel) -> None:
    """Refuse the results of a compare of another model (--compare-results): their numbers would go into this
    model's card. The model is known by where its weights came from (a folder, a Hub id, a GGUF file)."""
    if compare.get("model_source") != loaded.source:
        raise PtqError(
            f"{compare['file']} compares another model ('{compare['model']}', from {compare.get('model_source')}), "
            f"not '{loaded.name}' (from {loaded.source}): its numbers do not belong in this model's card"
        )


def check_compare_calibration(compare: dict, calibration: Calibration | None) -> None:
    """Refuse the results of a compare whose calibration gave other input scales than this checkpoint's
    (--compare-results with another --calib, text or number of windows): the card would quote numbers measured with
    other scales. Known by the layers' input amax, which results.json records exactly (a float32 as a double)."""
    theirs = (
        (compare.get("calibration") or {}).get("input_amax") if calibration is not None else None
    )
    for layer, amax in (theirs or {}).items():
        if layer in calibration.input_amax and float(calibration.input_amax[layer]) != amax:
            c, m = compare["calibration"], calibration.metadata
            raise PtqError(
                f"{compare['file']} was calibrated otherwise ({c['data']}, {c['windows']} x {c['seq_len']} tokens) than "
                f"this checkpoint ({m.get('data')}, {m.get('windows')} x {m.get('seq_len')} tokens): the input amax of "
                f"'{layer}' is {amax:.6g} there, {float(calibration.input_amax[layer]):.6g} here, so its numbers are "
                "not this checkpoint's; quantize with the compare's calibration (--calib), or compare again"
            )


def _without_amax(calibration: dict | None) -> dict | None:
    """The compare's calibration as ptq-export.json records it: its text and windows, not every layer's amax."""
    return (
        None if calibration is None else {k: v for k, v in calibration.items() if k != "input_amax"}
    )


def load_compare_results(path: Path, recipe: Recipe, target: str) -> dict:
    """The rows of a `ptq compare` results.json (a file or its directory) for the model card: the variant of this
    recipe's name, refused unless it quantized as this recipe does, for the same target (a name alone can be another
    recipe's: a card would then quote another configuration's numbers)."""
    path = Path(path)
    path = path / "results.json" if path.is_dir() else path
    r = load_compare(path)
    variant = next((v for v in r.variants if v.name == recipe.name), None)
    if variant is None:
        raise PtqError(
            f"{path} has no results for recipe '{recipe.name}' (it compares {', '.join(v.name for v in r.variants) or 'nothing'})"
        )
    mine, theirs = to_json(recipe_summary(recipe)), to_json(variant.recipe)
    differs = [
        k for k in mine if k not in ("name", "description", "source") and mine[k] != theirs.get(k)
    ]
    if differs:
        k = differs[0]
        raise PtqError(
            f"{path}'s '{recipe.name}' is another recipe of that name ({k}: {theirs.get(k)}, here: {mine[k]}): "
            "its numbers are not this checkpoint's"
        )
    if r.target != target:
        raise PtqError(
            f"{path} simulated '{recipe.name}' as {r.target} serves it; this checkpoint is for --target {target}: "
            f"compare with --target {target}, or quantize with --target {r.target}"
        )
    base, ev = r.baseline, r.eval
    c = r.calibration
    return {
        "file": str(path),
        "model": r.model.name,
        "model_source": r.model.source,
        # what the variant's static scales came from, checked against this checkpoint's (check_compare_calibration)
        "calibration": None
        if c is None
        else {
            "data": c.data,
            "windows": c.windows,
            "seq_len": c.seq_len,
            "input_amax": {row.layer: row.input_amax for row in c.layers},
        },
        "eval": ev.description,
        "eval_data": ev.data,
        "eval_sha256": ev.data_sha256,
        "baseline": {"name": base.name, "perplexity": base.perplexity, "accuracy": base.accuracy}
        | {"recipe": to_json(base.recipe)},
        "variant": {
            k: getattr(variant, k)
            for k in (
                "name",
                "perplexity",
                "accuracy",
                "ppl_delta_pct",
                "accuracy_delta",
                "kl_div",
                "top1_agreement",
            )
        }
        | {"recipe": to_json(variant.recipe)},
    }
