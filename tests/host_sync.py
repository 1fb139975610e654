"""Counting the reads a training step makes from the device (issue 36, "nothing in a step waits on
the host"), on the CPU build where no device sync can be observed directly.

:class:`HostReads` patches the ``torch.Tensor`` methods through which a value reaches Python -
``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``numpy``, ``cpu``
and ``to`` from a device to the CPU - and records each call made while it is active (name and the caller's
file:line). Each of them would wait for the device on a GPU (``to``/``cpu`` a device-to-host
copy), so a step with zero recorded calls has no host sync on any device. The patch is undone on
exit; calls inside torch's own Python code count too (they would sync just the same).

Also counted, as ``"hidden <name>"``: the operations whose output SIZE depends on tensor values,
which CUDA computes by waiting for the device although no value reaches Python - ``nonzero``,
``masked_select``, indexing with a boolean mask, ``bincount`` (its length is the maximum), and
``repeat_interleave`` with tensor repeats and no ``output_size`` - when called from Python.

Not counted: reads made by :data:`HOST_TRANSPORTS`, the shared-memory collectives of CPU ranks,
which poll their own counters in host memory (a GPU run uses NCCL, never them).
"""

from __future__ import annotations

import contextlib
import traceback

import torch

HOST_TRANSPORTS = ("hybrid/shm_collectives.py",)
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
_HIDDEN_METHODS = ("nonzero", "masked_select", "bincount", "repeat_interleave", "__getitem__")
_HIDDEN_FUNCTIONS = ("nonzero", "masked_select", "bincount", "repeat_interleave")


def _hidden_sync(name: str, args, kwargs) -> bool:
    """Whether this call of ``name`` sizes its output from tensor values (module docstring)."""
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return True


class HostReads(contextlib.AbstractContextManager):
    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}
        self.active = False

    def _record(self, name: str) -> None:
        if self.active:
            frame = traceback.extract_stack(limit=3)[0]   # the caller of the patched method
            if frame.filename.endswith(HOST_TRANSPORTS):
                return
            self.calls.append((name, f"{frame.filename}:{frame.lineno}"))

    def _wrap(self, name: str, original):
        def patched(tensor, *args, **kwargs):
            self._record(name)
            return original(tensor, *args, **kwargs)
        return patched

    def _wrap_to(self, original):
        def patched(tensor, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            # a copy from another device to the host (on the CPU build the training device IS
            # the host: moves there are no copies, and the value reads above catch host reads)
            if (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
                    and tensor.device.type != "cpu"):
                self._record("to(cpu)")
            return original(tensor, *args, **kwargs)
        return patched

    def _wrap_hidden(self, name: str, original):
        def patched(*args, **kwargs):
            if self.active and _hidden_sync(name, args, kwargs):
                self._record(f"hidden {name}")
            return original(*args, **kwargs)
        return patched

    def __enter__(self) -> "HostReads":
        for name in _READS + ("to",) + _HIDDEN_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
        for name in _READS:
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        for name in _HIDDEN_METHODS:
            setattr(torch.Tensor, name, self._wrap_hidden(name, self._saved[name]))
        torch.Tensor.to = self._wrap_to(self._saved["to"])
        self._saved_functions = {name: getattr(torch, name) for name in _HIDDEN_FUNCTIONS}
        for name, original in self._saved_functions.items():
            setattr(torch, name, self._wrap_hidden(name, original))
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in self._saved_functions.items():
            setattr(torch, name, original)

    @contextlib.contextmanager
    def paused(self):
        """Calls made inside are not recorded (the test's own bookkeeping)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def take(self) -> list[tuple[str, str]]:
        out, self.calls = self.calls, []
        return out
