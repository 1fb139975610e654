"""ZeRO stages 0-2 x TP x DP x gradient accumulation against a single-device torch.optim.AdamW
reference: the same model unsharded, trained on the same global batch (fp32 to rounding)."""

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
from hybrid.topology import Topology
from hybrid.zero.config import AdamWConfig, ZeroConfig
from hybrid.zero.optimizer import build_zero_optimizer
from tests.multirank import run_on_ranks

HIDDEN, FFN, SEQ, BATCH, STEPS = 16, 32, 4, 8, 5
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class TinyTPBlock(nn.Module):
    """A transformer-style MLP block from the TP layers: sharded (fc1, fc2 weights) and replicated
    (fc2 bias, norm) parameters. Input/target [s, b, h]; returns the mean-squared error."""

    def __init__(self, group, dtype=torch.float32):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, group, dtype=dtype)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, group, dtype=dtype)
        self.norm = LayerNorm(HIDDEN, group, dtype=dtype)
        for name in ("fc1", "fc2"):
            getattr(self, name).init_weights(7, std=0.3, prefix=name + ".")

    def forward(self, x, target):
        y = self.norm(x + self.fc2(F.gelu(self.fc1(x))))
        return F.mse_loss(y.float(), target)


def make_data(steps=STEPS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g))
            for _ in range(steps)]


def reference_run(data, clip=0.0):
    """Unsharded model, torch.optim.AdamW (no decay on ndim < 2), full global batch per step."""
    model = TinyTPBlock(ParallelState.single_process().tp)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                            weight_decay=ADAMW.weight_decay)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def zero_run(state, data, config, dtype=torch.float32):
    """Train with ZeRO; returns (global losses, this rank's parameters, optimizer)."""
    model = TinyTPBlock(state.tp, dtype=torch.float32)
    opt = build_zero_optimizer(model, state, config, ADAMW)
    accum, dp = config.gradient_accumulation_steps, state.dp_size
    local = BATCH // dp
    losses = []
    for x, y in data:
        opt.zero_grad()
        total = torch.zeros(1)
        xs, ys = x[:, state.dp_rank * local:(state.dp_rank + 1) * local], y[:, state.dp_rank * local:(state.dp_rank + 1) * local]
        for m in range(accum):
            mb = slice(m * local // accum, (m + 1) * local // accum)
            loss = model(xs[:, mb].to(dtype), ys[:, mb]) / accum
            opt.backward(loss)
            total += loss.detach()
        result = opt.step()
        assert not result.skipped
        comm.all_reduce(total, state.dp)
        losses.append(total.item() / dp)
    return losses, dict(model.named_parameters()), opt


def assert_matches_reference(state, params, losses, ref_losses, ref_params, rtol, atol, what):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} losses: {m}")
    for name, p in params.items():
        ref = ref_params[name].detach()
        ref = tp_init.shard(ref, p.partition_dim, state.tp_rank, state.tp_size)
        torch.testing.assert_close(p.detach().float(), ref, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} param {name}: {m}")


def _fp32_parity(rank, world_size, tps, stages, accums):
    data = make_data()
    ref_losses, ref_params = reference_run(data)
    checked = []
    for tp in tps:
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
        for stage in stages:
            for accum in accums:
                cfg = ZeroConfig(stage=stage, bucket_size=300, gradient_accumulation_steps=accum)
                losses, params, _ = zero_run(state, data, cfg)
                what = f"stage {stage} tp {tp} dp {state.dp_size} accum {accum}"
                assert_matches_reference(state, params, losses, ref_losses, ref_params, 1e-5, 1e-6,
                                         what)
                checked.append(what)
    return checked


def test_fp32_stages_match_reference_single_rank():
    checked = run_on_ranks(_fp32_parity, 1, args=([1], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 6


def test_fp32_stages_match_reference_two_ranks():
    checked = run_on_ranks(_fp32_parity, 2, args=([1, 2], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 12


def test_fp32_stages_match_reference_four_ranks():
    checked = run_on_ranks(_fp32_parity, 4, args=([1, 2], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 12
