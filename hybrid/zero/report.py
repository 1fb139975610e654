"""Measured model-state memory and DP communication beside the ZeRO paper's formulas (§5, §7).

Memory is measured from the real storages a rank holds (docs/design.md §6): every tensor's untyped storage
is counted once, by its data pointer, in the first category that claims it - so an fp32 master that
IS the parameter partition adds nothing, and views into one flat buffer count that buffer once.
Categories: ``param16`` (the model's parameters, "16-bit" even when fp32), ``grad16``, ``master32``,
``adam_moments``, ``param16_secondary`` (ZeRO++ hpZ's intra-host copy of stage 3's parameters,
:mod:`hybrid.zero.host_groups`; its formula is 2Ψ/h), ``buffers`` (constant-size communication buffers of ZeRO-R's CB, outside the
paper's model-state formula). The formula side is ZeRO §5 with Ψ = this TP rank's parameter count,
from the shared pure model :func:`hybrid.perf.model_states.model_state_bytes`.

Communication comes from the ledger of :mod:`hybrid.comm`: bytes a ring collective moves per rank,
summed per group and op over one optimizer step, beside the paper's 2Ψ(n-1)/n (stages 0-2) or
3Ψ(n-1)/n (stage 3), Ψ in bytes of the parameter dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from hybrid.comm import CommRecord
from hybrid.perf.model_states import dp_communication_elements, model_state_bytes

CATEGORIES = ("param16", "grad16", "master32", "adam_moments", "param16_secondary", "buffers")
MODEL_STATE_CATEGORIES = CATEGORIES[:5]


def measure_storages(categories: Mapping[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category from real storages, deduplicated by untyped-storage data pointer."""
    seen: set[tuple[str, int]] = set()
    out = {name: 0 for name in CATEGORIES}
    for name, tensors in categories.items():
        if name not in out:
            raise ValueError(f"unknown memory category {name!r}; use one of {CATEGORIES}")
        for t in tensors:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if t.device.type == "meta" or key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            out[name] += storage.nbytes()
    return out


def formula_bytes(psi: int, stage: int, dp: int, *, param_bytes: int, mixed_precision: bool,
                  moment_bytes: int = 8) -> dict[str, float]:
    """ZeRO §5 model states per device for Ψ = ``psi`` parameters (already divided by TP).

    Mixed precision: 16-bit params and grads (``param_bytes`` each) + K = 4 + ``moment_bytes``
    (fp32 master 4; the moments 8 in fp32 - the paper's K = 12 -, 6 or 4 when one or both are
    stored in bf16). Plain fp32: params and grads 4 bytes, the master IS the parameter (0), moments
    ``moment_bytes``.
    """
    master = 4 if mixed_precision else 0
    m = model_state_bytes(float(psi), stage, dp, param_bytes=param_bytes, grad_bytes=param_bytes,
                          optimizer_bytes_per_param=master + moment_bytes,
                          master_bytes_per_param=master)
    return {"param16": m.params_16bit, "grad16": m.grads_16bit, "master32": m.master_fp32,
            "adam_moments": m.adam_moments, "param16_secondary": 0.0}   # hpZ's engine sets it


def class_formula_bytes(shares: Iterable[tuple[int, int]], stage: int, *, param_bytes: int,
                        mixed_precision: bool, moment_bytes: int = 8) -> dict[str, float]:
    """:func:`formula_bytes` summed over parameter classes, each ``(Ψ, the DP size it is
    partitioned over)``: with experts (issue 32) Ψ_dense over DP plus Ψ_expert (this EP rank's
    experts) over expert-DP. One class: exactly :func:`formula_bytes`."""
    shares = list(shares)
    out = formula_bytes(shares[0][0], stage, shares[0][1], param_bytes=param_bytes,
                        mixed_precision=mixed_precision, moment_bytes=moment_bytes)
    for psi, dp in shares[1:]:
        more = formula_bytes(psi, stage, dp, param_bytes=param_bytes,
                             mixed_precision=mixed_precision, moment_bytes=moment_bytes)
        out = {k: out[k] + more[k] for k in out}
    return out


