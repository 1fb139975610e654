"""Small value types every ZeRO stage returns: the outcome of a step and the optimizer-state
fragments a rank owns (what a layout-independent checkpoint saves, docs/design.md §8).

A :class:`Fragment` is a 1-D view of ``numel`` elements of one parameter's fp32 master or Adam
moment, starting at ``offset`` in the flattened TP-local parameter. Saving writes the fragments each
rank owns; loading hands every saved fragment to :func:`copy_overlaps`, which copies whatever part
of it falls inside the fragments this rank owns now - so DP degree and stage may differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

FRAGMENT_KINDS = ("master", "exp_avg", "exp_avg_sq")


class StepResult:
    """The outcome of an optimizer step. The engines leave its three values on the device (0-dim
    tensors, issue 36: a step never waits on the host); the attributes read them on first use, so
    only a caller that looks pays the device sync - the trainer reads :meth:`device_values` once per
    log interval instead. Plain Python values are accepted too.

    ``skipped``: overflow or non-finite values, neither parameters nor optimizer state changed;
    ``grad_norm``: global L2 norm of the (unscaled, unclipped) gradient, nan when skipped;
    ``loss_scale``: the scale used for this step's backward."""

    __slots__ = ("_skipped", "_grad_norm", "_loss_scale")

    def __init__(self, skipped, grad_norm, loss_scale):
        self._skipped, self._grad_norm, self._loss_scale = skipped, grad_norm, loss_scale

    @property
    def skipped(self) -> bool:
        return bool(self._skipped)

    @property
    def grad_norm(self) -> float:
        return float(self._grad_norm)

    @property
    def loss_scale(self) -> float:
        return float(self._loss_scale)

    def device_values(self, device) -> torch.Tensor:
        """[skipped, grad_norm, loss_scale] as one float64 tensor on ``device``, built without a
        read (a Python value becomes a fill on the device)."""
        return torch.stack([_as_tensor(v, device) for v in
                            (self._skipped, self._grad_norm, self._loss_scale)])

    def __repr__(self) -> str:
        return (f"StepResult(skipped={self.skipped}, grad_norm={self.grad_norm}, "
                f"loss_scale={self.loss_scale})")


def _as_tensor(value, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


@dataclass(frozen=True)
class Fragment:
    param_name: str
    kind: str            # one of FRAGMENT_KINDS, or "model" for the parameters themselves
    offset: int          # element offset in the flattened TP-local parameter
    tensor: torch.Tensor  # 1-D

    @property
    def end(self) -> int:
        return self.offset + self.tensor.numel()


def copy_overlaps(owned: list[Fragment], given: Iterable[Fragment]) -> int:
    """Copy into each owned fragment the overlapping elements of the given ones; return the number
    of elements copied (a caller can check it covers everything it owns)."""
    index: dict[tuple[str, str], list[Fragment]] = {}
    for f in owned:
        index.setdefault((f.param_name, f.kind), []).append(f)
    copied = 0
    for g in given:
        for f in index.get((g.param_name, g.kind), ()):
            lo, hi = max(f.offset, g.offset), min(f.end, g.end)
            if lo < hi:
                f.tensor[lo - f.offset:hi - f.offset].copy_(g.tensor[lo - g.offset:hi - g.offset])
                copied += hi - lo
    return copied
