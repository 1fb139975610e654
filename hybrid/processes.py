"""Whether a process of this host still runs (liveness checks of the launcher's ranks)."""

import os


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
