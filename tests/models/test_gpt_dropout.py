"""Dropout under tensor parallelism (Megatron-LM §3 RNG rule), on 4 ranks = TP 2 x DP 2.

- DP replicas fed the same batch compute the same loss and gradients (the streams depend on the
  seed and the TP rank only), with and without sequence parallelism;
- a run is reproducible from its seed, and dropout is really on (train loss != eval loss, two
  consecutive steps draw different masks);
- the default stream stays in lockstep across the TP ranks (replicated activations get one mask);
- with only hidden dropout (replicated region, default stream) TP 2 equals TP 1 exactly;
- activation recompute (selective, full, full-pa = ZeRO-R Pa) reproduces the dropout masks: loss
  and gradients equal the run without recompute;
- TP > 1 with dropout in a TP region and no RNGTracker is refused with a clear message.
"""

import pytest
import torch
import torch.distributed as dist

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.tensor_parallel import RNGTracker
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel

SEED = 99
BOTH = GPTConfig(2, 64, 4, vocab_size=300, seq_length=16, make_vocab_size_divisible_by=1,
                 hidden_dropout=0.2, attention_dropout=0.2)
HIDDEN_ONLY = BOTH.replace(attention_dropout=0.0)


def _batch(config):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g)
    return tokens, torch.randint(0, config.vocab_size, tokens.shape, generator=g)


def _build(config, state, sp, plan: str | None = None):
    rng = RNGTracker(SEED, state.tp_rank, state.device)
    rng.seed_all()
    recompute = None if plan is None else RecomputePlan.from_flag(plan, config.num_layers)
    model = GPTModel(config, state, sequence_parallel=sp, device="meta", rng=rng, recompute=recompute)
    model.init_weights(SEED)
    return model, rng


def _loss_and_grads(model, config):
    tokens, labels = _batch(config)
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _recompute_mismatches(state, sp):
    """Plans whose loss or any gradient differs from the run without recompute (same seed)."""
    base_loss, base_grads = _loss_and_grads(_build(BOTH, state, sp)[0], BOTH)
    bad = []
    for plan in ("selective", "full", "full-pa"):
        loss, grads = _loss_and_grads(_build(BOTH, state, sp, plan)[0], BOTH)
        if not torch.equal(loss, base_loss):
            bad.append((plan, "loss"))
        bad += [(plan, n) for n, g in grads.items() if not torch.allclose(g, base_grads[n], rtol=1e-6,
                                                                          atol=1e-9)]
    return bad


def _step(model, config):
    """(loss, squared global grad norm: sharded grads summed over TP, replicated ones counted once)."""
    tokens, labels = _batch(config)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels).mean()
    loss.backward()
    params = list(model.parameters())
    sharded = torch.stack([p.grad.double().square().sum() for p in params if p.tensor_model_parallel])
    sharded = sharded.sum().reshape(1)
    comm.all_reduce(sharded, model.group)
    replicated = sum(p.grad.double().square().sum() for p in params if not p.tensor_model_parallel)
    return loss.item(), (sharded + replicated).item()


def _default_stream_digest() -> float:
    return torch.get_rng_state().double().sum().item()


def _dropout_runs(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    out = {}
    for sp in (False, True):
        model, rng = _build(BOTH, state, sp)
        first, second = _step(model, BOTH), _step(model, BOTH)
        stream = _default_stream_digest()
        fresh_tp_stream = RNGTracker(SEED, state.tp_rank).get_states().tp
        tp_stream_used = not torch.equal(rng.get_states().tp, fresh_tp_stream)
        rng.seed_all()
        again = _step(model, BOTH)
        model.eval()
        with torch.no_grad():
            eval_loss = model(*_batch(BOTH)).mean().item()
        out[sp] = dict(first=first, second=second, again=again, eval=eval_loss, stream=stream,
                       tp_stream_used=tp_stream_used, recompute_bad=_recompute_mismatches(state, sp))
    model, _ = _build(HIDDEN_ONLY, state, False)
    out["hidden_only_tp2"] = _step(model, HIDDEN_ONLY)
    if rank == 0:   # the same run at TP 1 on one rank
        single = ParallelState.single_process()
        model, _ = _build(HIDDEN_ONLY, single, False)
        out["hidden_only_tp1"] = _step(model, HIDDEN_ONLY)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_dropout_runs, 4, timeout=180)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_dp_replicas_agree_and_runs_reproduce(runs, sp):
    r = [rank_out[sp] for rank_out in runs]
    for tp_rank in (0, 1):   # ranks tp_rank and tp_rank + 2 are DP replicas of one TP shard
        assert r[tp_rank] == r[tp_rank + 2]
    assert r[0]["first"][0] == r[1]["first"][0]          # the loss is whole on every TP rank
    assert r[0]["again"] == r[0]["first"]                 # reseeding reproduces the step exactly
    assert r[0]["second"] != r[0]["first"]                # fresh masks on the next step
    assert abs(r[0]["eval"] - r[0]["first"][0]) > 1e-3   # dropout is really on in training
    assert r[0]["stream"] == r[1]["stream"]               # default stream in lockstep across TP
    assert r[0]["tp_stream_used"] and r[1]["tp_stream_used"]  # attention dropout drew from fork()
    assert [rank["recompute_bad"] for rank in r] == [[]] * 4     # recompute replays the masks


def test_hidden_dropout_tp2_equals_tp1(runs):
    tp1_loss, tp1_norm = runs[0]["hidden_only_tp1"]
    for rank_out in runs:
        loss, norm = rank_out["hidden_only_tp2"]
        assert loss == pytest.approx(tp1_loss, rel=1e-5)
        assert norm == pytest.approx(tp1_norm, rel=1e-4)


def test_tp_dropout_without_rng_tracker_is_refused():
    state = ParallelState.dry_run(Topology(2, 2, gpus_per_node=2))
    model = GPTModel(BOTH, state, device="cpu")   # the attention forward sends nothing before its core
    with pytest.raises(ValueError, match="needs the TP random stream: build the model with rng=RNGTracker"):
        model.layers[0].attn(torch.zeros(4, 1, BOTH.hidden_size))
