"""Muon under TP and ZeRO: whole matrices owned by DP ranks, orthogonalised whole (issue 33 part 2).

Muon's update of a weight matrix W is a function of the WHOLE matrix (Newton-Schulz
orthogonalises its momentum), while ZeRO's partitions cut the flattened TP-local matrices at
arbitrary offsets (:mod:`.partition`, :mod:`.stage3_unit`) and TP cuts the matrix itself. What is
elementwise stays where ZeRO put it; what needs the whole matrix goes to one owner:

1. elementwise, on this rank's pieces (the partition ZeRO gives it): the momentum
   ``m <- mu m + g`` (kept in the Adam ``exp_avg`` slot of the piece, so checkpoints store and
   reshard it as they do Adam's first moment) and the Nesterov input ``u = g + mu m``;
2. every Muon matrix has ONE owner DP rank, chosen by :func:`assign_owners` (greedy longest-first
   on the Newton-Schulz FLOPs of the whole matrix, the same on every rank); each rank places its
   pieces of ``u`` at their matrix's place in a ``dp x R`` buffer laid out by owner (R: the
   largest owner's TP-local Muon elements, zeros elsewhere) and one reduce-scatter over the DP
   partition group hands every owner its matrices whole (the pieces are disjoint, so the sum is
   exact);
3. under TP (``--muon-tp-mode duplicated``): the owner's region is all-gathered over its TP group,
   so every TP rank of the owner holds the whole matrix, orthogonalises it and keeps its own shard
   of the result (the NS iteration is computed redundantly on the TP ranks instead of distributed:
   its cost is a few small GEMMs per matrix, a distributed iteration would need two collectives
   per iteration instead of one per step);
4. one all-gather over DP returns the updates to the partitions that hold them, and each rank
   applies ``W <- W (1 - lr wd) - lr scale(m, n) O`` to its master pieces.

Extra traffic per rank and step (:func:`hybrid.muon_config.muon_comm_bytes`, recorded under the
ledger category ``muon``): ``2 (dp - 1) R b + (tp - 1) R b`` bytes, b = 2 (bf16 NS) or 4 (fp32).
The fused QKV matrix is orthogonalised as one matrix (Megatron's ``--muon-no-split-qkv``); its TP
layout is a row permutation of the canonical [Q; K; V], and Newton-Schulz commutes with row
permutations, so every TP degree takes the same step. With PP each stage does the above over its
own DP group. Expert stacks [E_local, rows, cols] (issue 32) are E_local matrices, each placed,
owned and orthogonalised on its own; with expert parallelism the expert matrices are exchanged
over their ZeRO class's group (expert-DP), the dense ones over DP (x CP), one
:class:`_ClassExchange` each. Offloaded optimizer state is refused (the update runs on the
device's partition).

:class:`MuonOptimizerState` wraps the device backend (:mod:`.optimizer_state`), which runs AdamW on
every other piece; the engines hold it through the same protocol and never ask which it is.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch

from hybrid import comm
from hybrid.comm import Group
from hybrid.muon_config import (COMM_CATEGORY, NS_COEFFICIENTS, NS_EPS, MuonConfig,
                                is_muon_param, muon_comm_bytes, newton_schulz_flops)
from hybrid.offload.backend import OptimizerStateBackend
from hybrid.zero.pieces import OwnedPiece

_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The semi-orthogonal matrix nearest ``update`` [m, n] (approximately U V^T of its SVD) by
    ``steps`` quintic Newton-Schulz iterations in ``dtype``; returned in fp32 [m, n]. The wide
    orientation is iterated (X X^T is min(m, n) square)."""
    a, b, c = NS_COEFFICIENTS
    wide = update.size(0) <= update.size(1)
    x = (update if wide else update.t()).to(dtype)
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.t()                                   # [s, s]
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)   # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)                # a X + (b G + c G^2) X
    out = x if wide else x.t()
    return out.float()


