"""The ZeRO-DP engines of stages 0, 1 and 2: plain data parallelism, Pos and Pos+g (ZeRO paper §5.1-5.2).

Every engine here keeps this TP rank's parameters in one flat buffer of the training dtype (see
:mod:`.partition` for the bucket/chunk layout); ``param.data`` are views into it. One class per
stage, each named after what it partitions across the data-parallel group (the factory
:mod:`.factory` picks one from ``ZeroConfig.stage``):

* :class:`DataParallel` (stage 0): full fp32 master and moments on every rank; gradients (a full
  buffer, as ``param.grad`` views) all-reduced bucket by bucket.
* :class:`OptimizerStatePartitioning` (stage 1, Pos, §5.1): this DP rank owns chunk ``dp_rank``
  of every bucket: its master (fp32, or the parameter chunk itself in plain fp32) and moments
  cover only those chunks. The full gradients are reduce-scattered per bucket at the end of the
  step's last backward; after the update each bucket's parameters are all-gathered. Volume:
  Ψ + Ψ, times (n-1)/n (§7.2.1).
* :class:`GradientPartitioning` (stage 2, Pos+g, §5.2): as Pos, but each gradient is moved into a
  constant-size staging bucket as backward produces it and the bucket reduce-scattered at once,
  every micro-batch; the rank keeps only its gradient partition.

With ``ZeroConfig.quantized_gradients`` (ZeRO++ qgZ) stages 1 and 2 reduce-scatter each bucket in
int8, inside each host first and then across hosts (:mod:`.quantized_collectives`).

Stage 3 (Pos+g+p, §5.3) is :class:`hybrid.zero.stage3.ParameterPartitioning`. The step itself
(norm, overflow, clipping, AdamW, skip) is :class:`hybrid.zero.engine.ZeroEngine`'s, written once;
this module provides where the gradients and parameters live. Gradients are summed by the
reduction and divided by the DP size inside the AdamW pass (``grad_divisor``).

Optimizer offload (``offload=OffloadConfig(mode="cpu"|"nvme")``, :mod:`hybrid.offload`): the fp32
master and moments of the owned chunks live in a backend object on the host (or NVMe) instead;
the backend runs AdamW there and writes the updated values into this rank's parameter chunks.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from hybrid import comm
from hybrid.adamw_config import AdamWConfig, uses_weight_decay
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import grad_fusion
from hybrid.zero.adamw import FlatAdamWState
from hybrid.zero.config import ZeroConfig
from hybrid.zero.engine import OwnedPiece, ZeroEngine
from hybrid.zero.host_groups import partition_groups
from hybrid.zero.loss_scaler import build_loss_scaler
from hybrid.zero.partition import FlatLayout
from hybrid.zero.quantized_collectives import gradient_reduce_scatter
from hybrid.zero.reducer import (BucketAllReduce, BucketReduceScatter, GradReducer,
                                 PartitionReduceScatter)
from hybrid.zero.report import MemoryReport, formula_bytes, measure_storages
from hybrid.zero.results import Fragment

log = logging.getLogger(__name__)


class ZeroOptimizer(ZeroEngine):
    """The flat-buffer engine the stages 0-2 share; a subclass says what it partitions.

    Use: ``opt.backward(loss)`` per micro-batch, ``opt.step()``, ``opt.zero_grad()``. Gradients
    here are a full buffer (``param.grad`` views into it), :class:`GradientPartitioning` replaces
    it with this rank's partition. Subclasses set ``stage`` (the paper's number, for reports) and
    ``reducer_class``, and define :meth:`_partitioning` and :meth:`_norm_group`.
    """

    reducer_class: type[GradReducer]

    def __init__(self, model: nn.Module, state: ParallelState, config: ZeroConfig,
                 adamw: AdamWConfig, offload=None):
        if config.stage != self.stage:
            raise ValueError(f"{type(self).__name__} is ZeRO stage {self.stage}, the config asks for "
                             f"stage {config.stage}; build engines with "
                             f"hybrid.zero.build_zero_optimizer")
        self.state, self.config, self.adamw = state, config, adamw
        self.lr = adamw.lr
        self.names, self.params = _trainable(model)
        self.dtype, self.device = config.param_dtype, state.device
        self.shard_group, self.replicas = partition_groups(state, config)   # DP, or by host
        self.partitions, self.part_rank = self._partitioning()
        self.layout = FlatLayout([p.numel() for p in self.params], config.bucket_size,
                                 self.partitions, config.alignment_elements)
        self.offload = offload if offload is not None and offload.enabled else None
        self._build_buffers()
        if self.offload is None:   # otherwise _build_buffers made the offload backend
            self.adam = FlatAdamWState(self.layout.chunk_sizes(), self.device)
        self.scaler = build_loss_scaler(config)
        if self.partitions > 1:   # reduce-scatters write a whole bucket
            comm.reserve_transport(self.shard_group, max(b.numel for b in self.layout.buckets) *
                                   self.flat_param.element_size())
        quantized = (gradient_reduce_scatter(state, quantized=True)    # qgZ, stages 1 and 2
                     if config.quantized_gradients else None)
        self.reducer = self.reducer_class(self.params, self.layout, self.shard_group,
                                          dtype=self.dtype, device=self.device,
                                          overlap=config.overlap_communication,
                                          grad_flat=self.grad_flat, grad_chunks=self.grad_chunks,
                                          replicas=self.replicas, reduce_scatter=quantized)
        if self.offload is not None:   # gradients stream to the host as buckets complete
            self.reducer.on_final = self._stream_grad
        # weight-gradient products go straight into param.grad's buffer (stages 0, 1) or the
        # staging bucket (stage 2)
        grad_fusion.allow(self.params, None if self.grad_flat is not None
                          else self.reducer.fusion_targets(),
                          enabled=self.config.grad_accumulation_fusion)
        self.pieces = [OwnedPiece(self.names[p.index], b, p.chunk_offset, p.param_offset, p.numel,
                                  uses_weight_decay(self.params[p.index]),
                                  bool(getattr(self.params[p.index], "tensor_model_parallel", False)))
                       for b, p in self.layout.owned_pieces(self.part_rank)]
        self.norm_group = self._norm_group()
        self.norm_replicas = self.replicas.size if self.replicas is not None else 1
        self.grad_divisor = float(state.dp_size)
        self._init_engine()
        if state.rank == 0:
            log.info("%s", self.memory_report())

    # ---- what the stage partitions ----------------------------------------------------------
    def _partitioning(self) -> tuple[int, int]:
        """(number of partitions of every bucket, the one this rank owns)."""
        raise NotImplementedError

    def _norm_group(self):
        """The group whose ranks' owned gradients together make the whole model's gradient."""
        raise NotImplementedError

    # ---- construction ----------------------------------------------------------------------
    def _chunk_of(self, flat: torch.Tensor, bucket) -> torch.Tensor:
        lo, hi = bucket.chunk_range(self.part_rank)
        return flat[bucket.start + lo:bucket.start + hi]

    def _build_buffers(self) -> None:
        """Flat 16-bit params, master chunks, then the gradient storage (:meth:`_build_grads`)."""
        layout = self.layout
        mixed = self.config.mixed_precision and self.offload is None   # offload: backend's master
        self.flat_param = torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
        sizes = layout.chunk_sizes()
        self.master_flat = (torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
                            if mixed else None)
        self.masters = (list(torch.split(self.master_flat, sizes)) if mixed
                        else [self._chunk_of(self.flat_param, b) for b in layout.buckets])
        for p, slot in zip(self.params, layout.slots):
            if p.is_meta:
                raise ValueError("ZeRO stages 0-2 need materialised parameters; call "
                                 "model.init_weights(seed) before building the optimizer")
            self.flat_param[slot.start:slot.start + slot.numel].copy_(p.detach().reshape(-1))
        if self.offload is not None:
            self._build_offload_state()
        elif mixed:  # the master starts from the ORIGINAL values (exact when the model was fp32)
            for b, piece in layout.owned_pieces(self.part_rank):
                src = self.params[piece.index].detach().reshape(-1)
                self.masters[b][piece.chunk_offset:piece.chunk_offset + piece.numel].copy_(
                    src[piece.param_offset:piece.param_offset + piece.numel])
        for p, slot in zip(self.params, layout.slots):
            p.data = self.flat_param[slot.start:slot.start + slot.numel].view(p.shape)
        self.grad_flat, self.grad_chunks, self.grad_part, self._grad_views = None, None, None, []
        self._build_grads()
        self._attach_grads()

    # ---- gradient storage: a full buffer (GradientPartitioning overrides) -------------------
    def _build_grads(self) -> None:
        """The full gradient buffer; ``param.grad`` are views, so autograd accumulates into it."""
        self.grad_flat = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        self._grad_views = [self.grad_flat[s.start:s.start + s.numel].view(p.shape)
                            for p, s in zip(self.params, self.layout.slots)]

    def _grad_numel(self) -> int:
        """Elements of gradient storage this rank holds."""
        return self.layout.numel

    def _grad_buffer(self) -> torch.Tensor:
        return self.grad_flat

    def _reduced_grad(self, bucket: int) -> torch.Tensor:
        """This rank's reduced chunk of bucket ``bucket``, in the gradient dtype."""
        return self._chunk_of(self.grad_flat, self.layout.buckets[bucket])

    def _attach_grads(self) -> None:
        """``param.grad`` = views of the full buffer."""
        for p, view in zip(self.params, self._grad_views):
            p.grad = view

    def _communicates(self, last: bool) -> bool:
        """Whether this micro-batch's backward reduces: full gradients accumulate locally and are
        reduced once, in the step's last backward."""
        return last

    def _before_backward(self) -> None:
        """Before a micro-batch's backward (full gradients: nothing is in flight between them)."""

    def _build_offload_state(self) -> None:
        """The offload backend (hybrid.offload) holding master + moments of the owned chunks; its
        master starts from the ORIGINAL parameter values (call before params become views)."""
        from hybrid.offload.budget import build_offload_state
        sizes, item = self.layout.chunk_sizes(), self.flat_param.element_size()
        decay = [[] for _ in sizes]
        for b, piece in self.layout.owned_pieces(self.part_rank):
            if uses_weight_decay(self.params[piece.index]):
                decay[b].append((piece.chunk_offset, piece.numel))
        grads = self._grad_numel()
        resident = item * (self.layout.numel + grads + 3 * max(self.layout.chunk_sizes()) *
                           self.partitions)
        self.adam = build_offload_state(self.offload, sizes, decay, self.adamw, device=self.device,
                                        param_dtype=self.dtype, rank=self.state.rank,
                                        resident_bytes=resident)
        for b, piece in self.layout.owned_pieces(self.part_rank):
            src = self.params[piece.index].detach().reshape(-1)
            self.adam.write_master(b, piece.chunk_offset,
                                   src[piece.param_offset:piece.param_offset + piece.numel])

    def _param_chunks(self):
        chunks = [self._chunk_of(self.flat_param, b) for b in self.layout.buckets]
        return contextlib.nullcontext(chunks)

    # ---- training-loop API -----------------------------------------------------------------
    def backward(self, loss, grad_tensors=None) -> None:
        """Backward of one micro-batch (the caller divides the loss by the number of them).

        A pipeline stage that does not end in the loss passes its outputs and their received
        gradients (``torch.autograd.backward``'s ``tensors`` and ``grad_tensors``), already
        multiplied by the loss scale downstream."""
        self._before_backward()
        if any(p.grad is not v for p, v in zip(self.params, self._grad_views)):
            raise RuntimeError("param.grad no longer points into the ZeRO gradient buffer (was "
                               "model.zero_grad() called?); call opt.zero_grad() instead")
        self._micro_batches += 1
        last = self._micro_batches % self.config.gradient_accumulation_steps == 0
        self.reducer.enabled = self._communicates(last)
        self.reducer.final = last
        if grad_tensors is not None:
            torch.autograd.backward(loss, grad_tensors)
            return
        scale = self.scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()

    def drop_gradients(self) -> None:
        """Discard this step's gradients without an update (a skipped step): land the collectives
        still in flight, so none writes into the buffers after they are zeroed, then zero them."""
        self.reducer.finish()
        self.zero_grad()

    def _zero_grads(self) -> None:
        """Zero the gradient storage; re-attach grad views."""
        self._grad_buffer().zero_()
        grad_fusion.zeroed(self.params)
        self._attach_grads()

    def _stream_grad(self, bucket: int) -> None:
        """Offload: bucket's reduced chunk is final for this step; the backend takes it now."""
        self.adam.accept_grad(bucket, self._reduced_grad(bucket))

    # ---- the engine's hooks (the step is ZeroEngine.step) -----------------------------------
    def _land_gradients(self) -> None:
        self.reducer.enabled = True
        self.reducer.finish()

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks (summed over DP, still loss-scaled)."""
        return [self._reduced_grad(b) for b in range(len(self.layout.buckets))]

    def _publish(self, rounded: bool = False) -> None:
        """Write the updated master into this rank's 16-bit chunks (unless ``rounded``) and
        all-gather every bucket (all launched, then waited: consecutive buckets overlap)."""
        inflight = []
        for bucket, master in zip(self.layout.buckets, self.masters):
            own = self._chunk_of(self.flat_param, bucket)
            if self.config.mixed_precision and self.offload is None and not rounded:
                own.copy_(master)
            if self.partitions > 1:   # in place: own is this rank's slot of the bucket
                full = self.flat_param[bucket.start:bucket.start + bucket.numel]
                inflight.append(comm.all_gather_into(full, own, self.shard_group, async_op=True))
        for handle in inflight:
            handle.wait()

    # ---- reports and checkpoint support ----------------------------------------------------
    @property
    def num_local_params(self) -> int:
        """Ψ of this TP rank: parameters it trains, without padding."""
        return self.layout.num_params

    def memory_report(self) -> MemoryReport:
        categories = {"param16": [self.flat_param] + [p.data for p in self.params],
                      "grad16": [self._grad_buffer()],
                      "master32": [self.master_flat] if self.master_flat is not None else self.masters,
                      "adam_moments": self.adam.tensors(),
                      "buffers": (self.reducer.buffers() + comm.transport_buffers(self.shard_group)
                                  + self._kernel_buffers())}
        if self.offload is not None:   # what the backend keeps resident (nothing on NVMe)
            host = self.adam.resident()
            categories.update(master32=host["master32"], adam_moments=host["adam_moments"],
                              buffers=categories["buffers"] + host["buffers"])
        itemsize = self.flat_param.element_size()
        formula = formula_bytes(self.num_local_params, self.stage, self.shard_group.size,
                                param_bytes=itemsize, mixed_precision=self.config.mixed_precision)
        return MemoryReport(self.stage, self.shard_group.size, self.state.tp_size,
                            self.config.precision, self.num_local_params,
                            measure_storages(categories), formula)

    @property
    def optimizer_state_replicated(self) -> bool:
        """Stage 0 keeps the whole optimizer state on every DP rank (save it from DP rank 0 only)."""
        return self.partitions == 1 and self.replicas is None

    @property
    def state_replica(self) -> int:
        """Hybrid sharding: which host's copy of the partitions this rank holds (0 writes them)."""
        return self.replicas.rank if self.replicas is not None else 0

    def _parameter_fragments(self) -> list[Fragment]:
        return [Fragment(name, "model", 0, p.data.view(-1)) for name, p in zip(self.names, self.params)]


