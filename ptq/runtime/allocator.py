"""The host allocator: keep glibc's malloc from handing back, after each forward, the memory the
next forward asks for again. No torch import: the CLI calls it first thing."""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h) and the values ptq sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's ceiling for its own sliding threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 256 * 2**20
# malloc's parameters set by the user (theirs are kept): the variables, and glibc.malloc.* in
# GLIBC_TUNABLES
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep the host memory a forward frees for the next forward, instead of
    returning it to the kernel and faulting it back in, 4 KiB at a time. glibc's default thresholds
    slide with the blocks freed and trimmed the heap at the end of forwards, and the faults fell
    more on the simulated models, which allocate per layer what the plain model does not
    (measurements: docs/performance.md). Fixed instead: blocks up to 32 MiB come from the heap and
    up to 256 MiB free at its top is kept; larger blocks (the logits, a large model's weights) are
    mapped and unmapped as before.

    Only on glibc (elsewhere: False), and not where the user sets malloc's parameters (MALLOC_*_,
    glibc.malloc.* in GLIBC_TUNABLES). Called by the CLI and the bench, not on import: a program
    importing ptq keeps its own."""
    if any(name in os.environ for name in ENVIRONMENT) or "glibc.malloc." in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting either parameter ends glibc's sliding thresholds, so
    # both are set
    return (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
