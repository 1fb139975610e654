"""MoE GPT under expert parallelism x context parallelism trains exactly like the independent
single-device oracle (models/gpt/reference.py MixtureOfExperts; issues 31 and 32): 5 AdamW steps,
fp32, rtol 1e-5 on the losses, the gradient norms and every final parameter, and the interval's
MoE metrics (tokens per expert, aux + z loss per micro-batch) equal to the oracle's; every
micro-batch's router bytes on the CP group equal hybrid.perf.moe_comm.cp_statistics_bytes (ring
attention cases).

Each CP rank holds 2 of the 2C load-balanced chunks of every sequence (pretrain.token_split, the
trainer's own split) and the loss mask drops different numbers of tokens on the CP ranks, so the
aux losses' gradient scale must be the whole micro-batch's; the statistics (aux / seq-aux / z
losses, capacity) must be the whole sequences'. The oracle trains each DP rank's rows as one
micro-batch: ``sum(loss x mask) / sum(mask) + aux losses``, averaged over DP.

AdamW's eps is 1e-3 here (1e-4 in tests/moe/test_moe_parity.py) and the parameters' atol 5e-6 (as
tests/context_parallel/test_cp_parity.py's masked cases): with the loss mask, lr / eps = 100 turns
rounding on near-eps gradients into parameter steps. Measured on the shared-expert-with-drops
variant at plain DP 2 (no CP, no EP): eps 1e-4 leaves 1.6e-5 on one embedding row, eps 1e-3
2.6e-6, eps 1e-2 1.2e-7 everywhere, while losses and grad norms agree within 3e-6 throughout.

EP groups are carved out of DP x CP (rank grid ``[pp, dp, cp, tp]``): at world 2 (CP 2, DP 1) and
world 4 (CP 2 x DP 2, TP 1) the EP-2 group is the two CP ranks of one sample; at TP 2 x CP 2 the
same with sequence parallelism. The default case is world 2, ring attention, ZeRO 1, aux + z
losses; the slow set adds seq-aux with the expert bias, a capacity that drops, a2a, ZeRO 3, DP 2
and TP 2.
"""

import dataclasses

import pytest
import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from models.gpt.sharding import expert_slice, shard_tensor
from hybrid.perf.moe_comm import cp_scale_bytes, cp_statistics_bytes
from pretrain.metrics import moe_metrics
from pretrain.token_split import model_loss, split_micro_batch
from tests.moe.test_moe_parity import ADAMW as MOE_ADAMW
from tests.moe.test_moe_parity import BASE, SEED, STEPS, VARIANTS, oracle_adamw

BATCH, SEQ = 4, 8
ADAMW = dataclasses.replace(MOE_ADAMW, eps=1e-3)   # module docstring


def _config(variant: str) -> GPTConfig:
    return GPTConfig(2, 32, 4, **{**BASE, **VARIANTS[variant], "seq_length": SEQ})