@dataclass(frozen=True)
class MuonMatrix:
    """One Muon matrix: its TP-local shape, the TP dimension it is cut along (-1: replicated) and
    the TP degree, from which its whole shape follows. An expert stack [E_local, rows, cols]
    (issue 32) is E matrices: ``expert`` is the index in the stack (-1: a 2-D weight), and
    ``param_class`` the ZeRO parameter class whose partitions hold it (0 dense; experts: the
    class over the expert-DP group, :mod:`hybrid.zero.param_classes`)."""

    name: str
    local_shape: tuple[int, int]
    partition_dim: int
    tp: int
    expert: int = -1
    param_class: int = 0

    @property
    def numel(self) -> int:
        return self.local_shape[0] * self.local_shape[1]

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.expert

    @property
    def whole_shape(self) -> tuple[int, int]:
        rows, cols = self.local_shape
        if self.partition_dim == 0:
            return rows * self.tp, cols
        if self.partition_dim == 1:
            return rows, cols * self.tp
        return rows, cols


def muon_matrices(params, tp: int) -> list[MuonMatrix]:
    """The Muon matrices among ``(name, TP-local shape, partition_dim[, expert, param_class])``
    rows; an expert stack [E, rows, cols] (its ``partition_dim`` 1 or 2 counts the stack's
    dimension) gives E matrices [rows, cols] cut along ``partition_dim - 1``."""
    out = []
    for name, shape, dim, *rest in params:
        expert = bool(rest[0]) if rest else False
        pclass = int(rest[1]) if len(rest) > 1 else 0
        if not is_muon_param(name, len(shape), expert):
            continue
        if expert:
            cut = int(dim) - 1 if tp > 1 and int(dim) >= 1 else -1
            out += [MuonMatrix(name, (int(shape[1]), int(shape[2])), cut, tp, e, pclass)
                    for e in range(int(shape[0]))]
        else:
            out.append(MuonMatrix(name, (int(shape[0]), int(shape[1])),
                                  int(dim) if tp > 1 else -1, tp, -1, pclass))
    return out


