"""The host allocator: keep glibc's malloc from handing back, after each forward, the memory the next forward
asks for again. No torch import: the CLI calls it first thing."""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h) and the values ptq sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for its own sliding threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 256 * 2**20
# malloc's parameters set by the user (theirs are kept): the variables, and glibc.malloc.* in GLIBC_TUNABLES
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep the host memory a forward frees for the next forward, instead of returning it to
    the kernel and taking page faults (4 KiB each, zeroed) to get it back. Its default slides: a freed block of
    up to 32 MiB lifts the size served by mmap to that block's size, and the heap is trimmed whenever more than
    twice that is free at its top, which the end of a forward often is. A simulated model allocates per layer
    what the plain model does not (the dequantized weight, the rounded input), so the faults fell on it more:
    on the default model 160-200 thousand minor faults per evaluation against the plain model's 100 thousand
    (its 400 MB of logits, mmapped either way), and 1.13x-1.20x instead of 1.09x-1.10x (docs/performance.md).
    Fixed instead: blocks up to 32 MiB come from the heap, and up to 256 MiB free at its top is kept; larger
    blocks are mmapped and unmapped as before, so a model's large weights still go back to the kernel when
    freed. What is kept counts in the process's memory while a block larger than 32 MiB (the logits) is mapped
    beside it: at most 256 MiB more at a peak, within the noise of `make bench`'s peaks here (1 GiB kept added
    to them; 64 MiB still trimmed memory the next forward faulted back in).

    Only on glibc (elsewhere there is no mallopt, or it does nothing: False), and not where the environment
    sets malloc's parameters itself (MALLOC_*_, glibc.malloc.* in GLIBC_TUNABLES: those are kept). Called by the CLI and the
    benchmarks, not on import: a program that imports ptq keeps its allocator as it had it."""
    if any(name in os.environ for name in ENVIRONMENT) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting either parameter ends glibc's sliding thresholds, so both are set
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
