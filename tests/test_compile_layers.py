"""Regional torch.compile of the transformer layers (models/gpt/compile.py) trains like eager: the same
tiny GPT, data and ZeRO engine, 5 steps eager then 5 steps compiled on the same ranks, losses and
final parameters compared (fp32 rtol 1e-5; bf16 within BF16_RTOL, see docs/compile.md), across TP 1/2
(TP 2 with sequence parallelism) x ZeRO stages 0-3 x recompute modes, and the TP ledger identical
(the collectives graph-break and run eagerly, once each).

Inductor's C++ compile takes tens of seconds per graph on a small CPU, so every test of the module
shares one cache directory (warm after the first compile of each graph): two cases run in the default
suite, the rest are marked slow.
"""

import pytest
import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.compile import compile_layers
from models.gpt.model import GPTModel
from tests.multirank import run_on_ranks
from tests.test_zero_stages import GPTTask

STEPS, INIT_SEED = 5, 11
BF16_RTOL = 2e-2          # bf16 keeps 8 mantissa bits: fused vs unfused rounding differs by ulps


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("inductor-cache"))


def _train(state, task, data, stage, precision, recompute, compiled, cache_dir):
    plan = None if recompute == "none" else RecomputePlan.uniform(recompute, task.config.num_layers)
    model = GPTModel(task.config, state, device="meta", sequence_parallel=task.sequence_parallel,
                     recompute=plan)
    if stage < 3:
        model.init_weights(INIT_SEED)
    if compiled:
        compile_layers(model, cache_dir=cache_dir)
    cfg = ZeroConfig(stage=stage, precision=precision, bucket_size=300)
    opt = build_zero_optimizer(model, state, cfg, task.adamw,
                               **(dict(seed=INIT_SEED) if stage == 3 else {}))
    mark, losses = state.ledger.position, []
    for tokens, labels in data:
        opt.zero_grad()
        rows = slice(state.dp_rank * len(tokens) // state.dp_size,
                     (state.dp_rank + 1) * len(tokens) // state.dp_size)   # this DP rank's samples
        loss = model(tokens[rows], labels[rows]).float().mean()
        opt.backward(loss)
        opt.step()
        total = loss.detach().clone()
        with comm.unrecorded(state.dp):   # the loss average is not the engine's traffic
            comm.all_reduce(total, state.dp)
        losses.append(total.item() / state.dp_size)
    tp_ops = [(r.op, r.numel) for r in state.ledger.since(mark) if r.group == "tp"]
    params = opt.gathered_state_dict() if stage == 3 else {
        n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, params, tp_ops


def _compiled_vs_eager(rank, world_size, tp, cases, cache_dir):
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    task = GPTTask(sequence_parallel=tp > 1)
    data = task.data(steps=STEPS)
    for stage, precision, recompute in cases:
        what = f"tp {tp} dp {state.dp_size} stage {stage} {precision} recompute {recompute}"
        eager = _train(state, task, data, stage, precision, recompute, False, cache_dir)
        compiled = _train(state, task, data, stage, precision, recompute, True, cache_dir)
        rtol, atol = (1e-5, 1e-6) if precision == "fp32" else (BF16_RTOL, BF16_RTOL)
        torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=rtol,
                                   atol=atol, msg=lambda m: f"{what} losses: {m}")
        assert compiled[1].keys() == eager[1].keys()
        for name, p in eager[1].items():
            torch.testing.assert_close(compiled[1][name], p, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what} {name}: {m}")
        assert compiled[2] == eager[2], f"{what}: the TP collectives differ under compile"
    return len(cases)


def _run(tp, cases, cache_dir, world_size=2):
    done = run_on_ranks(_compiled_vs_eager, world_size, args=(tp, cases, cache_dir), timeout=900)
    assert done == [len(cases)] * world_size


def test_tp1_zero0_fp32_matches_eager(cache_dir):
    _run(1, [(0, "fp32", "none")], cache_dir)


def test_tp2_sp_zero3_full_recompute_matches_eager(cache_dir):
    _run(2, [(3, "fp32", "full")], cache_dir)
