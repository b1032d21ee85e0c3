"""What several commands share, in the order a command meets it: what stamps its outputs (versions,
now), the refusals made before any work, the model (loaded whole or layer by layer, its context, its
windows of text), each recipe's coverage of it, and the calibration its recipes use (made here, or
read from a file and checked).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path

import torch

from ptq import __version__
from ptq.calibration.calibrate import Calibration, calibrate, range_findings, save_calibration
from ptq.commands.options import CalibrationOptions, ModelOptions, refuse_unused
from ptq.errors import PtqError
from ptq.evaluation.data import Corpus, make_windows
from ptq.execution import streaming
from ptq.execution.placement import Placement, placed, placed_copy
from ptq.models.damage import check_parameters
from ptq.models.loading import LoadedModel, load_model
from ptq.models.matmuls import unsupported_weights
from ptq.progress import note_at_end, stderr
from ptq.quantization.plan import Plan, calibration_targets
from ptq.quantization.quantize import blockwise_unavailable, resolve_matmul
from ptq.runtime import devices, distributed
from ptq.runtime.devices import compute_dtype, cpu_model, default_device


def versions() -> dict[str, str]:
    """What shaped the numbers: the model's code (torch, transformers), its windows (tokenizers) and
    the intervals' resampling (numpy)."""
    return {
        "ptq": __version__,
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "tokenizers": importlib.metadata.version("tokenizers"),
        "numpy": importlib.metadata.version("numpy"),
        "python": platform.python_version(),
    }


def now() -> str:
    """The `created` timestamp, the one field that differs between two identical runs.
    SOURCE_DATE_EPOCH (the reproducible-builds convention) pins it, which makes outputs
    byte-identical."""
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


# ---- refused before any work


def refuse_torchrun(command: str) -> None:
    """calibrate and quantize run in one process (their outputs are one file or folder, which every
    torchrun process would compute and write alike): refused under torchrun, before any work."""
    if distributed.active():
        raise PtqError(
            f"ptq {command} runs in one process: start it without torchrun / accelerate launch "
            "(compare and eval spread their windows over the processes)"
        )


def refuse_resume(command: str, calibration: CalibrationOptions) -> None:
    refuse_unused(command, calibration, resume="--resume", checkpoint_every="--checkpoint-every")


def refuse_unused_calibration(
    calibration: CalibrationOptions, needs: bool, why: str, data_flag: str | None
) -> None:
    """--calib and the calibration text (`data_flag`) when no recipe of the run needs a calibration:
    refused in one line rather than dropped (a missing file, or a calibration of another model,
    would otherwise pass unnoticed); the options of a calibration run here, where none runs, named
    in a note."""
    if not needs:
        given = [
            flag
            for flag, value in (("--calib", calibration.file), (data_flag, calibration.data))
            if flag and value
        ]
        if given:
            raise PtqError(f"{given[0]} is not used: {why} (leave it out)")
    # how to calibrate here, where nothing is calibrated (a file is reused, or no recipe needs it):
    # said once the command has run, not dropped
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


def check_placement(placement: Placement | None, low_memory: bool | None) -> None:
    """--device-map is refused with --low-memory and under torchrun (one process places over all
    the GPUs)."""
    if placement is not None and low_memory:
        raise PtqError(
            f"{streaming.LOW_MEMORY_FLAG} and --device-map are two ways to run a model larger than "
            "one GPU: choose one"
        )
    if placement is not None and distributed.active():
        raise PtqError(
            "--device-map places one copy of the model over all the GPUs: start ptq in one "
            "process, without torchrun / accelerate launch"
        )


