"""The out-of-memory demonstration: `ptq calibrate --low-memory` and `ptq quantize --low-memory` on a model
whose float32 weights (what the in-memory path loads) do not fit in this machine's memory, with the peak
resident memory of each command (getrusage of the child process) next to the model's size.

    python benchmarks/make_big_model.py /tmp/ptq-big-llama        # 6.7B parameters, 13.5 GB bf16
    python benchmarks/low_memory_demo.py /tmp/ptq-big-llama --samples 4 --seq-len 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes of one child process (os.wait4 gives that child's own rusage)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--recipe", default="fp8-e4m3")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="Keep the calibration file and the quantized checkpoint.",
    )
    args = ap.parse_args()

    import torch

    from ptq.runtime.resources import available_memory, checkpoint_parameters

    params = checkpoint_parameters(args.model)
    on_disk = sum(f.stat().st_size for f in args.model.glob("*.safetensors"))
    mem_total = (
        int(
            next(
                line
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            ).split()[1]
        )
        * 1024
    )
    print(
        f"model {args.model}: {params:,} parameters; {on_disk / GIB:.1f} GiB on disk (bf16), "
        f"{params * 4 / GIB:.1f} GiB in float32 (what the in-memory path loads)"
    )
    print(
        f"machine: {mem_total / GIB:.1f} GiB memory, {available_memory(torch.device('cpu')) / GIB:.1f} GiB available now, "
        f"{os.cpu_count()} CPUs"
    )
    calib = args.model.with_name(args.model.name + ".calib.safetensors")
    out = args.model.with_name(args.model.name + "-" + args.recipe)
    ptq = [sys.executable, "-m", "ptq"]
    steps = {
        "calibrate": ptq
        + [
            "calibrate",
            str(args.model),
            "--low-memory",
            "--recipe",
            args.recipe,
            "--samples",
            str(args.samples),
            "--seq-len",
            str(args.seq_len),
            "-o",
            str(calib),
            "--force",
        ],
        "quantize": ptq
        + [
            "quantize",
            str(args.model),
            "--low-memory",
            "--recipe",
            args.recipe,
            "--calib",
            str(calib),
            "-o",
            str(out),
            "--force",
        ],
    }
    rows = []
    for name, cmd in steps.items():
        print("$ " + " ".join(cmd[2:]).replace(sys.executable, "python"), flush=True)
        seconds, peak = run(cmd)
        rows.append((name, seconds, peak))
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print()
    print(
        "| command | wall time | peak RSS | peak RSS / bf16 weights | peak RSS / float32 weights |"
    )
    print("|---|---|---|---|---|")
    for name, seconds, peak in rows:
        print(
            f"| ptq {name} --low-memory | {seconds:.0f} s | {peak / GIB:.2f} GiB | {peak / on_disk:.2f} | "
            f"{peak / (params * 4):.2f} |"
        )
    print(f"\nwrote {out}: {written / GIB:.1f} GiB of safetensors ({args.recipe})")
    if not args.keep:
        shutil.rmtree(out)
        calib.unlink()


if __name__ == "__main__":
    main()
