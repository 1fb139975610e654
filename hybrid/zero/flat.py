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

With expert-parallel parameters (issue 32) the engine keeps one flat buffer, layout and gradient
reduction per parameter class (:class:`~hybrid.zero.flat_class.FlatClass`: dense over DP, experts
over the expert-DP group); the optimizer state sees their chunks back to back. Without experts
there is one class and everything above holds unchanged.

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
from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import grad_fusion
from hybrid.zero.config import ZeroConfig
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.flat_class import ChunkOffset, FlatClass
from hybrid.zero.host_groups import place_classes
from hybrid.zero.optimizer_state import build_optimizer_state
from hybrid.zero.param_classes import expert_dp_group, is_expert, split_classes
from hybrid.zero.quantized_collectives import gradient_reduce_scatter
from hybrid.zero.reducer import FullGradients, GradientReduction, PartitionedGradients
from hybrid.zero.report import MemoryReport, class_formula_bytes, measure_storages
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
                 adamw: AdamWConfig, offload=None, expert_dp: comm.Group | None = None):
        super().__init__(state, config, adamw)
        self.names, self.params = _trainable(model)
        # one flat buffer per parameter class (dense over DP, experts over expert-DP; issue 32)
        classes = split_classes(self.params, self.shard_group, expert_dp_group(state, expert_dp),
                                state.dp_cp.size)   # dense replicas: DP x CP
        classes = place_classes(state, config, classes, self.replicas)   # hybrid: by host
        self.classes: list[FlatClass] = []
        for k, pclass in enumerate(classes):
            base = sum(len(c.layout.buckets) for c in self.classes)
            self.classes.append(FlatClass(k, pclass, self.names, self.params,
                                          bucket_size=config.bucket_size,
                                          alignment=config.alignment_elements,
                                          partitioned=self.partitions_optimizer_state,
                                          dtype=self.dtype, device=self.device, chunk_base=base))
        first = self.classes[0]   # the dense class (the only one without experts)
        self.layout, self.flat_param = first.layout, first.flat_param
        self.partitions, self.part_rank = first.partitions, first.part_rank
        pieces = [piece for c in self.classes for piece in c.pieces()]
        sizes = [size for c in self.classes for size in c.layout.chunk_sizes()]
        numel = sum(c.layout.numel for c in self.classes)
        grads = sum(sizes) if self.partitions_gradients else numel
        item = self.flat_param.element_size()   # device model states an offload budget counts
        staging = max(max(c.layout.chunk_sizes()) * c.partitions for c in self.classes)
        resident = item * (numel + grads + 3 * staging)
        optimizer_state = build_optimizer_state(
            offload, self._own_chunks(), pieces, adamw, mixed_precision=config.mixed_precision,
            device=self.device, rank=state.rank, resident_bytes=resident,
            muon=self._muon_setup([(c.names[i], tuple(p.shape), getattr(p, "partition_dim", -1),
                                    is_expert(p), c.index)
                                   for c in self.classes for i, p in enumerate(c.params)],
                                  [c.group if c.partitions > 1 else None for c in self.classes]))
        for c in self.classes:
            c.write_masters(optimizer_state.write_master)
        for c in self.classes:   # frees the original values
            c.bind_params()
        # allocated once the original values are gone (the peak is one copy of the parameters);
        # each bucket's final reduced chunk goes to the optimizer state as it lands (an offloaded
        # one moves it to the host during backward)
        for c in self.classes:
            c.gradients = self._build_gradients(
                c, on_final=(optimizer_state.accept_grad if c.chunk_base == 0
                             else ChunkOffset(optimizer_state.accept_grad, c.chunk_base)))
            c.gradients.zero()   # param.grad: views of the full buffer, or None (Pos+g)
            # weight-gradient products go straight into param.grad's buffer (stages 0, 1) or the
            # staging bucket (stage 2)
            grad_fusion.allow(c.params, c.gradients.fusion_targets(),
                              enabled=config.grad_accumulation_fusion)
        self.gradients = first.gradients
        # DP ranks of stage 0 hold the same all-reduced gradients: count them once, summing over
        # TP and the pipeline stages of one replica (mp; the TP group itself without PP); with
        # several classes, over the world, each class counted on its group's rank 0
        norm_group = (state.world if self.partitions_optimizer_state or len(self.classes) > 1
                      else state.mp)
        self.optimizer_state_replicated = self.partitions == 1 and self.replicas is None
        self.parameters_replicated = True
        self.expert_replicas = next((c.replicas for c in self.classes if c.name == "expert"),
                                    self.replicas)
        # a class's gradients count once: on one rank of its group when not partitioned, on the
        # first host's copy under hybrid sharding
        self._init_step(optimizer_state, pieces, norm_group,
                        counted=[(c.partitions > 1 or c.group.rank == 0) and
                                 (c.replicas is None or c.replicas.rank == 0)
                                 for c in self.classes])
        if state.rank == 0:
            log.info("%s", self.memory_report())

    def _build_gradients(self, pclass: FlatClass, on_final) -> GradientReduction:
        """The gradient part this stage declares, for one parameter class."""
        options = dict(dtype=self.dtype, device=self.device,
                       overlap=self.config.overlap_communication, replicas=pclass.replicas,
                       on_final=on_final,
                       reduce_scatter=(gradient_reduce_scatter(self.state, quantized=True,
                                                               expert=pclass.name == "expert")
                                       if self.config.quantized_gradients else None))   # qgZ
        if self.partitions_gradients:
            return PartitionedGradients(pclass.params, pclass.layout, pclass.group, **options)
        return FullGradients(pclass.params, pclass.layout, pclass.group,
                             partitioned=self.partitions_optimizer_state, **options)

    def _own_chunks(self) -> list[torch.Tensor]:
        """This rank's chunk of every bucket of every class's flat parameter buffer."""
        return [chunk for c in self.classes for chunk in c.own_chunks()]

    # ---- training-loop API -----------------------------------------------------------------
    def backward(self, loss, grad_tensors=None) -> None:
        """Backward of one micro-batch (the caller divides the loss by the number of them).

        A pipeline stage that does not end in the loss passes its outputs and their received
        gradients (``torch.autograd.backward``'s ``tensors`` and ``grad_tensors``), already
        multiplied by the loss scale downstream."""
        first = self._micro_batches == 0
        last = (self._micro_batches + 1) % self.config.gradient_accumulation_steps == 0
        for c in self.classes:
            c.gradients.begin_backward(first=first, last=last)
        self._micro_batches += 1
        if grad_tensors is not None:
            torch.autograd.backward(loss, grad_tensors)
            return
        scale = self.scaler.scale_tensor()   # a device tensor (fp16) or 1.0: no read
        (loss if isinstance(scale, float) else loss * scale).backward()

    def drop_gradients(self) -> None:
        """Discard this step's gradients without an update (a skipped step): land the collectives
        still in flight, so none writes into the buffers after they are zeroed, then zero them."""
        for c in self.classes:
            c.gradients.finish()
        self.zero_grad()

    # ---- storage methods of the shared step (ZeroEngine.step) -------------------------------
    def _land_gradients(self) -> None:
        for c in self.classes:
            c.gradients.land()

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks (summed over DP, still loss-scaled)."""
        return [c.gradients.reduced(b) for c in self.classes
                for b in range(len(c.layout.buckets))]

    def _param_chunks(self):
        return contextlib.nullcontext(self._own_chunks())

    def _gather_params(self) -> None:
        """All-gather every class's buckets from their owners over its group."""
        for c in self.classes:
            c.gather()

    def _zero_grads(self) -> None:
        for c in self.classes:
            c.gradients.zero()

    def _parameter_fragments(self) -> list[Fragment]:
        return [Fragment(name, "model", 0, p.data.view(-1)) for name, p in zip(self.names, self.params)]

    # ---- reports ---------------------------------------------------------------------------
    @property
    def num_local_params(self) -> int:
        """Ψ of this TP rank: parameters it trains, without padding (every class)."""
        return sum(c.layout.num_params for c in self.classes)

    def memory_report(self) -> MemoryReport:
        resident = self.optimizer_state.resident()   # the device's, or what offload keeps
        categories = {"param16": [c.flat_param for c in self.classes] + [p.data for p in self.params],
                      "grad16": [c.gradients.storage for c in self.classes],
                      "master32": resident["master32"],
                      "adam_moments": resident["adam_moments"],
                      "buffers": ([t for c in self.classes for t in c.gradients.buffers()]
                                  + [t for c in self.classes for t in comm.transport_buffers(c.group)]
                                  + resident["buffers"])}
        itemsize = self.flat_param.element_size()
        shares = {c.name: (c.layout.num_params, c.group.size) for c in self.classes}
        formula = class_formula_bytes(shares.values(), self.stage, param_bytes=itemsize,
                                      mixed_precision=self.config.mixed_precision,
                                      moment_bytes=self.adamw.moment_bytes_per_param)
        return MemoryReport(self.stage, self.shard_group.size, self.state.tp_size,
                            self.config.precision, self.num_local_params,
                            measure_storages(categories), formula,
                            classes=shares if len(shares) > 1 else None)


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
