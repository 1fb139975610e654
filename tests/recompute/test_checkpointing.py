"""Recompute machinery on a small TP stack: every mode gives the no-recompute loss and gradients
(bit-equal: the recomputation reruns the same kernels on the same inputs with the same dropout
masks), Pa adds exactly one checkpoint all-gather per segment to the TP ledger, Pa+cpu leaves the
device tier, and MD arenas keep the checkpoint storages constant across steps."""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute import ActivationMeter, Arena, RecomputePlan
from hybrid.tensor_parallel import RNGTracker
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from tests.recompute.toy_stack import ToyStack

S, B, H, HEADS, LAYERS, P = 8, 2, 16, 4, 3, 0.2
PLANS = {
    "selective": dict(mode="selective"),
    "full": dict(mode="full"),
    "full-k2": dict(mode="full", granularity=2),
    "full-md": dict(mode="full", arena_chunk_bytes=4096),
    "full-pa": dict(mode="full-pa"),
    "full-pa-md": dict(mode="full-pa", arena_chunk_bytes=4096),
    "full-pa-cpu": dict(mode="full-pa-cpu", host_chunk_bytes=4096),
}


def _plan(name: str) -> RecomputePlan | None:
    if name == "none":
        return None
    kw = dict(PLANS[name])
    return RecomputePlan.uniform(kw.pop("mode"), LAYERS, **kw)


def _step(state, sp: bool, name: str, seed: int = 3):
    """One forward/backward of a fresh stack; loss, grads, ledger counts and the meter."""
    rng = RNGTracker(11, state.tp_rank)
    rng.seed_all()
    model = ToyStack(LAYERS, H, HEADS, state.tp, sp, rng, P, _plan(name))
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    w = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed + 1))   # loss weights
    arenas = model.recomputer.arenas() if model.recomputer else []
    state.ledger.reset()
    with ActivationMeter(exclude=[*model.parameters(), w], arenas=arenas) as meter:
        out = model(x)
        loss = (out * w[:out.size(0)]).sum()      # saves only w: the meter counts the layers alone
        saved = dict(meter.live)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad.clone()
    gathers = [r.numel for r in state.ledger.records if r.group == "tp" and r.op == "all_gather"]
    return dict(loss=loss.detach(), grads=grads, saved=saved, gathers=gathers, left=meter.total())


CORE = ("selective", "full", "full-pa", "full-pa-cpu")   # the modes of the spec; variants at tp 1-2


def _check_all_modes(rank, world_size, tp):
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    out = {}
    for sp in ([False, True] if tp > 1 else [False]):
        ref = _step(state, sp, "none")
        for name in (CORE if tp > 2 else PLANS):
            got = _step(state, sp, name)
            assert torch.equal(got["loss"], ref["loss"]), (sp, name, got["loss"], ref["loss"])
            for key, g in ref["grads"].items():
                assert torch.equal(got["grads"][key], g), (sp, name, key, (got["grads"][key] - g).abs().max())
            assert got["left"] == 0, (sp, name, "saved tensors outlived backward")
            out[(sp, name)] = dict(saved=got["saved"], gathers=got["gathers"])
        out[(sp, "none")] = dict(saved=ref["saved"], gathers=ref["gathers"])
    return out


def _check_layout(results, tp):
    ckpt = S * B * H * 4                        # one fp32 layer input [s, b, h]
    for (sp, name), r in results[0].items():
        if not name.startswith("full-pa"):
            continue
        # compared with plain full recompute (which reruns the same forward collectives, e.g. the
        # SP all-gathers), Pa adds exactly one all-gather of one s*b*h checkpoint per layer;
        # under SP the checkpoint is already a sequence shard and is never gathered.
        base = list(results[0][(sp, "full")]["gathers"])
        extra = list(r["gathers"])
        for numel in base:
            extra.remove(numel)
        assert extra == ([] if sp else [S * B * H] * LAYERS), (sp, name, extra)
    if tp > 1:
        full, pa = results[0][(False, "full")]["saved"], results[0][(False, "full-pa")]["saved"]
        assert full["device"] == LAYERS * ckpt and pa["device"] == LAYERS * ckpt // tp
        cpu = results[0][(False, "full-pa-cpu")]["saved"]
        assert cpu.get("device", 0) == 0 and cpu["host"] == LAYERS * ckpt // tp
        if (False, "full-pa-md") in results[0]:
            assert results[0][(False, "full-pa-md")]["saved"]["device"] == LAYERS * ckpt // tp
        sp_full = results[0][(True, "full-pa-cpu")]["saved"]
        assert sp_full["host"] == LAYERS * ckpt // tp and sp_full.get("device", 0) == 0


def test_all_modes_single_rank():
    results = [_check_all_modes_local()]
    ckpt = S * B * H * 4
    assert results[0][(False, "full")]["saved"]["device"] == LAYERS * ckpt
    assert results[0][(False, "full-k2")]["saved"]["device"] == 2 * ckpt   # layers 0-1, 2
    assert results[0][(False, "full-pa-cpu")]["saved"]["host"] == LAYERS * ckpt


