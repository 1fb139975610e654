"""The MoE GPT under the ZeRO engines at expert-parallel size 2 (DP 4 = EP 2 x expert-DP 2) trains
like the single-device oracle (models/gpt/reference.py; issue 32 items 3-4): 5 steps, fp32, rtol
1e-5 on losses, the clipped global norms and the final parameters (gathered over EP), and a
checkpoint written at EP 2 resumes at EP 1 and EP 4 on the same 5-step curve.

The engines reduce the expert gradients over the expert-DP group and divide by DP (the all-to-all
already summed the EP ranks' tokens), the dense ones over DP; tests/zero/test_experts.py checks the
same on a toy with the averaging written out.
"""

import pytest
import torch

from hybrid import comm
from hybrid.checkpoint.state import load_state, save_state
from hybrid.muon_config import MuonConfig
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT, ReferenceMuon
from models.gpt.sharding import expert_slice, shard_tensor
from tests.moe.test_moe_parity import ADAMW, BATCH, SEED, config_of, data, reference_run

VARIANT = "top2-aux-z"


def _state(world_size, ep, tp=1):
    return ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size,
                                             expert_model_parallel_size=ep))


def _engine(state, config, stage, **zero):
    model = GPTModel(config, state, device="meta")
    if stage < 3:
        model.init_weights(SEED)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, bucket_size=300, **zero),
                               ADAMW, **(dict(seed=SEED) if stage == 3 else {}))
    return model, opt


def _steps(state, model, opt, batches):
    local = BATCH // state.dp_size
    rows = slice(state.dp_rank * local, (state.dp_rank + 1) * local)
    losses, norms = [], []
    for tokens, labels in batches:
        opt.zero_grad()
        loss = model(tokens[rows], labels[rows]).mean()
        opt.backward(loss)
        norms.append(float(opt.step().grad_norm))
        model.update_expert_biases(state.dp)
        model.pop_moe_metrics()
        total = loss.detach().reshape(1).clone()
        comm.all_reduce(total, state.dp)
        losses.append(total.item() / state.dp_size)
    return losses, norms


def _final(state, model, opt, stage):
    """This rank's parameters in its TP / EP layout (stage 3: gathered over DP)."""
    if stage < 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    return opt.gathered_state_dict()


def _check(what, state, config, losses, params, ref_losses, ref_params, norms=None,
           ref_norms=None):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what} losses: {m}")
    if norms is not None:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{what} grad norms: {m}")
    assert params.keys() == ref_params.keys(), what
    for name, value in params.items():
        expected = shard_tensor(config, name, expert_slice(name, ref_params[name], state.ep_rank,
                                                           state.ep_size),
                                state.tp_rank, state.tp_size)
        torch.testing.assert_close(value.float(), expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} param {name}: {m}")


def _parity(rank, world_size, stages):
    config, batches = config_of(VARIANT), data()
    ref_losses, ref_norms, ref_params = reference_run(config, batches, world_size)
    state = _state(world_size, 2)
    for stage in stages:
        model, opt = _engine(state, config, stage)
        losses, norms = _steps(state, model, opt, batches)
        _check(f"EP 2 zero {stage}", state, config, losses, _final(state, model, opt, stage),
               ref_losses, ref_params, norms, ref_norms)
    return True


def _resume(rank, world_size, directory, save_stage, loads):
    config, batches = config_of(VARIANT), data()
    ref_losses, _, ref_params = reference_run(config, batches, world_size)
    state = _state(world_size, 2)
    model, opt = _engine(state, config, save_stage)
    _steps(state, model, opt, batches[:2])
    save_state(directory, 2, opt, model.checkpoint_layout(), state, extra={}, metadata={},
               keep_last=1)
    for stage, ep in loads:
        state = _state(world_size, ep)
        model, opt = _engine(state, config, stage)
        load_state(directory, opt, model.checkpoint_layout(), state)
        # DeepSeek-V3 expert biases are buffers outside the optimizer: this variant has none
        losses, _ = _steps(state, model, opt, batches[2:])
        _check(f"saved at EP 2 zero {save_stage}, resumed at EP {ep} zero {stage}", state, config,
               losses, _final(state, model, opt, stage), ref_losses[2:], ref_params)
    return True


@pytest.mark.slow
def test_moe_gpt_zero1_at_ep2_matches_oracle():
    assert all(run_on_ranks(_parity, 4, args=([1],), timeout=600))


