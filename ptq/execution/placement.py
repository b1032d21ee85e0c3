"""Models larger than one GPU: `--device-map auto` places each model ptq runs over the GPUs with
accelerate.

Each model ptq runs (the original while calibrating; the baseline and each recipe's variant while
evaluating) is placed whole, module by module, by accelerate's `infer_auto_device_map` (decoder
blocks are never split: `_no_split_modules`; "auto" spreads each model evenly over the GPUs, as
transformers' `device_map="auto"` does, "sequential" fills them in order) and `dispatch_model`: the
first blocks on the first GPU, the next on the next, and what the GPUs cannot hold in CPU memory,
copied to the GPU for each forward (accelerate's CPU offload), and past the CPU's limit on disk (a
temporary folder under PTQ_CACHE, removed after the run). accelerate's hooks move the hidden states
from one device to the next.

The model is loaded and quantized on the CPU first (host memory holds the original and the variants'
weight codes); then each model gets its share of every device: `--max-memory` (or, by default, 70%
of each GPU's free memory, the rest being left for the activations, and 90% of the host memory
available to the models: what is free plus what they already take there) divided by the number of
models held at once. Offloaded modules are loaded whole: a mixture-of-experts layer reads its
experts' weights directly (ptq.models.matmuls.LinearExperts), so it is loaded with them
(`preload_module_classes`), and the quantized layers' codes and scales are buffers, offloaded with
the weights (`offload_buffers`).

Without CUDA, what the CPU limit holds stays in CPU memory and the rest goes to disk, through the
same offloading hooks that copy CPU-offloaded modules to a GPU: that is how the tests exercise them
on a CPU.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.files import cache_root, make_dir
from ptq.runtime.devices import gpu_memory
from ptq.runtime.resources import check_disk, size_text

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's names
GPU_WEIGHTS_FRACTION = (
    0.7  # of each GPU's free memory for weights; the rest for activations (ptq.execution.batching)
)
CPU_WEIGHTS_FRACTION = (
    0.9  # of the host memory available to the models (free, plus what they take already)
)
PRELOADED = ["LinearExperts"]  # modules whose forward reads their submodules' tensors directly
FLAG = "--device-map"


@dataclass(frozen=True)
class Placement:
    strategy: str = "auto"
    max_memory: dict | None = (
        None  # device (GPU index, "cpu", "disk") -> bytes, for all models held at once
    )


def parse(device_map: str | None, max_memory: str | None) -> Placement | None:
    """`--device-map STRATEGY` and `--max-memory "0=70GiB,1=70GiB,cpu=400GiB"`, checked; None
    without --device-map."""
    if device_map is None:
        if max_memory is not None:
            raise PtqError(
                f"--max-memory limits what {FLAG} places on each device: give {FLAG} auto with it"
            )
        return None
    if device_map not in STRATEGIES:
        raise PtqError(f"unknown {FLAG} '{device_map}' (known: {', '.join(STRATEGIES)})")
    return Placement(device_map, parse_max_memory(max_memory) if max_memory is not None else None)


def parse_max_memory(text: str) -> dict:
    """ "0=70GiB,cpu=400GiB" -> {0: bytes, "cpu": bytes} (sizes as accelerate reads them: 70GiB,
    70GB, 512MB)."""
    from accelerate.utils import convert_file_size_to_int

    limits: dict = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        device, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not device or not size:
            raise PtqError(f"--max-memory '{part}' is not DEVICE=SIZE (e.g. 0=70GiB, cpu=400GiB)")
        if device.isdigit():
            key: int | str = int(device)
            if key >= torch.cuda.device_count():
                raise PtqError(
                    f"--max-memory names GPU {key}, but torch sees {torch.cuda.device_count()} "
                    "GPU(s)"
                )
        elif device in ("cpu", "disk"):
            key = device
        else:
            raise PtqError(f"--max-memory device '{device}' is not a GPU index, 'cpu' or 'disk'")
        # cpu=1GiB,cpu=2GiB (or 0=..,00=..): which one was meant is not ptq's to guess
        if key in limits:
            raise PtqError(f"--max-memory names device {key} twice")
        try:
            limits[key] = convert_file_size_to_int(size)
        except (ValueError, OverflowError):  # 1e400GiB: an infinite float
            raise PtqError(
                f"--max-memory size '{size}' is not a size (e.g. 70GiB, 512MB)"
            ) from None
        if limits[key] <= 0:
            raise PtqError(f"--max-memory size '{size}' is less than a byte")
    if not limits:
        raise PtqError("--max-memory is empty")
    return limits


def budgets(placement: Placement, models: int, held: int = 0) -> dict:
    """Each of `models` models' share of every device: the --max-memory limits (devices not named
    there get nothing), or the default fractions of the free GPU memory and of the host memory
    available to the models: what is available, plus the `held` bytes the models (loaded and
    quantized on the CPU) already take there, where the modules placed on the CPU stay, with nothing
    new allocated (counted as used, they would send to disk modules that the host has room for)."""
    from ptq.runtime.resources import available_memory

    limits = placement.max_memory
    if limits is None:
        limits = {
            i: int(available_memory(torch.device("cuda", i)) * GPU_WEIGHTS_FRACTION)
            for i in range(torch.cuda.device_count())
        }
        limits["cpu"] = int(
            ((available_memory(torch.device("cpu")) or 0) + held) * CPU_WEIGHTS_FRACTION
        )
    return {device: size // max(models, 1) for device, size in limits.items()}


def host_bytes(models) -> int:
    """Bytes of host memory the models' tensors take, each storage once (the variants share what
    they do not quantize)."""
    seen, total = set(), 0
    for model in models:
        for t in (*model.parameters(), *model.buffers()):
            if t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def device_map(model: nn.Module, placement: Placement, share: dict) -> dict:
    """accelerate's device map for `model` within `share` (device -> bytes): module name ->
    device."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    memory = {device: size for device, size in share.items() if device != "disk"}
    # "auto" is "balanced", as in
    if placement.strategy != "sequential" and any(isinstance(d, int) for d in memory):
        memory = get_balanced_memory(
            model,
            max_memory=memory,
            no_split_module_classes=no_split,  # from_pretrained
            low_zero=placement.strategy == "balanced_low_0",
        )
    # what no GPU or the CPU limit holds: offloaded to disk
    memory["disk"] = share.get("disk", 1 << 62)
    return dict(infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split))


