"""Processes of this host: whether one still runs (liveness checks of the launcher's ranks),
which processes one started (the launch wrapper signals torchrun's ranks), and how this process's
C allocator keeps freed memory (:func:`keep_freed_memory`, called where a rank starts)."""

import ctypes
import os
import subprocess

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_MMAP_THRESHOLD = 32 << 20    # glibc's largest on 64-bit: blocks up to it come from the heap
_TRIM_THRESHOLD = 1 << 30     # free memory at the heap's top kept before any is given back


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse instead of returning them to the kernel; True where
    applied (glibc), False elsewhere (nothing changes).

    By default glibc serves a block above its mmap threshold (128 KiB, raised dynamically) with
    fresh pages and unmaps it on free, and gives the heap's free top back beyond its trim threshold;
    a training step's activations and temporaries (MiBs each) are then page-faulted and zeroed by
    the kernel again on every step: ~8,000 minor faults per step of the benchmark GPT in bf16 on
    CPU, about 10% of its step time on one thread. With fixed thresholds the next step reuses the
    same memory; the resident size stays at its high-water mark (peak RSS measured +3%). The
    threshold cannot exceed 32 MiB, so blocks above it (GPT-2 small's [50304, 768] word-embedding
    gradient, 77 MB in bf16: 33 ms to allocate and zero fresh pages, 4 ms from the heap) are kept
    too by serving no block with mmap at all (``M_MMAP_MAX`` 0: the heap grows with brk, and a
    thread's arena that cannot hold a block falls back to the main heap)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):   # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and
                mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) and mallopt(_M_MMAP_MAX, 0))


def process_gone(pid: int) -> bool:
    """No process ``pid`` on this host, or only its zombie (killed, not yet reaped by torchrun)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:   # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def child_pids(parent: int) -> list[int]:
    """The live processes whose parent is ``parent`` (from /proc, else ``ps``)."""
    if os.path.isdir("/proc/self"):
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()   # state, ppid, ...
            except OSError:   # it ended while we looked
                continue
            if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
                found.append(int(entry))
        return sorted(found)
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    return sorted(int(pid) for pid, ppid in (line.split() for line in out.splitlines())
                  if int(ppid) == parent)
