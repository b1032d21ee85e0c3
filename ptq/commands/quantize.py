"""quantize: model + recipe (+ calibration) -> compressed-tensors checkpoint, reloaded and verified.

The export record (ptq.export.record) is what ptq-export.json holds and what the model card is
rendered from; run_quantize returns it as that JSON (with the upload's `hub` where it pushed).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import json
from pathlib import Path

import torch

from ptq import __version__
from ptq.calibration.calibrate import Calibration, load_calibration
from ptq.commands.common import (
    calibration_for,
    check_coverage,
    check_placement,
    check_seq_len,
    load_model_for,
    model_windows,
    now,
    refuse_resume,
    refuse_torchrun,
    refuse_unused_calibration,
    runs_layer_by_layer,
    versions,
)
from ptq.commands.options import (
    CalibrationOptions,
    CheckpointOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
    refuse_unused,
)
from ptq.commands.results import calibration_faults, recipe_summary
from ptq.errors import PtqError
from ptq.evaluation.data import load_corpus, spec_source
from ptq.export import checkpoint as export
from ptq.export import hub
from ptq.export import verify as check
from ptq.export.card import render_model_card
from ptq.export.format import check_exportable, quantization_config
from ptq.export.reading import reload_or_read
from ptq.export.record import (
    EXPORT_INFO,
    KIND,
    CheckpointSize,
    ExportCalibration,
    ExportedModel,
    ExportFormat,
    ExportRecord,
    Verification,
)
from ptq.files import check_outputs, check_writable, writes_outputs
from ptq.models.loading import LoadedModel, hub_repo
from ptq.models.matmuls import kind
from ptq.models.names import checkpoint_names
from ptq.numerics.granularity import PerToken
from ptq.quantization import engines
from ptq.quantization.plan import Plan, resolve_plans
from ptq.quantization.recipes import Recipe, load_recipe
from ptq.reporting.results import load_compare, to_json
from ptq.runtime import devices


@writes_outputs
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
    """quantize: model + recipe (+ calibration) -> compressed-tensors checkpoint in output.path,
    reloaded with transformers and checked against ptq's simulation on `data`'s windows before it
    is renamed into place. compute.low_memory: layer by layer from disk (ptq.execution.streaming),
    unverified (the model is never whole in memory); None: when the model does not fit in memory.
    model.placement (--device-map): the model loaded and exported from CPU memory; calibration and
    the verification's models placed over the devices (ptq.execution.placement)."""
    from ptq.files import atomic_dir

    out, target = _check_options(recipe, model, data, calibration, compute, output, checkpoint)
    r, compare, reused = _inputs(recipe, target, calibration, checkpoint)
    # checked early
    calib_corpus = load_corpus(calibration.data, role="calibration") if reused is None else None
    streamed = runs_layer_by_layer(model, compute.low_memory, note=_too_big(model))
    loaded = load_model_for(model, streamed)
    check_seq_len(loaded, data.seq_len)
    if compare is not None:
        check_compare_model(compare, loaded)
    plans = resolve_plans(loaded.model, [r], target)  # the one plan
    export.export_layers(loaded.model, r, plans[r.name])  # refused before calibrating
    coverage = check_coverage(plans, model.strict_coverage)[r.name]
    calib, calibration_source = _quantize_calibration(
        loaded, r, plans, calibration, reused, calib_corpus, compare, compute, model
    )
    dtypes, entries, quantized, ignored = _plan(loaded, r, calib, target, plans[r.name], streamed)
    planned = export.checkpoint_bytes(entries, quantized)
    known = _known_before_writing(
        loaded,
        r,
        target,
        quantized,
        ignored,
        calib,
        calibration_source,
        coverage,
        streamed,
        compare,
    )
    with atomic_dir(out) as tmp, devices.gpu_memory("exporting and verifying the checkpoint"):
        written = _write(
            tmp, entries, loaded, r, ignored, dtypes, checkpoint.shard_size_mb, plans[r.name]
        )
        del entries
        skipped = _unverified(checkpoint, model, streamed, loaded.model, r, target)
        verification = (
            _verify(tmp, loaded, r, target, plans[r.name], calib, quantized, data, model, compute)
            if checkpoint.verify and skipped is None
            else None
        )
        record = ExportRecord(
            **known,
            size=CheckpointSize(**planned, **written),
            verification=verification,
            verification_skipped=skipped,
        )
        if verification is not None and not verification.passed:
            raise check.VerificationFailed(record)
        (tmp / EXPORT_INFO).write_text(json.dumps(record.to_json(), indent=2) + "\n")
        (tmp / "README.md").write_text(render_model_card(record), encoding="utf-8")
    info = record.to_json()
    if checkpoint.push_to_hub:
        message = f"ptq {__version__}: {r.name} of {loaded.name}" + (
            "" if record.verification else " (unverified)"
        )
        info["hub"] = hub.push(out, checkpoint.push_to_hub, checkpoint.private, message)
    return info


