"""The ZeRO-DP engines of stages 0, 1 and 2: plain data parallelism, Pos and Pos+g (ZeRO paper §5.1-5.2).

Every engine here keeps this TP rank's parameters in one flat buffer of the training dtype (see
:mod:`.partition` for the bucket/chunk layout); ``param.data`` are views into it. One engine class,
:class:`FlatEngine`, made of named parts; a stage is the combination of parts it declares, named
after what it partitions across the data-parallel group (the factory :mod:`.factory` picks one
from ``ZeroConfig.stage``):

=======================================  ==================  ===========================================
stage                                    optimizer state     gradients (:mod:`.reducer`)
=======================================  ==================  ===========================================
0 :class:`DataParallel`                  whole on each rank  :class:`~.reducer.FullGradients`, all-reduced
1 :class:`OptimizerStatePartitioning`    partitioned (Pos)   :class:`~.reducer.FullGradients`,
                                                             reduce-scattered in the last backward
2 :class:`GradientPartitioning`          partitioned         :class:`~.reducer.PartitionedGradients`
                                                             (Pos+g): staged, reduce-scattered every
                                                             micro-batch
=======================================  ==================  ===========================================

* Stage 0: full fp32 master and moments on every rank; gradients (a full buffer, as ``param.grad``
  views) all-reduced bucket by bucket.
* Stage 1 (Pos, §5.1): this DP rank owns chunk ``dp_rank`` of every bucket: its master (fp32, or
  the parameter chunk itself in plain fp32) and moments cover only those chunks. The full gradients
  are reduce-scattered per bucket at the end of the step's last backward; after the update each
  bucket's parameters are all-gathered. Volume: Ψ + Ψ, times (n-1)/n (§7.2.1).
* Stage 2 (Pos+g, §5.2): as Pos, but each gradient is moved into a constant-size staging bucket as
  backward produces it and the bucket reduce-scattered at once, every micro-batch; the rank keeps
  only its gradient partition.

With ``ZeroConfig.quantized_gradients`` (ZeRO++ qgZ) stages 1 and 2 reduce-scatter each bucket in
int8, inside each host first and then across hosts (:mod:`.quantized_collectives`).

Stage 3 (Pos+g+p, §5.3) is :class:`hybrid.zero.stage3.ParameterPartitioning`. The step itself
(norm, overflow, clipping, AdamW, skip) is :class:`hybrid.zero.engine.ZeroEngine`'s, written once;
the optimizer state (master and moments, on the device, host or NVMe) is an
:class:`hybrid.offload.backend.OptimizerStateBackend`. Gradients are summed by the reduction and
divided by the DP size inside the AdamW pass (``grad_divisor``).
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
from hybrid.zero.config import ZeroConfig
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.optimizer_state import build_optimizer_state
from hybrid.zero.partition import FlatLayout
from hybrid.zero.pieces import OwnedPiece
from hybrid.zero.quantized_collectives import gradient_reduce_scatter
from hybrid.zero.reducer import FullGradients, GradientReduction, PartitionedGradients
from hybrid.zero.report import MemoryReport, formula_bytes, measure_storages
from hybrid.zero.results import Fragment

log = logging.getLogger(__name__)


class FlatEngine(ZeroEngine):
    """The flat-buffer engine of stages 0-2; a stage subclass only declares what it partitions.

    Use: ``opt.backward(loss)`` per micro-batch, ``opt.step()``, ``opt.zero_grad()``. Parts:
    ``layout`` (the flat buffer's buckets and this rank's chunks), ``gradients`` (a
    :class:`~hybrid.zero.reducer.GradientReduction`: gradient storage and its reduction) and
    ``optimizer_state`` (master and moments, :mod:`.optimizer_state`).
    """

    partitions_optimizer_state: bool   # Pos: each DP rank keeps the master and moments of its chunks
    partitions_gradients: bool         # Pos+g: and only its chunk of the reduced gradients

    def __init__(self, model: nn.Module, state: ParallelState, config: ZeroConfig,
                 adamw: AdamWConfig, offload=None):
        super().__init__(state, config, adamw)
        self.names, self.params = _trainable(model)
        group = self.shard_group
        self.partitions, self.part_rank = ((group.size, group.rank)
                                           if self.partitions_optimizer_state else (1, 0))
        self.layout = FlatLayout([p.numel() for p in self.params], config.bucket_size,
                                 self.partitions, config.alignment_elements)
        self.flat_param = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        for p, slot in zip(self.params, self.layout.slots):
            if p.is_meta:
                raise ValueError("ZeRO stages 0-2 need materialised parameters; call "
                                 "model.init_weights(seed) before building the optimizer")
            self.flat_param[slot.start:slot.start + slot.numel].copy_(p.detach().reshape(-1))
        if self.partitions > 1:   # reduce-scatters write a whole bucket
            comm.reserve_transport(group, max(b.numel for b in self.layout.buckets) *
                                   self.flat_param.element_size())
        owned = list(self.layout.owned_pieces(self.part_rank))
        pieces = [OwnedPiece(self.names[p.index], b, p.chunk_offset, p.param_offset, p.numel,
                             uses_weight_decay(self.params[p.index]),
                             bool(getattr(self.params[p.index], "tensor_model_parallel", False)))
                  for b, p in owned]
        sizes = self.layout.chunk_sizes()
        grads = sum(sizes) if self.partitions_gradients else self.layout.numel
        item = self.flat_param.element_size()   # device model states an offload budget counts
        resident = item * (self.layout.numel + grads + 3 * max(sizes) * self.partitions)
        optimizer_state = build_optimizer_state(
            offload, self._own_chunks(), pieces, adamw, mixed_precision=config.mixed_precision,
            device=self.device, rank=state.rank, resident_bytes=resident,
            muon=self._muon_setup([(n, tuple(p.shape), getattr(p, "partition_dim", -1))
                                   for n, p in zip(self.names, self.params)],
                                  partitioned=self.partitions > 1))
        # the master starts from the ORIGINAL values (exact when the model was fp32)
        for b, piece in owned:
            src = self.params[piece.index].detach().reshape(-1)
            optimizer_state.write_master(b, piece.chunk_offset,
                                         src[piece.param_offset:piece.param_offset + piece.numel])
        for p, slot in zip(self.params, self.layout.slots):   # frees the original values
            p.data = self.flat_param[slot.start:slot.start + slot.numel].view(p.shape)
        # allocated once the original values are gone (the peak is one copy of the parameters);
        # each bucket's final reduced chunk goes to the optimizer state as it lands (an offloaded
        # one moves it to the host during backward)
        self.gradients = self._build_gradients(on_final=optimizer_state.accept_grad)
        self.gradients.zero()   # param.grad: views of the full buffer, or None (Pos+g)
        # weight-gradient products go straight into param.grad's buffer (stages 0, 1) or the
        # staging bucket (stage 2)
        grad_fusion.allow(self.params, self.gradients.fusion_targets(),
                          enabled=config.grad_accumulation_fusion)
        # DP ranks of stage 0 hold the same all-reduced gradients: count them once, summing over
        # TP and the pipeline stages of one replica (mp; the TP group itself without PP)
        norm_group = state.world if self.partitions_optimizer_state else state.mp
        self.optimizer_state_replicated = self.partitions == 1 and self.replicas is None
        self.parameters_replicated = True
        self._init_step(optimizer_state, pieces, norm_group)
        if state.rank == 0:
            log.info("%s", self.memory_report())

    def _build_gradients(self, on_final) -> GradientReduction:
        """The gradient part this stage declares."""
        options = dict(dtype=self.dtype, device=self.device,
                       overlap=self.config.overlap_communication, replicas=self.replicas,
                       on_final=on_final,
                       reduce_scatter=(gradient_reduce_scatter(self.state, quantized=True)
                                       if self.config.quantized_gradients else None))   # qgZ
        if self.partitions_gradients:
            return PartitionedGradients(self.params, self.layout, self.shard_group, **options)
        return FullGradients(self.params, self.layout, self.shard_group,
                             partitioned=self.partitions_optimizer_state, **options)

    def _own_chunks(self) -> list[torch.Tensor]:
        """This rank's chunk of every bucket of the flat parameter buffer."""
        return [b.chunk_of(self.flat_param, self.part_rank) for b in self.layout.buckets]

    # ---- training-loop API -----------------------------------------------------------------
    def backward(self, loss, grad_tensors=None) -> None:
        """Backward of one micro-batch (the caller divides the loss by the number of them).

        A pipeline stage that does not end in the loss passes its outputs and their received
        gradients (``torch.autograd.backward``'s ``tensors`` and ``grad_tensors``), already
        multiplied by the loss scale downstream."""
        first = self._micro_batches == 0
        last = (self._micro_batches + 1) % self.config.gradient_accumulation_steps == 0
        self.gradients.begin_backward(first=first, last=last)
        self._micro_batches += 1
        if grad_tensors is not None:
            torch.autograd.backward(loss, grad_tensors)
            return
        scale = self.scaler.scale_tensor()   # a device tensor (fp16) or 1.0: no read
        (loss if isinstance(scale, float) else loss * scale).backward()

    def drop_gradients(self) -> None:
        """Discard this step's gradients without an update (a skipped step): land the collectives
        still in flight, so none writes into the buffers after they are zeroed, then zero them."""
        self.gradients.finish()
        self.zero_grad()

    # ---- storage methods of the shared step (ZeroEngine.step) -------------------------------
    def _land_gradients(self) -> None:
        self.gradients.land()

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks (summed over DP, still loss-scaled)."""
        return [self.gradients.reduced(b) for b in range(len(self.layout.buckets))]

    def _param_chunks(self):
        return contextlib.nullcontext(self._own_chunks())

    def _gather_params(self) -> None:
        """All-gather every bucket from its owners (all launched, then waited: consecutive
        buckets overlap); nothing to gather when every rank updated everything."""
        if self.partitions == 1:
            return
        inflight = []
        for bucket, own in zip(self.layout.buckets, self._own_chunks()):
            full = self.flat_param[bucket.start:bucket.start + bucket.numel]   # own is its slot
            inflight.append(comm.all_gather_into(full, own, self.shard_group, async_op=True))
        for handle in inflight:
            handle.wait()

    def _zero_grads(self) -> None:
        self.gradients.zero()

    def _parameter_fragments(self) -> list[Fragment]:
        return [Fragment(name, "model", 0, p.data.view(-1)) for name, p in zip(self.names, self.params)]

    # ---- reports ---------------------------------------------------------------------------
    @property
    def num_local_params(self) -> int:
        """Ψ of this TP rank: parameters it trains, without padding."""
        return self.layout.num_params

    def memory_report(self) -> MemoryReport:
        resident = self.optimizer_state.resident()   # the device's, or what offload keeps
        categories = {"param16": [self.flat_param] + [p.data for p in self.params],
                      "grad16": [self.gradients.storage],
                      "master32": resident["master32"],
                      "adam_moments": resident["adam_moments"],
                      "buffers": (self.gradients.buffers() + comm.transport_buffers(self.shard_group)
                                  + resident["buffers"])}
        itemsize = self.flat_param.element_size()
        formula = formula_bytes(self.num_local_params, self.stage, self.shard_group.size,
                                param_bytes=itemsize, mixed_precision=self.config.mixed_precision,
                                moment_bytes=self.adamw.moment_bytes_per_param)
        return MemoryReport(self.stage, self.shard_group.size, self.state.tp_size,
                            self.config.precision, self.num_local_params,
                            measure_storages(categories), formula)


class DataParallel(FlatEngine):
    """Stage 0, plain data parallelism: nothing partitioned. Every rank keeps the full gradient
    (all-reduced bucket by bucket), the full fp32 master and both Adam moments, and updates all
    parameters itself; no all-gather follows the update."""

    stage = 0
    partitions_optimizer_state = False
    partitions_gradients = False


class OptimizerStatePartitioning(FlatEngine):
    """Pos, optimizer state partitioning (ZeRO §5.1, stage 1): rank ``dp_rank`` owns chunk
    ``dp_rank`` of every bucket and keeps the fp32 master and Adam moments of that chunk only
    (12Ψ/Nd instead of 12Ψ). Gradients stay a full buffer, accumulated locally over the
    micro-batches and reduce-scattered bucket by bucket in the last backward; after the update
    every bucket's parameters are all-gathered from their owners."""

    stage = 1
    partitions_optimizer_state = True
    partitions_gradients = False


class GradientPartitioning(FlatEngine):
    """Pos+g, gradient partitioning (ZeRO §5.2, stage 2): Pos, and the rank keeps only the
    gradient chunks it owns (2Ψ/Nd instead of 2Ψ). Each gradient is moved into a constant-size
    staging bucket as backward produces it and the full-size ``param.grad`` freed; a complete
    bucket is reduce-scattered at once, on every micro-batch, and this rank's chunk added to its
    gradient partition."""

    stage = 2
    partitions_optimizer_state = True
    partitions_gradients = True


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
