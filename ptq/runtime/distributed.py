"""Data-parallel evaluation under `torchrun --nproc-per-node N` or `accelerate launch` (WORLD_SIZE >
1).

Every process loads the model (on its own GPU: cuda:LOCAL_RANK, ptq.runtime.devices.default_device)
and builds the same variants. Calibration is split by batches: one batch size for all (the smallest
automatic one), each process observes a contiguous share of the one-process run's batches, and the
observers are gathered and merged (ptq.calibration.calibrate.merge_shares): every process then holds
the one-process calibration, bit for bit (a running max and a histogram of fixed bins do not depend
on which process saw a batch). The evaluation windows are split into contiguous shares, one per
process (the first process's share holds the windows the input SNR is measured on); the scores are
gathered with all_gather_object, so that every process has the whole result, and merged window by
window in their order (ptq.evaluation.evaluate.gather_scores): the numbers are those of one process
(Scores sums one window at a time, so the merge replays the same additions). Only the first process
(rank 0) writes the report and prints; the others print nothing.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch

from ptq.errors import PtqError


def world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed's environment (RANK, WORLD_SIZE); (0, 1) without
    it."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise PtqError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are "
            "not integers: start several processes with torchrun or accelerate launch"
        ) from None


def local_processes() -> int:
    """How many processes of this run are on this machine: LOCAL_WORLD_SIZE (torchrun and accelerate
    launch set it), else WORLD_SIZE (all of them, at most); 1 without torch.distributed's
    environment."""
    size = world()[1]
    if size == 1:
        return 1
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", size))
    except ValueError:
        raise PtqError(
            f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')!r} is not an integer: start "
            "several processes with torchrun or accelerate launch"
        ) from None


def active() -> bool:
    return world()[1] > 1


def joined() -> bool:
    """Whether this process runs with others in a process group (setup): what collectives need."""
    import torch.distributed as dist

    return active() and dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    """Whether this process writes reports and prints (rank 0, or the only process)."""
    return world()[0] == 0


def setup() -> None:
    """Join the process group (NCCL between GPUs, gloo on CPUs) once; the other ranks print
    nothing."""
    if not active():
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        from ptq.runtime.devices import default_device

        device = default_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        # Leave the group while the interpreter is whole: a process that exits without it can be
        # aborted (SIGABRT, "terminate called without an active exception") by gloo's worker threads
        # during finalization.
        atexit.register(leave)
    if not is_main():
        from ptq import progress

        progress.QUIET = True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)


def leave() -> None:
    """Leave the process group joined by setup (at exit; a no-op when there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def share(n: int, first_at_least: int = 0) -> range:
    """This process's contiguous share of n items (windows), in order: near-equal shares, the first
    of at least `first_at_least` items (where the input SNR is measured) when there are that
    many."""
    rank, size = world()
    if size == 1:
        return range(n)
    first = min(n, max(first_at_least, -(-n // size)))
    if rank == 0:
        return range(first)
    rest, others = n - first, size - 1
    start = first + (rank - 1) * rest // others
    return range(start, first + rank * rest // others)


def gather(value):
    """Every process's `value`, in rank order (all_gather_object); [value] alone."""
    if not active():
        return [value]
    import torch.distributed as dist

    values = [None] * world()[1]
    dist.all_gather_object(values, value)
    return values
