"""The optimizer step every ZeRO stage shares (ZeRO paper §5; mixed precision §3.1).

Stages 0-2 (:mod:`.optimizer`) and stage 3 (:mod:`.stage3`) differ in where gradients and
parameters live and how they move; the step on top of that is one sequence, implemented once here:

    land the gradient communication of the last micro-batch          (stage-specific)
    g = this rank's reduced gradient chunks (fp32)                     (stage-specific)
    norm = ||g|| over DP and TP / (DP divisor x loss scale)            one all-reduce of one number
    norm not finite -> skip: nothing changes; fp16 lowers its scale (after hysteresis)
    AdamW on the owned pieces, g divided by divisor x scale / clip coefficient in the same pass
    publish the updated 16-bit parameters                               (stage-specific)

Overflow detection IS the global norm: a NaN or Inf anywhere in any rank's partition makes the
all-reduced sum of squares non-finite on every rank of the world (stages 1-3, disjoint partitions)
or of the TP group (stage 0, whose DP ranks hold identical all-reduced gradients), so every rank
takes the same branch without a separate overflow all-reduce. A skipped step leaves parameters,
master weights and Adam moments bit-equal. bf16 and fp32 skip the same way (the caller decides
whether a skip is acceptable, see ``--on-nonfinite``).

A subclass describes what it owns with :class:`OwnedPiece` rows (one per parameter piece in this
rank's partition) and provides the stage-specific hooks named ``_land_gradients``,
``_owned_grads``, ``_param_chunks`` and ``_publish``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.comm import Group
from hybrid.parallel_state import ParallelState
from hybrid.zero.adamw import adamw_step, fused_adamw_step
from hybrid.zero.adamw_compiled import compiled_adamw_step, decay_masks
from hybrid.zero.clip import clip_coefficient, global_grad_norm
from hybrid.zero.config import ZeroConfig
from hybrid.zero.report import CommReport, comm_report
from hybrid.zero.results import Fragment, StepResult, copy_overlaps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnedPiece:
    """Elements [param_offset, +numel) of the flattened TP-local parameter ``name`` live at
    [offset, +numel) of chunk ``chunk`` of this rank's partition (params, grads, master, moments)."""

    name: str
    chunk: int
    offset: int
    param_offset: int
    numel: int
    decay: bool          # AdamW weight decay applies (matrices, embeddings)
    tp_sharded: bool     # False: replicated over TP, counted once in the global norm

    def of(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        return chunks[self.chunk].narrow(0, self.offset, self.numel)


def merged_spans(pieces: list[OwnedPiece], key) -> list[tuple[int, int, int, bool]]:
    """(chunk, offset, numel, key(piece)) runs of adjacent pieces with the same key, so kernels see a
    few long views instead of one per parameter."""
    spans: list[list] = []
    for p in sorted(pieces, key=lambda p: (p.chunk, p.offset)):
        k = key(p)
        last = spans[-1] if spans else None
        if last and last[0] == p.chunk and last[1] + last[2] == p.offset and last[3] == k:
            last[2] += p.numel
        else:
            spans.append([p.chunk, p.offset, p.numel, k])
    return [tuple(s) for s in spans]


def _views(chunks: list[torch.Tensor], spans) -> list[torch.Tensor]:
    return [chunks[c].narrow(0, offset, numel) for c, offset, numel, _ in spans]


class ZeroEngine:
    """Shared step, checkpoint fragments and reports; see the module docstring.

    Subclasses name their ``stage`` (class attribute) and set ``state``, ``config``, ``adamw``, ``lr``, ``scaler``, ``offload``, ``adam``
    (a FlatAdamWState or an offload backend), ``masters`` (fp32 master per chunk; the parameter
    chunk itself in plain fp32), ``pieces`` (list of OwnedPiece), ``norm_group`` and
    ``grad_divisor`` (what the owned gradients must still be divided by: the DP size when the
    reduction summed them, 1 when they were divided before it), then call :meth:`_init_engine`.
    """

    stage: int           # the ZeRO paper's stage number (reports, memory formula)
    state: ParallelState
    config: ZeroConfig
    adamw: AdamWConfig
    norm_group: Group
    grad_divisor: float
    norm_replicas: int = 1   # copies of each owned gradient in norm_group (hybrid sharding: hosts)

    def _init_engine(self) -> None:
        self._decay_spans = merged_spans(self.pieces, lambda p: p.decay)
        self._spans_by_chunk = [[span for span in self._decay_spans if span[0] == c]
                                for c in range(len(self.masters))]
        self._tp_spans = merged_spans(self.pieces, lambda p: p.tp_sharded)
        # the compiled kernel: one pass from the 16-bit gradient to the 16-bit parameters
        self._one_pass = self.adamw.kernel == "compiled" and self.offload is None
        self._masks = (decay_masks([m.numel() for m in self.masters], self._decay_spans,
                                   self.state.device) if self._one_pass else None)
        self._micro_batches = 0
        self._ledger_mark, self._last_step_records = self.state.ledger.position, []

    # ---- stage-specific hooks --------------------------------------------------------------
    def _land_gradients(self) -> None:
        raise NotImplementedError

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks, one per chunk, in the gradient's dtype, still
        multiplied by ``grad_divisor`` x loss scale. Whoever needs fp32 converts what it reads (the
        update a chunk at a time, the offload backends a block at a time): never a fp32 copy of
        the whole partition. In fp32 training the update scales them in place."""
        raise NotImplementedError

    def _param_chunks(self):
        """A context manager yielding the 16-bit (or fp32) parameter chunks this rank owns, one
        per chunk, for an offload backend to write (an NVMe parameter store's writer queues the
        last write-back when it closes)."""
        raise NotImplementedError

    def _publish(self, rounded: bool = False) -> None:
        """Make the updated owned chunks the model's parameters (round the master into them unless
        ``rounded``: the update wrote them already; all-gather)."""
        raise NotImplementedError

    def _zero_grads(self) -> None:
        """Zero this rank's gradient buffers or partitions."""
        raise NotImplementedError

    def _end_step(self) -> None:
        """After a step, taken or skipped."""

    def zero_grad(self) -> None:
        """Zero this rank's gradients, including any an offload backend has staged from them."""
        self._zero_grads()
        if self.offload is not None:
            self.adam.drop_staged_grads()
        self._micro_batches = 0

    # ---- the step --------------------------------------------------------------------------
    def check_micro_batches(self) -> None:
        accum = self.config.gradient_accumulation_steps
        if self._micro_batches != accum:
            raise RuntimeError(f"step() after {self._micro_batches} backward() calls but "
                               f"ZeroConfig.gradient_accumulation_steps is {accum}; call "
                               f"opt.backward once per micro-batch and opt.zero_grad after step")

    @torch.no_grad()
    def step(self) -> StepResult:
        """Update the parameters from the gradients of the micro-batches since ``zero_grad``."""
        self.check_micro_batches()
        self._land_gradients()
        scale = self.scaler.scale
        grads = self._owned_grads()   # 16-bit stays 16-bit: the norm reads it in fp32
        divisor = self.grad_divisor * scale
        norm = self._global_norm(grads) / divisor
        if not math.isfinite(norm):
            self.scaler.update(True)   # fp16: hysteresis / back-off; bf16 and fp32: nothing
            self._finish_step()
            return StepResult(True, norm, scale)
        coef = clip_coefficient(norm, self.config.clip_grad)
        self._update(grads, divisor / coef)
        self._publish(rounded=self._one_pass)
        self.scaler.update(False)
        self._finish_step()
        return StepResult(False, norm, scale)

    def _finish_step(self) -> None:
        self._end_step()
        self._last_step_records = list(self.state.ledger.since(self._ledger_mark))
        self._ledger_mark = self.state.ledger.position

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm of the whole model's gradient as one device would see it (see hybrid.zero.clip)."""
        views = _views(grads, self._tp_spans)
        sharded = [v for v, span in zip(views, self._tp_spans) if span[3]]
        replicated = [v for v, span in zip(views, self._tp_spans) if not span[3]]
        norm = global_grad_norm(sharded, replicated, tp=self.state.tp, reduce_group=self.norm_group,
                                device=self.state.device)
        return norm / math.sqrt(self.norm_replicas) if self.norm_replicas > 1 else norm

    def _update(self, grads: list[torch.Tensor], grad_scale: float) -> None:
        """AdamW on the owned pieces, the gradients divided by ``grad_scale`` first."""
        if self.offload is not None:   # the host / NVMe backend runs AdamW, writes the chunks
            with self._param_chunks() as out:   # gradients it staged are used first
                self.adam.update(grads, out, lr=self.lr, grad_scale=grad_scale)
            return
        self.adam.step += 1
        moments = (self.adam.exp_avgs, self.adam.exp_avg_sqs)
        if self._one_pass:   # 16-bit gradient in, 16-bit parameters out
            with self._param_chunks() as chunks:
                compiled_adamw_step(grads, self.masters, *moments, self._masks,
                                    chunks if self.config.mixed_precision else None,
                                    step=self.adam.step, config=self.adamw, lr=self.lr,
                                    grad_scale=grad_scale)
            return
        # one chunk at a time: a 16-bit chunk's fp32 copy is the only transient (at most one
        # bucket, 4 bytes per element), not an fp32 copy of the whole partition
        for c, grad in enumerate(grads):
            self._update_chunk(c, grad, grad_scale)

    def _update_chunk(self, c: int, grad: torch.Tensor, grad_scale: float) -> None:
        """The fused or foreach AdamW kernel on chunk ``c`` (its copy dies on return)."""
        grad = grad.float()   # fp32 training: the chunk itself, scaled in place
        spans = self._spans_by_chunk[c]
        views = [[t.narrow(0, offset, numel) for _, offset, numel, _ in spans]
                 for t in (self.masters[c], grad, self.adam.exp_avgs[c], self.adam.exp_avg_sqs[c])]
        if self.adamw.kernel == "foreach":
            grad.mul_(1.0 / grad_scale)
            decayed = [p for p, span in zip(views[0], spans) if span[3]]
            adamw_step(*views, decayed, step=self.adam.step, config=self.adamw, lr=self.lr)
            return
        for decay in (True, False):
            pick = [i for i, span in enumerate(spans) if span[3] == decay]
            fused_adamw_step(*([v[i] for i in pick] for v in views), decay=decay,
                             step=self.adam.step, config=self.adamw, lr=self.lr,
                             grad_scale=grad_scale)

    def _kernel_buffers(self) -> list[torch.Tensor]:
        """Storages the AdamW kernel keeps (the memory report's buffers): the compiled kernel's
        per-chunk weight-decay masks."""
        return list(self._masks or [])

    # ---- checkpoint interface --------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self.adam.step

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.adam.step = int(value)

    def _state_chunks(self) -> dict[str, list[torch.Tensor]]:
        if self.offload is not None:
            return {k: self.adam.fragment_views(k) for k in ("master", "exp_avg", "exp_avg_sq")}
        return {"master": self.masters, "exp_avg": self.adam.exp_avgs,
                "exp_avg_sq": self.adam.exp_avg_sqs}

    def owned_fragments(self) -> list[Fragment]:
        """Master and moment pieces this rank owns, addressed by parameter name and offset."""
        return [Fragment(p.name, kind, p.param_offset, p.of(chunks))
                for p in self.pieces for kind, chunks in self._state_chunks().items()]

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
        if self.offload is not None:
            with self._param_chunks() as out:
                self.adam.publish(out)
        self._publish()

    # ---- the checkpoint state protocol (hybrid.checkpoint.state.CheckpointState) ------------
    @property
    def optimizer_state_replicated(self) -> bool:
        """Every DP rank holds the same master and moments; engines that partition them say no."""
        return False

    @property
    def parameters_replicated(self) -> bool:
        """Every DP rank holds the whole 16-bit parameters; stage 3 partitions them."""
        return True

    @property
    def state_replica(self) -> int:
        """Which copy of its partitioned state this rank holds: 0 unless partitions are replicated
        across hosts (hybrid sharding), where only the first host's copy is written."""
        return 0

    def _parameter_fragments(self) -> list[Fragment]:
        """The 16-bit (or fp32) parameters this rank holds, as ``model`` fragments."""
        raise NotImplementedError

    def checkpoint_pieces(self) -> list[Fragment]:
        return self._parameter_fragments() + self.owned_fragments()

    def checkpoint_counters(self) -> dict:
        return {"step_count": self.step_count, "loss_scaler": self.scaler.state_dict()}

    def load_checkpoint_pieces(self, pieces: list[Fragment], counters: dict) -> None:
        """The master and moments of ``pieces`` become this rank's (the 16-bit parameters are
        rebuilt from the master, so ``model`` pieces only matter through it). Collective over DP."""
        self.step_count = counters["step_count"]
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
                           dp=self.state.dp_size, psi=self.num_local_params,
                           param_bytes=self.param_bytes)
