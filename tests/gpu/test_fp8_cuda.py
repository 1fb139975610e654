"""FP8 linears on CUDA (docs/fp8.md): cuBLASLt's ``torch._scaled_mm`` against the CPU kernel's
results for the same fp8 operands (both accumulate in fp32: equal up to the bf16 output's rounding
and summation order), for every recipe; rowwise needs sm_90 (H100) and is skipped below it; and
a bf16 GPT step with FP8 linears stays near the bf16 step. Written without a GPU (issue 36 part A):
first run in part B.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel.fp8_linear import Fp8Scaling, fp8_linear
from hybrid.tensor_parallel.fp8_scaling import Fp8Recipe
from models.gpt.config import GPTConfig
from models.gpt.fp8 import enable_fp8
from models.gpt.model import GPTModel


def _fp8_capable(recipe: str) -> bool:
    major, minor = torch.cuda.get_device_capability()
    return (major, minor) >= ((9, 0) if recipe == "rowwise" else (8, 9))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_cuda_fp8_linear_matches_the_cpu_kernel(recipe):
    if not _fp8_capable(recipe):
        pytest.skip(f"{recipe} fp8 GEMMs need a newer GPU")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    w = (torch.randn(256, 128, generator=gen) * 0.05).to(torch.bfloat16)
    g = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    out = {}
    for device in ("cpu", "cuda"):
        xd, wd = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        y = fp8_linear(xd, wd, None, Fp8Scaling(Fp8Recipe(recipe=recipe), device=device))
        y.backward(g.to(device))
        out[device] = [t.detach().float().cpu() for t in (y, xd.grad, wd.grad)]
    for cpu, cuda in zip(out["cpu"], out["cuda"]):
        torch.testing.assert_close(cuda, cpu, rtol=2 ** -7, atol=cpu.abs().max() * 2 ** -9)


def test_fp8_gpt_step_stays_near_bf16():
    if not _fp8_capable("tensorwise"):
        pytest.skip("fp8 GEMMs need sm_89 or newer")
    config = GPTConfig(2, 128, 4, vocab_size=256, seq_length=64, hidden_dropout=0.0,
                       attention_dropout=0.0)
    state = ParallelState.single_process(device="cuda")
    losses = []
    for fp8 in (False, True):
        model = GPTModel(config, state, dtype=torch.bfloat16, device="cuda")
        model.init_weights(5)
        if fp8:
            enable_fp8(model, Fp8Recipe(format="hybrid", recipe="tensorwise"))
        tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
        loss = model(tokens, tokens).float().mean()
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 0.02 * losses[0], losses
