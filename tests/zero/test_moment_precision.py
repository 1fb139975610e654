"""16-bit Adam moments (issue 33 part 4; Megatron's --exp-avg-dtype / --exp-avg-sq-dtype).

The oracle of the step is torch.optim.AdamW computing in fp32, with its moments rounded to bf16
(round to nearest even) after every step: our step with bf16 moments must equal it exactly, for the
``fused`` and ``foreach`` kernels, in mixed precision with a loss scale and in plain fp32, with one
or both moments in bf16. The memory report's measured model-state bytes must drop by exactly what
the formula says (K = 4 + 8 -> 4 + 2 + 2) at DP 2 under stages 1, 2 and 3.
"""

import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.optimizer_state import DeviceOptimizerState
from hybrid.zero.pieces import OwnedPiece
from hybrid.zero.report import formula_bytes

STEPS = 6
W_SHAPE, B_NUMEL = (5, 3), 7
# two chunks [10, 12]: the weight's 15 elements cross the chunk boundary, the bias follows it
PIECES = [OwnedPiece("w", 0, 0, 0, 10, True, True), OwnedPiece("w", 1, 0, 10, 5, True, True),
          OwnedPiece("b", 1, 5, 0, 7, False, False)]
SIZES = [10, 12]


def _config(kernel, exp_avg, exp_avg_sq):
    return AdamWConfig(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, kernel=kernel,
                       exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq)


def _round_like(t: torch.Tensor, dtype: str) -> None:
    """The reference's storage rounding: keep the fp32 tensor, its values rounded to bf16."""
    if dtype == "bf16":
        t.copy_(t.bfloat16())


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
@pytest.mark.parametrize("moments", [("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16")])
@pytest.mark.parametrize("mixed", [True, False])
def test_bf16_moments_step_equals_fp32_compute_rounded_each_step(kernel, moments, mixed):
    torch.manual_seed(0)
    cfg = _config(kernel, *moments)
    w, b = torch.randn(W_SHAPE), torch.randn(B_NUMEL)
    dtype = torch.bfloat16 if mixed else torch.float32
    flat = torch.cat([w.flatten(), b]).to(dtype)
    params_out = list(torch.split(flat, SIZES))
    state = DeviceOptimizerState(params_out, PIECES, cfg, mixed_precision=mixed,
                                 device=torch.device("cpu"))
    if mixed:
        for c, chunk in enumerate(params_out):
            state.write_master(c, 0, chunk.float())
    ref = [flat[:15].float().view(W_SHAPE).clone().requires_grad_(),
           flat[15:].float().clone().requires_grad_()]
    opt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            foreach=kernel == "foreach", fused=kernel == "fused")
    scale = 4.0 if mixed else 1.0   # a power of two: unscaling is exact in both
    for _ in range(STEPS):
        g = torch.randn(15 + B_NUMEL).to(dtype) * scale
        ref[0].grad = (g[:15].float() / scale).view(W_SHAPE)
        ref[1].grad = g[15:].float() / scale
        opt.step()
        for p in ref:
            _round_like(opt.state[p]["exp_avg"], moments[0])
            _round_like(opt.state[p]["exp_avg_sq"], moments[1])
        state.update(list(torch.split(g.clone(), SIZES)), params_out, lr=cfg.lr, grad_scale=scale)
    master = torch.cat(state.fragment_views("master"))
    expected = torch.cat([ref[0].detach().flatten(), ref[1].detach()])
    torch.testing.assert_close(master, expected, rtol=0, atol=0)
    torch.testing.assert_close(flat, expected.to(dtype), rtol=0, atol=0)
    for kind, stored in zip(("exp_avg", "exp_avg_sq"), moments):
        ours = torch.cat(state.fragment_views(kind))
        assert ours.dtype == (torch.bfloat16 if stored == "bf16" else torch.float32), kind
        theirs = torch.cat([opt.state[ref[0]][kind].flatten(), opt.state[ref[1]][kind]])
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=0)


def test_moment_rounding_is_to_nearest_even():
    """What "rounded to bf16" means: nearest, ties to even (torch's copy_), the documented rule."""
    one_ulp = 2.0 ** -7            # bf16's spacing at 1.0
    x = torch.tensor([1 + one_ulp / 2, 1 + 1.5 * one_ulp, 1 + one_ulp / 2 + 2 ** -20])
    got = torch.zeros(3, dtype=torch.bfloat16).copy_(x).float()
    assert got.tolist() == [1.0, 1 + 2 * one_ulp, 1 + one_ulp]


