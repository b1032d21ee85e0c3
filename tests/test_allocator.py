"""The host allocator setting (ptq.runtime.allocator): glibc keeps the memory a forward frees for the next one.
Measured in fresh processes, in page faults: the same allocation pattern with glibc's default and with ptq's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ptq import cli
from ptq.runtime import allocator

# Eight 8 MiB blocks written and freed, six times over (what a forward's per-layer buffers do), with malloc
# itself: the minor page faults of each round. glibc's default (mmap threshold sliding up to the 8 MiB
# blocks, trim threshold twice that) trims the 64 MiB freed at the heap's top each round and faults it back.
ROUNDS = """
import ctypes, json, resource, sys
from ptq.runtime.allocator import keep_freed_host_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
kept = keep_freed_host_memory() if sys.argv[1] == "ptq" else None
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(8 << 20) for _ in range(8)]
    for b in blocks:
        libc.memset(b, 1, 8 << 20)
    for b in blocks:
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([kept, faults]))
"""

glibc = pytest.mark.skipif(
    not os.confstr_names.get("CS_GNU_LIBC_VERSION"), reason="mallopt is glibc's"
)


def rounds(setting: str, **env) -> tuple:
    environment = {
        k: v for k, v in os.environ.items() if k not in (*allocator.ENVIRONMENT, "GLIBC_TUNABLES")
    } | env
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, setting], capture_output=True, text=True, env=environment
    )
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout))


PAGES = 8 * (8 << 20) // 4096  # the 64 MiB of one round, in 4 KiB pages


@glibc
def test_freed_memory_is_kept_for_the_next_round_instead_of_faulted_back():
    _, default = rounds("default")
    kept, faults = rounds("ptq")
    assert all(f > PAGES / 2 for f in default[1:]), (
        default
    )  # glibc's default: every round faults its blocks in
    assert kept is True
    assert faults[0] > PAGES / 2 and all(f < PAGES / 100 for f in faults[1:]), (
        faults
    )  # once, then reused


@glibc
@pytest.mark.parametrize(
    "setting",
    [{"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}],
)
def test_the_users_own_malloc_settings_are_kept(setting):
    kept, faults = rounds("ptq", **setting)  # trim everything: what they asked for
    assert kept is False
    assert all(f > PAGES / 2 for f in faults[1:]), faults


@glibc
def test_other_glibc_tunables_do_not_turn_it_off():
    kept, faults = rounds("ptq", GLIBC_TUNABLES="glibc.cpu.x86_rep_movsb_threshold=2048")
    assert kept is True and all(f < PAGES / 100 for f in faults[1:]), faults


def test_the_cli_sets_it_before_any_command(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_host_memory", lambda: calls.append(True) or True)
    monkeypatch.setattr(sys, "argv", ["ptq", "--help"])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 0 and calls == [True]
