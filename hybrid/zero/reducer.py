"""Gradient storage and its bucketed reduction overlapped with backward, for the flat-buffer stages
(ZeRO §5.1-5.2, §6.3 constant-size buffers).

A post-accumulate-grad hook on every parameter counts which bucket is complete; complete buckets are
launched asynchronously, strictly in bucket order (every rank issues collectives in the same order),
while backward keeps producing the next gradients. ``finish()`` launches what is left (buckets of
parameters that got no gradient carry zeros) and waits for every handle. ``on_final(bucket,
chunk)`` is called with this rank's reduced chunk as each bucket of the step's last micro-batch
lands (an offloaded optimizer state streams that chunk to the host while backward goes on).

The engine tells a reduction what each backward is with :meth:`GradientReduction.begin_backward`
and lands it with :meth:`GradientReduction.land`; it reads this rank's reduced chunk of a bucket
with :meth:`GradientReduction.reduced`.

With hybrid sharding (:mod:`hybrid.zero.host_groups`) ``group`` is the intra-host DP group and each
reduced chunk is then all-reduced over ``replicas``, the inter-host group
(:func:`hybrid.comm.reduce_scatter_replicated`).

Two kinds of gradient storage, the difference between ZeRO's stage 1 and stage 2 (the shared
counting, ordering and buffer pool are :class:`GradientReduction`'s):

* :class:`FullGradients` (stages 0 and 1): a full gradient buffer, ``param.grad`` views into it,
  accumulated locally over the micro-batches and reduced in the step's last backward. Stage 0
  (plain data parallelism) all-reduces each bucket in place; stage 1 (Pos) reduce-scatters it in
  place: this rank's reduced chunk lands on its own chunk of the buffer (the rest is left stale,
  never read).
* :class:`PartitionedGradients` (stage 2, Pos+g): no full gradient buffer. The hook copies the
  fresh ``param.grad`` into a constant-size staging buffer and frees it (with gradient-accumulation
  fusion the weight-gradient products were written there already, and there is no ``param.grad``);
  the staged bucket is reduce-scattered and this rank's chunk ADDED to its gradient partition
  (accumulation), on every micro-batch.

Every reduce-scatter goes through ``reduce_scatter`` (default :func:`hybrid.comm.reduce_scatter_into`
over the group; qgZ: :func:`hybrid.zero.quantized_collectives.hierarchical_reduce_scatter`).

Staging buffers come from a small pool (two in steady state): when none is free the oldest
in-flight bucket is completed to release one. Where the backend reduce-scatters through a
full-size receive buffer (gloo, :func:`hybrid.comm.needs_reduce_scratch`) each pool entry holds
one too, so no collective allocates: the buffers are the constant-size ones of ZeRO-R's CB.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid import comm
from hybrid.comm import Group
from hybrid.tensor_parallel import grad_fusion
from hybrid.tensor_parallel.grad_fusion import GradTarget
from hybrid.zero.partition import Bucket, FlatLayout
from hybrid.zero.weak_hooks import add_post_accumulate_hooks

log = logging.getLogger(__name__)


@dataclass
class _Staging:
    """One pool entry: the staged bucket (Pos+g), the reduced chunk (Pos+g) and the receive
    buffer of gloo's reduce-scatter; each sized for the largest bucket, empty when not needed."""

    full: torch.Tensor
    chunk: torch.Tensor
    scratch: torch.Tensor | None


