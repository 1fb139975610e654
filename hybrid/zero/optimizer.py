"""The ZeRO-DP engine for stages 0, 1 and 2 (ZeRO paper §5.1 Pos, §5.2 Pos+g; stage 0 = plain DP).

Every stage keeps this TP rank's parameters in one flat buffer of the training dtype (see
:mod:`.partition` for the bucket/chunk layout); ``param.data`` are views into it.

* stage 0: full fp32 master and moments on every rank; gradients all-reduced bucket by bucket.
* stage 1: this DP rank owns chunk ``dp_rank`` of every bucket: its master (fp32, or the parameter
  chunk itself in plain fp32) and moments cover only those chunks. Gradients (a full buffer, as
  ``param.grad`` views) are reduce-scattered per bucket; after the update each bucket's parameters
  are all-gathered. Volume: Ψ + Ψ, times (n-1)/n (§7.2.1).
* stage 2: as stage 1, but each gradient is moved into a constant-size staging bucket as backward
  produces it and reduce-scattered at once; the rank keeps only its gradient partition.

The step itself (norm, overflow, clipping, AdamW, skip) is :class:`hybrid.zero.engine.ZeroEngine`'s;
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
from hybrid.parallel_state import ParallelState
from hybrid.zero.adamw import FlatAdamWState
from hybrid.zero.config import AdamWConfig, ZeroConfig, uses_weight_decay
from hybrid.zero.engine import OwnedPiece, ZeroEngine
from hybrid.zero.loss_scaler import build_loss_scaler
from hybrid.zero.partition import FlatLayout
from hybrid.zero.reducer import GradReducer
from hybrid.zero.report import MemoryReport, formula_bytes, measure_storages

log = logging.getLogger(__name__)
REDUCER_MODES = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter_partition"}


class ZeroOptimizer(ZeroEngine):
    """Stages 0-2. Use: ``opt.backward(loss)`` per micro-batch, ``opt.step()``, ``opt.zero_grad()``."""

    def __init__(self, model: nn.Module, state: ParallelState, config: ZeroConfig,
                 adamw: AdamWConfig, offload=None):
        if config.stage not in REDUCER_MODES:
            raise ValueError(f"ZeroOptimizer implements stages 0-2, got {config.stage}; "
                             f"build stage 3 with build_zero_optimizer")
        self.state, self.config, self.adamw = state, config, adamw
        self.lr = adamw.lr
        self.names, self.params = _trainable(model)
        self.dtype, self.device = config.param_dtype, state.device
        self.partitions = state.dp_size if config.stage >= 1 else 1
        self.part_rank = state.dp_rank if config.stage >= 1 else 0
        self.layout = FlatLayout([p.numel() for p in self.params], config.bucket_size,
                                 self.partitions, config.alignment_elements)
        self.offload = offload if offload is not None and offload.enabled else None
        self._build_buffers()
        if self.offload is None:   # otherwise _build_buffers made the offload backend
            self.adam = FlatAdamWState(self.layout.chunk_sizes(), self.device)
        self.scaler = build_loss_scaler(config)
        if self.partitions > 1:   # reduce-scatters write a whole bucket
            comm.reserve_transport(state.dp, max(b.numel for b in self.layout.buckets) *
                                   self.flat_param.element_size())
        self.reducer = GradReducer(self.params, self.layout, state.dp, REDUCER_MODES[config.stage],
                                   dtype=self.dtype, device=self.device,
                                   overlap=config.overlap_communication, grad_flat=self.grad_flat,
                                   grad_chunks=self.grad_chunks)
        if self.offload is not None:   # gradients stream to the host as buckets complete
            self.reducer.on_final = self._stream_grad
        self.pieces = [OwnedPiece(self.names[p.index], b, p.chunk_offset, p.param_offset, p.numel,
                                  uses_weight_decay(self.params[p.index]),
                                  bool(getattr(self.params[p.index], "tensor_model_parallel", False)))
                       for b, p in self.layout.owned_pieces(self.part_rank)]
        # stages >= 1: disjoint partitions, summed over the world; stage 0: DP ranks hold the same
        self.norm_group = state.world if config.stage >= 1 else state.tp
        self.grad_divisor = float(state.dp_size)
        self._init_engine()
        if state.rank == 0:
            log.info("%s", self.memory_report())

    # ---- construction ----------------------------------------------------------------------
    def _chunk_of(self, flat: torch.Tensor, bucket) -> torch.Tensor:
        lo, hi = bucket.chunk_range(self.part_rank)
        return flat[bucket.start + lo:bucket.start + hi]

    def _build_buffers(self) -> None:
        """Flat 16-bit params (+ full grads for stages 0/1), master chunks, gradient chunks."""
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
        if self.config.stage < 2:   # param.grad are views: autograd accumulates into the buffer
            self.grad_flat = torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
            self._grad_views = [self.grad_flat[s.start:s.start + s.numel].view(p.shape)
                                for p, s in zip(self.params, layout.slots)]
        else:
            self.grad_part = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
            self.grad_chunks = list(torch.split(self.grad_part, sizes))
        self._attach_grads()

    def _build_offload_state(self) -> None:
        """The offload backend (hybrid.offload) holding master + moments of the owned chunks; its
        master starts from the ORIGINAL parameter values (call before params become views)."""
        from hybrid.offload.budget import build_offload_state
        sizes, item = self.layout.chunk_sizes(), self.flat_param.element_size()
        decay = [[] for _ in sizes]
        for b, piece in self.layout.owned_pieces(self.part_rank):
            if uses_weight_decay(self.params[piece.index]):
                decay[b].append((piece.chunk_offset, piece.numel))
        grads = self.layout.numel if self.config.stage < 2 else sum(sizes)
        fp32_grads = 4 * sum(sizes) if self.config.mixed_precision else 0   # _owned_grads_fp32
        resident = item * (self.layout.numel + grads + 3 * max(self.layout.chunk_sizes()) *
                           self.partitions) + fp32_grads
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

    def _attach_grads(self) -> None:
        """Stages 0/1: ``param.grad`` = views of the flat buffer; stage 2: no full-size grads."""
        for i, p in enumerate(self.params):
            p.grad = self._grad_views[i] if self._grad_views else None

    # ---- training-loop API -----------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch (the caller divides the loss by the number of them)."""
        if self.config.stage == 2 and self._micro_batches:
            self.reducer.finish()   # previous micro-batch's reduce-scatters land before new ones
        if any(p.grad is not v for p, v in zip(self.params, self._grad_views)):
            raise RuntimeError("param.grad no longer points into the ZeRO gradient buffer (was "
                               "model.zero_grad() called?); call opt.zero_grad() instead")
        self._micro_batches += 1
        last = self._micro_batches % self.config.gradient_accumulation_steps == 0
        self.reducer.enabled = self.config.stage == 2 or last
        self.reducer.final = last
        scale = self.scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()

    def drop_gradients(self) -> None:
        """Discard this step's gradients without an update (a skipped step): land the collectives
        still in flight, so none writes into the buffers after they are zeroed, then zero them."""
        self.reducer.finish()
        self.zero_grad()

    def _zero_grads(self) -> None:
        """Zero the gradient buffer (stages 0/1) or partition (stage 2); re-attach grad views."""
        (self.grad_flat if self.grad_flat is not None else self.grad_part).zero_()
        self._attach_grads()

    def _stream_grad(self, bucket: int) -> None:
        """Offload: bucket's reduced chunk is final for this step; the backend takes it now."""
        b = self.layout.buckets[bucket]
        grad = self.grad_chunks[bucket] if self.grad_flat is None else self._chunk_of(self.grad_flat, b)
        self.adam.accept_grad(bucket, grad)

    # ---- the engine's hooks (the step is ZeroEngine.step) -----------------------------------
    def _land_gradients(self) -> None:
        self.reducer.enabled = True
        self.reducer.finish()

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks (summed over DP, still loss-scaled) in fp32."""
        if self.grad_flat is not None:
            chunks = [self._chunk_of(self.grad_flat, b) for b in self.layout.buckets]
        else:
            chunks = self.grad_chunks
        return [c.float() for c in chunks] if self.config.mixed_precision else chunks

    def _publish(self) -> None:
        """Write the updated master into this rank's 16-bit chunks and all-gather every bucket
        (all launched, then waited: the transfers of consecutive buckets overlap)."""
        inflight = []
        for bucket, master in zip(self.layout.buckets, self.masters):
            own = self._chunk_of(self.flat_param, bucket)
            if self.config.mixed_precision and self.offload is None:
                own.copy_(master)
            if self.partitions > 1:   # in place: own is this rank's slot of the bucket
                full = self.flat_param[bucket.start:bucket.start + bucket.numel]
                inflight.append(comm.all_gather_into(full, own, self.state.dp, async_op=True))
        for handle in inflight:
            handle.wait()

    # ---- reports and checkpoint support ----------------------------------------------------
    @property
    def num_local_params(self) -> int:
        """Ψ of this TP rank: parameters it trains, without padding."""
        return self.layout.num_params

    def memory_report(self) -> MemoryReport:
        categories = {"param16": [self.flat_param] + [p.data for p in self.params],
                      "grad16": [self.grad_flat if self.grad_flat is not None else self.grad_part],
                      "master32": [self.master_flat] if self.master_flat is not None else self.masters,
                      "adam_moments": self.adam.tensors(),
                      "buffers": self.reducer.buffers() + comm.transport_buffers(self.state.dp)}
        if self.offload is not None:   # what the backend keeps resident (nothing on NVMe)
            host = self.adam.resident()
            categories.update(master32=host["master32"], adam_moments=host["adam_moments"],
                              buffers=categories["buffers"] + host["buffers"])
        itemsize = self.flat_param.element_size()
        formula = formula_bytes(self.num_local_params, self.config.stage, self.state.dp_size,
                                param_bytes=itemsize, mixed_precision=self.config.mixed_precision)
        return MemoryReport(self.config.stage, self.state.dp_size, self.state.tp_size,
                            self.config.precision, self.num_local_params,
                            measure_storages(categories), formula)

    @property
    def fragments_replicated_over_dp(self) -> bool:
        """Stage 0 keeps the whole optimizer state on every DP rank (save it from DP rank 0 only)."""
        return self.partitions == 1


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


def build_zero_optimizer(model: nn.Module, state: ParallelState, zero_config: ZeroConfig,
                         adamw_config: AdamWConfig, offload=None, **stage3_options):
    """The engine for ``zero_config.stage``: stages 0-2 here, stage 3 in :mod:`.stage3`
    (``stage3_options``, e.g. ``init_fn``/``seed`` for a meta-built model, go to stage 3 only).
    ``offload``: a :class:`hybrid.offload.OffloadConfig` (optimizer state on host or NVMe)."""
    if zero_config.stage == 3:
        from hybrid.zero.stage3 import build_stage3_optimizer  # engineer E2's engine
        if offload is not None:
            stage3_options["offload"] = offload
        return build_stage3_optimizer(model, state, zero_config, adamw_config, **stage3_options)
    if stage3_options:
        raise TypeError(f"options {sorted(stage3_options)} apply to ZeRO stage 3 only")
    return ZeroOptimizer(model, state, zero_config, adamw_config, offload)
