"""Shared-memory collectives of CPU groups on one host (hybrid.shm_collectives).

They must give what gloo gives, in any order of waits, when the ring is too small for what is in
flight (ranks then complete their own older collectives first: no deadlock), above the capacity
(gloo takes those), inside the ZeRO engines (bitwise the same training as over gloo), leave no
file behind, and end a wait on a dead peer with an error naming it.
"""

import glob
import random
import time

import pytest
import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

RING_BYTES = 4096   # reserve makes a region of twice this: many collectives wrap it


def _inputs(op: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * op + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _plan(seed=5, count=60):
    """The same list of collectives on every rank: (kind, dtype, shard numel, in flight before
    the oldest is waited)."""
    r = random.Random(seed)
    kinds = ("gather", "reduce", "gather in place", "reduce in place", "all-reduce sum",
             "all-reduce max", "all-reduce min")
    return [(r.choice(kinds), r.choice((torch.float32, torch.bfloat16)),
             r.randint(1, 700), r.randint(1, 5)) for _ in range(count)]


def _against_expected(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size),
                                     dp_transport="shm")
    group = state.dp
    assert comm.reserve_transport(group, RING_BYTES)
    assert not glob.glob("/dev/shm/hybrid-*"), "the shared files must be unlinked after set-up"
    waits = random.Random(rank)      # each rank waits in its own order
    inflight, results, over_capacity = [], [], 0
    for op, (kind, dtype, numel, depth) in enumerate(_plan()):
        mine = _inputs(op, rank, numel * (world_size if "reduce" in kind else 1), dtype)
        out = torch.empty(numel * (world_size if "gather" in kind else 1), dtype=dtype)
        over_capacity += mine.nbytes > group.shm.capacity
        own = slice(rank * numel, (rank + 1) * numel)
        if kind == "gather in place":        # the shard is this rank's slot of the output
            out[own] = mine
            mine = out[own]
        if kind == "reduce in place":        # the output is this rank's slice of the input
            out = mine[own]
        if kind.startswith("all-reduce"):   # in place, any size (a norm, a flag, a bucket)
            out = mine
            handle = comm.all_reduce(out, group, kind.split()[-1], async_op=True)
        elif "gather" in kind:
            handle = comm.all_gather_into(out, mine, group, async_op=True)
        else:
            handle = comm.reduce_scatter_into(out, mine, group, async_op=True)
        inflight.append(handle)
        results.append((op, kind, dtype, numel, out))
        while len(inflight) > depth:
            inflight.pop(waits.randrange(len(inflight))).wait()
    for handle in inflight:
        handle.wait()
    capacity = group.shm.capacity
    for op, kind, dtype, numel, out in results:
        every = [_inputs(op, r, numel * (world_size if "reduce" in kind else 1), dtype)
                 for r in range(world_size)]
        if kind.startswith("all-reduce"):   # combined in rank order: the same bits on every rank
            reduce = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[kind.split()[-1]]
            if out.nbytes <= capacity:
                assert torch.equal(out, reduce(torch.stack(every), dim=0)), op
            else:                           # gloo's own order
                tol = 1e-6 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(out.float(), reduce(torch.stack(every).float(), dim=0),
                                           rtol=tol, atol=tol)
        elif "gather" in kind:
            assert torch.equal(out, torch.cat(every)), op
        else:
            expected = sum(x.float()[rank * numel:(rank + 1) * numel] for x in every)
            tol = 1e-6 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    return over_capacity, group.shm._seq


def test_results_equal_gloo_with_out_of_order_waits_ring_reuse_and_fallback():
    outcome = run_on_ranks(_against_expected, 4, timeout=120)
    over_capacity, shm_collectives = outcome[0]
    assert over_capacity > 0, "the plan must include collectives above the capacity"
    assert shm_collectives > 20, "most collectives must have gone through shared memory"


