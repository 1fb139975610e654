"""hybrid.processes.keep_freed_memory: freed blocks are reused instead of page-faulted in again.

A fresh interpreter holds 32 blocks of 4 MiB and 2 of 48 MiB (above the 32 MiB that glibc's mmap
threshold can be raised to, like GPT-2 small's embedding gradient) at once and frees them (a step's
activations), six times, and counts its thread's minor page faults in the last three. The baseline
pins glibc's mmap threshold at its initial 128 KiB (its later adaptation depends on what the
interpreter freed before, so it is not reproducible): every block is then mapped and unmapped,
faulting its 1024 pages in each time. After ``keep_freed_memory()`` the first times' pages are
reused.
"""

import platform
import subprocess
import sys

from hybrid.processes import keep_freed_memory

_PROBE = """
import ctypes, resource, sys, torch
from hybrid.processes import keep_freed_memory
ctypes.CDLL(None).mallopt(-3, 128 << 10)    # M_MMAP_THRESHOLD: glibc's initial value, fixed
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def burst():
    blocks = [torch.empty(1 << 20).fill_(1.0) for _ in range(32)]
    blocks += [torch.empty(12 << 20).fill_(1.0) for _ in range(2)]
    del blocks
for _ in range(3):   # the heap settles (its free blocks rearranged) within three bursts
    burst()
before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
for _ in range(3):
    burst()
print(applied, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
"""


def _late_faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


def test_freed_blocks_are_reused_on_glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        assert keep_freed_memory() is False
        return
    _, baseline = _late_faults("baseline")
    applied, kept = _late_faults("keep")
    assert baseline > 3 * 32 * 256     # at least a quarter of each burst's 32 x 1024 pages
    assert applied == "True" and kept < 2048     # a few stray pages at most