def _check_options(
    recipe: str,
    model: ModelOptions,
    data: DataOptions,
    calibration: CalibrationOptions,
    compute: ComputeOptions,
    output: OutputOptions,
    checkpoint: CheckpointOptions,
) -> tuple[Path, str]:
    """The options quantize refuses before any work; its output directory and target engine."""
    refuse_torchrun("quantize")
    refuse_unused("quantize", model, dtype="--dtype")
    refuse_unused("quantize", data, tasks="--tasks")
    refuse_unused("quantize", compute, matmul="--matmul")
    refuse_unused("quantize", output, limits="a gate")
    refuse_resume("quantize", calibration)
    if not 0 < checkpoint.shard_size_mb < 1e12:  # inf and nan too
        raise PtqError(
            "--shard-size must be a number of MB above 0 and below 1e12, not "
            f"{checkpoint.shard_size_mb:g}"
        )
    out = Path(output.path)
    inputs = {
        "the model": model.model,
        "the calibration text": spec_source(calibration.data),
        "the calibration file": calibration.file,
        "the compare results": checkpoint.compare_results,
        "the verification text": spec_source(data.data),
        "the recipe": load_recipe(recipe).source,
    }
    check_outputs([out], inputs, output.force, folder=True)
    check_export_target(out, output.force)
    if checkpoint.push_to_hub:
        # before the long work, as the folder is
        hub.check_push(checkpoint.push_to_hub, output.force)
    elif checkpoint.private:
        raise PtqError("--private applies with --push-to-hub (the repository it creates)")
    target = engines.check_target(compute.target)
    check_placement(model.placement, compute.low_memory)
    return out, target


def _inputs(
    recipe: str, target: str, calibration: CalibrationOptions, checkpoint: CheckpointOptions
) -> tuple[Recipe, dict | None, Calibration | None]:
    """The recipe, refused unless the checkpoint format can express it; the compare results for
    the card (--compare-results) and the calibration to reuse (--calib), where given."""
    r = load_recipe(recipe)
    check_exportable(r)
    refuse_unused_calibration(
        calibration, r.needs_calibration, f"recipe {r.name} needs no calibration", None
    )
    compare = (
        load_compare_results(checkpoint.compare_results, r, target)
        if checkpoint.compare_results
        else None
    )
    reused = load_calibration(calibration.file) if calibration.file else None
    return r, compare, reused


def _too_big(model: ModelOptions) -> str:
    return (
        f"note: model '{model.model}' does not fit in memory in float32: working layer by "
        "layer from disk (--low-memory)"
    )


def _quantize_calibration(
    loaded: LoadedModel,
    recipe: Recipe,
    plans: dict[str, Plan],
    calibration: CalibrationOptions,
    reused: Calibration | None,
    corpus,
    compare: dict | None,
    compute: ComputeOptions,
    model: ModelOptions,
) -> tuple[Calibration | None, str]:
    """The checkpoint's calibration (reused from --calib, made here, or none where the recipe needs
    none), checked against the compare results' where given, and its source for the card."""
    needed = recipe.needs_calibration
    calib, _ = calibration_for(
        loaded,
        calibration,
        plans if needed else {},
        reused,
        corpus if needed else None,
        batch_size=compute.batch_size,
        placement=model.placement,
    )
    if compare is not None and needed:
        check_compare_calibration(compare, calib)
    if reused is not None:
        return calib, f"calibration file {Path(calibration.file).name}"
    if needed:
        return calib, "calibrated in this run"
    return calib, "none: the recipe's scales come from the weights and, on the fly, from the inputs"


def _plan(
    loaded: LoadedModel,
    recipe: Recipe,
    calib: Calibration | None,
    target: str,
    plan: Plan,
    streamed: bool,
) -> tuple[dict, list, list[str], list[str]]:
    """The source's dtypes and what the checkpoint holds (export.plan_checkpoint): a streamed
    model's tensors are read from its checkpoint as their shards are written."""
    if streamed:
        dtypes = export.source_dtypes(str(loaded.model.ptq_checkpoint.directory))
        planned = export.plan_checkpoint(
            loaded.model,
            recipe,
            calib,
            dtypes,
            target,
            read=loaded.model.ptq_checkpoint.read_one,
            plan=plan,
        )
    else:
        dtypes = export.source_dtypes(loaded.model.config._name_or_path)
        planned = export.plan_checkpoint(loaded.model, recipe, calib, dtypes, target, plan=plan)
    return (dtypes, *planned)


