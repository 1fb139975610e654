"""The flat buffer of one parameter class for ZeRO stages 0-2 (ZeRO paper §5.1-5.2; classes: issue 32,
:mod:`hybrid.zero.param_classes`).

A :class:`hybrid.zero.flat.FlatEngine` keeps one :class:`FlatClass` per parameter class (dense, and
expert with expert parallelism): its own :class:`~hybrid.zero.partition.FlatLayout` cut for its own
DP group, its own flat 16-bit parameter buffer and gradient reduction. The engine's chunk list is
the classes' bucket chunks back to back (``chunk_base``: the index of this class's first bucket),
which the optimizer-state backend sees as one partition.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid import comm
from hybrid.adamw_config import uses_weight_decay
from hybrid.zero.param_classes import ParamClass
from hybrid.zero.partition import FlatLayout
from hybrid.zero.pieces import OwnedPiece


class FlatClass:
    """Flat storage of one parameter class: ``layout`` (buckets over ``group``), ``flat_param`` and,
    once the engine builds it, ``gradients`` (a :class:`~hybrid.zero.reducer.GradientReduction`)."""

    def __init__(self, index: int, pclass: ParamClass, names: list[str],
                 params: list[nn.Parameter], *, bucket_size: int, alignment: int,
                 partitioned: bool, dtype: torch.dtype, device: torch.device, chunk_base: int):
        self.index, self.name, self.group = index, pclass.name, pclass.group
        self.replicas = pclass.replicas   # hybrid sharding: the copies of each partition
        self.names = [names[i] for i in pclass.members]
        self.params = [params[i] for i in pclass.members]
        self.partitions, self.part_rank = ((self.group.size, self.group.rank) if partitioned
                                           else (1, 0))
        self.chunk_base = chunk_base
        self.layout = FlatLayout([p.numel() for p in self.params], bucket_size, self.partitions,
                                 alignment)
        self.flat_param = torch.zeros(self.layout.numel, dtype=dtype, device=device)
        for p, slot in zip(self.params, self.layout.slots):
            if p.is_meta:
                raise ValueError("ZeRO stages 0-2 need materialised parameters; call "
                                 "model.init_weights(seed) before building the optimizer")
            self.flat_param[slot.start:slot.start + slot.numel].copy_(p.detach().reshape(-1))
        if self.partitions > 1:   # reduce-scatters write a whole bucket
            comm.reserve_transport(self.group, max(b.numel for b in self.layout.buckets) *
                                   self.flat_param.element_size())
        self.owned = list(self.layout.owned_pieces(self.part_rank))
        self.gradients = None

    def pieces(self) -> list[OwnedPiece]:
        """This rank's pieces, their chunks numbered in the engine's list."""
        return [OwnedPiece(self.names[p.index], self.chunk_base + b, p.chunk_offset, p.param_offset,
                           p.numel, uses_weight_decay(self.params[p.index]),
                           bool(getattr(self.params[p.index], "tensor_model_parallel", False)),
                           self.index)
                for b, p in self.owned]

    def own_chunks(self) -> list[torch.Tensor]:
        """This rank's chunk of every bucket of the flat parameter buffer."""
        return [b.chunk_of(self.flat_param, self.part_rank) for b in self.layout.buckets]

    def write_masters(self, write_master) -> None:
        """The master starts from the ORIGINAL values (exact when the model was fp32)."""
        for b, piece in self.owned:
            src = self.params[piece.index].detach().reshape(-1)
            write_master(self.chunk_base + b, piece.chunk_offset,
                         src[piece.param_offset:piece.param_offset + piece.numel])

    def bind_params(self) -> None:
        """``param.data`` become views of the flat buffer (frees the original values)."""
        for p, slot in zip(self.params, self.layout.slots):
            p.data = self.flat_param[slot.start:slot.start + slot.numel].view(p.shape)

    def gather(self) -> None:
        """All-gather every bucket from its owners (all launched, then waited: consecutive
        buckets overlap); nothing to gather when every rank updated everything."""
        if self.partitions == 1:
            return
        inflight = []
        for bucket, own in zip(self.layout.buckets, self.own_chunks()):
            full = self.flat_param[bucket.start:bucket.start + bucket.numel]   # own is its slot
            inflight.append(comm.all_gather_into(full, own, self.group, async_op=True))
        for handle in inflight:
            handle.wait()


class ChunkOffset:
    """``accept_grad`` of the optimizer state with a class's bucket index moved to the engine's
    chunk index (a plain object, not a closure over the engine: see :mod:`.weak_hooks`)."""

    def __init__(self, accept_grad, base: int):
        self.accept_grad, self.base = accept_grad, base

    def __call__(self, bucket: int, chunk: torch.Tensor) -> None:
        self.accept_grad(self.base + bucket, chunk)
