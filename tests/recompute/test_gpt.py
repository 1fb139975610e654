"""Recompute on the GPT model, TP 1 / 2 / 4, SP on and off, dropout 0.1 (one spawn per TP degree).

* parity: every mode (selective, full, full k=2, Pa, Pa+cpu, Pa + MD arena) gives the loss and the
  gradients of the no-recompute run bit for bit (fp32; the recomputation reruns the same kernels on
  the same inputs with the RNGTracker's states restored, so dropout masks are identical);
* memory: saved-activation bytes per layer and rank (saved_tensors_hooks) agree with the activation
  model (hybrid.perf.activations via the planner's element-size conversion, CPU fp32 dropout masks)
  within 10% on two GPT shapes - exactly, in fact, with the CPU attention core's own accounting
  (``cpu_core``: a bool attention mask, no dropout output kept); Pa divides the checkpoint bytes by TP; Pa+cpu moves them to
  the host tier;
* communication: Pa adds exactly one all-gather of one [s, b, h] checkpoint per layer to the TP
  ledger (none under SP, where the checkpoint already is a sequence shard).
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute import ActivationMeter, ModelDims, RecomputePlan
from hybrid.recompute.planner import mode_costs
from hybrid.tensor_parallel import RNGTracker
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel

log = logging.getLogger(__name__)

DROP = dict(hidden_dropout=0.1, attention_dropout=0.1)
SHAPES = {   # (config, micro-batch)
    "2x64-s32": (GPTConfig(2, 64, 4, vocab_size=128, seq_length=32, **DROP), 2),
    "3x96-s16": (GPTConfig(3, 96, 8, vocab_size=128, seq_length=16, **DROP), 3),
}
MODES = {"selective": {}, "full": {}, "full-k2": dict(granularity=2), "full-pa": {},
         "full-pa-md": dict(arena_chunk_bytes=1 << 16), "full-pa-cpu": dict(host_chunk_bytes=1 << 16)}


def _plan(name: str, layers: int) -> RecomputePlan | None:
    if name == "none":
        return None
    return RecomputePlan.uniform(name.replace("-k2", "").replace("-md", ""), layers, **MODES[name])


def _step(state, config, micro_batch, sp, name):
    rng = RNGTracker(17, state.tp_rank)
    rng.seed_all()
    model = GPTModel(config, state, sequence_parallel=sp, rng=rng,
                     recompute=_plan(name, config.num_layers))
    model.init_weights(5)
    gen = torch.Generator().manual_seed(23)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length), generator=gen)
    labels = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length), generator=gen)
    arenas = model.recomputer.arenas() if model.recomputer else []
    state.ledger.reset()
    with ActivationMeter(exclude=model.parameters(), arenas=arenas) as meter:
        meter.track_modules({f"layer{i}": layer for i, layer in enumerate(model.layers)})
        loss = model(tokens, labels).mean()
        saved = dict(meter.live)
        outside = meter.by_scope["other"]
        loss.backward()
    gathers = [r.numel for r in state.ledger.records if r.group == "tp" and r.op == "all_gather"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), grads=grads, saved=saved, outside=outside, gathers=gathers,
                left=meter.total())


CORE = ("selective", "full", "full-pa", "full-pa-cpu")   # k2 / MD variants: TP 1 and 2 only


def _run_layout(state, sps, shapes=tuple(SHAPES), modes=tuple(MODES)):
    """Parity checks in place; per (shape, sp, mode) the measured bytes and extra gathers."""
    out = {}
    for shape in shapes:
        config, mb = SHAPES[shape]
        for sp in sps:
            ref = _step(state, config, mb, sp, "none")
            out[(shape, sp, "none")] = dict(saved=ref["saved"], per_layer=_per_layer(ref, ref, config))
            for name in modes:
                got = _step(state, config, mb, sp, name)
                assert torch.equal(got["loss"], ref["loss"]), (shape, sp, name)
                for key, g in ref["grads"].items():
                    assert torch.equal(got["grads"][key], g), (shape, sp, name, key)
                assert got["left"] == 0, "saved tensors outlived backward"
                out[(shape, sp, name)] = dict(saved=got["saved"], gathers=got["gathers"],
                                              per_layer=_per_layer(got, ref, config))
    return out


def _per_layer(got, ref, config):
    """Bytes one layer keeps, per tier: what the forward left alive minus the embedding / output /
    loss activations (measured outside the layers in the no-recompute run), over the layers."""
    tiers = dict(got["saved"])
    tiers["device"] = tiers.get("device", 0) - ref["outside"]
    return {t: b / config.num_layers for t, b in tiers.items()}


def _ranks(rank, world_size, tp):
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    if tp > 2:   # keep CI fast: one shape and the spec's modes at TP 4
        return _run_layout(state, [False, True], shapes=("3x96-s16",), modes=CORE)
    return _run_layout(state, [False, True])


def _expected(config, mb, tp, sp, name) -> dict[str, float]:
    d = ModelDims(config.num_layers, config.hidden_size, config.num_attention_heads, config.seq_length,
                  mb, tp=tp, sequence_parallel=sp and tp > 1, mask_bytes=4,   # CPU masks are fp32
                  cpu_core=True)
    mode = name.replace("-md", "")
    if mode == "full-k2":   # one checkpoint per 2-layer segment
        segments = -(-config.num_layers // 2)
        return {"device": mode_costs(d)["full"].device_bytes * segments / config.num_layers}
    c = mode_costs(d)[mode]
    return {"device": c.device_bytes, "host": c.host_bytes}


def _check_memory_and_comm(results, tp):
    rows = []
    for (shape, sp, name), r in results.items():
        config, mb = SHAPES[shape]
        want = _expected(config, mb, tp, sp, name)
        for tier, value in want.items():
            got = r["per_layer"].get(tier, 0)
            rows.append(f"tp{tp} sp={int(sp)} {shape} {name:>11} {tier}: measured {got:,.0f} B "
                        f"model {value:,.0f} B")
            assert got == pytest.approx(value, rel=0.10, abs=1), rows[-1]
        if name.startswith("full-pa") and tp > 1:
            base = list(results[(shape, sp, "full")]["gathers"])
            extra = list(r["gathers"])
            for numel in base:
                extra.remove(numel)
            sbh = config.seq_length * mb * config.hidden_size
            assert extra == ([] if sp else [sbh] * config.num_layers), (shape, sp, name, extra)
    log.info("recompute memory per layer and rank:\n%s", "\n".join(rows))


def test_gpt_recompute_tp1():
    _check_memory_and_comm(_run_layout(ParallelState.single_process(), [False]), 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_recompute_tp(tp):
    results = run_on_ranks(_ranks, tp, args=(tp,), timeout=600)
    _check_memory_and_comm(results[0], tp)