def _known_before_writing(
    loaded: LoadedModel,
    recipe: Recipe,
    target: str,
    quantized: list[str],
    ignored: list[str],
    calib: Calibration | None,
    calibration_source: str,
    coverage: dict,
    streamed: bool,
    compare: dict | None,
) -> dict:
    """The export record's fields known before the checkpoint is written (ExportRecord's keywords),
    its creation time among them."""
    m = calib.metadata if calib is not None else {}
    compressed_tensors = importlib.metadata.version("compressed-tensors")
    return dict(
        kind=KIND,
        model=ExportedModel(
            name=loaded.name,
            source=loaded.source,
            caveats=list(loaded.caveats),
            architecture=type(loaded.model).__name__,
            hub_id=hub_repo(loaded.name),
        ),
        recipe=to_json(recipe_summary(recipe)),
        target=target,
        target_rules=engines.describe(target),
        format=ExportFormat(
            quant_method="compressed-tensors",
            format=quantization_config(recipe, ignored).format,
            compressed_tensors=compressed_tensors,
            quantized_layers=len(quantized),
            ignored_layers=ignored,
        ),
        calibration=ExportCalibration(
            source=calibration_source,
            **{k: m.get(k) for k in ("data", "data_sha256", "windows", "seq_len", "tokens")},
            batch_size=m.get("batch_size"),
            faults=to_json(calibration_faults(m)),
        ),
        coverage=coverage,
        low_memory=streamed,
        compare=None
        if compare is None
        else compare | {"calibration": _without_amax(compare["calibration"])},
        versions=versions() | {"compressed-tensors": compressed_tensors},
        created=now(),
    )


def _write(
    directory: Path,
    entries: list,
    loaded: LoadedModel,
    recipe: Recipe,
    ignored: list[str],
    dtypes: dict,
    shard_size_mb: float,
    plan: Plan,
) -> dict:
    """The checkpoint's files in `directory`: the shards, config.json (the quantization_config) and
    the tokenizer; what write_weights wrote."""
    from ptq.progress import progress

    with progress("writing", len(entries)) as advance:
        written = export.write_weights(entries, directory, int(shard_size_mb * 1e6), advance)
    export.write_config(loaded.model, recipe, ignored, dtypes, directory, plan)
    loaded.tokenizer.save_pretrained(directory)
    return written


def _unverified(
    checkpoint: CheckpointOptions,
    model: ModelOptions,
    streamed: bool,
    module: torch.nn.Module,
    recipe: Recipe,
    target: str,
) -> str | None:
    """Why the checkpoint is written unverified though --verify asks for it (None: it is verified,
    or --no-verify)."""
    if not checkpoint.verify:
        return None
    if streamed:
        return (
            "exported layer by layer with `--low-memory`: the model was never whole in "
            "memory to be reloaded and compared"
        )
    # transformers 5 with compressed-tensors 0.20 fails to run such a checkpoint offloaded
    if model.placement:
        return (
            "exported with `--device-map`: the checkpoint is not reloaded and compared, "
            "since transformers cannot run a compressed-tensors checkpoint offloaded by "
            "accelerate; reload it where it fits, or serve it with vLLM"
        )
    if model.memory_check:
        return _verification_shortfall(module, recipe, target)
    return None