@pytest.mark.slow
def test_compiled_kernel_with_bf16_moments_agrees_with_fused():
    """The compiled one-pass kernel reads bf16 moments into fp32 and rounds the new ones once: it
    agrees with the fused kernel to about an ulp of the master per step (its own rounding of the
    fp32 arithmetic), and its stored moments to one bf16 ulp."""
    torch.manual_seed(1)
    flat = torch.randn(22).bfloat16()
    outs = {}
    for kernel in ("fused", "compiled"):
        params_out = list(torch.split(flat.clone(), SIZES))
        state = DeviceOptimizerState(params_out, PIECES, _config(kernel, "bf16", "bf16"),
                                     mixed_precision=True, device=torch.device("cpu"))
        for c, chunk in enumerate(params_out):
            state.write_master(c, 0, chunk.float())
        g = torch.Generator().manual_seed(2)
        for _ in range(STEPS):
            grads = list(torch.split(torch.randn(22, generator=g).bfloat16(), SIZES))
            state.update(grads, params_out, lr=0.05, grad_scale=2.0)
        outs[kernel] = [torch.cat(state.fragment_views(k)).float()
                        for k in ("master", "exp_avg", "exp_avg_sq")]
    torch.testing.assert_close(outs["compiled"][0], outs["fused"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs["compiled"][1:], outs["fused"][1:]):
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-7)


def test_formula_k_follows_the_moment_dtypes():
    from hybrid.perf.model_states import model_state_bytes, optimizer_bytes_per_param
    assert optimizer_bytes_per_param() == 12                                   # the paper's K
    assert optimizer_bytes_per_param(exp_avg="bf16", exp_avg_sq="bf16") == 8   # 4 + 2 + 2
    assert optimizer_bytes_per_param(exp_avg="bf16") == 10
    assert optimizer_bytes_per_param(master=None, exp_avg="bf16", exp_avg_sq="bf16") == 4
    with pytest.raises(ValueError, match="exp_avg dtype"):
        optimizer_bytes_per_param(exp_avg="fp8")
    full = formula_bytes(1000, 1, 4, param_bytes=2, mixed_precision=True)
    low = formula_bytes(1000, 1, 4, param_bytes=2, mixed_precision=True, moment_bytes=4)
    assert full["adam_moments"] - low["adam_moments"] == 4 * 1000 / 4
    assert sum(low.values()) == model_state_bytes(1000, 1, 4, optimizer_bytes_per_param=8).total
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        AdamWConfig(exp_avg_dtype="fp16")


class _Block(torch.nn.Module):
    """fc1 [64, 32] + bias, fc2 [32, 64] + bias: Ψ = 4,192, even chunks at DP 2 (no padding)."""

    def __init__(self, dtype):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64, dtype=dtype)
        self.fc2 = torch.nn.Linear(64, 32, dtype=dtype)

    def sharding_units(self):   # what ZeRO stage 3 gathers one at a time, in forward order
        return [self.fc1, self.fc2]

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.to(self.fc1.weight.dtype)))).float().pow(2).mean()


def _memory(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    rows = {}
    for stage in (1, 2, 3):
        for moments in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = _Block(torch.bfloat16)
            cfg = AdamWConfig(exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
            opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision="bf16",
                                                                bucket_size=1024), cfg)
            opt.backward(model(torch.randn(8, 32)))
            opt.step()
            report = opt.memory_report()
            rows[(stage, moments)] = (report.measured_model_states, report.formula_model_states,
                                      report.measured["adam_moments"], report.psi)
            if hasattr(opt, "close"):
                opt.close()
    return rows


def test_memory_report_drops_by_the_formulas_amount_at_dp2():
    rows = run_on_ranks(_memory, 2)
    for rank_rows in rows:
        for stage in (1, 2, 3):
            full, low = rank_rows[(stage, "fp32")], rank_rows[(stage, "bf16")]
            psi = full[3]
            drop_formula = full[1] - low[1]
            assert drop_formula == (12 - 8) * psi / 2, (stage, full, low)   # K: 12 -> 8, over DP 2
            assert full[0] - low[0] == drop_formula, (stage, full, low)      # measured, exactly
            assert low[2] * 2 == full[2], (stage, full, low)                 # half the moments


def test_offloaded_optimizer_state_refuses_bf16_moments():
    """The host / NVMe AdamW has no 16-bit path: one clear error, before anything is allocated."""
    from hybrid.offload.budget import OffloadConfig, build_offload_state
    with pytest.raises(ValueError, match="no 16-bit path"):
        build_offload_state(OffloadConfig(mode="cpu"), SIZES, [[], []], _config("fused", "bf16",
                                                                                  "fp32"),
                            device=torch.device("cpu"), param_dtype=torch.bfloat16, rank=0,
                            resident_bytes=0)
