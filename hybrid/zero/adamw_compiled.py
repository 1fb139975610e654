"""The mixed-precision optimizer step as one compiled pass per chunk (ZeRO §3.1, §5.1; AdamW).

With the ``fused`` kernel a mixed-precision step walks a rank's partition three times: the 16-bit
reduced gradient is cast into a fp32 copy, torch's fused AdamW reads that copy with the master and
both moments and writes them back, and the publish rounds the master into the 16-bit parameters.
Here ``torch.compile`` (inductor: C++ on CPU, Triton on CUDA) turns the whole update into one loop
per chunk: read the 16-bit gradient, master and moments, write master, moments and the 16-bit
parameter (28 bytes an element in bf16 instead of 40). Measured on this project's 2-core CPU
(benchmarks/README.md): 2.65 M elements in one process 1.9 ms against 2.4-2.6 ms for the three
passes; GPT-2 small's optimizer step at DP 2 7% shorter; the small benchmark GPT's at DP 2 the same
within its noise (its two ranks' updates share the memory bus).

Weight decay applies per element through a mask of the chunk (uint8, 1 byte an element, built once
from the engine's decay spans: a chunk mixes decayed matrices and undecayed biases and norms; a bool
mask and ``torch.where`` make inductor's CPU loop 1.7x slower). The arithmetic is AdamW's as
``torch._fused_adamw_`` does it (gradient divided by the scale, decoupled decay, ``lerp`` first
moment, second moment, bias-corrected step), but the compiled loop rounds differently now and then,
so it agrees with the ``fused`` kernel to about an ulp per step (with bf16 moments, issue 33: it
reads them into fp32 and rounds the new ones once, to nearest even, after the update used them); every element gets the same
arithmetic whatever its position in a chunk. The step's scalars are tensors, so a learning-rate
schedule does not recompile; chunk sizes are dynamic, so one graph serves every chunk.
"""

from __future__ import annotations

import functools
import types

import torch

from hybrid.adamw_config import AdamWConfig


def _adamw_pass(grad, master, exp_avg, exp_avg_sq, decay, param16, grad_scale, decay_factor,
                step_size, bias_correction2_sqrt, skip, beta1: float, beta2: float, eps: float):
    g = grad.float() / grad_scale
    p = master * (1 + (decay_factor - 1) * decay.float())   # exactly master * factor or master
    m = torch.lerp(exp_avg.float(), g, 1 - beta1)   # 16-bit moments: read into fp32
    v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
    p = p - step_size * m / (v.sqrt() / bias_correction2_sqrt + eps)
    # a skipped step (0-dim bool on the device) writes back the old values, bit for bit
    m, v, p = torch.where(skip, exp_avg, m), torch.where(skip, exp_avg_sq, v), torch.where(skip, master, p)
    exp_avg.copy_(m)      # 16-bit moments: rounded to nearest once, after the update used m, v
    exp_avg_sq.copy_(v)
    master.copy_(p)
    if param16 is not None:
        param16.copy_(p)


@functools.cache
def _compiled_pass(dtypes: tuple):
    """The compiled pass for one (gradient, 16-bit parameter, exp_avg, exp_avg_sq) dtype tuple. dynamo caches graphs per
    code object, at most 8 (its recompile limit), and compiles one per dtype pair and per layout of
    the views it is given: a process that builds engines of several precisions (the tests, the
    benchmarks) would pass that limit, and fullgraph would then fail. Each pair therefore gets its
    own copy of the code."""
    fn = _adamw_pass
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    return torch.compile(copy, dynamic=True, fullgraph=True)


def decay_masks(sizes: list[int], spans, device) -> list[torch.Tensor]:
    """One uint8 tensor per chunk: 1 where weight decay applies. ``spans`` are the engine's
    ``(chunk, offset, numel, decay)`` rows."""
    masks = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    for chunk, offset, numel, decay in spans:
        if decay:
            masks[chunk][offset:offset + numel] = 1
    return masks


def compiled_adamw_step(grads: list[torch.Tensor], masters: list[torch.Tensor],
                        exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                        masks: list[torch.Tensor], params16: list[torch.Tensor] | None, *,
                        step, config: AdamWConfig, lr: float, grad_scale,
                        skip: torch.Tensor | None = None) -> None:
    """One AdamW update of every chunk in place: ``grads`` (any float dtype, read only) divided by
    ``grad_scale``; ``masks`` from :func:`decay_masks`; ``params16`` (mixed precision) receive the
    updated master rounded to their dtype, or None. ``step`` is 1-based, after this update.
    ``step`` and ``grad_scale`` may be 0-dim device tensors, ``skip`` a 0-dim bool tensor that
    leaves everything unchanged where set: then nothing is read to the host (issue 36); the bias
    corrections are formed in float64 on the device, as Python's doubles are on the host."""
    device = masters[0].device if masters else "cpu"
    beta1, beta2 = config.betas

    def scalar(x) -> torch.Tensor:   # a fill on the device (as fused_adamw_step's), no copy
        if isinstance(x, torch.Tensor):
            return x.to(device=device, dtype=torch.float32).reshape(())
        return torch.full((), x, dtype=torch.float32, device=device)
    if isinstance(step, torch.Tensor):
        n = step.to(device=device, dtype=torch.float64).reshape(())
        step_size = lr / (1 - torch.pow(beta1, n))
        bias2_sqrt = (1 - torch.pow(beta2, n)).sqrt()
    else:
        if step < 1:
            raise ValueError(f"AdamW step numbers start at 1, got {step}")
        step_size, bias2_sqrt = lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5
    skip = (torch.zeros((), dtype=torch.bool, device=device) if skip is None
            else skip.to(device=device, dtype=torch.bool).reshape(()))
    scalars = (scalar(grad_scale), scalar(1.0 - lr * config.weight_decay), scalar(step_size),
               scalar(bias2_sqrt), skip)
    for k, master in enumerate(masters):
        if master.numel() == 0:
            continue
        param16 = None if params16 is None else params16[k]
        kernel = _compiled_pass((grads[k].dtype, None if param16 is None else param16.dtype,
                                 exp_avgs[k].dtype, exp_avg_sqs[k].dtype))
        args = (grads[k], master, exp_avgs[k], exp_avg_sqs[k], masks[k], param16, *scalars,
                beta1, beta2, config.eps)
        try:
            kernel(*args)
        except Exception as err:   # inductor could not build it: no C++ compiler, no Triton ...
            raise RuntimeError(
                f"the 'compiled' AdamW kernel failed in torch.compile ({type(err).__name__}: "
                f"{str(err)[:300]}); use the 'fused' kernel (AdamWConfig(kernel='fused'); in the "
                f"trainer: drop --compile)") from err