@dataclass
class MemoryReport:
    stage: int
    dp: int
    tp: int
    precision: str
    psi: int                       # parameters held by this TP rank (unpadded)
    measured: dict[str, int]       # bytes per category, real storages
    formula: dict[str, float]      # bytes per model-state category, ZeRO §5
    # stage 3: parameter bytes gathered while one unit computes, "tiled" (with ``tile_factor``)
    # and "untiled" (hybrid.zero.tiling.working_memory); None for stages 0-2
    working_memory: dict[str, int] | None = None
    tile_factor: int = 1
    # with expert parallelism: class name -> (Ψ of the class on this rank, its DP group's size)
    classes: dict[str, tuple[int, int]] | None = None

    @property
    def measured_model_states(self) -> int:
        return sum(self.measured[c] for c in MODEL_STATE_CATEGORIES)

    @property
    def formula_model_states(self) -> float:
        return sum(self.formula.values())

    def __str__(self) -> str:
        rows = [f"ZeRO stage {self.stage} model states per rank ({self.precision}, DP {self.dp}, "
                f"TP {self.tp}, psi = {self.psi:,} params on this TP rank)",
                f"  {'category':<14}{'measured MiB':>14}{'paper MiB':>14}"]
        for c in CATEGORIES:
            paper = f"{self.formula[c] / 2**20:14.3f}" if c in self.formula else f"{'-':>14}"
            rows.append(f"  {c:<14}{self.measured[c] / 2**20:14.3f}{paper}")
        rows.append(f"  {'model states':<14}{self.measured_model_states / 2**20:14.3f}"
                    f"{self.formula_model_states / 2**20:14.3f}")
        for name, (psi, dp) in (self.classes or {}).items():
            rows.append(f"  of which {name}: psi = {psi:,} params partitioned over {dp} ranks")
        if self.working_memory is not None:
            tiled, untiled = self.working_memory["tiled"], self.working_memory["untiled"]
            rows.append(f"  gathered working memory {tiled / 2**20:.3f} MiB with --tile-factor "
                        f"{self.tile_factor}, {untiled / 2**20:.3f} MiB untiled (largest unit whole)")
        return "\n".join(rows)


def expected_dp_bytes(psi: int, stage: int, dp: int, param_bytes: int) -> float:
    """ZeRO §7: 2Ψ (stages 0-2) or 3Ψ (stage 3) elements, ring factor (n-1)/n, in bytes."""
    return dp_communication_elements(psi, stage) * param_bytes * (dp - 1) / dp


@dataclass
class CommReport:
    stage: int
    dp: int
    psi: int
    param_bytes: int
    by_group_op: dict[tuple[str, str], float] = field(default_factory=dict)  # bytes per rank per step
    cross_host_by_group_op: dict[tuple[str, str], float] = field(default_factory=dict)  # their part
                                                                  # on links between hosts

    @property
    def dp_bytes(self) -> float:
        """DP traffic, the host-split DP groups' (dp_intra_host, dp_inter_host) included."""
        return sum(v for (g, _), v in self.by_group_op.items() if g.startswith("dp"))

    @property
    def tp_bytes(self) -> float:
        return sum(v for (g, _), v in self.by_group_op.items() if g == "tp")

    @property
    def expected_dp_bytes(self) -> float:
        return expected_dp_bytes(self.psi, self.stage, self.dp, self.param_bytes)

    def __str__(self) -> str:
        rows = [f"communication per rank per optimizer step (stage {self.stage}, DP {self.dp})"]
        for (g, op), v in sorted(self.by_group_op.items()):
            cross = self.cross_host_by_group_op.get((g, op), 0.0)
            rows.append(f"  {g:<6}{op:<16}{v / 2**20:12.3f} MiB, {cross / 2**20:.3f} MiB across hosts")
        rows.append(f"  DP total {self.dp_bytes / 2**20:.3f} MiB, paper "
                    f"{dp_communication_elements(1, self.stage):g}psi(n-1)/n = "
                    f"{self.expected_dp_bytes / 2**20:.3f} MiB")
        return "\n".join(rows)


def comm_report(records: list[CommRecord], steps: int, *, stage: int, dp: int, psi: int,
                param_bytes: int) -> CommReport:
    """Average bytes per rank per step over ``records`` covering ``steps`` optimizer steps."""
    totals: dict[tuple[str, str], float] = {}
    cross: dict[tuple[str, str], float] = {}
    for r in records:   # an optimizer's own traffic (Muon) keyed apart: ("dp/muon", op)
        key = (f"{r.group}/{r.category}" if r.category else r.group, r.op)
        totals[key] = totals.get(key, 0.0) + r.bytes_per_rank
        cross[key] = cross.get(key, 0.0) + r.cross_host_bytes
    steps = max(steps, 1)
    return CommReport(stage, dp, psi, param_bytes, {k: v / steps for k, v in totals.items()},
                      {k: v / steps for k, v in cross.items()})
