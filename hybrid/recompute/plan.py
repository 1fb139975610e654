"""Recompute plans: which layers keep what for backward (Korthikanti et al. 2022 §5; ZeRO §6.1).

A :class:`RecomputePlan` gives every transformer layer one mode:

=============== ===================================================================================
``none``        autograd keeps every activation (paper: ``sbh(10 + 24/t + 5as/(ht))`` bytes, 16-bit)
``selective``   the attention core - softmax(QK^T), its dropout, times V - is recomputed; q, k, v kept
``full``        only the layer input is kept (``2sbh``); the layer is rerun in backward
``full-pa``     ``full`` with the input partitioned across the TP ranks (ZeRO-R Pa, ``2sbh/t``)
``full-pa-cpu`` ``full-pa`` with the partitions in the host tier (ZeRO-R Pa+cpu, ~0 on the device)
=============== ===================================================================================

``granularity`` k groups consecutive layers of the same ``full*`` mode into segments of up to k
layers checkpointed as one unit: only every k-th layer input is kept and a whole segment is
recomputed at once (fewer checkpoints, a k-layer transient in backward).

CB and MD sizes live here too: ``arena_chunk_bytes`` (0 = off) places device-resident checkpoints in
a contiguous arena of constant-size chunks; ``host_chunk_bytes`` is the chunk size of Pa+cpu's host
tier. Both are constants, independent of the model size (ZeRO §6.2).

A plan is plain data: the automatic planner (:mod:`.planner`) builds plans from a memory budget and
imports this module, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "selective", "full", "full-pa", "full-pa-cpu")
FULL_MODES = ("full", "full-pa", "full-pa-cpu")
DEFAULT_HOST_CHUNK_BYTES = 64 << 20    # 64 MiB pinned host chunks for Pa+cpu
DEFAULT_ARENA_CHUNK_BYTES = 0          # MD off unless asked for


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, stop)`` run under one ``mode`` (several layers only for ``full*`` modes)."""

    start: int
    stop: int
    mode: str


@dataclass(frozen=True)
class RecomputePlan:
    modes: tuple[str, ...]                 # one per layer
    granularity: int = 1                   # layers per full-recompute segment
    arena_chunk_bytes: int = DEFAULT_ARENA_CHUNK_BYTES
    host_chunk_bytes: int = DEFAULT_HOST_CHUNK_BYTES
    note: str = ""                         # why this plan (the planner's summary)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(self.modes))
        bad = sorted({m for m in self.modes if m not in MODES})
        if bad:
            raise ValueError(f"unknown recompute mode(s) {bad}; choose from {', '.join(MODES)}")
        if not self.modes:
            raise ValueError("a recompute plan needs at least one layer")
        if not isinstance(self.granularity, int) or self.granularity < 1:
            raise ValueError(f"recompute granularity must be a positive integer, got {self.granularity!r}")
        for name in ("arena_chunk_bytes", "host_chunk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def uniform(cls, mode: str, num_layers: int, **kw) -> "RecomputePlan":
        return cls((mode,) * num_layers, **kw)

    @classmethod
    def from_flag(cls, flag: str, num_layers: int, **kw) -> "RecomputePlan":
        """``--recompute none|selective|full|full-pa|full-pa-cpu`` (``auto`` is the planner's:
        :func:`hybrid.recompute.planner.plan_from_cli`)."""
        if flag == "auto":
            raise ValueError("--recompute auto needs --memory-budget: use "
                             "hybrid.recompute.planner.plan_from_cli or plan_for_budget")
        if flag not in MODES:
            raise ValueError(f"--recompute {flag!r} is not one of {', '.join(MODES + ('auto',))}")
        return cls.uniform(flag, num_layers, **kw)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.modes)

    def segments(self) -> list[Segment]:
        """Consecutive runs of one ``full*`` mode cut into segments of ``granularity`` layers;
        every other layer is a segment of its own."""
        out, i = [], 0
        while i < len(self.modes):
            mode, stop = self.modes[i], i + 1
            if mode in FULL_MODES:
                while stop < len(self.modes) and self.modes[stop] == mode and stop - i < self.granularity:
                    stop += 1
            out.append(Segment(i, stop, mode))
            i = stop
        return out

    def selective(self, layer: int) -> bool:
        return self.modes[layer] == "selective"

    def counts(self) -> dict[str, int]:
        return {m: self.modes.count(m) for m in MODES if m in self.modes}

    def uses(self, *modes: str) -> bool:
        return any(m in self.modes for m in modes)

    def __str__(self) -> str:
        runs = ", ".join(f"{s.start}-{s.stop - 1}: {s.mode}" if s.stop - s.start > 1
                         else f"{s.start}: {s.mode}" for s in _merge(self.segments()))
        lines = [f"RecomputePlan({self.num_layers} layers, granularity {self.granularity}) {runs}"]
        if self.arena_chunk_bytes:
            lines.append(f"  MD arena chunks {self.arena_chunk_bytes:,d} B (device tier)")
        if self.uses("full-pa-cpu"):
            lines.append(f"  host tier chunks {self.host_chunk_bytes:,d} B")
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)


def _merge(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments of one mode shown as one range when printing."""
    out: list[Segment] = []
    for s in segments:
        if out and out[-1].mode == s.mode and out[-1].stop == s.start:
            out[-1] = Segment(out[-1].start, s.stop, s.mode)
        else:
            out.append(s)
    return out