class GradientReduction:
    """Gradient storage of the flat-buffer stages and its reduction; see the module docstring.

    A subclass builds ``storage`` (what the memory report counts as 16-bit gradients),
    ``_reduced_chunks`` (this rank's reduced chunk of every bucket) and ``_grad_views`` (what
    ``param.grad`` is between backwards, per parameter), and says how a bucket is reduced
    (``_launch``) and, when gradients are staged, what happens to a fresh gradient (``_take``) or
    a landed bucket (``_landed``) and where the weight-gradient products go
    (:meth:`fusion_targets`)."""

    stages_gradients = False   # True: gradients are copied into staging buckets, every backward

    storage: torch.Tensor
    _reduced_chunks: list[torch.Tensor]
    _grad_views: list[torch.Tensor | None]

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, group: Group, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool = True,
                 replicas: Group | None = None, reduce_scatter: Callable | None = None,
                 on_final: Callable[[int, torch.Tensor], None] | None = None):
        self.params, self.layout, self.group = params, layout, group
        self.replicas = replicas            # hybrid sharding: the chunk is all-reduced over them
        self.reduce_scatter = (reduce_scatter if reduce_scatter is not None   # qgZ's
                               else functools.partial(comm.reduce_scatter_replicated, group=group,
                                                      replicas=replicas))
        self._needs_scratch = comm.needs_reduce_scratch(group) and reduce_scatter is None
        self.dtype, self.device, self.overlap = dtype, device, overlap
        self._enabled = True                # False on micro-batches that must not communicate
        self._final = True                  # this backward is the step's last micro-batch
        self._on_final = on_final           # (bucket, its reduced chunk), final for the step
        self._written: set[int] = set()     # staged slots (by start) written in this backward
        self._pool: list[_Staging] = []     # every staging entry ever made
        self._free: list[_Staging] = []
        self._staged: dict[int, _Staging] = {}
        self._inflight: deque = deque()     # (bucket, handle, staging entry or None)
        self._reset_counters()
        add_post_accumulate_hooks(self, "_on_grad", ((p, (i,)) for i, p in enumerate(params)))

    # ---- the engine's interface --------------------------------------------------------------
    def begin_backward(self, first: bool, last: bool) -> None:
        """Before a micro-batch's backward (``first`` since the gradients were zeroed, ``last`` of
        the step). Full gradients accumulate locally and communicate in the last one only; staged
        ones reduce every micro-batch, after the previous one's reductions have landed."""
        if self.stages_gradients and not first:
            self.finish()
        if any(v is not None and p.grad is not v for p, v in zip(self.params, self._grad_views)):
            raise RuntimeError("param.grad no longer points into the ZeRO gradient buffer (was "
                               "model.zero_grad() called?); call opt.zero_grad() instead")
        self._enabled = last or self.stages_gradients
        self._final = last

    def land(self) -> None:
        """Before the step: every bucket reduced (those of the last backward launched now)."""
        self._enabled = True
        self.finish()

    def reduced(self, bucket: int) -> torch.Tensor:
        """This rank's reduced chunk of bucket ``bucket``, in the gradient dtype."""
        return self._reduced_chunks[bucket]

    def zero(self) -> None:
        """Zero the gradient storage and point ``param.grad`` where the next backward writes."""
        self.storage.zero_()
        grad_fusion.zeroed(self.params)
        for p, view in zip(self.params, self._grad_views):
            p.grad = view

    def fusion_targets(self) -> list[GradTarget] | None:
        """Where the weight-gradient products go (:func:`hybrid.tensor_parallel.grad_fusion.allow`;
        None: into ``param.grad``)."""
        return None

    # ---- hooks -----------------------------------------------------------------------------
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self._enabled:
            return
        slot = self.layout.slots[index]
        bucket = self.layout.buckets[slot.bucket]
        self._take(slot, bucket, param)
        self._missing[bucket.index] -= 1
        if self.overlap:
            self._launch_ready()

    def _take(self, slot, bucket: Bucket, param: torch.Tensor) -> None:
        """A fresh gradient of ``param`` (slot ``slot`` of ``bucket``) is complete for this backward."""

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._missing[self._next] == 0:
            self._launch(buckets[self._next])
            self._next += 1

    # ---- collectives -----------------------------------------------------------------------
    def _launch(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def _landed(self, bucket: Bucket, entry: _Staging) -> None:
        """The reduction of ``bucket`` (staging entry ``entry``) has completed."""

    def _complete_oldest(self) -> None:
        bucket, handle, entry = self._inflight.popleft()
        handle.wait()
        if entry is not None:
            self._landed(bucket, entry)
            self._free.append(entry)
        if self._final and self._on_final is not None:   # e.g. stream the chunk to the host now
            self._on_final(bucket.index, self._reduced_chunks[bucket.index])

    def finish(self) -> None:
        """Launch every bucket not yet launched, wait for all, reset for the next backward."""
        if not self._enabled:
            return
        while self._next < len(self.layout.buckets):
            self._launch(self.layout.buckets[self._next])
            self._next += 1
        while self._inflight:
            self._complete_oldest()
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._missing = [len(b.params) for b in self.layout.buckets]
        self._next = 0

    # ---- staging buffers (constant size: the largest bucket and its chunk) -----------------
    def _staging_for(self, bucket: Bucket) -> _Staging:
        if bucket.index not in self._staged:
            entry = self._acquire(bucket)
            entry.full[:bucket.numel].zero_()   # padding and parameters without a gradient reduce
                                                # as zeros (the entry is sized for the largest bucket)
            self._written.difference_update(self.layout.slots[i].start for i in bucket.params)
            self._staged[bucket.index] = entry
        return self._staged[bucket.index]

    def _acquire(self, bucket: Bucket) -> _Staging:
        if not self._free and self._inflight:
            self._complete_oldest()
        if self._free:
            return self._free.pop()
        numel = max(b.numel for b in self.layout.buckets)
        chunk = max(b.chunk for b in self.layout.buckets)
        new = lambda n: torch.empty(n, dtype=self.dtype, device=self.device)  # noqa: E731
        staged = self.stages_gradients
        entry = _Staging(new(numel if staged else 0), new(chunk if staged else 0),
                         new(numel) if self._needs_scratch else None)
        self._pool.append(entry)
        log.debug("gradient staging pool grew to %d entries (bucket %d)", len(self._pool),
                  bucket.index)
        return entry

    def buffers(self) -> list[torch.Tensor]:
        """Every staging buffer allocated so far (memory report category 'buffers')."""
        return [t for e in self._pool for t in (e.full, e.chunk, e.scratch) if t is not None]


class FullGradients(GradientReduction):
    """Stages 0 and 1: a full gradient buffer (``param.grad`` views into it), each bucket
    all-reduced (``partitioned`` False: plain data parallelism) or reduce-scattered in place (Pos,
    ZeRO §5.1: this rank's reduced chunk lands on its own chunk of the buffer)."""

    def __init__(self, params, layout: FlatLayout, group: Group, *, partitioned: bool,
                 dtype: torch.dtype, device: torch.device, **options):
        self.partitioned = partitioned
        self.storage = torch.zeros(layout.numel, dtype=dtype, device=device)
        self._grad_views = [self.storage[s.start:s.start + s.numel].view(p.shape)
                            for p, s in zip(params, layout.slots)]
        own = group.rank if partitioned else 0   # unpartitioned: the whole bucket is the chunk
        self._reduced_chunks = [b.chunk_of(self.storage, own) for b in layout.buckets]
        super().__init__(params, layout, group, dtype=dtype, device=device, **options)

    def _launch(self, bucket: Bucket) -> None:
        full = self.storage[bucket.start:bucket.start + bucket.numel]
        if not self.partitioned:
            self._inflight.append((bucket, comm.all_reduce(full, self.group, async_op=True), None))
            return
        entry = self._acquire(bucket)
        own = self._reduced_chunks[bucket.index]   # this rank's chunk of ``full``
        handle = self.reduce_scatter(own, full, async_op=True, scratch=entry.scratch)
        self._inflight.append((bucket, handle, entry))


class _StagedSlot(GradTarget):
    """Gradient-accumulation fusion under Pos+g: a parameter's products go straight into its slot
    of the staging bucket (acquired, zeroed, on the first), not into a ``param.grad`` to copy."""

    def __init__(self, gradients: "PartitionedGradients", index: int):
        self.gradients, self.slot = gradients, gradients.layout.slots[index]

    def buffer(self, param: torch.Tensor) -> torch.Tensor | None:
        return self.gradients.fusion_buffer(self.slot, param.shape)

    @property
    def zeroed(self) -> bool:
        return not self.gradients.slot_written(self.slot)

    def written(self) -> None:
        self.gradients.mark_written(self.slot)


class PartitionedGradients(GradientReduction):
    """Pos+g (ZeRO §5.2, stage 2): gradients are moved into a staging bucket as backward produces
    them and the full-size ``param.grad`` is freed; the staged bucket is reduce-scattered and this
    rank's chunk added to its gradient partition (2Ψ/Nd bytes instead of 2Ψ)."""

    stages_gradients = True

    def __init__(self, params, layout: FlatLayout, group: Group, *, dtype: torch.dtype,
                 device: torch.device, **options):
        sizes = layout.chunk_sizes()
        self.storage = torch.zeros(sum(sizes), dtype=dtype, device=device)
        self._reduced_chunks = list(torch.split(self.storage, sizes))
        self._grad_views = [None] * len(params)   # param.grad exists only until the hook stages it
        super().__init__(params, layout, group, dtype=dtype, device=device, **options)

    def fusion_targets(self) -> list[GradTarget]:
        """One target per parameter: its slot of the staging bucket. (Made here, not kept: the
        targets refer to this object, which must die with its engine, see :mod:`.weak_hooks`.)"""
        return [_StagedSlot(self, i) for i in range(len(self.params))]

    # ---- gradient-accumulation fusion (the _StagedSlot targets ask) -------------------------
    def fusion_buffer(self, slot, shape) -> torch.Tensor | None:
        """The staged view of ``slot`` shaped as its parameter, or None on a backward that does
        not reduce."""
        return self._staged_slot(slot).view(shape) if self._enabled else None

    def slot_written(self, slot) -> bool:
        return slot.start in self._written

    def mark_written(self, slot) -> None:
        self._written.add(slot.start)

    def _staged_slot(self, slot) -> torch.Tensor:
        """The flat view of ``slot`` in its bucket's staging buffer (acquired on first use)."""
        bucket = self.layout.buckets[slot.bucket]
        begin = slot.start - bucket.start
        return self._staging_for(bucket).full[begin:begin + slot.numel]

    # ---- reduction -------------------------------------------------------------------------
    def _take(self, slot, bucket: Bucket, param: torch.Tensor) -> None:
        if param.grad is not None:   # autograd's gradient (None: fused products wrote the slot)
            staged = self._staged_slot(slot)
            grad = param.grad.reshape(-1)
            if slot.start in self._written:
                staged.add_(grad)
            else:
                staged.copy_(grad)
            param.grad = None       # the full-size gradient must not persist (Pos+g)
        self._written.discard(slot.start)

    def _launch(self, bucket: Bucket) -> None:
        entry = self._staging_for(bucket)
        handle = self.reduce_scatter(entry.chunk[:bucket.chunk], entry.full[:bucket.numel],
                                     async_op=True, scratch=entry.scratch)
        self._inflight.append((bucket, handle, entry))

    def _landed(self, bucket: Bucket, entry: _Staging) -> None:
        self._reduced_chunks[bucket.index].add_(entry.chunk[:bucket.chunk])
        self._staged.pop(bucket.index, None)
