"""Executes a :class:`~hybrid.recompute.plan.RecomputePlan` over a stack of transformer layers
(Megatron-LM activation checkpointing; ZeRO-R Pa / Pa+cpu / MD, ZeRO §6.1-6.3).

The model owns one :class:`Recomputer` and calls ``recomputer.run(layers, hidden)`` instead of its
layer loop; an attention module whose layer is planned ``selective`` (``plan.selective(i)``) runs
its core through :func:`~hybrid.recompute.checkpoint.checkpoint` itself. The recomputer owns the
stores (one per ``full*`` mode) and the arenas, so the trainer can list the constant buffer sizes
and the memory report can count the host tier.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hybrid.comm import Group
from hybrid.recompute.arena import Arena
from hybrid.recompute.checkpoint import checkpoint
from hybrid.recompute.partitioned import CheckpointStore
from hybrid.recompute.plan import FULL_MODES, RecomputePlan


class _Run:
    """Layers ``[start, stop)`` applied in order: the function a full-recompute segment reruns."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int):
        self.layers, self.start, self.stop = layers, start, stop

    def __call__(self, hidden: torch.Tensor, *extra) -> torch.Tensor:
        for i in range(self.start, self.stop):
            hidden = self.layers[i](hidden, *extra)
        return hidden


class Recomputer:
    """Runs layers under ``plan`` on the TP ``group``; ``rng`` is the model's ``RNGTracker``."""

    def __init__(self, plan: RecomputePlan, group: Group, *, sequence_parallel: bool = False,
                 rng=None, device: str | torch.device = "cpu"):
        self.plan, self.group, self.rng = plan, group, rng
        self.device = torch.device(device)
        self.device_arena = (Arena("checkpoints", plan.arena_chunk_bytes, self.device)
                             if plan.arena_chunk_bytes else None)
        self.host_arena = (Arena("host-checkpoints", plan.host_chunk_bytes, "cpu", tier="host",
                                 pin_memory=True) if plan.uses("full-pa-cpu") else None)
        kw = dict(sequence_parallel=sequence_parallel, device_arena=self.device_arena)
        options = {"full": {}, "full-pa": dict(partition=True),
                   "full-pa-cpu": dict(offload=True, host_arena=self.host_arena)}
        self.stores = {mode: CheckpointStore(group, **options[mode], **kw)
                       for mode in FULL_MODES if plan.uses(mode)}   # one store per full* mode used

    def check_layers(self, num_layers: int) -> None:
        if num_layers != self.plan.num_layers:
            raise ValueError(f"the recompute plan covers {self.plan.num_layers} layers but the model "
                             f"has {num_layers}; build the plan with num_layers={num_layers}")

    def run(self, layers: Sequence[nn.Module], hidden: torch.Tensor, *extra) -> torch.Tensor:
        """``hidden`` through every layer, checkpointing the ``full*`` segments."""
        self.check_layers(len(layers))
        for seg in self.plan.segments():
            run = _Run(layers, seg.start, seg.stop)
            if seg.mode in FULL_MODES:
                hidden = checkpoint(run, hidden, *extra, rng=self.rng, store=self.stores[seg.mode])
            else:
                hidden = run(hidden, *extra)
        return hidden

    def arenas(self) -> list[Arena]:
        return [a for a in (self.device_arena, self.host_arena) if a is not None]

    def tier_bytes(self) -> dict[str, int]:
        """Bytes reserved by the arenas per tier ("device" / "host"): what a memory report lists
        apart from the allocator's device memory."""
        out: dict[str, int] = {}
        for a in self.arenas():
            out[a.tier] = out.get(a.tier, 0) + a.stats().capacity_bytes
        return out

    def buffer_report(self) -> str:
        """CB: the constant buffer sizes of activation recompute (ZeRO §6.2) and the store counters."""
        rows = [f"{a.name:>18} ({a.tier} tier): chunk {a.chunk_bytes:,d} B, "
                f"{a.stats().num_chunks} chunk(s), peak used {a.stats().peak_used_bytes:,d} B"
                for a in self.arenas()]
        rows += [f"{mode:>18}: {st.counters}" for mode, st in self.stores.items()]
        return "\n".join(["recompute buffers"] + (rows or ["  none (no arena, no offload)"]))
