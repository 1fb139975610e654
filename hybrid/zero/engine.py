"""The ZeRO engine a training loop holds, and the optimizer step every stage shares (ZeRO paper §5;
mixed precision §3.1).

An engine is made of named parts:

* where the model states live and how they move, the only thing the paper's stages differ in:
  flat buffers cut into partitioned buckets for stages 0-2 (:class:`hybrid.zero.flat.FlatEngine`,
  whose gradient reduction is a part of :mod:`.reducer`), sharded units gathered around their use
  for stage 3 (:class:`hybrid.zero.stage3.ParameterPartitioning`);
* the optimizer state, a :class:`hybrid.offload.backend.OptimizerStateBackend` (on the device, in
  host memory or on NVMe: :func:`hybrid.zero.optimizer_state.build_optimizer_state`), which owns
  the fp32 master and Adam moments and runs AdamW on them;
* the step, written once here:

    land the gradient communication of the last micro-batch           (storage)
    g = this rank's reduced gradient chunks, in the gradient dtype      (storage)
    norm = ||g|| over DP and TP / (DP divisor x loss scale)             one all-reduce of one number
    norm not finite -> skip: nothing changes; fp16 lowers its scale (after hysteresis)
    AdamW on the owned chunks, g divided by divisor x scale / clip coefficient in the same pass,
    the updated values written into this rank's parameter chunks      (optimizer-state backend)
    gather the updated parameters                                       (storage)

Overflow detection IS the global norm: a NaN or Inf anywhere in any rank's partition makes the
all-reduced sum of squares non-finite on every rank of the world (stages 1-3, disjoint partitions)
or of the TP group (stage 0, whose DP ranks hold identical all-reduced gradients), so every rank
takes the same branch without a separate overflow all-reduce. A skipped step leaves parameters,
master weights and Adam moments bit-equal. bf16 and fp32 skip the same way (the caller decides
whether a skip is acceptable, see ``--on-nonfinite``).

The storage says what it owns with :class:`~hybrid.zero.pieces.OwnedPiece` rows (one per parameter
piece in this rank's partition) and implements the storage methods below (``_land_gradients``,
``_owned_grads``, ``_param_chunks``, ``_gather_params``, ``_zero_grads``, ``_end_step``,
``_parameter_fragments``).
"""

from __future__ import annotations

import logging
import math

import torch

from hybrid import comm
from hybrid.adamw_config import AdamWConfig
from hybrid.comm import Group
from hybrid.offload.backend import STATE_KINDS, OptimizerStateBackend
from hybrid.parallel_state import ParallelState
from hybrid.zero.clip import (clip_coefficient, global_grad_norm_tensor, local_sum_of_squares,
                              only_if_not_finite)
from hybrid.zero.config import ZeroConfig
from hybrid.zero.host_groups import partition_groups
from hybrid.zero.loss_scaler import build_loss_scaler
from hybrid.zero.muon import MuonSetup, muon_matrices
from hybrid.zero.pieces import OwnedPiece, merged_spans, views
from hybrid.zero.report import CommReport, comm_report
from hybrid.zero.results import Fragment, StepResult, copy_overlaps

log = logging.getLogger(__name__)


