"""The ``compiled`` AdamW kernel (hybrid/zero/adamw_compiled.py) against torch's fused one.

One compiled pass reads the 16-bit gradient and writes master, moments and the 16-bit parameters;
it must give the fused kernel's update to about an ulp per step, the same bits for an element
wherever it sits in a chunk (ZeRO partitions move elements between chunks), leave the gradient
untouched, and, in the ZeRO engines at DP 2, train stages 0-3 as the fused kernel does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import adamw_compiled
from hybrid.zero.adamw import fused_adamw_step
from hybrid.zero.adamw_compiled import compiled_adamw_step, decay_masks
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from tests.zero.test_stages import GPTTask, train

SCALE = LossScaleConfig(initial_scale=2.0 ** 8)
CONFIG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
N = 1000
SPANS = [(0, 0, 300, True), (0, 300, 77, False), (0, 377, 600, True), (0, 977, 23, False)]


def _state(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g) * 0.02, torch.zeros(N), torch.zeros(N)


def _fused(state, grad, step, grad_scale):
    for decay in (True, False):
        spans = [s for s in SPANS if s[3] == decay]
        views = [[t.narrow(0, o, n) for _, o, n, _ in spans] for t in (*state, grad.float())]
        fused_adamw_step(views[0], views[3], views[1], views[2], decay=decay, step=step,
                         config=CONFIG, lr=CONFIG.lr, grad_scale=grad_scale)


def five_steps_against_fused(dtype: torch.dtype, device: str = "cpu"):
    """Five steps of the compiled kernel and of the fused one from the same state on ``device``,
    compared after each; returns (the decay masks, the last gradient) for further checks."""
    g = torch.Generator().manual_seed(2)
    compiled = tuple(t.to(device) for t in _state())
    fused = tuple(t.to(device) for t in _state())
    params16 = compiled[0].to(dtype)
    masks = decay_masks([N], SPANS, device)
    for step in range(1, 6):
        grad = (torch.randn(N, generator=g) * 0.1).to(dtype).to(device)
        before = grad.clone()
        compiled_adamw_step([grad], [compiled[0]], [compiled[1]], [compiled[2]], masks,
                            [params16] if dtype != torch.float32 else None, step=step,
                            config=CONFIG, lr=CONFIG.lr, grad_scale=4.0)
        assert torch.equal(grad, before), "the kernel wrote into the gradient"
        _fused(fused, grad, step, 4.0)
        for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), compiled, fused):
            # the update is lr-sized: an ulp of it is ~1e-9 absolute on a parameter near 0
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")
        if dtype != torch.float32:   # the 16-bit parameters are the master rounded
            assert torch.equal(params16, compiled[0].to(dtype))
    return masks, grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_matches_the_fused_kernel(dtype):
    masks, grad = five_steps_against_fused(dtype)
    # the decay mask did its work: an undecayed piece differs from a run decaying everything
    everything = _state()
    compiled_adamw_step([grad], [everything[0]], [everything[1]], [everything[2]],
                        [torch.ones(N, dtype=torch.uint8)], None, step=1, config=CONFIG,
                        lr=CONFIG.lr, grad_scale=4.0)
    fresh = _state()
    compiled_adamw_step([grad], [fresh[0]], [fresh[1]], [fresh[2]], masks, None, step=1,
                        config=CONFIG, lr=CONFIG.lr, grad_scale=4.0)
    assert not torch.equal(fresh[0][300:377], everything[0][300:377])
    assert torch.equal(fresh[0][:300], everything[0][:300])


def test_an_element_gets_the_same_bits_in_any_chunk():
    """Chunks of odd sizes and offsets (vector loop and tails) give every element the same bits."""
    grad = (torch.randn(N, generator=torch.Generator().manual_seed(3)) * 0.1).bfloat16()
    whole, split = _state(), _state()
    compiled_adamw_step([grad], [whole[0]], [whole[1]], [whole[2]], decay_masks([N], SPANS, "cpu"),
                        None, step=3, config=CONFIG, lr=CONFIG.lr, grad_scale=2.0)
    cuts = [0, 7, 333, 334, 901, N]
    pieces = [[t[a:b] for a, b in zip(cuts, cuts[1:])] for t in (*split, grad)]
    mask = decay_masks([N], SPANS, "cpu")[0]
    compiled_adamw_step(pieces[3], pieces[0], pieces[1], pieces[2],
                        [mask[a:b] for a, b in zip(cuts, cuts[1:])], None, step=3, config=CONFIG,
                        lr=CONFIG.lr, grad_scale=2.0)
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


def test_a_kernel_that_cannot_compile_names_the_fix(monkeypatch):
    def broken(dtypes):
        def kernel(*args):
            raise OSError("g++: not found")
        return kernel
    monkeypatch.setattr(adamw_compiled, "_compiled_pass", broken)
    master, m, v = _state()
    with pytest.raises(RuntimeError, match="'fused' kernel"):
        compiled_adamw_step([torch.zeros(N)], [master], [m], [v],
                            [torch.zeros(N, dtype=torch.uint8)], None, step=1, config=CONFIG,
                            lr=CONFIG.lr, grad_scale=1.0)


def test_an_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="'compiled'"):
        AdamWConfig(kernel="triton")


def _engines(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    task = GPTTask()
    data = task.data()
    out = []
    cases = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("bf16", "fp32")]
    for stage, precision in cases + [(1, "fp16"), (3, "fp16")]:   # fp16: a loss scale divides
        runs = {}
        for kernel in ("fused", "compiled"):
            model = task.model(state)
            opt = build_zero_optimizer(model, state,
                                       ZeroConfig(stage=stage, precision=precision,
                                                  bucket_size=700, loss_scale=SCALE),
                                       dataclasses.replace(task.adamw, kernel=kernel),
                                       **({"seed": 11} if stage == 3 else {}))
            losses, _ = train(task, state, opt, model, data, 1)
            params = (opt.gathered_state_dict() if stage == 3 else
                      {n: p.detach().clone() for n, p in model.named_parameters()})
            runs[kernel] = losses, params, opt.memory_report(), sum(
                m.numel() for m in opt.optimizer_state.masters)
        (fl, fp, fused_report, _), (cl, cp, report, owned) = runs["fused"], runs["compiled"]
        what = f"stage {stage} {precision}"
        torch.testing.assert_close(torch.tensor(cl), torch.tensor(fl), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} losses: {m}")
        # 16-bit: a rounding apart; near zero, where the next steps' 16-bit gradients differ in
        # their last bits too, Adam's normalised step can differ by ~1e-3 of lr (1e-2)
        for name, value in fp.items():
            tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=8e-3,
                                                                              atol=5e-5)
            torch.testing.assert_close(cp[name].float(), value.float(), **tol,
                                       msg=lambda m: f"{what} {name}: {m}")
        out.append((what, report.measured["buffers"] - fused_report.measured["buffers"], owned))
    return out


def test_zero_stages_train_as_with_the_fused_kernel():
    for what, extra_bytes, owned in run_on_ranks(_engines, 2, timeout=600)[0]:
        assert extra_bytes == owned, (f"{what}: the decay masks (1 byte an owned element) "
                                      f"reported as {extra_bytes} bytes for {owned} elements")
