"""Measured activation memory: the bytes autograd keeps for backward, per rank (the quantity the
selective-recompute paper's per-layer formulas and ZeRO-R's checkpoint sizes predict).

:class:`ActivationMeter` installs ``torch.autograd.graph.saved_tensors_hooks``. Every tensor autograd
saves passes through the pack hook; the meter counts its *storage* once (q, k and v viewed out of one
fused QKV output are one allocation; a tensor saved by two ops is one allocation), skips parameters,
and follows the storage's lifetime: the packed wrapper dies when autograd frees the saved variable
(after its node ran in backward), so the meter knows the live saved bytes at every moment and their
peak over forward + backward (recomputed activations included, when the meter encloses backward).

Tiers: a tensor inside a registered :class:`~hybrid.recompute.arena.Arena` is counted in that arena's
tier (Pa+cpu's host pool is ``"host"``), and only its own bytes (arenas are shared storages); other
tensors count as ``"device"`` when on the meter's device, else ``"host"``.
Scopes: ``meter.scope(name)`` (or :meth:`track_modules`) attributes first saves to a name, e.g. a layer.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterable

import torch

from hybrid.parallel_state import concrete_device
from hybrid.recompute.arena import Arena


class _Packed:
    """What autograd holds instead of the tensor while the meter is on; its death frees the count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    def __init__(self, *, exclude: Iterable[torch.Tensor] = (), arenas: Iterable[Arena] = (),
                 device: str | torch.device = "cpu"):
        self.device = concrete_device(device)   # compared with tensors' cuda:N below
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._arenas = list(arenas)
        self._refs: dict[tuple, int] = defaultdict(int)    # storage key -> live saved variables
        self._size: dict[tuple, tuple[str, int]] = {}       # storage key -> (tier, bytes)
        self.live = defaultdict(int)                        # tier -> bytes now
        self.peak = defaultdict(int)                        # tier -> max bytes seen
        self.peak_total = 0
        self.by_scope = defaultdict(int)                    # scope -> bytes first saved there
        self._scope = "other"
        self._outer: list[str] = []                          # enclosing scopes of tracked modules
        self._hooks = None

    # ---- context ---------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

    @contextmanager
    def scope(self, name: str):
        outer, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = outer

    def track_modules(self, modules: dict[str, torch.nn.Module]) -> list:
        """Attribute saves made during each module's forward to its name; returns hook handles."""
        handles = []
        for name, module in modules.items():
            def enter(_m, _a, name=name):
                self._stack_push(name)

            def leave(_m, _a, _o):
                self._stack_pop()
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        return handles

    def _stack_push(self, name: str) -> None:
        self._outer.append(self._scope)
        self._scope = name

    def _stack_pop(self) -> None:
        self._scope = self._outer.pop()

    # ---- accounting ------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        key, tier, nbytes = self._classify(t)
        if key is None:
            return t
        packed = _Packed(t)
        if self._refs[key] == 0:
            self._size[key] = (tier, nbytes)
            self.live[tier] += nbytes
            self.peak[tier] = max(self.peak[tier], self.live[tier])
            self.peak_total = max(self.peak_total, sum(self.live.values()))
            self.by_scope[self._scope] += nbytes
        self._refs[key] += 1
        weakref.finalize(packed, self._release, key)
        return packed

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            tier, nbytes = self._size.pop(key)
            self.live[tier] -= nbytes
            del self._refs[key]

    def _classify(self, t: torch.Tensor):
        if t.device.type == "meta":
            return None, None, 0
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._excluded:
            return None, None, 0
        for arena in self._arenas:
            if arena.contains(t):
                nbytes = t.numel() * t.element_size()
                return ("arena", t.data_ptr(), nbytes), arena.tier, nbytes
        tier = "device" if t.device == self.device else "host"
        return ("storage", t.device.type, ptr), tier, storage.nbytes()

    # ---- results ---------------------------------------------------------------------------------
    def total(self, tier: str | None = None) -> int:
        """Bytes saved so far and still alive (all tiers unless ``tier``)."""
        return self.live[tier] if tier is not None else sum(self.live.values())

    def report(self) -> str:
        tiers = sorted(set(self.live) | set(self.peak))
        rows = [f"{t:>8}: live {self.live[t]:>12,d} B  peak {self.peak[t]:>12,d} B" for t in tiers]
        return "\n".join(["saved activations per rank"] + rows)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Packed) else packed