def compute_path(
    dtype: str | None, matmul: str, low_memory: bool = False, placement: Placement | None = None
) -> dict:
    """Where and how the models run: {"device", "dtype", "matmul", "low_memory"} (see
    devices.compute_dtype, quantize.resolve_matmul and streaming) and on a CPU "cpu_kernels" (the
    instruction set of torch's kernels: AVX2, AVX512, ...) and "cpu" (the processor,
    devices.cpu_model), checked before anything is loaded; with a placement (--device-map),
    "placement" is filled in once the models are placed (ptq.execution.placement.summary of
    each)."""
    device = default_device()
    check_placement(placement, low_memory)
    if low_memory and dtype not in (None, "float32"):
        raise PtqError(
            f"{streaming.LOW_MEMORY_FLAG} computes in float32 (each layer is read in float32), "
            f"not {dtype}"
        )
    info = {
        "device": str(device),
        "dtype": str(compute_dtype("float32" if low_memory else dtype, device)).removeprefix(
            "torch."
        ),
        "matmul": resolve_matmul(matmul, device),
        "low_memory": low_memory,
    }
    # torch's CPU kernels round apart between instruction sets (AVX2, AVX-512) and processors
    if device.type == "cpu":
        info["cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
        info["cpu"] = cpu_model()
    if info["matmul"] == "fp8":  # 128 x 128 blocks: real where torch has the kernel, else why not
        info["blockwise_simulated"] = blockwise_unavailable(device, getattr(torch, info["dtype"]))
        # layers whose out_features is not a multiple of 128: tried apart
        if info["blockwise_simulated"] is None:
            info["blockwise_partial_simulated"] = blockwise_unavailable(
                device, getattr(torch, info["dtype"]), False
            )
    return info


# ---- the model


def runs_layer_by_layer(
    model: ModelOptions, low_memory: bool | None, copies: float = 1, note: str = ""
) -> bool:
    """Whether the model runs layer by layer from disk (ptq.execution.streaming): `low_memory` as
    given; None (automatic) when `copies` float32 copies of a local checkpoint do not fit in memory,
    never with --device-map or --no-memory-check; `note` is printed then."""
    if low_memory is not None:
        return low_memory
    # layer by layer runs in one process: the memory check's own error says what to do
    if distributed.active():
        return False
    streamed = (
        model.placement is None and model.memory_check and streaming.too_big(model.model, copies)
    )
    if streamed and note:
        stderr.print(note, highlight=False, soft_wrap=True)
    return streamed


def load_model_for(
    model: ModelOptions,
    streamed: bool = False,
    *,
    dtype: torch.dtype = torch.float32,
    copies: float = 1,
) -> LoadedModel:
    """The whole model (ptq.models.loading), in `dtype`, on the CPU with a placement (placed later),
    its size checked against the memory as `copies` float32 copies; or when `streamed` its
    meta-device skeleton to stream from disk (ptq.execution.streaming)."""
    if streamed:
        return streaming.load_streamed(model.model, model.trust_remote_code, model.memory_check)
    with devices.gpu_memory(f"loading model '{model.model}'"):
        loaded = load_model(
            model.model,
            model.trust_remote_code,
            torch.device("cpu") if model.placement else None,
            allow_pickle=model.allow_pickle,
            memory_check=model.memory_check,
            dtype=dtype,
            copies=copies,
            reader=streaming.whole_reader(model.model, model.trust_remote_code, dtype),
        )
    # before any forward pass, for every command: a damaged norm or embedding is named as itself,
    # not as the non-finite input of the layer after it (layer by layer: each part as it is read)
    check_parameters(loaded.model)
    return loaded


def check_seq_len(loaded: LoadedModel, seq_len: int) -> None:
    """--seq-len against the model's context: refused beyond a learned position table (an embedding
    with one row per position, GPT-2's wpe: a longer window indexes past it), warned about beyond a
    rotary or other computed position encoding's trained range (it runs, extrapolated)."""
    limit = max_len({"model": loaded.model})
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
            f"--seq-len {seq_len} is longer than model '{loaded.name}' can take: its learned "
            f"position table ('{learned[0]}') has {limit} positions"
        )
    stderr.print(
        f"warning: --seq-len {seq_len} is beyond the context model '{loaded.name}' was trained on "
        f"({limit} positions): its positions are extrapolated, and the numbers may not mean much",
        highlight=False,
        soft_wrap=True,
    )


def max_len(models: dict) -> int | None:
    """The context of the first of `models`, from its config; None where the config names none."""
    config = getattr(next(iter(models.values())), "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_windows(corpus: Corpus, loaded: LoadedModel, seq_len: int, count: int | None):
    """make_windows with the model's tokenizer, refused in one line where the tokenizer gives a
    token id the model's embedding has no row for (a tokenizer of another model: an IndexError deep
    in the first forward otherwise)."""
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
            f"the tokenizer of model '{loaded.name}' gives token id {largest}, but its embedding "
            f"has {rows} rows (vocab_size {getattr(loaded.model.config, 'vocab_size', rows)}): "
            "the tokenizer is not this model's"
        )
    return windows


# ---- the recipes' plans