class ZeroEngine:
    """Shared step, checkpoint fragments and reports; see the module docstring.

    A storage class names its ``stage`` (the ZeRO paper's number: reports, memory formula), calls
    ``ZeroEngine.__init__`` first and :meth:`_init_step` once its parts exist.
    """

    stage: int
    optimizer_state: OptimizerStateBackend
    pieces: list[OwnedPiece]
    norm_group: Group              # whose owned gradients together are the whole model's
    optimizer_state_replicated: bool   # every DP rank holds the same master and moments
    parameters_replicated: bool        # every DP rank holds the whole 16-bit parameters

    def __init__(self, state: ParallelState, config: ZeroConfig, adamw: AdamWConfig):
        if config.stage != self.stage:
            raise ValueError(f"{type(self).__name__} is ZeRO stage {self.stage}, the config asks for "
                             f"stage {config.stage}; build engines with "
                             f"hybrid.zero.build_zero_optimizer")
        self.state, self.config, self.adamw = state, config, adamw
        self.lr = adamw.lr            # the training loop's schedule may set it before each step
        self.dtype, self.device = config.param_dtype, state.device
        self.shard_group, self.replicas = partition_groups(state, config)   # DP, or by host
        self.scaler = build_loss_scaler(config, state.device)
        # the reductions sum over DP (x CP): the AdamW pass divides by the DP size. Under context
        # parallelism each CP rank's loss is its tokens' share of the micro-batch's loss, so the
        # sum over CP is the whole gradient and only the DP replicas are averaged
        self.grad_divisor = float(state.dp_size)
        # copies of each owned gradient in the norm group (hybrid sharding: one per host)
        self.norm_replicas = self.replicas.size if self.replicas is not None else 1
        # the expert class's copies across hosts under hybrid sharding (issue 32; set by the
        # storage when it has an expert class)
        self.expert_replicas = self.replicas

    def _init_step(self, optimizer_state: OptimizerStateBackend, pieces: list[OwnedPiece],
                   norm_group: Group, counted: list[bool] | None = None) -> None:
        """``counted``: per parameter class (:mod:`hybrid.zero.param_classes`), whether this rank's
        copy of its gradients counts in the norm (False: another rank of the class's group holds
        the same all-reduced gradient, stage 0); None: one class, counted."""
        self.optimizer_state, self.pieces, self.norm_group = optimizer_state, pieces, norm_group
        self._tp_spans = merged_spans(pieces, lambda p: p.tp_sharded)
        self._class_spans = None          # several classes: per class, its spans and whether counted
        if counted is not None and len(counted) > 1:
            self._class_spans = [(merged_spans([p for p in pieces if p.param_class == k],
                                               lambda p: p.tp_sharded), counts)
                                 for k, counts in enumerate(counted)]
        self._micro_batches = 0
        self._ledger_mark, self._last_step_records = self.state.ledger.position, []

    def _muon_setup(self, params, groups) -> MuonSetup | None:
        """--optimizer muon: Muon's matrices among ``(name, TP-local shape, partition_dim,
        expert, parameter class)`` rows and its groups (per parameter class, the partition group
        or None when nothing is partitioned; TP); None under AdamW."""
        if self.config.muon is None:
            return None
        return MuonSetup(self.config.muon, muon_matrices(params, self.state.tp_size),
                         list(groups), self.state.tp, self.adamw.weight_decay)

    # ---- storage methods ---------------------------------------------------------------------
    def _land_gradients(self) -> None:
        """Wait for the gradient communication still in flight."""
        raise NotImplementedError

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks, one per chunk, in the gradient's dtype, still
        multiplied by ``grad_divisor`` x loss scale. Whoever needs fp32 converts what it reads (the
        update a chunk at a time, the offload backends a block at a time): never a fp32 copy of
        the whole partition. In fp32 training the update scales them in place."""
        raise NotImplementedError

    def _param_chunks(self):
        """A context manager yielding the 16-bit (or fp32) parameter chunks this rank owns, one
        per chunk, for the optimizer-state backend to write (an NVMe parameter store's writer
        queues the last write-back when it closes)."""
        raise NotImplementedError

    def _gather_params(self) -> None:
        """The owned chunks were updated: make them the model's parameters (all-gather)."""
        raise NotImplementedError

    def _zero_grads(self) -> None:
        """Zero this rank's gradient buffers or partitions."""
        raise NotImplementedError

    def _end_step(self) -> None:
        """After a step, taken or skipped (the flat buffers keep their gradients until
        ``zero_grad``: nothing)."""

    def _parameter_fragments(self) -> list[Fragment]:
        """The 16-bit (or fp32) parameters this rank holds, as ``model`` fragments."""
        raise NotImplementedError

    # ---- the step --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero this rank's gradients, including any the optimizer state has staged from them."""
        self._zero_grads()
        self.optimizer_state.drop_staged_grads()
        self._micro_batches = 0

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Count ``steps`` backwards per step from the next step on (a batch ramp changes them
        between steps); the config object is shared with the engine's parts, so it changes in
        place."""
        if self._micro_batches not in (0, self.config.gradient_accumulation_steps):
            raise RuntimeError(f"the accumulation count changes between steps only; "
                               f"{self._micro_batches} backward() calls are pending")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps!r}")
        self.config.gradient_accumulation_steps = steps

    def check_micro_batches(self) -> None:
        accum = self.config.gradient_accumulation_steps
        if self._micro_batches != accum:
            raise RuntimeError(f"step() after {self._micro_batches} backward() calls but "
                               f"ZeroConfig.gradient_accumulation_steps is {accum}; call "
                               f"opt.backward once per micro-batch and opt.zero_grad after step")

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> StepResult:
        """Update the parameters from the gradients of the micro-batches since ``zero_grad``.

        Nothing here reads the device (issue 36): the norm, the overflow flag, the clip coefficient
        and the loss scale stay 0-dim tensors, and an overflowed step is skipped on the device (the
        fused and compiled AdamW kernels leave master, moments and step count untouched where the
        flag is set). ``skip``: a 0-dim bool tensor the caller adds to the overflow flag (the
        trainer's agreed non-finite loss). Backends whose update runs on the host (the foreach
        reference kernel, CPU / NVMe offload) read the flag and the scale once here."""
        self.check_micro_batches()
        self._land_gradients()
        scale = self.scaler.scale_tensor()        # 1.0 without loss scaling
        grads = self._owned_grads()   # 16-bit stays 16-bit: the norm reads it in fp32
        divisor = self.grad_divisor * scale
        norm = self._global_norm(grads) / divisor
        overflow = ~torch.isfinite(norm)
        if skip is not None:
            overflow = overflow | skip.to(device=overflow.device, dtype=torch.bool).reshape(())
        grad_scale = divisor / clip_coefficient(norm, self.config.clip_grad)
        if not isinstance(grad_scale, torch.Tensor):   # no scaler and no clipping: a constant
            grad_scale = torch.full((), grad_scale, dtype=torch.float64, device=norm.device)
        if getattr(self.optimizer_state, "skips_on_device", False):
            with self._param_chunks() as out:
                self.optimizer_state.update(grads, out, lr=self.lr, grad_scale=grad_scale,
                                            skip=overflow)
            self._gather_params()
        else:
            skipped, host_scale = torch.stack([overflow.double(), grad_scale.double()]).tolist()
            if not skipped:
                with self._param_chunks() as out:
                    self.optimizer_state.update(grads, out, lr=self.lr, grad_scale=host_scale)
                self._gather_params()
        self.scaler.update(overflow)   # fp16: hysteresis / back-off on the device; else nothing
        self._finish_step()
        return StepResult(overflow, torch.where(overflow, torch.full_like(norm, float("nan")), norm),
                          scale)

    def _finish_step(self) -> None:
        self._end_step()
        self._last_step_records = list(self.state.ledger.since(self._ledger_mark))
        self._ledger_mark = self.state.ledger.position

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the whole model's gradient as one device would see it (see hybrid.zero.clip),
        a 0-dim float64 tensor on the device."""
        if self._class_spans is not None:
            return self._classes_norm(grads)
        spans = views(grads, self._tp_spans)
        sharded = [v for v, span in zip(spans, self._tp_spans) if span[3]]
        replicated = [v for v, span in zip(spans, self._tp_spans) if not span[3]]
        norm = global_grad_norm_tensor(sharded, replicated, tp=self.state.tp,
                                       reduce_group=self.norm_group, device=self.state.device)
        return norm / math.sqrt(self.norm_replicas) if self.norm_replicas > 1 else norm

    def _classes_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm with several parameter classes: each class's squares (counted, or only where
        not finite), one all-reduce over ``norm_group`` (the world)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.state.device)
        for spans, counts in self._class_spans:
            mine = views(grads, spans)
            part = local_sum_of_squares([v for v, s in zip(mine, spans) if s[3]],
                                        [v for v, s in zip(mine, spans) if not s[3]],
                                        tp=self.state.tp, device=self.state.device)
            sq += part if counts else only_if_not_finite(part)
        comm.all_reduce(sq, self.norm_group)
        return sq.double().sqrt().reshape(())

    # ---- checkpoint interface --------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self.optimizer_state.step

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.optimizer_state.step = int(value)

    def owned_fragments(self) -> list[Fragment]:
        """Master and moment pieces this rank owns, addressed by parameter name and offset."""
        chunks = {kind: self.optimizer_state.fragment_views(kind) for kind in STATE_KINDS}
        return [Fragment(p.name, kind, p.param_offset, p.of(chunks[kind]))
                for p in self.pieces for kind in STATE_KINDS]

    @torch.no_grad()
    def load_fragments(self, fragments) -> None:
        """Copy the overlapping parts of saved fragments (any layout) into the owned ones, then
        rebuild the 16-bit parameters from the master. Collective over DP."""
        owned = self.owned_fragments()
        copied = copy_overlaps(owned, fragments)
        expected = sum(f.tensor.numel() for f in owned)
        if copied < expected:
            raise ValueError(f"the checkpoint covers {copied} of the {expected} optimizer-state "
                             f"elements this rank owns; was it saved from another model?")
        with self._param_chunks() as out:
            self.optimizer_state.publish(out)
        self._gather_params()

    def _note_moment_conversion(self, counters: dict) -> None:
        """A checkpoint whose moments were stored in another dtype loads converted (issue 33,
        docs/optimizer-precision.md): fp32 -> bf16 rounds each moment to nearest even once, as
        every step of a bf16-moment run does; bf16 -> fp32 is exact. One logged note says so."""
        for kind, ours in self._moment_dtypes().items():
            saved = counters.get(kind, "fp32")
            if saved != ours and self.state.rank == 0:
                log.info("note: the checkpoint's %s is stored in %s, this run's in %s: converted on "
                         "load (%s)", kind.removesuffix("_dtype"), saved, ours,
                         "rounded to nearest even" if ours != "fp32" else "exact")

    # ---- the checkpoint state protocol (hybrid.checkpoint.state.CheckpointState) ------------
    @property
    def state_replica(self) -> int:
        """Which copy of its partitioned state this rank holds: 0 unless partitions are replicated
        across hosts (hybrid sharding), where only the first host's copy is written."""
        return self.replicas.rank if self.replicas is not None else 0

    @property
    def expert_state_replica(self) -> int:
        """:attr:`state_replica` of the expert parameters' state (their copies across hosts are
        counted over the expert-DP group's host split, issue 32)."""
        return self.expert_replicas.rank if self.expert_replicas is not None else 0

    def checkpoint_pieces(self) -> list[Fragment]:
        return self._parameter_fragments() + self.owned_fragments()

    def checkpoint_counters(self) -> dict:
        return {"step_count": self.step_count, "loss_scaler": self.scaler.state_dict(),
                **self._moment_dtypes(), "optimizer": self._optimizer_name}

    def _moment_dtypes(self) -> dict:
        """The storage dtypes of the saved moments (absent in checkpoints from before issue 33:
        fp32)."""
        return {"exp_avg_dtype": self.adamw.exp_avg_dtype,
                "exp_avg_sq_dtype": self.adamw.exp_avg_sq_dtype}

    @property
    def _optimizer_name(self) -> str:
        """Whose state the moment slots hold (Muon keeps its momentum in ``exp_avg``)."""
        return "muon" if self.config.muon is not None else "adamw"

    def load_checkpoint_pieces(self, pieces: list[Fragment], counters: dict) -> None:
        """The master and moments of ``pieces`` become this rank's (the 16-bit parameters are
        rebuilt from the master, so ``model`` pieces only matter through it). Collective over DP."""
        saved = counters.get("optimizer", "adamw")   # checkpoints older than Muon: AdamW
        if saved != self._optimizer_name:
            raise ValueError(f"the checkpoint holds {saved} optimizer state, this run trains with "
                             f"--optimizer {self._optimizer_name}; resume with --optimizer {saved}, "
                             f"or load the weights alone with --no-load-optim")
        self.step_count = counters["step_count"]
        self._note_moment_conversion(counters)
        self.load_fragments([f for f in pieces if f.kind != "model"])
        if counters["loss_scaler"]:
            self.scaler.load_state_dict(counters["loss_scaler"])

    # ---- reports ---------------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return torch.empty((), dtype=self.config.param_dtype).element_size()

    def comm_report(self) -> CommReport:
        """Bytes per rank of the last optimizer step (everything since the step before it)."""
        return comm_report(self._last_step_records, 1, stage=self.stage,
                           dp=self.state.dp_cp.size, psi=self.num_local_params,
                           param_bytes=self.param_bytes)
