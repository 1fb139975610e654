"""Same seed, same curve at every ZeRO stage (mixed precision, ZeRO §3.1 and §5).

In bf16 every stage keeps an fp32 master beside the 16-bit parameters. Stages 0-2 copy it from
the fp32 model; stage 3 builds the model on the meta device and initialises each unit's chunk
itself. Every stage must start its master from the same fp32 values: after construction, each
rank's master fragments are bitwise equal to the fp32 initial weights of the single-device model
(together covering every parameter once per partition).

The first steps' losses then agree across stages 0-3: the 16-bit parameters are the same rounding
of the same masters, and at DP 2 a gradient sum of two addends is rounded once whichever collective
computes it. Measured on CPU/gloo: the five losses are bitwise equal at all four stages (ten steps
too). The bound is a relative 1e-6, so an engine may reorder its norm or reduction sums: the
difference that matters is far larger. A stage-3 master taken from the bf16-rounded weights (the
old behaviour) starts up to 2^-9 relative away from the fp32 init and moves the losses by 8e-6
relative within three steps and 5e-5 by the fourth.
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import DataParallel, ZeroConfig, build_zero_optimizer
from models.gpt.model import GPTModel
from tests.zero.test_stages import GPTTask, train

TASK = GPTTask()
SEED = 11
STEPS = 5
LOSS_RTOL = 1e-6   # measured: 0 (bitwise equal)


def _fp32_initial_weights() -> dict[str, torch.Tensor]:
    """The single-device model's fp32 initial weights, flattened."""
    model = GPTModel(TASK.config, ParallelState.single_process(), device="cpu", dtype=torch.float32)
    model.init_weights(SEED)
    return {n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}


def _engine(state: ParallelState, stage: int):
    config = ZeroConfig(stage=stage, precision="bf16", bucket_size=700)
    if stage == 3:   # as the trainer builds it: fp32 on meta, each rank initialises its partition
        model = GPTModel(TASK.config, state, device="meta", dtype=torch.float32)
        return model, build_zero_optimizer(model, state, config, TASK.adamw, seed=SEED)
    model = GPTModel(TASK.config, state, device=state.device, dtype=torch.float32)
    model.init_weights(SEED)
    return model, build_zero_optimizer(model, state, config, TASK.adamw)


def _master_matches_fp32_init(opt, initial, state) -> None:
    """Every master fragment is bitwise the fp32 initial value; together they cover the model."""
    covered = torch.zeros(1, dtype=torch.float64)
    for f in opt.owned_fragments():
        if f.kind != "master":
            continue
        want = initial[f.param_name][f.offset:f.end]
        assert f.tensor.dtype == torch.float32, (opt.stage, f.param_name)
        assert torch.equal(f.tensor, want), (opt.stage, f.param_name, f.offset,
                                             (f.tensor - want).abs().max().item())
        covered += f.tensor.numel()
    state.ledger.enabled = False
    comm.all_reduce(covered, state.dp)
    state.ledger.enabled = True
    copies = state.dp_size if isinstance(opt, DataParallel) else 1   # stage 0 replicates it
    assert covered.item() == copies * sum(t.numel() for t in initial.values()), opt.stage


def _curves(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    initial = _fp32_initial_weights()
    data = TASK.data(steps=STEPS)
    curves = {}
    for stage in (0, 1, 2, 3):
        model, opt = _engine(state, stage)
        _master_matches_fp32_init(opt, initial, state)
        losses, results = train(TASK, state, opt, model, data, 1)
        assert not any(r.skipped for r in results)
        curves[stage] = losses
    return curves


def test_bf16_masters_start_from_fp32_init_and_curves_agree_across_stages():
    curves = run_on_ranks(_curves, 2)[0]
    for stage in (1, 2, 3):
        torch.testing.assert_close(torch.tensor(curves[stage], dtype=torch.float64),
                                   torch.tensor(curves[0], dtype=torch.float64),
                                   rtol=LOSS_RTOL, atol=0, msg=lambda m: f"stage {stage}: {m}")
