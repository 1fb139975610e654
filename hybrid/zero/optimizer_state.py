"""Where a ZeRO engine's fp32 master weights and Adam moments live: the on-device backend, and the
one function that picks a backend (:class:`hybrid.offload.backend.OptimizerStateBackend`).

:class:`DeviceOptimizerState` keeps this rank's master (fp32; in plain fp32 training the parameter
chunks themselves) and both Adam moments on the training device and updates them with one of the
kernels of :mod:`.adamw` (ZeRO §3.1 mixed precision, §5.1 Pos):

* ``fused`` / ``foreach``: one chunk at a time, so the fp32 copy of a 16-bit gradient chunk is the
  only transient (at most one bucket, 4 bytes an element), never an fp32 copy of the partition;
  each chunk's updated master is rounded into its 16-bit parameter chunk right after its update.
* ``compiled`` (:mod:`.adamw_compiled`): one pass per chunk from the 16-bit gradient to the 16-bit
  parameters, with a 1-byte weight-decay mask per owned element.

The moments are stored in ``AdamWConfig.exp_avg_dtype`` / ``exp_avg_sq_dtype`` (fp32 or bf16,
issue 33): with bf16 the fused / foreach update of a chunk runs on fp32 copies of that chunk's
moments and rounds them back once (:func:`hybrid.zero.adamw.moments_in_fp32`).

:func:`build_optimizer_state` returns it, or, with ``OffloadConfig(mode="cpu"|"nvme")``, the host
or NVMe backend of :mod:`hybrid.offload` (ZeRO-Offload, ZeRO-Infinity). The engines hold what it
returns and never ask which backend it is.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.offload.backend import OptimizerStateBackend
from hybrid.offload.budget import OffloadConfig, build_offload_state
from hybrid.zero.adamw import FlatAdamWState, adamw_step, fused_adamw_step, moments_in_fp32
from hybrid.zero.adamw_compiled import compiled_adamw_step, decay_masks
from hybrid.zero.pieces import OwnedPiece, merged_spans


class DeviceOptimizerState(OptimizerStateBackend):
    """Master and moments of the chunks ``params_out`` (this rank's parameter chunks) on their
    device; ``pieces`` say which elements are parameters and which of them decay."""

    def __init__(self, params_out: list[torch.Tensor], pieces: list[OwnedPiece],
                 adamw: AdamWConfig, *, mixed_precision: bool, device: torch.device):
        sizes = [c.numel() for c in params_out]
        self.adamw, self.mixed_precision = adamw, mixed_precision
        # mixed precision: one fp32 storage for every chunk's master; fp32: the chunks themselves
        self.master_flat = (torch.zeros(sum(sizes), dtype=torch.float32, device=device)
                            if mixed_precision else None)
        self.masters = (list(torch.split(self.master_flat, sizes)) if mixed_precision
                        else list(params_out))
        self.moments = FlatAdamWState(sizes, device, exp_avg_dtype=adamw.exp_avg_dtype,
                                      exp_avg_sq_dtype=adamw.exp_avg_sq_dtype)
        self._spans_by_chunk = [[] for _ in sizes]   # (chunk, offset, numel, decay) runs
        for span in merged_spans(pieces, lambda p: p.decay):
            self._spans_by_chunk[span[0]].append(span)
        self._one_pass = adamw.kernel == "compiled"
        self._masks = (decay_masks(sizes, [s for spans in self._spans_by_chunk for s in spans],
                                   device) if self._one_pass else None)
        # fused and compiled kernels take the step number and a skip flag as device tensors, so the
        # engine never reads its overflow flag (issue 36); foreach keeps torch.optim.AdamW's host
        # bias corrections and gets a host-decided step
        self.skips_on_device = adamw.kernel in ("fused", "compiled")
        self._taken = torch.zeros((), dtype=torch.float32, device=device)   # steps not skipped

    @property
    def step(self) -> int:
        if self.skips_on_device:
            return int(self._taken.item())   # a checkpoint's read, off the step path
        return self.moments.step

    @step.setter
    def step(self, value: int) -> None:
        self.moments.step = int(value)
        self._taken.fill_(float(value))

    def write_master(self, chunk: int, offset: int, values: torch.Tensor) -> None:
        self.masters[chunk][offset:offset + values.numel()].copy_(values.reshape(-1))

    def accept_grad(self, chunk: int, grad: torch.Tensor) -> None:
        """Nothing to move: the update reads the gradient where it is."""

    def drop_staged_grads(self) -> None:
        """Nothing staged."""

    def update(self, grads: list[torch.Tensor], params_out: Sequence[torch.Tensor], *, lr: float,
               grad_scale, skip: torch.Tensor | None = None) -> None:
        """``grad_scale``: a float, or with ``skips_on_device`` a 0-dim tensor; ``skip``: a 0-dim
        bool tensor, where set nothing changes (master, moments, parameters, step count)."""
        if not self.skips_on_device:
            self.moments.step += 1
            for c, grad in enumerate(grads):
                self._update_chunk(c, grad, lr, float(grad_scale))
                if self.mixed_precision:
                    params_out[c].copy_(self.masters[c])
            return
        device = self._taken.device
        skip = (torch.zeros((), dtype=torch.bool, device=device) if skip is None
                else skip.to(device=device, dtype=torch.bool).reshape(()))
        if not isinstance(grad_scale, torch.Tensor):
            grad_scale = torch.full((), float(grad_scale), dtype=torch.float32, device=device)
        step = self._taken + 1                                # this update's 1-based number
        moments = (self.moments.exp_avgs, self.moments.exp_avg_sqs)
        if self._one_pass:   # 16-bit gradient in, 16-bit parameters out
            compiled_adamw_step(grads, self.masters, *moments, self._masks,
                                list(params_out) if self.mixed_precision else None,
                                step=step, config=self.adamw, lr=lr, grad_scale=grad_scale, skip=skip)
        else:
            found_inf = skip.to(torch.float32)
            for c, grad in enumerate(grads):
                self._fused_chunk(c, grad, lr, grad_scale, step, found_inf)
                if self.mixed_precision:   # a skipped step rewrites the same rounded master
                    params_out[c].copy_(self.masters[c])
        self._taken += (~skip).to(torch.float32)

    def _chunk_views(self, c: int, grad: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor):
        """Per-span views of chunk ``c``'s master, gradient and (fp32) moments."""
        spans = self._spans_by_chunk[c]
        views = [[t.narrow(0, offset, numel) for _, offset, numel, _ in spans]
                 for t in (self.masters[c], grad, exp_avg, exp_avg_sq)]
        return spans, views

    def _fused_chunk(self, c: int, grad: torch.Tensor, lr: float, grad_scale: torch.Tensor,
                     step: torch.Tensor, found_inf: torch.Tensor) -> None:
        """torch's fused AdamW on chunk ``c`` with the step, the unscaling and the skip flag as
        device tensors (the kernel returns at once where ``found_inf`` is 1). Moments stored in
        bf16 are updated on fp32 copies and rounded back once (a skipped step round-trips them
        exactly)."""
        with moments_in_fp32(self.moments.exp_avgs[c], self.moments.exp_avg_sqs[c]) as moments:
            spans, views = self._chunk_views(c, grad.float(), *moments)
            for decay in (True, False):
                pick = [i for i, span in enumerate(spans) if span[3] == decay]
                fused_adamw_step(*([v[i] for i in pick] for v in views), decay=decay,
                                 step=step, config=self.adamw, lr=lr, grad_scale=grad_scale,
                                 found_inf=found_inf)

    def _update_chunk(self, c: int, grad: torch.Tensor, lr: float, grad_scale: float) -> None:
        """The foreach AdamW kernel on chunk ``c`` (its fp32 copies die on return: the gradient's in
        mixed precision, the moments' when they are stored in bf16)."""
        grad = grad.float()   # fp32 training: the chunk itself, scaled in place
        with moments_in_fp32(self.moments.exp_avgs[c], self.moments.exp_avg_sqs[c]) as moments:
            spans, views = self._chunk_views(c, grad, *moments)
            grad.mul_(1.0 / grad_scale)
            decayed = [p for p, span in zip(views[0], spans) if span[3]]
            adamw_step(*views, decayed, step=self.step, config=self.adamw, lr=lr)

    def publish(self, params_out: Sequence[torch.Tensor]) -> None:
        if self.mixed_precision:
            for out, master in zip(params_out, self.masters):
                out.copy_(master)

    def fragment_views(self, kind: str) -> list[torch.Tensor]:
        return {"master": self.masters, "exp_avg": self.moments.exp_avgs,
                "exp_avg_sq": self.moments.exp_avg_sqs}[kind]

    def resident(self) -> dict[str, list[torch.Tensor]]:
        """The master (in fp32 training: the parameter chunks, counted as parameters), the moments
        and the compiled kernel's weight-decay masks."""
        return {"master32": [self.master_flat] if self.mixed_precision else list(self.masters),
                "adam_moments": self.moments.tensors(), "buffers": list(self._masks or [])}

    def tensors(self) -> list[torch.Tensor]:
        return self.moments.tensors()

    def close(self) -> None:
        """Nothing to release."""


def build_optimizer_state(offload: OffloadConfig | None, params_out: list[torch.Tensor],
                          pieces: list[OwnedPiece], adamw: AdamWConfig, *, mixed_precision: bool,
                          device: torch.device, rank: int, resident_bytes: int, muon=None
                          ) -> OptimizerStateBackend:
    """The backend of this rank's optimizer state: on the device, or where ``offload`` puts it.
    ``params_out``: this rank's parameter chunks (their sizes are the partition's);
    ``resident_bytes``: what the engine keeps in host memory anyway (the offload budget's);
    ``muon``: a :class:`hybrid.zero.muon.MuonSetup` (--optimizer muon), which trains its matrices'
    pieces and leaves the others to the backend built here."""
    if muon is not None:
        return muon.wrap(offload, pieces, lambda kept: build_optimizer_state(
            offload, params_out, kept, adamw, mixed_precision=mixed_precision, device=device,
            rank=rank, resident_bytes=resident_bytes), adamw.kernel, device)
    if offload is None or not offload.enabled:
        return DeviceOptimizerState(params_out, pieces, adamw, mixed_precision=mixed_precision,
                                    device=device)
    decay: list[list[tuple[int, int]]] = [[] for _ in params_out]
    for piece in pieces:
        if piece.decay:
            decay[piece.chunk].append((piece.offset, piece.numel))
    return build_offload_state(offload, [c.numel() for c in params_out], decay, adamw,
                               device=device, param_dtype=params_out[0].dtype, rank=rank,
                               resident_bytes=resident_bytes)
