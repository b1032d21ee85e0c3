"""Memory: estimate what loading a model will take, from its checkpoint, before loading it, and fail
early with the estimate (being killed by the OOM killer half-way through says nothing)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ptq.errors import PtqError, unreadable_weights

GIB = 2**30
FLOAT32_BYTES = 4
NO_CHECK_FLAG = "--no-memory-check"


# values per element of a packed weight whose unpacked shape is not stored: 4-bit values (W4A16,
# NVFP4), the common case (8-bit packing stores its shape; counting 4-bit values over-estimates it,
# the safe side)
PACKED_VALUES = {"I32": 8, "I64": 16, "U8": 2, "I8": 2}


def checkpoint_parameters(directory: Path) -> int | None:
    """Parameter count from the safetensors headers (read without loading any tensor data, but the
    2-number unpacked shapes of packed weights, which load dequantized: one parameter per value, not
    per stored element); for pickle checkpoints, the file size over 2 bytes (a 16-bit checkpoint,
    the common case); None if unknown. With a model.safetensors.index.json, only the files its
    weight_map names, which are what loads (Mistral's repositories also ship the same weights as
    consolidated.safetensors)."""
    import safetensors

    from ptq.model_files import safetensors_files

    # the files the index names (each inside the folder: ptq.model_files), or every one
    files = safetensors_files(directory) if any(Path(directory).glob("*.safetensors")) else []
    if files:
        total, packed, unpacked = 0, {}, {}
        for f in files:
            try:
                with safetensors.safe_open(str(f), framework="pt") as st:
                    for key in st.keys():
                        piece = st.get_slice(key)
                        size, dtype = math.prod(piece.get_shape()), piece.get_dtype()
                        # compressed-tensors pack-quantized (int4), NVFP4
                        if key.endswith(".weight_packed"):
                            packed[key.removesuffix("_packed")] = size * PACKED_VALUES.get(dtype, 1)
                        # the unpacked shape, stored beside the codes
                        elif key.endswith(".weight_shape"):
                            unpacked[key.removesuffix("_shape")] = math.prod(
                                st.get_tensor(key).tolist()
                            )
                        else:
                            # MXFP4 (gpt-oss): two 4-bit values per byte of a *_blocks tensor,
                            # dequantized on load
                            total += size * (2 if key.endswith("_blocks") and dtype == "U8" else 1)
            except Exception as e:
                raise unreadable_weights(f, e) from None
        return total + sum(unpacked.get(stem, values) for stem, values in packed.items())
    pickles = sorted(Path(directory).glob("*.bin"))
    return sum(f.stat().st_size for f in pickles) // 2 if pickles else None


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`: free GPU memory; on the host, the kernel's
    MemAvailable, or less where this process's memory cgroup allows less (a container, a Kubernetes
    pod or a Slurm job: their limit is not in /proc/meminfo, which shows the whole machine, and past
    it the OOM killer ends the run unannounced)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    host = _mem_available()
    limited = cgroup_available()
    return host if limited is None else limited if host is None else min(host, limited)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned int64


def cgroup_available(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path | None = None
) -> int | None:
    """Bytes this process's memory cgroup, and every cgroup above it, still allows: the tightest of
    limit - (usage - inactive file cache), the cache the kernel reclaims before it kills (as the
    container engines count a working set); None where no limit is set or none can be read. cgroup
    v2 (memory.max, memory.current) and v1 (the memory controller's memory.limit_in_bytes,
    memory.usage_in_bytes)."""
    root = root or CGROUP_ROOT
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    # hierarchy-id:controllers:path; v2's line is 0::path (hybrid systems have both)
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", None, "")
        if controllers == "":
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif controllers is not None and "memory" in controllers.split(","):
            base, files = (
                root / "memory",
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
            )
        else:
            continue
        rooms.append(_cgroup_room(base, path, *files))
    rooms = [r for r in rooms if r is not None]
    return min(rooms) if rooms else None


def _cgroup_room(
    base: Path, path: str, limit_file: str, usage_file: str, inactive_key: str
) -> int | None:
    """The tightest limit - working set from the cgroup at `path` up to `base`, None where none is
    limited."""
    folder, rooms = base / path.strip("/"), []
    while True:
        try:
            text = (folder / limit_file).read_text().strip()
            if text != "max" and int(text) < _UNLIMITED:
                usage = int((folder / usage_file).read_text())
                stat = dict(
                    line.split()
                    for line in (folder / "memory.stat").read_text().splitlines()
                    if " " in line
                )
                rooms.append(max(int(text) - max(usage - int(stat.get(inactive_key, 0)), 0), 0))
        except (OSError, ValueError):
            pass  # not mounted here, or not readable: the kernel's MemAvailable stands
        if folder == base or base not in folder.parents:
            break
        folder = folder.parent
    return min(rooms) if rooms else None


def shortfall(directory: Path, copies: float, device: torch.device) -> tuple[int, int, int] | None:
    """(parameters, bytes needed, bytes available) when the model's float32 weights, times the
    copies the command keeps (in float32 copies: a compared variant holds 16- or 8-bit weight codes,
    half a copy at most), exceed the memory available on `device`; None when they fit or either side
    is unknown. Under torchrun, times the processes that each hold their own (processes_sharing).
    Activations come on top: the estimate is a lower bound."""
    return parameters_shortfall(checkpoint_parameters(directory), copies, device)


def processes_sharing(device: torch.device) -> int:
    """How many processes of this run load their own copy of the model into `device`'s memory at
    once: under torchrun or accelerate launch, every process on this machine for the host's memory
    (from_pretrained converts a 16-bit checkpoint to float32 in each process's own memory; what they
    share, the checkpoint's page cache, MemAvailable already counts as free); on a GPU, the
    processes placed on it (ptq.runtime.devices.default_device: cuda:LOCAL_RANK modulo the GPU
    count). 1 in a single process. Each process measures before its own load: one that starts late
    sees the others' loads under way and may count them twice (--no-memory-check then)."""
    from ptq.runtime.distributed import local_processes

    local = local_processes()
    if device.type == "cuda" and local > 1:
        return -(-local // max(torch.cuda.device_count(), 1))
    return local


def parameters_shortfall(
    params: int | None, copies: float, device: torch.device
) -> tuple[int, int, int] | None:
    free = available_memory(device)
    if params is None or free is None:
        return None
    needed = int(params * FLOAT32_BYTES * copies * processes_sharing(device))
    return (params, needed, free) if needed > free else None


def check_fits(directory: Path, copies: float, device: torch.device, what: str) -> None:
    """Refuse to load a model that does not fit (shortfall), with the estimate and the ways out."""
    check_parameters_fit(checkpoint_parameters(directory), copies, device, what)


def check_parameters_fit(
    params: int | None, copies: float, device: torch.device, what: str
) -> None:
    """check_fits for a model of `params` parameters (a GGUF file's, before it is converted)."""
    short = parameters_shortfall(params, copies, device)
    if short is not None:
        params, needed, free = short
        copies_text = (
            (
                f" x {copies:g} copies (the original, and half a copy per variant: weights held as "
                "16- or 8-bit codes)"
            )
            if copies > 1
            else ""
        )
        processes = processes_sharing(device)
        processes_text = f" x {processes} processes, each loading its own" if processes > 1 else ""
        raise PtqError(
            f"{what} needs at least {size_text(needed)} ({params:,} parameters x {FLOAT32_BYTES} "
            f"bytes in float32{copies_text}{processes_text}) but only {size_text(free)} is "
            f"available on {device.type}: use a machine with more memory"
            f"{', compare fewer recipes per run' if copies > 2 else ''}"
            f"{', start fewer processes per machine' if processes > 1 else ''}, or pass "
            f"{NO_CHECK_FLAG} to try anyway"
        )


def check_disk(folder: Path, needed: int, what: str, way_out: str) -> None:
    """Refuse, before it starts, to write `needed` bytes into `folder` (or the nearest folder above
    it that exists) when its disk has less free: a download or conversion would otherwise fail once
    it has filled the disk."""
    import shutil

    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # cannot tell: the write itself says so if the disk is full
        return
    if needed > free:
        raise PtqError(
            f"{what} needs at least {size_text(needed)} in {folder}, which has {size_text(free)} "
            f"free: {way_out}"
        )


def size_text(n: int, si: bool = False) -> str:
    """A byte count for people, in the largest unit it holds one of: binary units (GiB: memory, as
    free and nvidia-smi count it, and disk) or, with `si`, decimal ones (GB: file sizes, as the Hub
    shows them)."""
    base, units = (1000, ("kB", "MB", "GB", "TB")) if si else (1024, ("KiB", "MiB", "GiB", "TiB"))
    if abs(n) < base:
        return f"{n} B"
    value, unit = n / base, units[0]
    for bigger in units[1:]:
        if abs(value) < base:
            break
        value, unit = value / base, bigger
    return f"{value:,.1f} {unit}"