def _peer_exits(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size),
                                     dp_transport="shm")
    assert comm.reserve_transport(state.dp, RING_BYTES)
    if rank == 1:
        return None                    # this process ends; rank 0 then waits for its shard
    time.sleep(0.5)
    begin = time.monotonic()
    out = torch.empty(8)
    with pytest.raises(RuntimeError) as caught:
        comm.all_gather_into(out, torch.ones(4), state.dp)
    return str(caught.value), time.monotonic() - begin


def test_dead_peer_ends_the_wait_with_its_rank_named():
    message, waited = run_on_ranks(_peer_exits, 2, timeout=60)[0]
    assert "lost connection to rank(s) 1 (pid" in message, message
    assert waited < 5.0, waited


def _disabled(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size),
                                     dp_transport="gloo")
    return comm.reserve_transport(state.dp, RING_BYTES), state.dp.shm


def test_switched_off_by_the_config():
    assert run_on_ranks(_disabled, 2) == [(False, None)] * 2


def _default_is_shared_memory(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    return state.dp.shm is not None, comm.needs_reduce_scratch(state.dp)


def test_auto_is_on_for_cpu_ranks_of_one_host_and_unsized_until_an_engine_reserves():
    assert run_on_ranks(_default_is_shared_memory, 2) == [(True, True)] * 2


def _train(rank, world_size, stage, shm):
    from hybrid.zero import AdamWConfig, ZeroConfig, build_zero_optimizer
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size),
                                     dp_transport="shm" if shm else "gloo")
    config = GPTConfig(2, 32, 4, vocab_size=128, seq_length=16, hidden_dropout=0.0,
                       attention_dropout=0.0)
    model = GPTModel(config, state, device="meta")   # stage 3 partitions it from init_parameter
    if stage < 3:
        model.init_weights(0)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, bucket_size=3000),
                               AdamWConfig(lr=1e-2), **({"seed": 0} if stage == 3 else {}))
    assert (state.dp.shm is not None) == shm
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 128, (2, 16), generator=g)
        opt.zero_grad()
        loss = model(tokens, tokens.roll(1, 1)).mean()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    report = opt.memory_report()
    params = torch.cat([u.shard for u in opt.all_units] if stage == 3 else [opt.flat_param])
    return losses, params.tolist(), report.measured["buffers"]   # no tensor through the queue


@pytest.mark.slow   # CI budget: the transport itself stays in the default set (results equal gloo)
@pytest.mark.parametrize("stage", [2, 3])
def test_engines_train_bitwise_as_over_gloo(stage):
    over_shm = run_on_ranks(_train, 2, args=(stage, True))
    over_gloo = run_on_ranks(_train, 2, args=(stage, False))
    for (losses, params, buffers), (losses_gloo, params_gloo, _) in zip(over_shm, over_gloo):
        assert losses == losses_gloo
        assert params == params_gloo
        assert buffers > 0


TRANSPORT_FLAGS = {None: True, "auto": True, "shm": True, "gloo": False}   # flag -> shm on


def _from_flags(rank, world_size):
    from pretrain.arguments import parse_args
    from hybrid.launch_env import LaunchEnv
    from pretrain.build import build_parallel_state
    from tests.training_helpers import tiny_args
    on = {}
    for transport in TRANSPORT_FLAGS:
        cfg, _ = parse_args(tiny_args(extra=["--gpus-per-node", str(world_size)])
                            + ([] if transport is None else ["--dp-transport", transport]))
        layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
        on[transport] = build_parallel_state(cfg, layout).dp.shm is not None
    return on


def test_the_trainer_flag_chooses_the_transport():
    assert run_on_ranks(_from_flags, 2) == [TRANSPORT_FLAGS] * 2


def test_an_unknown_transport_is_a_config_error():
    from pretrain.arguments import parse_args
    from pretrain.sections import TrainConfigError
    with pytest.raises(TrainConfigError, match="--dp-transport must be auto, shm or gloo, got 'nccl'"):
        parse_args(["--dp-transport", "nccl"])
