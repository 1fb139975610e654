"""Processes of this host: whether one still runs (liveness checks of the launcher's ranks) and
which processes one started (the launch wrapper signals torchrun's ranks)."""

import os
import subprocess


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