def place(model: nn.Module, placement: Placement, share: dict, offload_dir: Path) -> nn.Module:
    """`model` (on the CPU) dispatched over the devices by its device map (device_map), in place;
    its device map is kept as `model.hf_device_map`. Disk-offloaded tensors go to a folder of their
    own under `offload_dir`."""
    import tempfile

    from accelerate import dispatch_model
    from accelerate.utils import offload_state_dict

    with _quiet():
        mapping = device_map(model, placement, share)
        folder = None
        disk = [name for name, device in mapping.items() if device == "disk"]
        if disk:
            offloaded = {
                k: t
                for k, t in model.state_dict().items()
                if any(not m or k == m or k.startswith(m + ".") for m in disk)
            }
            # before writing: accelerate writes through memory maps, and a disk that fills under one
            # ends the process with SIGBUS, no message, and the folder left behind
            size = sum(t.numel() * t.element_size() for t in offloaded.values())
            # accelerate takes the limit and does not apply it
            if "disk" in share and size > share["disk"]:
                raise PtqError(
                    f"{FLAG}: {size_text(size)} of the model would go to disk, past the other "
                    "devices' limits, and --max-memory's disk limit leaves it "
                    f"{size_text(share['disk'])} (the limit is split over the models held at "
                    "once): raise the disk limit or the others"
                )
            check_disk(
                Path(offload_dir),
                size,
                f"offloading part of the model to disk ({FLAG})",
                "free space there, set PTQ_CACHE to a folder on a larger disk, or give the GPUs "
                "and the CPU more (--max-memory)",
            )
            make_dir(
                Path(offload_dir),
                "the offload folder",
                " (set PTQ_CACHE to a folder that can be written)",
            )
            folder = tempfile.mkdtemp(prefix="model-", dir=offload_dir)
            # Written here rather than by dispatch_model, which misses a whole model sent to disk
            # (module name "").
            try:
                offload_state_dict(folder, offloaded)
            except OSError as e:
                raise PtqError(
                    f"cannot offload the model to disk in {folder} ({FLAG}): {e.strerror or e}; "
                    "free space there or set PTQ_CACHE to another folder"
                ) from None
        gpus = [d for d in mapping.values() if d not in ("cpu", "disk")]
        own_buffers(model)
        # force_hooks: even a model that fits one device is placed by the hooks, which give each
        # placed module new tensors, not by model.to(), which would move in place the tensors the
        # variants share with one another
        dispatch_model(
            model,
            mapping,
            main_device=gpus[0] if gpus else "cpu",
            offload_dir=folder,
            offload_buffers=True,
            preload_module_classes=PRELOADED,
            force_hooks=True,
        )
    model.hf_device_map = mapping
    return model