def check_coverage(
    plans: dict[str, Plan], strict: bool = False, refuse_empty: bool = True
) -> dict[str, dict]:
    """Each recipe's coverage of the model's matmul weights (its plan's coverage); weights that no
    recipe could quantize for lack of support get a one-line warning naming them, or with `strict`
    (--strict-coverage) stop the run before any work. A recipe that quantizes nothing of this model
    stops it too (`refuse_empty`; inspect, which shows the plans, does not): its numbers would be
    the 16-bit model's, under the recipe's name."""
    for name, plan in plans.items():
        why = plan.quantizes_nothing() if refuse_empty else None
        if why:
            raise PtqError(f"recipe '{name}' quantizes no layer of this model ({why})")
    coverages = {name: plan.coverage() for name, plan in plans.items()}
    weights = {x["name"]: x for cov in coverages.values() for x in unsupported_weights(cov)}
    # attention layers whose inputs or KV cache a recipe asks for and ptq cannot quantize
    layers = {
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
        message = (
            f"{len(items)} {what} ptq cannot quantize stay in the compute dtype: {names} "
            f"({items[0]['reason']})"
        )
        if strict:
            raise PtqError(f"{message}; --strict-coverage refuses a partial answer")
        if distributed.is_main():  # once, not once per torchrun process
            stderr.print(
                f"warning: {message}; every report lists them", highlight=False, soft_wrap=True
            )
    return coverages


# ---- the calibration


def calibrate_on_text(
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
    """Calibrate `loaded` for the recipes of `plans` (resolve_plans) on options.samples windows of
    options.seq_len tokens of `corpus`, with its policies; saved to `output` if given (a checkpoint
    kept at `checkpoint` meanwhile, with options.resume continuing from it). batch_size: windows
    per forward pass, None for automatic (ptq.calibration.calibrate.calibrate: on CUDA from the
    free memory, halved with a restart from the first batch when a batch does not fit; 4 on the CPU
    and layer by layer). placement (--device-map): a copy of the model placed over the devices
    runs; the weight amax come from the model itself, in CPU memory."""
    windows = _calibration_windows(corpus, loaded, options)
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
    # one decoder layer at a time from disk; a batch that does not fit: as below
    if streaming.is_streamed(loaded.model):
        calibration = calibrate(
            loaded.model,
            windows.input_ids,
            layers,
            batch_size,
            layer_by_layer=streaming.LayerByLayer(loaded.model),
            **policies,
        )
    else:
        calibration = _calibrate_whole(
            loaded, windows.input_ids, layers, batch_size, placement, checkpoint, options, policies
        )
    calibration.metadata = _calibration_metadata(
        calibration, plans, loaded, corpus, windows, len(layers), options
    )
    if output is not None:
        save_calibration(calibration, output, force)
    return calibration


def _calibration_windows(corpus: Corpus, loaded: LoadedModel, options: CalibrationOptions):
    """The windows calibrated on; fewer than asked for: said, not silent."""
    windows = model_windows(corpus, loaded, options.seq_len, options.samples)
    if len(windows.input_ids) < options.samples and distributed.is_main():
        stderr.print(
            f"note: {corpus.source} holds {len(windows.input_ids)} windows of {windows.seq_len} "
            f"tokens: calibrating on {len(windows.input_ids)}, not the {options.samples} asked "
            "for",
            highlight=False,
            soft_wrap=True,
        )
    return windows


def _calibrate_whole(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    layers,
    batch_size: int | None,
    placement: Placement | None,
    checkpoint: Path | None,
    options: CalibrationOptions,
    policies: dict,
) -> Calibration:
    """Calibrate the whole model in memory, or a copy of it placed over the devices (its GPU memory
    released at the end), keeping the checkpoint. A batch that does not fit: calibrate backs off
    (automatic size) or stops with one line naming the size."""
    with placed(
        {"original": placed_copy(loaded.model) if placement else loaded.model}, placement
    ) as runner:
        calibration = calibrate(
            runner["original"],
            input_ids,
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
    return calibration


def _calibration_metadata(
    calibration: Calibration,
    plans: dict[str, Plan],
    loaded: LoadedModel,
    corpus: Corpus,
    windows,
    layers: int,
    options: CalibrationOptions,
) -> dict:
    """What a calibration records beside its amax: what it worked around, the range rule's
    warnings, the model, the text and windows, the recipes, the versions and the time."""
    faults = calibration.metadata
    warnings = check_ranges(calibration, plans)
    return {
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
        "layers": layers,
        "all_experts": options.all_experts,
        "versions": versions(),
        "created": now(),
    }


def check_ranges(calibration: Calibration, plans: dict[str, Plan]) -> list[str]:
    """The range rule (ptq.calibration.calibrate.range_findings) for every amax a recipe's plan
    turns into a scale."""
    checks = []
    for plan in plans.values():
        for name, m in plan.matmuls.items():
            weights, inputs = m.weights, m.inputs
            if name in calibration.input_amax and inputs.format.scaled:
                checks.append((name, "input", calibration.input_amax[name], inputs.format))
            if name in calibration.weight_amax and weights.format.scaled:
                checks.append((name, "weight", calibration.weight_amax[name], weights.format))
    return range_findings(checks)


def calibration_for(
    loaded: LoadedModel,
    options: CalibrationOptions,
    plans: dict[str, Plan],
    calibration: Calibration | None,
    corpus: Corpus | None,
    *,
    batch_size: int | None,
    placement: Placement | None,
) -> tuple[Calibration | None, str]:
    """The calibration a command uses for the recipes of `plans`, and its source for reports:
    `calibration`, read from options.file, with the range rule applied to these recipes (its
    warnings join the file's, so that they are reported as for a calibration made here); else
    calibrated here on `corpus`; else (no recipe needs one) None."""
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
        calibrate_on_text(
            loaded, corpus, plans, options, batch_size=batch_size, placement=placement
        ),
        "Calibrated in this run (no --calib file).",
    )