class DataParallel(ZeroOptimizer):
    """Stage 0, plain data parallelism: nothing partitioned. Every rank keeps the full gradient
    (all-reduced bucket by bucket), the full fp32 master and both Adam moments, and updates all
    parameters itself; no all-gather follows the update."""

    stage = 0
    reducer_class = BucketAllReduce

    def _partitioning(self) -> tuple[int, int]:
        return 1, 0

    def _norm_group(self):
        # DP ranks hold the same all-reduced gradients: count them once, summing over TP and the
        # pipeline stages of one replica (mp; the TP group itself without PP)
        return self.state.mp


class OptimizerStatePartitioning(ZeroOptimizer):
    """Pos, optimizer state partitioning (ZeRO §5.1, stage 1): rank ``dp_rank`` owns chunk
    ``dp_rank`` of every bucket and keeps the fp32 master and Adam moments of that chunk only
    (12Ψ/Nd instead of 12Ψ). Gradients stay a full buffer, accumulated locally over the
    micro-batches and reduce-scattered bucket by bucket in the last backward; after the update
    every bucket's parameters are all-gathered from their owners."""

    stage = 1
    reducer_class = BucketReduceScatter

    def _partitioning(self) -> tuple[int, int]:
        return self.shard_group.size, self.shard_group.rank

    def _norm_group(self):
        return self.state.world   # disjoint partitions: the sum over every rank is the model's


