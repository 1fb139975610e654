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


@dataclass(frozen=True)
class StepResult:
    skipped: bool        # fp16 overflow: neither parameters nor optimizer state changed
    grad_norm: float     # global L2 norm of the (unscaled, unclipped) gradient; nan when skipped
    loss_scale: float    # the scale used for this step's backward


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