def _check_all_modes_local():
    import torch.distributed as dist
    assert not dist.is_initialized()
    state = ParallelState.single_process()
    out = {}
    ref = _step(state, False, "none")
    for name in PLANS:
        got = _step(state, False, name)
        assert torch.equal(got["loss"], ref["loss"]), name
        for key, g in ref["grads"].items():
            assert torch.equal(got["grads"][key], g), (name, key)
        out[(False, name)] = dict(saved=got["saved"])
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_all_modes_tensor_parallel(tp):
    _check_layout(run_on_ranks(_check_all_modes, tp, args=(tp,)), tp)


def test_recompute_changes_dropout_stream_nowhere():
    """After a recomputed step the RNG streams are where the no-recompute step left them."""
    states = []
    for name in ("none", "full"):
        state = ParallelState.single_process()
        rng = RNGTracker(11, 0)
        rng.seed_all()
        model = ToyStack(LAYERS, H, HEADS, state.tp, False, rng, P, _plan(name))
        x = torch.randn(S, B, H, requires_grad=True)
        model(x).sum().backward()
        states.append((torch.get_rng_state(), rng.get_states().tp))
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])


def test_md_arena_keeps_storages_constant():
    """MD: checkpoints of three steps live in the same storages; without an arena they do not."""
    def storages(plan):
        state = ParallelState.single_process()
        rng = RNGTracker(11, 0)
        model = ToyStack(LAYERS, H, HEADS, state.tp, False, rng, P, plan)
        per_step = []
        for _ in range(3):
            x = torch.randn(S, B, H, requires_grad=True)
            ptrs = set()
            store = model.recomputer.stores["full"]
            original = store.save

            def spy(t, original=original):
                handle = original(t)
                ptrs.add(handle.kept.untyped_storage().data_ptr())
                return handle
            store.save = spy
            model(x).sum().backward()
            store.save = original
            per_step.append(ptrs)
        return per_step
    md = storages(RecomputePlan.uniform("full", LAYERS, arena_chunk_bytes=1 << 16))
    recomputer = ToyStack(1, H, HEADS, ParallelState.single_process().tp, False, RNGTracker(1, 0), P,
                          RecomputePlan.uniform("full-pa-cpu", 1, arena_chunk_bytes=4096,
                                                host_chunk_bytes=8192)).recomputer
    assert recomputer.tier_bytes() == {"device": 0, "host": 0}     # chunks are created on first use
    recomputer.host_arena.allocate((4,), torch.float32)
    assert recomputer.tier_bytes() == {"device": 0, "host": 8192}
    assert "host-checkpoints (host tier)" in recomputer.buffer_report()
    assert [len(s) for s in md] == [1, 1, 1] and md[0] == md[1] == md[2]
    plain = storages(RecomputePlan.uniform("full", LAYERS))
    assert all(len(s) == LAYERS for s in plain)


def test_arena_bump_rewind_and_errors():
    arena = Arena("t", 256)
    a = arena.allocate((10,), torch.float32)            # 40 B at 0
    b = arena.allocate((3, 5), torch.float64)           # 120 B at 64
    c = arena.allocate((30,), torch.float32)            # 120 B: does not fit -> chunk 2
    assert a.data_ptr() % 64 == 0 and b.data_ptr() - a.data_ptr() == 64
    assert not c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert arena.stats().num_chunks == 2 and arena.contains(b) and not arena.contains(torch.ones(2))
    for t in (a, b, c):
        arena.release(t)
    again = arena.allocate((10,), torch.float32)
    assert again.data_ptr() == a.data_ptr()            # rewound: same memory next step
    with pytest.raises(ValueError, match="raise the arena chunk size"):
        arena.allocate((100,), torch.float32)
    with pytest.raises(ValueError, match="did not allocate"):
        arena.release(torch.ones(3))


def test_plan_segments_and_flags():
    plan = RecomputePlan(("none", "full", "full", "full", "selective", "full-pa"), granularity=2)
    assert [(s.start, s.stop, s.mode) for s in plan.segments()] == [
        (0, 1, "none"), (1, 3, "full"), (3, 4, "full"), (4, 5, "selective"), (5, 6, "full-pa")]
    assert "1-3: full" in str(plan) and plan.selective(4) and not plan.selective(1)
    with pytest.raises(ValueError, match="unknown recompute mode"):
        RecomputePlan(("nope",))
    with pytest.raises(ValueError, match="memory-budget"):
        RecomputePlan.from_flag("auto", 4)
    assert RecomputePlan.from_flag("full-pa-cpu", 2).modes == ("full-pa-cpu", "full-pa-cpu")


def test_meter_counts_storages_once_and_follows_their_lifetime():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    arena = Arena("h", 1024, tier="host")
    with ActivationMeter(exclude=[w], arenas=[arena]) as meter:
        y = x @ w                        # saves x (48 B) and w (a parameter: excluded)
        with meter.scope("square"):
            z = (y * y).sum()            # saves y once although both operands are y
        parts = y.unbind(0)              # views of y's storage: counted with y
        p = (parts[0] * parts[1]).sum()
        assert meter.total() == 48 + 48 and meter.live["device"] == 96
        slot = arena.allocate((2,), torch.float32)
        q = (torch.ones(2, requires_grad=True) * slot).sum()   # saves the arena slot: host tier
        assert meter.live["host"] == 8
        (z + p + q).backward()
    assert meter.total() == 0 and meter.peak["device"] == 96 and meter.peak_total == 104
    assert meter.by_scope == {"other": 48 + 8, "square": 48}