def assign_owners(matrices: list[MuonMatrix], ranks: int, steps: int) -> list[int]:
    """Owner DP rank of each matrix: longest Newton-Schulz first, each to the least-loaded rank
    (ties: the lower rank). Deterministic, so every rank computes the same table."""
    load = [0] * ranks
    owners = [0] * len(matrices)
    order = sorted(range(len(matrices)),
                   key=lambda i: (-newton_schulz_flops(*matrices[i].whole_shape, steps), i))
    for i in order:
        r = min(range(ranks), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += newton_schulz_flops(*matrices[i].whole_shape, steps)
    return owners


class MuonPlan:
    """Where each Muon matrix sits in the owner-ordered exchange buffer: owner, offset inside the
    owner's region, and the region size R (the largest owner's elements)."""

    def __init__(self, matrices: list[MuonMatrix], ranks: int, steps: int):
        self.matrices, self.ranks = matrices, ranks
        self.by_key = {m.key: i for i, m in enumerate(matrices)}
        self.by_name = {m.name for m in matrices}
        self.owners = assign_owners(matrices, ranks, steps)
        fill = [0] * ranks
        self.offsets = []
        for m, owner in zip(matrices, self.owners):
            self.offsets.append(fill[owner])
            fill[owner] += m.numel
        self.region = max(fill) if fill else 0
        self.loads = fill

    def position(self, name: str, expert: int = -1) -> int:
        """Offset of matrix ``name``'s (expert ``expert``'s) first element in the dp x R buffer."""
        i = self.by_key[(name, expert)]
        return self.owners[i] * self.region + self.offsets[i]

    def owned(self, rank: int) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def segments(self, piece: OwnedPiece) -> list[tuple[int, int, int]]:
        """(offset in the dp x R buffer, offset in the piece, length) of the piece's elements, one
        per matrix it covers: a 2-D weight's piece is one run; an expert stack's piece is cut at
        the experts' boundaries (each expert's matrix has its own owner and place)."""
        if (piece.name, -1) in self.by_key:
            return [(self.position(piece.name) + piece.param_offset, 0, piece.numel)]
        size = self.matrices[self.by_key[(piece.name, 0)]].numel   # one expert's elements
        out, at, end = [], piece.param_offset, piece.param_offset + piece.numel
        while at < end:
            expert = at // size
            stop = min(end, (expert + 1) * size)
            out.append((self.position(piece.name, expert) + at - expert * size,
                        at - piece.param_offset, stop - at))
            at = stop
        return out


class _ClassExchange:
    """Muon's exchange for one ZeRO parameter class: its plan over its partition ``group`` (None:
    nothing partitioned) and this rank's pieces of its matrices, cut per matrix."""

    def __init__(self, matrices: list[MuonMatrix], pieces: list[OwnedPiece], group: Group | None,
                 steps: int):
        self.group = group if group is not None and group.size > 1 else None
        self.rank = self.group.rank if self.group is not None else 0
        self.plan = MuonPlan(matrices, self.group.size if self.group is not None else 1, steps)
        self.pieces = [(p, self.plan.segments(p)) for p in pieces if p.name in self.plan.by_name]
        self.tp_sharded = any(m.partition_dim >= 0 for m in matrices)


class MuonOptimizerState(OptimizerStateBackend):
    """Muon on the pieces of the Muon matrices, AdamW (``inner``, built over the other pieces only)
    on the rest; the master and both moment slots are the inner backend's (``exp_avg`` holds
    Muon's momentum, ``exp_avg_sq`` stays zero for Muon pieces). ``groups``: per parameter class
    (``OwnedPiece.param_class``), the group its partitions are cut over (None: every rank holds
    everything, stage 0): the dense matrices are exchanged over DP (x CP), the experts' over
    expert-DP, each class with its own owners; ``tp_group``: the TP group (None or size 1: no
    TP)."""

    def __init__(self, inner: OptimizerStateBackend, pieces: list[OwnedPiece],
                 matrices: list[MuonMatrix], config: MuonConfig, *, weight_decay: float,
                 groups: Sequence[Group | None], tp_group: Group | None, device: torch.device):
        self.inner, self.config, self.weight_decay = inner, config, weight_decay
        self.tp = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.device = device
        self.dtype = _NS_DTYPES[config.ns_dtype]
        present = sorted({m.param_class for m in matrices}) or [0]
        self.exchanges = [_ClassExchange([m for m in matrices if m.param_class == k],
                                         [p for p in pieces if p.param_class == k],
                                         groups[k], config.ns_steps) for k in present]
        self.plan = self.exchanges[0].plan    # the dense class's (the only one without experts)

    # ---- the protocol, delegated -------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    def write_master(self, chunk: int, offset: int, values: torch.Tensor) -> None:
        self.inner.write_master(chunk, offset, values)

    def accept_grad(self, chunk: int, grad: torch.Tensor) -> None:
        self.inner.accept_grad(chunk, grad)

    def drop_staged_grads(self) -> None:
        self.inner.drop_staged_grads()

    def publish(self, params_out: Sequence[torch.Tensor]) -> None:
        self.inner.publish(params_out)

    def fragment_views(self, kind: str) -> list[torch.Tensor]:
        return self.inner.fragment_views(kind)

    def resident(self) -> dict[str, list[torch.Tensor]]:
        return self.inner.resident()

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def close(self) -> None:
        self.inner.close()

    # ---- the step ------------------------------------------------------------------------------
    def expected_comm_bytes(self) -> float:
        """Bytes per rank this state's step records under the ``muon`` ledger category (the sum
        over the parameter classes' exchanges)."""
        return sum(muon_comm_bytes(x.plan.region, x.plan.ranks,
                                   self.tp.size if self.tp is not None else 1,
                                   self.config.ns_itemsize, x.tp_sharded)
                   for x in self.exchanges if x.plan.matrices)

    def update(self, grads: list[torch.Tensor], params_out: Sequence[torch.Tensor], *, lr: float,
               grad_scale: float, skip: torch.Tensor | None = None) -> None:
        """Muon on the Muon pieces (first: the inner AdamW rounds whole chunks of the master into
        ``params_out``), then AdamW on the rest. The engine decides a skipped step on the host for
        Muon (no ``skips_on_device``), so ``skip`` is set only by direct callers."""
        if skip is not None and bool(skip):
            return
        for exchange in self.exchanges:   # the same classes in the same order on every rank
            if exchange.plan.matrices:
                self._muon(exchange, grads, lr, grad_scale)
        self.inner.update(grads, params_out, lr=lr, grad_scale=grad_scale)

    @torch.no_grad()
    def _muon(self, exchange: _ClassExchange, grads: list[torch.Tensor], lr: float,
              grad_scale: float) -> None:
        mu, plan, dp = self.config.momentum, exchange.plan, exchange.group
        masters, moms = self.inner.fragment_views("master"), self.inner.fragment_views("exp_avg")
        buffer = torch.zeros(plan.ranks * plan.region, dtype=self.dtype, device=self.device)
        for p, segments in exchange.pieces:                 # 1. elementwise on this rank's pieces
            g = p.of(grads).float() / grad_scale
            m = p.of(moms)
            m32 = m.float().mul_(mu).add_(g)
            m.copy_(m32)
            u = g.add_(m32, alpha=mu) if self.config.nesterov else m32
            for start, at, length in segments:
                buffer[start:start + length].copy_(u[at:at + length])
        region = buffer.narrow(0, exchange.rank * plan.region, plan.region)
        group = dp if dp is not None else self.tp
        with comm.labelled(group, COMM_CATEGORY) if group is not None else nullcontext():
            if dp is not None:                              # 2. each owner gets its matrices whole
                comm.reduce_scatter_into(region, buffer, dp)
            self._orthogonalise(exchange, region)           # 3. TP gather + Newton-Schulz
            if dp is not None:                              # 4. updates back to every partition
                comm.all_gather_into(buffer, region, dp)
        for p, segments in exchange.pieces:
            master = p.of(masters)
            if p.decay and self.weight_decay:
                master.mul_(1.0 - lr * self.weight_decay)
            for start, at, length in segments:
                master[at:at + length].add_(buffer[start:start + length].to(master.dtype),
                                            alpha=-lr)

    def _orthogonalise(self, exchange: _ClassExchange, region: torch.Tensor) -> None:
        """Replace each owned matrix's Nesterov input in ``region`` by its scaled update (this TP
        rank's shard of the whole matrix's)."""
        plan, owned = exchange.plan, exchange.plan.owned(exchange.rank)
        tp = self.tp.size if self.tp is not None else 1
        whole = region
        if self.tp is not None and exchange.tp_sharded:
            whole = torch.empty(tp * plan.region, dtype=region.dtype, device=region.device)
            comm.all_gather_into(whole, region, self.tp)
        for i in owned:
            m, offset = plan.matrices[i], plan.offsets[i]
            rows, cols = m.local_shape
            if m.partition_dim >= 0 and tp > 1:
                shards = [whole[t * plan.region + offset:t * plan.region + offset + m.numel]
                          .view(rows, cols) for t in range(tp)]
                full = torch.cat(shards, dim=m.partition_dim)
            else:
                full = region[offset:offset + m.numel].view(rows, cols)
            out = newton_schulz(full, self.config.ns_steps, self.dtype)
            out.mul_(self.config.scale(*m.whole_shape))
            if m.partition_dim >= 0 and tp > 1:
                out = out.narrow(m.partition_dim, self.tp.rank * m.local_shape[m.partition_dim],
                                 m.local_shape[m.partition_dim])
            region[offset:offset + m.numel].copy_(out.reshape(-1))


@dataclass
class MuonSetup:
    """What an engine hands :func:`hybrid.zero.optimizer_state.build_optimizer_state` to train its
    Muon matrices with Muon: the config, the matrices (TP-local) and the groups."""

    config: MuonConfig
    matrices: list[MuonMatrix]
    groups: Sequence[Group | None]   # per parameter class, its partition group (None: stage 0)
    tp_group: Group | None
    weight_decay: float

    def wrap(self, offload, pieces: list[OwnedPiece], build_inner, kernel: str,
             device: torch.device) -> OptimizerStateBackend:
        """``build_inner(pieces)`` builds the AdamW backend over the pieces given; it gets the
        non-Muon pieces, and the result is wrapped."""
        if offload is not None and getattr(offload, "enabled", False):
            raise ValueError("Muon runs on the device's optimizer state; --optimizer muon with "
                             "--offload-optimizer is not supported: drop one of them")
        if kernel == "compiled":
            raise ValueError("the compiled AdamW kernel updates whole chunks; with Muon use the "
                             "fused or foreach kernel")
        names = {m.name for m in self.matrices}
        inner = build_inner([p for p in pieces if p.name not in names])
        return MuonOptimizerState(inner, pieces, self.matrices, self.config,
                                  weight_decay=self.weight_decay, groups=self.groups,
                                  tp_group=self.tp_group, device=device)