def _verify(
    directory: Path,
    loaded: LoadedModel,
    recipe: Recipe,
    target: str,
    plan: Plan,
    calib: Calibration | None,
    quantized: list[str],
    data: DataOptions,
    model: ModelOptions,
    compute: ComputeOptions,
) -> Verification:
    """The written checkpoint reloaded (by transformers, or ptq's reader where transformers cannot
    run it) and checked against ptq's simulation of its loader on `data`'s windows."""
    corpus = load_corpus(data.data, role="evaluation")
    windows = model_windows(corpus, loaded, data.seq_len, data.windows)
    source, r = loaded.model, recipe
    conv1d = [name for name in quantized if kind(source.get_submodule(name)) == "Conv1D"]
    # The loader first, so that the simulation computes its arithmetic: compressed-tensors in
    # transformers takes one dynamic "token" scale for a whole 2-D input (ptq's reader, and vLLM,
    # scale each token).
    reloaded, load_info = reload_or_read(
        directory, conv1d=bool(conv1d), trust_remote_code=model.trust_remote_code
    )
    # Layers whose input scales the loader does not apply (experts in transformers; every layer
    # where ptq's own dequantizing reader stands in, as for Conv1D, which transformers cannot load
    # quantized) are simulated with their inputs as they are, and their input scales are checked
    # in the files instead.
    reader = bool(conv1d) or "loader" in load_info
    dynamic = {n for n in quantized if plan.matmuls[n].inputs.dynamic}
    unrounded = check.unapplied_input_layers(source, quantized, conv1d=reader, dynamic=dynamic)
    per_token = [
        n
        for n in quantized
        if n not in unrounded
        and n in dynamic
        and isinstance(plan.matmuls[n].inputs.granularity, PerToken)
    ]
    token_rule = (
        []
        if "loader" in load_info
        else check.token_rule_layers(source, r, per_token, windows.input_ids)
    )
    own = _ptq_own(source, r, calib, target, unrounded, token_rule)
    disk = checkpoint_names(source, [f"{name}.weight" for name in quantized])
    scales = check.unapplied_scales(source, unrounded, calib, plan)
    simulated = check.simulate_export(
        source,
        r,
        calib,
        unrounded_inputs=unrounded,
        target=target,
        token_rule_inputs=token_rule,
        kv_cache=load_info.get("kv_cache_quantized", False),
    )
    expected = check.simulated_tensors(simulated, disk, conv1d)
    # the experts' input scales as the target engine has them (vllm: one per layer, the largest)
    scales = {k: expected.get(k, v) for k, v in scales.items()}
    reloaded.to(next(simulated.parameters()).device)  # reloaded as a user would: on the CPU
    verification = check.verify(
        simulated,
        reloaded,
        load_info,
        len(quantized) - len(unrounded),
        windows.input_ids,
        compute.batch_size,
        ptq_own=own,
        unapplied_input_scales=scales,
        directory=directory,
        expected_tensors=expected,
    )
    return dataclasses.replace(
        verification,
        loader=load_info.get("loader", "transformers AutoModelForCausalLM.from_pretrained"),
        transformers_bfloat16=load_info.get("bfloat16"),  # transformers failed in float32
        loader_token_rule_layers=token_rule,  # so in the check's simulation only
        data=corpus.source,
        data_sha256=corpus.sha256,
        description=windows.description,
    )


def _ptq_own(
    model: torch.nn.Module,
    recipe: Recipe,
    calib: Calibration | None,
    target: str,
    unrounded: list[str],
    token_rule: list[str],
) -> tuple[str, torch.nn.Module] | None:
    """Where the target rounds inputs otherwise than the reload's loader: how, and ptq's own
    simulation of the target (on a copy of the model). int8: the loaders round inputs over
    [-128, 127], ptq over [-127, 127]; static FP8 under vllm: transformers divides by the scale,
    vLLM multiplies by its reciprocal. The logits are checked against the simulation of what the
    loader computes, and the perplexity against ptq's own too."""
    rounding = "; ".join(
        filter(
            None,
            (
                *dict.fromkeys(
                    engines.unlike_reload_loader(s.inputs, target) for s in recipe.schemes
                ),
                check.describe_token_rule(token_rule),
            ),
        )
    )
    if not rounding:
        return None
    return rounding, check.simulate_export(
        copy.deepcopy(model),
        recipe,
        calib,
        loader_inputs=False,
        unrounded_inputs=unrounded,
        target=target,
    )


def _verification_shortfall(model: torch.nn.Module, recipe: Recipe, target: str) -> str | None:
    """Why reloading and comparing the checkpoint would not fit in memory (None: it fits, or memory
    is unknown). The check holds, next to the model, the checkpoint reloaded in float32 (read on
    the host, then moved to the model's device) and, where the target rounds inputs unlike the
    reload's loader, a float32 copy of the model for ptq's own simulation. Checked before the
    check starts: running out of memory there would throw away a checkpoint written correctly;
    this way it is kept, unverified, and the card says why."""
    from ptq.runtime.resources import parameters_shortfall, size_text

    params = sum(p.numel() for p in model.parameters())
    own_copy = any(
        engines.unlike_reload_loader(s.inputs, target) is not None
        or (s.inputs.dynamic and isinstance(s.inputs.granularity, PerToken))
        for s in recipe.schemes
    )
    device = next(model.parameters()).device
    copies = {device: 2 if own_copy else 1}
    if device.type != "cpu":
        copies[torch.device("cpu")] = 1  # from_pretrained reads it on the host first
    for where, n in copies.items():
        short = parameters_shortfall(params, n, where)
        if short is not None:
            return (
                f"reloading and comparing the checkpoint needs about {size_text(short[1])} on "
                f"{where.type} beside the model "
                f"({'two float32 copies' if n == 2 else 'a float32 copy'} of the model) and "
                f"{size_text(short[2])} is free: the checkpoint is written but not verified; "
                "compare it where it fits (`ptq compare CHECKPOINT`), or serve it with vLLM"
            )
    return None