class GradientPartitioning(OptimizerStatePartitioning):
    """Pos+g, gradient partitioning (ZeRO §5.2, stage 2): Pos, and the rank keeps only the
    gradient chunks it owns (2Ψ/Nd instead of 2Ψ). Each gradient is moved into a constant-size
    staging bucket as backward produces it and the full-size ``param.grad`` freed; a complete
    bucket is reduce-scattered at once, on every micro-batch, and this rank's chunk added to its
    gradient partition."""

    stage = 2
    reducer_class = PartitionReduceScatter

    def _build_grads(self) -> None:
        sizes = self.layout.chunk_sizes()
        self.grad_part = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
        self.grad_chunks = list(torch.split(self.grad_part, sizes))

    def _grad_numel(self) -> int:
        return sum(self.layout.chunk_sizes())

    def _grad_buffer(self) -> torch.Tensor:
        return self.grad_part

    def _reduced_grad(self, bucket: int) -> torch.Tensor:
        return self.grad_chunks[bucket]

    def _attach_grads(self) -> None:
        """No full-size gradients: ``param.grad`` exists only until the hook stages it."""
        for p in self.params:
            p.grad = None

    def _communicates(self, last: bool) -> bool:
        return True   # no full gradient to accumulate into: reduce every micro-batch

    def _before_backward(self) -> None:
        if self._micro_batches:
            self.reducer.finish()   # previous micro-batch's reduce-scatters land before new ones


def _trainable(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    """Unique trainable parameters in registration order (tied weights once) with their names."""
    names, params, seen = [], [], set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            names.append(name)
            params.append(p)
    if not params:
        raise ValueError("the model has no trainable parameters to optimize")
    return names, params