@pytest.mark.slow
def test_moe_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep4(tmp_path):
    assert all(run_on_ranks(_resume, 4, args=(str(tmp_path), 1, [(1, 1), (1, 4)]), timeout=600))


@pytest.mark.slow
def test_moe_gpt_zero_stages_at_ep2_match_oracle():
    assert all(run_on_ranks(_parity, 4, args=([0, 2, 3],), timeout=900))


@pytest.mark.slow
def test_moe_checkpoint_reshards_across_ep_and_stages(tmp_path):
    assert all(run_on_ranks(_resume, 4, args=(str(tmp_path), 3, [(3, 1), (0, 4), (2, 2)]),
                            timeout=900))


# ---- Muon with experts (hybrid/zero/muon.py): each expert's fc1 and fc2 its own Muon matrix ----
MUON = MuonConfig(ns_dtype="fp32")


def _muon_reference(config, batches, dp):
    """ReferenceGPT trained by ReferenceMuon (the expert stacks [E, rows, cols] one matrix per
    expert), the global objective as in test_moe_parity.reference_run: (lm losses, params)."""
    model = ReferenceGPT(config)
    model.init_weights(SEED)
    opt = ReferenceMuon(model, MUON, ADAMW.lr, ADAMW.betas, ADAMW.eps, ADAMW.weight_decay)
    losses = []
    for tokens, labels in batches:
        opt.zero_grad()
        objective, lm = 0.0, 0.0
        for part in range(dp):
            rows = slice(part * BATCH // dp, (part + 1) * BATCH // dp)
            loss = model(tokens[rows], labels[rows]).mean()
            objective = objective + (loss + model.moe_aux_loss()) / dp
            lm += loss.item() / dp
        objective.backward()
        opt.step(ADAMW.lr)
        losses.append(lm)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _muon_parity(rank, world_size, stages, tp=1):
    config, batches = config_of(VARIANT), data()
    state = _state(world_size, 2, tp)
    ref_losses, ref_params = _muon_reference(config, batches, state.dp_size)
    for stage in stages:
        model, opt = _engine(state, config, stage, muon=MUON)
        experts = [m for x in opt.optimizer_state.exchanges for m in x.plan.matrices
                   if m.expert >= 0]
        assert len(experts) == 2 * config.num_layers * config.num_experts // 2   # fc1, fc2 each
        losses, _ = _steps(state, model, opt, batches)
        _check(f"muon EP 2 TP {tp} zero {stage}", state, config, losses,
               _final(state, model, opt, stage), ref_losses, ref_params)
    return True


@pytest.mark.slow
def test_moe_gpt_muon_at_ep2_matches_reference_muon():
    assert all(run_on_ranks(_muon_parity, 4, args=([1, 3],), timeout=900))


@pytest.mark.slow
def test_moe_gpt_muon_at_tp2_ep2_matches_reference_muon():
    assert all(run_on_ranks(_muon_parity, 4, args=([2],), kwargs={"tp": 2}, timeout=900))


# ---- tiling with experts (hybrid/zero/tiling.py): dense linears tiled, expert stacks whole -----
def _tiled_parity(rank, world_size):
    """ZeRO 3 at EP 2 with --tile-factor 2 = the oracle (hence = the untiled run of
    test_moe_gpt_zero_stages_at_ep2_match_oracle): attention's QKV and projection are tiled into
    DP units, the expert stacks stay untiled in their expert-DP units."""
    config, batches = config_of(VARIANT), data()
    ref_losses, ref_norms, ref_params = reference_run(config, batches, world_size)
    state = _state(world_size, 2)
    model, opt = _engine(state, config, 3, tile_factor=2)
    tiled = [u for tiles in opt.tiles for t in tiles for u in t.units]
    assert tiled and all(u.group is opt.shard_group for u in tiled)
    assert not any(getattr(s.param, "expert_parallel", False) for u in tiled for s in u.slots)
    experts = [u for u in opt.all_units if u.group is opt.expert_group]
    assert experts and all(s.whole_shape is None for u in experts for s in u.slots)
    losses, norms = _steps(state, model, opt, batches)
    _check("EP 2 zero 3 tile factor 2", state, config, losses, _final(state, model, opt, 3),
           ref_losses, ref_params, norms, ref_norms)
    return True


@pytest.mark.slow
def test_moe_gpt_tiled_zero3_at_ep2_matches_oracle():
    assert all(run_on_ranks(_tiled_parity, 4, timeout=600))
