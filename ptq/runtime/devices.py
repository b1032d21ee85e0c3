"""The machine ptq runs on: where it computes (default_device, PTQ_DEVICE), in which dtype
(compute_dtype), where a (possibly placed) model's inputs go (input_device), and GPU memory faults:
a CUDA out-of-memory becomes one line that names what did not fit and the way out (gpu_memory,
out_of_memory), freed memory goes back (release).

A leaf: it imports nothing of ptq but the errors, so that loading, batching, placement, calibration
and evaluation can all use it.
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch
from torch import nn

from ptq.errors import PtqError

WAYS_OUT = (
    "use a smaller --batch-size, --low-memory (one decoder layer on the GPU at a time), or fewer "
    "recipes per run"
)
# already one decoder layer at a time (ptq.execution.streaming.LayerByLayer)
LAYER_BY_LAYER_WAYS_OUT = "use a smaller --batch-size or fewer recipes per run"


def default_device() -> torch.device:
    """Where ptq computes: the GPU when there is one (under torchrun / accelerate launch, the
    process's own: cuda:LOCAL_RANK), else the CPU. PTQ_DEVICE (cpu, cuda, cuda:1) chooses instead;
    the tests set it to cpu, so that they build and compare on the CPU on any machine (the CUDA
    tests ask for cuda themselves)."""
    name = os.environ.get("PTQ_DEVICE", "").strip()
    if name:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise PtqError(
                f"PTQ_DEVICE={name!r} is not a device (cpu, cuda, cuda:1, ...)"
            ) from None
        # mps, xpu, meta...: kernels, dtypes and memory checks are for these
        if device.type not in (
            "cpu",
            "cuda",
        ):
            raise PtqError(
                f"PTQ_DEVICE={name!r}: ptq computes on cpu or cuda (an NVIDIA GPU), not "
                f"{device.type}"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise PtqError(f"PTQ_DEVICE={name!r} but torch sees no CUDA device")
        if (
            device.type == "cuda"
            and device.index is not None
            and device.index >= torch.cuda.device_count()
        ):
            raise PtqError(
                f"PTQ_DEVICE={name!r} but torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
        return device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
    return torch.device("cuda")


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The processor's model name ("Intel(R) Xeon(R) Processor @ 2.60GHz", "AMD EPYC ..."): on Linux
    from /proc/cpuinfo, elsewhere platform.processor(); None when neither names it. torch's float32
    CPU kernels round apart per processor, not only per instruction set (the offline model's 16-bit
    baseline reads 41.2510 on an Intel Xeon and 41.2528 on an AMD EPYC, both AVX512), so a report
    names it."""
    import platform

    with contextlib.suppress(OSError):
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    name = platform.processor().strip()
    return name if name and name not in ("x86_64", "aarch64", "arm64", "i386") else None


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The dtype a model computes in: `name` ("float32" or "bfloat16"), by default bfloat16 on CUDA
    (its fast path) and float32 on CPU, where a simulated product of 8- or 16-bit values is
    exact."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in COMPUTE_DTYPES:
        raise PtqError(f"unknown compute dtype '{name}' (known: {', '.join(COMPUTE_DTYPES)})")
    return COMPUTE_DTYPES[name]


def input_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: its main device when placed (where its first modules run), else
    its first parameter's device."""
    mapping = getattr(model, "hf_device_map", None)
    if mapping:
        gpus = [d for d in mapping.values() if d not in ("cpu", "disk")]
        return (
            torch.device("cuda", gpus[0])
            if gpus and isinstance(gpus[0], int)
            else torch.device(gpus[0] if gpus else "cpu")
        )
    return next(model.parameters(), torch.empty(0)).device


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def out_of_memory(
    what: str, error: str | None = None, estimate: int | None = None, ways_out: str = WAYS_OUT
) -> PtqError:
    """The one-line error for a CUDA out-of-memory: what did not fit, the estimate if known, the way
    out. `error` is torch's message (its first sentence is kept: "CUDA out of memory. Tried to
    allocate 2.00 GiB")."""
    detail = ""
    if error:
        first = (error.strip().splitlines() or [""])[0]
        detail = f" ({'. '.join(first.split('. ')[:2]).rstrip('.')})" if first else ""
    needs = f", estimated {_gib(estimate)}" if estimate else ""
    return PtqError(f"out of GPU memory{' ' + what if what else ''}{needs}{detail}: {ways_out}")


def release() -> None:
    """Give freed GPU memory back to the device between variants and after an out-of-memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def gpu_memory(what: str, estimate: int | None = None):
    """Within the block, a CUDA out-of-memory becomes the one-line PtqError naming `what`."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        error = str(e)  # not the exception: its frames hold the tensors that did not fit
    else:
        return
    release()
    raise out_of_memory(what, error, estimate) from None
