"""AdamW over flat fp32 partitions (Loshchilov & Hutter 2019), the optimizer ZeRO partitions (§5.1).

ZeRO stores the fp32 master parameters and the two Adam moments of a rank's partition as a few flat
1-D tensors (one chunk per communication bucket or unit). Three kernels update them:

* ``fused`` (default, :func:`fused_adamw_step`): torch's single-pass AdamW kernel
  (``aten::_fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs, on CPU and CUDA): one read
  and one write of master, gradient and both moments per element, and the gradient's unscaling
  (1 / (DP size x loss scale), times the clip coefficient) folded into the same pass. Results agree
  with ``torch.optim.AdamW`` to about an ulp per step.
* ``foreach`` (:func:`adamw_step`): ``torch._foreach_*`` kernels in the same order of floating-point
  operations as ``torch.optim.AdamW(foreach=True)`` (decoupled decay, ``lerp`` for the first
  moment, ``addcmul`` for the second, bias corrections in Python doubles): bitwise that reference,
  seven passes over memory instead of one.
* ``compiled`` (:mod:`hybrid.zero.adamw_compiled`): one ``torch.compile``'d pass per chunk that also
  reads the 16-bit gradient and writes the 16-bit parameters (mixed precision without offload).

The moments may be STORED in bf16 (``AdamWConfig.exp_avg_dtype`` / ``exp_avg_sq_dtype``, Megatron's
precision-aware optimizer; issue 33 part 4): every kernel still computes in fp32. ``fused`` and
``foreach`` run on fp32 copies of one chunk's moments (:func:`moments_in_fp32`), ``compiled`` reads
the 16-bit moments into fp32 registers; the parameter update uses the new fp32 moments, and only
what is stored is rounded (round to nearest, ties to even: ``Tensor.copy_``), once per step.

Weight decay applies only to the decayed parameters' pieces: the flat chunks mix decayed and
undecayed parameters, which ``fused`` and ``foreach`` take as lists of views (no mask tensor) and
``compiled`` as a 1-byte mask per element.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from hybrid.adamw_config import AdamWConfig

TORCH_MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextmanager
def moments_in_fp32(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
    """Yield fp32 versions of one chunk's two moments for an fp32 kernel, and store them back
    rounded to nearest (ties to even) into their 16-bit storage on exit. An fp32 moment is yielded
    itself (no copy); a bf16 one as a transient fp32 copy of that chunk (4 bytes an element)."""
    wide = [t if t.dtype == torch.float32 else t.float() for t in (exp_avg, exp_avg_sq)]
    yield wide
    for stored, value in zip((exp_avg, exp_avg_sq), wide):
        if value is not stored:
            stored.copy_(value)


def fused_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor],
                     exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *, decay: bool,
                     step, config: AdamWConfig, lr: float | None = None,
                     grad_scale=1.0, found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update in place with torch's fused kernel; every gradient is first divided by
    ``grad_scale`` (in place, inside the same pass). ``decay``: apply the weight decay to all of
    ``params`` or to none. ``step`` is the 1-based step number after this update. ``step`` and
    ``grad_scale`` may be 0-dim device tensors (nothing is read to the host); ``found_inf``: a
    0-dim fp32 tensor, where 1 the kernel changes nothing (a skipped step)."""
    if not params:
        return
    device = params[0].device
    if isinstance(step, torch.Tensor):
        steps = [step.to(device=device, dtype=torch.float32).reshape(())] * len(params)
    else:
        if step < 1:
            raise ValueError(f"AdamW step numbers start at 1, got {step}")
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(params)
    if isinstance(grad_scale, torch.Tensor):
        scale = grad_scale.to(device=device, dtype=torch.float32).reshape(())
    else:
        scale = (None if grad_scale == 1.0 else
                 torch.full((), float(grad_scale), dtype=torch.float32, device=device))
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                        lr=config.lr if lr is None else lr, beta1=config.betas[0],
                        beta2=config.betas[1], weight_decay=config.weight_decay if decay else 0.0,
                        eps=config.eps, amsgrad=False, maximize=False, grad_scale=scale,
                        found_inf=found_inf)


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], decay_views: list[torch.Tensor], *, step: int,
               config: AdamWConfig, lr: float | None = None) -> None:
    """One AdamW update in place. ``step`` is the 1-based step number after this update.

    ``params``/``grads``/``exp_avgs``/``exp_avg_sqs`` are parallel lists of fp32 tensors of equal
    shapes; ``decay_views`` are views into ``params`` that get the decoupled weight decay.
    """
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        raise ValueError("adamw_step needs parallel lists of params, grads and both moments")
    if step < 1:
        raise ValueError(f"AdamW step numbers start at 1, got {step}")
    lr = config.lr if lr is None else lr
    beta1, beta2 = config.betas
    if decay_views and config.weight_decay != 0:
        torch._foreach_mul_(decay_views, 1 - lr * config.weight_decay)
    if not params:
        return
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, config.eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bias_correction1)


class FlatAdamWState:
    """The two Adam moments of a list of flat fp32 partitions, plus the step counter.

    ``sizes`` are the numels of the partitions; moments are allocated as ONE flat tensor each
    (so the memory report sees two storages) and handed out as views. ``exp_avg_dtype`` /
    ``exp_avg_sq_dtype`` (``fp32`` or ``bf16``) are their storage dtypes.
    """

    def __init__(self, sizes: list[int], device: torch.device | str, *,
                 exp_avg_dtype: str = "fp32", exp_avg_sq_dtype: str = "fp32"):
        total = sum(sizes)
        self.exp_avg_flat = torch.zeros(total, dtype=TORCH_MOMENT_DTYPES[exp_avg_dtype],
                                        device=device)
        self.exp_avg_sq_flat = torch.zeros(total, dtype=TORCH_MOMENT_DTYPES[exp_avg_sq_dtype],
                                           device=device)
        self.exp_avgs = list(torch.split(self.exp_avg_flat, sizes)) if sizes else []
        self.exp_avg_sqs = list(torch.split(self.exp_avg_sq_flat, sizes)) if sizes else []
        self.step = 0

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor],
               decay_views: list[torch.Tensor], config: AdamWConfig, lr: float | None = None) -> None:
        self.step += 1
        if self.exp_avg_flat.dtype != torch.float32 or self.exp_avg_sq_flat.dtype != torch.float32:
            raise ValueError("FlatAdamWState.update runs on fp32 moments; 16-bit moments are "
                             "updated chunk by chunk through moments_in_fp32")
        adamw_step(params, grads, self.exp_avgs, self.exp_avg_sqs, decay_views, step=self.step,
                   config=config, lr=lr)

    def tensors(self) -> list[torch.Tensor]:
        """The storages this state owns (for the memory report)."""
        return [self.exp_avg_flat, self.exp_avg_sq_flat]