def _data() -> list[dict]:
    """STEPS global batches [BATCH, SEQ]; the loss mask keeps about 3 tokens in 4, unevenly over
    the CP chunks (and every sample keeps at least one)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 101, (BATCH, SEQ + 1), generator=g)
        mask = (torch.rand(BATCH, SEQ, generator=g) < 0.75).float()
        mask[:, 0] = 1.0
        out.append({"tokens": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone(),
                    "loss_mask": mask})
    return out


def _rows(dp: int, dp_rank: int) -> slice:
    per = BATCH // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def _reference(config: GPTConfig, data: list[dict], dp: int):
    """(lm losses, grad norms, params, per step [per MoE layer (tokens per expert per micro-batch
    [E], aux + z per micro-batch)])."""
    model = ReferenceGPT(config)
    model.init_weights(SEED)
    params = list(model.parameters())
    opt = oracle_adamw(model, ADAMW)
    losses, norms, metrics = [], [], []
    for batch in data:
        opt.zero_grad()
        objective, lm = 0.0, 0.0
        aux = [0.0] * len(model.moe_blocks())
        for part in range(dp):
            mb = {k: v[_rows(dp, part)] for k, v in batch.items()}
            per_token = model(mb["tokens"], mb["labels"])
            loss = (per_token * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
            objective = objective + (loss + model.moe_aux_loss()) / dp
            lm += loss.item() / dp
            aux = [a + float(block.aux.detach()) / dp for a, block in zip(aux, model.moe_blocks())]
        objective.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
        opt.step()
        metrics.append([(block.load_since_update.clone() / dp, a)
                        for block, a in zip(model.moe_blocks(), aux)])
        for block in model.moe_blocks():
            block.update_bias()
        losses.append(lm)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, metrics


def _train(state, config: GPTConfig, data: list[dict], stage: int, comm_type: str):
    model = GPTModel(config, state, device="meta", sequence_parallel=state.tp_size > 1)
    if stage < 3:
        model.init_weights(SEED)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, bucket_size=300), ADAMW,
                               **(dict(seed=SEED) if stage == 3 else {}))
    losses, norms, metrics = [], [], []
    for batch in data:
        opt.zero_grad()
        mine = {k: v[_rows(state.dp_size, state.dp_rank)] for k, v in batch.items()}
        mark = state.ledger.position
        loss = model_loss(model, split_micro_batch(mine, state, comm_type))
        opt.backward(loss)
        if comm_type == "p2p":   # (a2a also all-gathers the tokens' indices on the CP group)
            _check_cp_ledger(state, config, mine["tokens"].size(0), state.ledger.since(mark))
        norms.append(float(opt.step().grad_norm))
        model.update_expert_biases(state.dp_cp)          # as the trainer: every token, DP x CP
        total = loss.detach().reshape(1).double()
        with comm.unrecorded(state.dp_cp):
            comm.all_reduce(total, state.dp_cp)          # the CP shares, the DP means
        losses.append(total.item() / state.dp_size)
        metrics.append(moe_metrics(model.pop_moe_metrics(), state.dp_cp))
    params = (opt.gathered_state_dict() if stage == 3
              else {n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, norms, params, metrics


def _check_cp_ledger(state, config, sequences: int, records) -> None:
    """The router's bytes on the CP group for one micro-batch, forward and backward, equal
    hybrid.perf.moe_comm's formula (the ring attention's sends and receives are other ops)."""
    cp = state.cp_size
    tokens = sequences * SEQ // cp
    layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    kind = config.moe_router_load_balancing_type if config.moe_aux_loss_coeff else "none"
    expected = layers * cp_statistics_bytes(
        tokens, config.moe_router_topk, config.num_experts, cp, sequences=sequences,
        load_balancing=kind, capacity=config.moe_expert_capacity_factor is not None)
    if kind != "none" or config.moe_z_loss_coeff is not None:
        expected += cp_scale_bytes(cp)
    moved = sum(r.bytes_per_rank for r in records
                if r.group == "cp" and r.op in ("all_reduce", "all_gather"))
    assert moved == pytest.approx(expected, rel=1e-12), (config, moved, expected)


def _check_metrics(config, metrics, ref_metrics, what):
    layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    for step, (got, ref) in enumerate(zip(metrics, ref_metrics)):
        for i, (load, aux) in zip(layers, ref):
            tokens = torch.tensor([got[f"moe/layer{i}/tokens-per-expert/{e}"]
                                   for e in range(config.num_experts)], dtype=torch.float32)
            torch.testing.assert_close(tokens, load, rtol=0, atol=1e-6,
                                       msg=lambda m: f"{what} step {step} layer {i} load: {m}")
            both = got[f"moe/layer{i}/aux-loss"] + got[f"moe/layer{i}/z-loss"]
            assert both == pytest.approx(aux, rel=1e-5, abs=1e-7), (what, step, i, both, aux)


def _cases(rank, world, cases):
    done, data = [], _data()
    for tp, cp, ep, variant, comm_type, stage in cases:
        state = ParallelState.initialize(Topology(world, tp, gpus_per_node=world, cp=cp,
                                                  expert_model_parallel_size=ep))
        config = _config(variant)
        ref_losses, ref_norms, ref_params, ref_metrics = _reference(config, data, state.dp_size)
        losses, norms, params, metrics = _train(state, config, data, stage, comm_type)
        what = f"{variant} TP {tp} CP {cp} EP {ep} DP {state.dp_size} {comm_type} ZeRO {stage}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{what} losses: {m}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{what} grad norms: {m}")
        assert params.keys() == ref_params.keys(), what
        for name, value in params.items():
            expected = shard_tensor(config, name, expert_slice(name, ref_params[name], state.ep_rank,
                                                               state.ep_size),
                                    state.tp_rank, state.tp_size)
            torch.testing.assert_close(value.float(), expected, rtol=1e-5, atol=5e-6,
                                       msg=lambda m: f"{what} param {name}: {m}")
        _check_metrics(config, metrics, ref_metrics, what)
        dropped = sum(m["moe/dropped-fraction"] for m in metrics)
        done.append((what, dropped))
    return done


def _check(world, cases):
    done = run_on_ranks(_cases, world, args=(cases,), timeout=900)
    assert [w for w, _ in done[0]] == [w for w, _ in done[-1]] and len(done[0]) == len(cases)
    for (what, dropped), case in zip(done[0], cases):   # the capacity cases do drop routes
        assert (dropped > 0) == (VARIANTS[case[3]].get("moe_expert_capacity_factor") is not None), \
            (what, dropped)


def test_ep2_cp2_ring_aux_z_matches_the_oracle():
    """The default case: world 2 (CP 2 = EP 2, DP 1), ring attention, ZeRO 1, aux + z losses."""
    _check(2, [(1, 2, 2, "top2-aux-z", "p2p", 1)])


@pytest.mark.slow
def test_ep2_cp2_dp2_matrix_matches_the_oracle():
    """World 4 (CP 2 x DP 2, TP 1; EP 2 = the CP pair): aux + z, seq-aux with the expert bias and a
    capacity that drops, over p2p and a2a, ZeRO 1 and 3; TP 2 x CP 2 x EP 2 with SP."""
    _check(4, [(1, 2, 2, "top2-aux-z", "a2a", 3),
               (1, 2, 2, "top2-sigmoid-bias-seqaux", "p2p", 1),
               (1, 2, 2, "top2-sigmoid-bias-seqaux", "a2a", 3),
               (1, 2, 2, "top2-shared-gate-drop", "p2p", 3),
               (1, 2, 2, "top2-sigmoid-bias-drop-shared-z", "a2a", 1),
               (1, 2, 1, "top1-shared-drop", "p2p", 1),
               (2, 2, 2, "top2-sigmoid-bias-drop-shared-z", "p2p", 3)])
