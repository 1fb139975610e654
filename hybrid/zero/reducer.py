"""Bucketed gradient reduction overlapped with backward (ZeRO §5.2, §6.3 constant-size buffers).

A post-accumulate-grad hook on every parameter counts which bucket is complete; complete buckets are
launched asynchronously, strictly in bucket order (every rank issues collectives in the same order),
while backward keeps producing the next gradients. ``finish()`` launches what is left (buckets of
parameters that got no gradient carry zeros) and waits for every handle. ``on_final(bucket)`` is
called as each bucket of the step's last micro-batch lands (optimizer offload streams that chunk
to the host while backward goes on).

* ``all_reduce`` (stage 0): the bucket slice of the full gradient buffer is all-reduced in place.
* ``reduce_scatter`` (stage 1): the bucket slice is reduce-scattered in place: this rank's reduced
  chunk lands on its own chunk of the full gradient buffer (the rest is left stale, never read).
* ``reduce_scatter_partition`` (stage 2): there is no full gradient buffer. The hook copies the
  fresh ``param.grad`` into a constant-size staging buffer and frees it; the staged bucket is
  reduce-scattered and this rank's chunk ADDED to its gradient partition (accumulation).
Staging buffers come from a small pool (two in steady state): when none is free the oldest
in-flight bucket is completed to release one. Where the backend reduce-scatters through a
full-size receive buffer (gloo, :func:`hybrid.comm.needs_reduce_scratch`) each pool entry holds
one too, so no collective allocates: the buffers are the constant-size ones of ZeRO-R's CB.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid import comm
from hybrid.comm import Group
from hybrid.zero.partition import Bucket, FlatLayout

log = logging.getLogger(__name__)
MODES = ("all_reduce", "reduce_scatter", "reduce_scatter_partition")


@dataclass
class _Staging:
    """One pool entry: the staged bucket (stage 2), the reduced chunk (stage 2) and the receive
    buffer of gloo's reduce-scatter; each sized for the largest bucket, empty when not needed."""

    full: torch.Tensor
    chunk: torch.Tensor
    scratch: torch.Tensor | None


class GradReducer:
    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, group: Group, mode: str,
                 *, dtype: torch.dtype, device: torch.device, overlap: bool = True,
                 grad_flat: torch.Tensor | None = None,
                 grad_chunks: list[torch.Tensor] | None = None):
        if mode not in MODES:
            raise ValueError(f"reducer mode must be one of {MODES}, got {mode!r}")
        self.params, self.layout, self.group, self.mode = params, layout, group, mode
        self.dtype, self.device, self.overlap = dtype, device, overlap
        self.grad_flat = grad_flat          # stages 0/1: [layout.numel] full gradient buffer
        self.grad_chunks = grad_chunks      # stage 2: this rank's chunk of every bucket
        self.enabled = True                 # False on micro-batches that must not communicate
        self.final = True                   # this backward is the step's last micro-batch
        self.on_final: Callable[[int], None] | None = None   # bucket whose chunk is now final
        self._pool: list[_Staging] = []     # every staging entry ever made
        self._free: list[_Staging] = []
        self._staged: dict[int, _Staging] = {}
        self._inflight: deque = deque()     # (bucket, handle, staging entry or None)
        self._reset_counters()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(params)]

    # ---- hooks -----------------------------------------------------------------------------
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)
        return hook

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        slot = self.layout.slots[index]
        bucket = self.layout.buckets[slot.bucket]
        if self.mode == "reduce_scatter_partition":
            staged_in = self._staging_for(bucket).full
            begin = slot.start - bucket.start
            staged_in[begin:begin + slot.numel].copy_(param.grad.reshape(-1))
            param.grad = None       # the full-size gradient must not persist (Pos+g)
        self._missing[bucket.index] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._missing[self._next] == 0:
            self._launch(buckets[self._next])
            self._next += 1

    # ---- collectives -----------------------------------------------------------------------
    def _launch(self, bucket: Bucket) -> None:
        if self.mode == "all_reduce":
            view = self.grad_flat[bucket.start:bucket.start + bucket.numel]
            self._inflight.append((bucket, comm.all_reduce(view, self.group, async_op=True), None))
            return
        if self.mode == "reduce_scatter":   # in place: own chunk of the bucket's gradients
            entry = self._acquire(bucket)
            full = self.grad_flat[bucket.start:bucket.start + bucket.numel]
            lo, hi = bucket.chunk_range(self.group.rank)
            out = full[lo:hi]
        else:
            entry = self._staging_for(bucket)
            full, out = entry.full[:bucket.numel], entry.chunk[:bucket.chunk]
        handle = comm.reduce_scatter_into(out, full, self.group, async_op=True,
                                          scratch=entry.scratch)
        self._inflight.append((bucket, handle, entry))

    def _complete_oldest(self) -> None:
        bucket, handle, entry = self._inflight.popleft()
        handle.wait()
        if entry is not None:
            if self.mode == "reduce_scatter_partition":
                self.grad_chunks[bucket.index].add_(entry.chunk[:bucket.chunk])
                self._staged.pop(bucket.index, None)
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
            entry.full.zero_()      # padding and parameters without a gradient reduce as zeros
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
        staged = self.mode == "reduce_scatter_partition"
        entry = _Staging(new(numel if staged else 0), new(chunk if staged else 0),
                         new(numel) if comm.needs_reduce_scratch(self.group) else None)
        self._pool.append(entry)
        log.debug("gradient staging pool grew to %d entries (bucket %d)", len(self._pool),
                  bucket.index)
        return entry

    def buffers(self) -> list[torch.Tensor]:
        """Every staging buffer allocated so far (memory report category 'buffers')."""
        return [t for e in self._pool for t in (e.full, e.chunk, e.scratch) if t is not None]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