def own_buffers(model: nn.Module) -> None:
    """Each module its own buffer tensors, in place. ptq hands one input scale tensor to the layers
    whose inputs round alike (an input shared by q/k/v is then rounded once), and accelerate moves a
    tensor that several submodules of one placed block hold only once (its named_buffers drops
    duplicates): the others kept it on the CPU, and an offloaded mixture-of-experts layer stacked
    its experts' scales from two devices."""
    seen = set()
    for module in model.modules():
        for name, tensor in module._buffers.items():
            if tensor is not None:
                if id(tensor) in seen:
                    module._buffers[name] = tensor.clone()
                else:
                    seen.add(id(tensor))


@contextlib.contextmanager
def placed(models: dict[str, nn.Module], placement: Placement | None):
    """For the block: `models` (on the CPU) each placed with an equal share of every device
    (budgets, place), their disk-offloaded tensors in a folder under PTQ_CACHE removed afterwards.
    Without a placement: `models` as they are."""
    if placement is None:
        yield models
        return
    folder = cache_root() / "offload" / uuid.uuid4().hex  # made only if something goes to disk
    share = budgets(placement, len(models), host_bytes(models.values()))
    try:
        with gpu_memory(f"placing {len(models)} model(s) over the devices ({FLAG})"):
            result = {
                name: place(model, placement, share, folder) for name, model in models.items()
            }
        yield result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _quiet():
    """accelerate's warnings while it places a model, which the report replaces: "some parameters
    are on the meta device" (where each model went is in results.json and the report) and "the model
    weights are not tied" (a variant's lm_head is a quantized layer, no longer tied to the
    embedding; the original's stay tied)."""
    loggers = [
        logging.getLogger(name) for name in ("accelerate.big_modeling", "accelerate.utils.modeling")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def placed_copy(model: nn.Module) -> nn.Module:
    """A second module tree over the same tensors (nothing copied), to dispatch without moving
    `model` itself: dispatch_model replaces a placed module's tensors, the original keeps its own on
    the CPU."""
    import copy

    return copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})


@contextlib.contextmanager
def onloaded(module: nn.Module):
    """An offloaded module's tensors on its execution device for the block, as accelerate's hook
    loads them for a forward (for a forward pre-hook, which runs before that); nothing to do for
    other modules."""
    hook = getattr(module, "_hf_hook", None)
    if not getattr(hook, "offload", False):
        yield
        return
    hook.pre_forward(module)
    try:
        yield
    finally:
        hook.post_forward(module, None)


def summary(model: nn.Module) -> dict[str, int]:
    """How many of the placed model's device-map entries went where: {"cuda:0": 12, "cpu": 3,
    "disk": 1}."""
    mapping = getattr(model, "hf_device_map", None) or {}
    return dict(Counter(f"cuda:{d}" if isinstance(d, int) else str(d) for d in mapping.values()))


def describe(summaries: dict[str, dict[str, int]]) -> str:
    """One line for the report: where the placed models went."""
    devices = sorted({d for s in summaries.values() for d in s})
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    if not gpus:
        places = " and ".join({"cpu": "in CPU memory", "disk": "on disk"}[d] for d in devices)
        return f"placed {places} by accelerate ({FLAG})"
    offloaded = [{"cpu": "CPU memory"}.get(d, d) for d in devices if d in ("cpu", "disk")]
    return f"placed over {', '.join(gpus)} by accelerate ({FLAG})" + (
        f", offloaded to {' and '.join(offloaded)}" if offloaded else ""
    )