def check_export_target(output: Path, force: bool) -> None:
    """Refuse an existing output without --force; with it, replace only an earlier ptq export or an
    empty directory, never a directory that ptq did not write."""
    check_writable(output, force, directory=True)
    if output.exists():
        if not output.is_dir():
            raise PtqError(f"{output} exists and is not a directory")
        if any(output.iterdir()) and not (output / EXPORT_INFO).is_file():
            raise PtqError(
                f"{output} is not a ptq export (no {EXPORT_INFO}): not replacing it, even with "
                "--force"
            )


def check_compare_model(compare: dict, loaded: LoadedModel) -> None:
    """Refuse the results of a compare of another model (--compare-results): their numbers would go
    into this model's card. The model is known by where its weights came from (a folder, a Hub id, a
    GGUF file)."""
    if compare.get("model_source") != loaded.source:
        raise PtqError(
            f"{compare['file']} compares another model ('{compare['model']}', from "
            f"{compare.get('model_source')}), not '{loaded.name}' (from {loaded.source}): its "
            "numbers do not belong in this model's card"
        )


def check_compare_calibration(compare: dict, calibration: Calibration | None) -> None:
    """Refuse the results of a compare whose calibration gave other input scales than this
    checkpoint's (--compare-results with another --calib, text or number of windows): the card
    would quote numbers measured with other scales. Known by the layers' input amax, which
    results.json records exactly (a float32 as a double)."""
    theirs = (
        (compare.get("calibration") or {}).get("input_amax") if calibration is not None else None
    )
    for layer, amax in (theirs or {}).items():
        if layer in calibration.input_amax and float(calibration.input_amax[layer]) != amax:
            c, m = compare["calibration"], calibration.metadata
            raise PtqError(
                f"{compare['file']} was calibrated otherwise ({c['data']}, {c['windows']} x "
                f"{c['seq_len']} tokens) than this checkpoint ({m.get('data')}, {m.get('windows')} "
                f"x {m.get('seq_len')} tokens): the input amax of '{layer}' is {amax:.6g} there, "
                f"{float(calibration.input_amax[layer]):.6g} here, so its numbers are not this "
                "checkpoint's; quantize with the compare's calibration (--calib), or compare again"
            )


def _without_amax(calibration: dict | None) -> dict | None:
    """The compare's calibration as ptq-export.json records it: its text and windows, not every
    layer's amax."""
    return (
        None if calibration is None else {k: v for k, v in calibration.items() if k != "input_amax"}
    )


def load_compare_results(path: Path, recipe: Recipe, target: str) -> dict:
    """The rows of a `ptq compare` results.json (a file or its directory) for the model card: the
    variant of this recipe's name, refused unless it quantized as this recipe does, for the same
    target (a name alone can be another recipe's: a card would then quote another configuration's
    numbers)."""
    path = Path(path)
    path = path / "results.json" if path.is_dir() else path
    r = load_compare(path)
    variant = next((v for v in r.variants if v.name == recipe.name), None)
    if variant is None:
        raise PtqError(
            f"{path} has no results for recipe '{recipe.name}' (it compares "
            f"{', '.join(v.name for v in r.variants) or 'nothing'})"
        )
    mine, theirs = to_json(recipe_summary(recipe)), to_json(variant.recipe)
    differs = [
        k for k in mine if k not in ("name", "description", "source") and mine[k] != theirs.get(k)
    ]
    if differs:
        k = differs[0]
        raise PtqError(
            f"{path}'s '{recipe.name}' is another recipe of that name ({k}: {theirs.get(k)}, here: "
            f"{mine[k]}): its numbers are not this checkpoint's"
        )
    if r.target != target:
        raise PtqError(
            f"{path} simulated '{recipe.name}' as {r.target} serves it; this checkpoint is for "
            f"--target {target}: compare with --target {target}, or quantize with --target "
            f"{r.target}"
        )
    base, ev = r.baseline, r.eval
    c = r.calibration
    return {
        "file": str(path),
        "model": r.model.name,
        "model_source": r.model.source,
        # what the variant's static scales came from, checked against this checkpoint's
        # (check_compare_calibration)
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
