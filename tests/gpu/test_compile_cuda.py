"""``--compile`` on CUDA: the regional compile of the transformer layers (models/gpt/compile.py,
inductor's Triton kernels) trains like eager, and the one-pass AdamW kernel
(hybrid/zero/adamw_compiled.py) gives torch's fused update on GPU tensors.

The CPU suite checks both with inductor's C++ kernels (tests/models/test_compile_layers.py,
tests/zero/test_adamw_compiled.py); these are the same comparisons on the GPU: fp32 (TF32 off) within
1e-5 over 5 steps, 16-bit within tests/models/test_compile_layers.py's bf16 bounds (docs/compile.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.compile import compile_layers
from models.gpt.model import GPTModel
from tests.gpu.cuda_helpers import INIT_SEED, ieee_fp32
from tests.models.test_compile_layers import CompileTask, _assert_16bit_parameters_close
from tests.zero.test_adamw_compiled import five_steps_against_fused

STEPS = 5


def _train(task, stage: int, precision: str, recompute: str, compiled: bool):
    state = ParallelState.single_process("cuda")
    plan = None if recompute == "none" else RecomputePlan.uniform(recompute, task.config.num_layers)
    model = GPTModel(task.config, state, device="meta", recompute=plan)
    if stage < 3:
        model.init_weights(INIT_SEED)
    if compiled:
        compile_layers(model)
    adamw = dataclasses.replace(task.adamw, kernel="compiled" if compiled else "fused")
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision=precision,
                                                        bucket_size=300), adamw,
                               **(dict(seed=INIT_SEED) if stage == 3 else {}))
    losses = []
    for tokens, labels in task.data(steps=STEPS):
        opt.zero_grad()
        loss = model(tokens.cuda(), labels.cuda()).float().mean()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    params = opt.gathered_state_dict() if stage == 3 else dict(model.named_parameters())
    return losses, {n: p.detach().float().cpu() for n, p in params.items()}


@pytest.mark.parametrize("stage,precision,recompute", [(0, "fp32", "none"), (1, "bf16", "full"),
                                                       (3, "bf16", "selective")])
def test_compiled_layers_train_like_eager_on_cuda(stage, precision, recompute):
    task = CompileTask()
    with ieee_fp32():
        eager = _train(task, stage, precision, recompute, compiled=False)
        compiled = _train(task, stage, precision, recompute, compiled=True)
    what = f"stage {stage} {precision} recompute {recompute} on CUDA"
    if precision == "fp32":
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
        for name, p in eager[1].items():
            torch.testing.assert_close(compiled[1][name], p, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what} {name}: {m}")
    else:
        torch.testing.assert_close(compiled[0], eager[0], rtol=2e-2, atol=2e-2)
        _assert_16bit_parameters_close(compiled[1], eager[1], what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_adamw_matches_the_fused_kernel_on_cuda(dtype):
    five_steps_against_fused(dtype, "cuda")
