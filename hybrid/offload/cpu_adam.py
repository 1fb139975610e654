"""Host-side AdamW over flat fp32 partitions: the "CPU Adam" of ZeRO-Offload (Ren et al. 2021, §4.2).

ZeRO-Offload keeps the fp32 master weights and both Adam moments of a rank's partition in host
memory and runs the update on the CPU, so the update must be as fast as the host allows. Two kernels
over the same flat 1-D tensors:

* ``fused`` (default): torch's vectorised single-pass AdamW kernel (``aten::_fused_adamw_``, one
  read and one write of each of param/grad/m/v per element), as ``torch.optim.AdamW(fused=True)``.
  Parameters and moments agree with the foreach AdamW to about an ulp per step (the kernel orders
  a few multiplications differently).
* ``exact``: the ``torch._foreach_*`` sequence of :func:`hybrid.zero.adamw.adamw_step`, so an
  offloaded run is bitwise identical to the in-device engine (used by parity tests and debugging).

Both walk the partition in blocks of ``block_elems`` elements so one block's master, gradient and
moments (16 bytes per element) stay in cache while the updated values are also written, in the same
pass, into the 16-bit (or fp32) parameter copy the accelerator will receive (``out``).

``grad_scale`` divides the gradient first (the engines' 1 / (DP size x loss scale) unscaling and
clip coefficient, as one divisor): ``fused`` folds the division into its single pass (as
``hybrid.zero.adamw.fused_adamw_step`` does), ``exact`` multiplies by the reciprocal first (as the
foreach engine path does). Either way the gradient block is modified in place.

Weight decay applies only to ``decay_ranges`` (offset, numel) of the flat partition (the decayed
parameters' pieces, ZeRO's flat chunks mix decayed and undecayed parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid.adamw_config import AdamWConfig

KERNELS = ("fused", "exact")


@dataclass(frozen=True)
class Span:
    """Elements [start, start + numel) of a flat block, with or without weight decay."""

    start: int
    numel: int
    decay: bool


def split_spans(lo: int, hi: int, decay_ranges: list[tuple[int, int]]) -> list[Span]:
    """Cut [lo, hi) into maximal spans that are entirely decayed or entirely undecayed.

    ``decay_ranges`` are sorted, non-overlapping (offset, numel) pairs; spans are relative to lo."""
    spans, pos = [], lo
    for start, numel in decay_ranges:
        a, b = max(start, lo), min(start + numel, hi)
        if a >= b:
            continue
        if a > pos:
            spans.append(Span(pos - lo, a - pos, False))
        spans.append(Span(a - lo, b - a, True))
        pos = b
    if pos < hi:
        spans.append(Span(pos - lo, hi - pos, False))
    return spans


class CPUAdamW:
    """AdamW for host-resident flat fp32 partitions. ``step_`` updates one partition in place."""

    def __init__(self, config: AdamWConfig, *, kernel: str = "fused", block_elems: int = 1 << 20):
        if kernel not in KERNELS:
            raise ValueError(f"CPU Adam kernel must be one of {KERNELS}, got {kernel!r}")
        if block_elems < 1:
            raise ValueError(f"block_elems must be >= 1, got {block_elems}")
        self.config, self.kernel, self.block_elems = config, kernel, int(block_elems)

    def step_(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, decay_ranges: list[tuple[int, int]], *, step: int,
              lr: float, out: torch.Tensor | None = None, grad_scale: float = 1.0) -> None:
        """One AdamW update of 1-D fp32 ``master``/``exp_avg``/``exp_avg_sq`` from ``grad`` (fp32,
        same length) divided by ``grad_scale``; ``step`` is 1-based. ``out`` (any float dtype, same
        length) receives the updated master, block by block while it is in cache."""
        n = master.numel()
        if not (grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == n):
            raise ValueError(f"CPU Adam needs equal lengths, got master {n}, grad {grad.numel()}, "
                             f"moments {exp_avg.numel()}/{exp_avg_sq.numel()}")
        if step < 1:
            raise ValueError(f"AdamW step numbers start at 1, got {step}")
        if not grad_scale > 0:
            raise ValueError(f"grad_scale must be a positive divisor, got {grad_scale}")
        steps = torch.full((), float(step), dtype=torch.float32)   # the fused kernel reads it
        scale = None if grad_scale == 1.0 else torch.full((), float(grad_scale))
        for lo in range(0, n, self.block_elems):
            hi = min(n, lo + self.block_elems)
            spans = split_spans(lo, hi, decay_ranges)
            views = [t[lo:hi] for t in (master, grad, exp_avg, exp_avg_sq)]
            if self.kernel == "fused":
                self._fused(views, spans, steps, lr, scale)
            else:
                if scale is not None:
                    views[1].mul_(1.0 / grad_scale)
                self._exact(views, spans, step, lr)
            if out is not None:
                out[lo:hi].copy_(views[0])

    def _fused(self, views, spans, steps, lr, scale) -> None:
        cfg = self.config
        for decay in (True, False):
            parts = [s for s in spans if s.decay == decay]
            if not parts:
                continue
            lists = [[t[s.start:s.start + s.numel] for s in parts] for t in views]
            torch._fused_adamw_(*lists, [], [steps] * len(parts), lr=lr, beta1=cfg.betas[0],
                                beta2=cfg.betas[1], eps=cfg.eps, amsgrad=False, maximize=False,
                                weight_decay=cfg.weight_decay if decay else 0.0, grad_scale=scale)

    def _exact(self, views, spans, step, lr) -> None:
        """The operation order of hybrid.zero.adamw.adamw_step (and torch.optim.AdamW foreach)."""
        cfg = self.config
        p, g, m, v = views
        beta1, beta2 = cfg.betas
        if cfg.weight_decay != 0:
            for s in spans:
                if s.decay:
                    p[s.start:s.start + s.numel].mul_(1 - lr * cfg.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2)
        v.addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt()
        denom.div_(math.sqrt(1 - beta2 ** step))
        denom.add_(cfg.eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
