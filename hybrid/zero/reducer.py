"""Bucketed gradient reduction overlapped with backward (ZeRO §5.2, §6.3 constant-size buffers).

A post-accumulate-grad hook on every parameter counts which bucket is complete; complete buckets are
launched asynchronously, strictly in bucket order (every rank issues collectives in the same order),
while backward keeps producing the next gradients. ``finish()`` launches what is left (buckets of
parameters that got no gradient carry zeros) and waits for every handle. ``on_final(bucket)`` is
called as each bucket of the step's last micro-batch lands (optimizer offload streams that chunk
to the host while backward goes on).

With hybrid sharding (:mod:`hybrid.zero.host_groups`) ``group`` is the intra-host DP group and each
reduced chunk is then all-reduced over ``replicas``, the inter-host group
(:func:`hybrid.comm.reduce_scatter_replicated`).

One class per way the engines of :mod:`.optimizer` reduce (the shared counting, ordering and
buffer pool are :class:`GradReducer`'s):

* :class:`BucketAllReduce` (plain data parallel): the bucket slice of the full gradient buffer is
  all-reduced in place.
* :class:`BucketReduceScatter` (Pos): the bucket slice is reduce-scattered in place: this rank's
  reduced chunk lands on its own chunk of the full gradient buffer (the rest is left stale, never
  read).
* :class:`PartitionReduceScatter` (Pos+g): there is no full gradient buffer. The hook copies the
  fresh ``param.grad`` into a constant-size staging buffer and frees it (with gradient-accumulation
  fusion the weight-gradient products were written there already, and there is no ``param.grad``);
  the staged bucket is reduce-scattered and this rank's chunk ADDED to its gradient partition
  (accumulation).

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


class GradReducer:
    """Counts gradients into buckets and reduces complete buckets in order; a subclass says how
    (``_launch``) and what happens to a fresh gradient (``_take``) or a landed bucket (``_landed``)."""

    stages_gradients = False   # True: gradients are copied into staging buckets (no full buffer)

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, group: Group, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool = True,
                 grad_flat: torch.Tensor | None = None,
                 grad_chunks: list[torch.Tensor] | None = None, replicas: Group | None = None,
                 reduce_scatter: Callable | None = None):
        self.params, self.layout, self.group = params, layout, group
        self.replicas = replicas            # hybrid sharding: the chunk is all-reduced over them
        self.reduce_scatter = (reduce_scatter if reduce_scatter is not None   # qgZ's
                               else functools.partial(comm.reduce_scatter_replicated, group=group,
                                                      replicas=replicas))
        self._needs_scratch = comm.needs_reduce_scratch(group) and reduce_scatter is None
        self.dtype, self.device, self.overlap = dtype, device, overlap
        self.grad_flat = grad_flat          # full gradients: [layout.numel] buffer
        self.grad_chunks = grad_chunks      # Pos+g: this rank's chunk of every bucket
        self.enabled = True                 # False on micro-batches that must not communicate
        self.final = True                   # this backward is the step's last micro-batch
        self.on_final: Callable[[int], None] | None = None   # bucket whose chunk is now final
        self._pool: list[_Staging] = []     # every staging entry ever made
        self._free: list[_Staging] = []
        self._staged: dict[int, _Staging] = {}
        self._inflight: deque = deque()     # (bucket, handle, staging entry or None)
        self._reset_counters()
        add_post_accumulate_hooks(self, "_on_grad", ((p, (i,)) for i, p in enumerate(params)))

    # ---- hooks -----------------------------------------------------------------------------
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self.enabled:
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
        if self.final and self.on_final is not None:
            self.on_final(bucket.index)     # e.g. stream this rank's chunk to the host now

    def finish(self) -> None:
        """Launch every bucket not yet launched, wait for all, reset for the next backward."""
        if not self.enabled:
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


class BucketAllReduce(GradReducer):
    """Plain data parallelism: every rank keeps the full gradient, all-reduced bucket by bucket."""

    def _launch(self, bucket: Bucket) -> None:
        view = self.grad_flat[bucket.start:bucket.start + bucket.numel]
        self._inflight.append((bucket, comm.all_reduce(view, self.group, async_op=True), None))


class BucketReduceScatter(GradReducer):
    """Pos (ZeRO §5.1): the full gradient buffer's bucket is reduce-scattered in place, so this
    rank's reduced chunk lands on its own chunk of the buffer."""

    def _launch(self, bucket: Bucket) -> None:
        entry = self._acquire(bucket)
        full = self.grad_flat[bucket.start:bucket.start + bucket.numel]
        lo, hi = bucket.chunk_range(self.group.rank)
        handle = self.reduce_scatter(full[lo:hi], full, async_op=True, scratch=entry.scratch)
        self._inflight.append((bucket, handle, entry))


class _StagedSlot(GradTarget):
    """Gradient-accumulation fusion under Pos+g: a parameter's products go straight into its slot
    of the staging bucket (acquired, zeroed, on the first), not into a ``param.grad`` to copy."""

    def __init__(self, reducer: "PartitionReduceScatter", index: int):
        self.reducer, self.slot = reducer, reducer.layout.slots[index]

    def buffer(self, param: torch.Tensor) -> torch.Tensor | None:
        if not self.reducer.enabled:
            return None
        return self.reducer.staged_slot(self.slot).view(param.shape)

    @property
    def zeroed(self) -> bool:
        return self.slot.start not in self.reducer.written

    def written(self) -> None:
        self.reducer.written.add(self.slot.start)


class PartitionReduceScatter(GradReducer):
    """Pos+g (ZeRO §5.2): gradients are moved into a staging bucket as backward produces them and
    the full-size ``param.grad`` is freed; the staged bucket is reduce-scattered and this rank's
    chunk added to its gradient partition."""

    stages_gradients = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written: set[int] = set()   # slots (by start) a fused product wrote this backward

    def fusion_targets(self) -> list[GradTarget]:
        """One :class:`hybrid.tensor_parallel.grad_fusion.GradTarget` per parameter: its slot."""
        return [_StagedSlot(self, i) for i in range(len(self.params))]

    def staged_slot(self, slot) -> torch.Tensor:
        """The flat view of ``slot`` in its bucket's staging buffer (acquired on first use)."""
        bucket = self.layout.buckets[slot.bucket]
        begin = slot.start - bucket.start
        return self._staging_for(bucket).full[begin:begin + slot.numel]

    def _staging_for(self, bucket: Bucket):
        if bucket.index not in self._staged:   # a fresh, zeroed entry: nothing written in it
            self.written.difference_update(self.layout.slots[i].start for i in bucket.params)
        return super()._staging_for(bucket)

    def _take(self, slot, bucket: Bucket, param: torch.Tensor) -> None:
        if param.grad is not None:   # autograd's gradient (None: fused products wrote the slot)
            staged = self.staged_slot(slot)
            grad = param.grad.reshape(-1)
            if slot.start in self.written:
                staged.add_(grad)
            else:
                staged.copy_(grad)
            param.grad = None       # the full-size gradient must not persist (Pos+g)
        self.written.discard(slot.start)

    def _launch(self, bucket: Bucket) -> None:
        entry = self._staging_for(bucket)
        handle = self.reduce_scatter(entry.chunk[:bucket.chunk], entry.full[:bucket.numel],
                                     async_op=True, scratch=entry.scratch)
        self._inflight.append((bucket, handle, entry))

    def _landed(self, bucket: Bucket, entry: _Staging) -> None:
        self.grad_chunks[bucket.index].add_(entry.chunk[:bucket.chunk])
        self._staged.pop(bucket.index, None)
