"""ZeRO stage 3 partitioning arithmetic and construction, without process groups (ZeRO §5.3).

A DP group of 4 ranks is described by plain Group objects (no communication happens while building
units), so each rank's construction is checked in one process: the chunks tile every unit exactly
once, are aligned, and a meta-built GPT is materialised one parameter at a time into 1/Nd chunks that
equal the canonical initial values, leaving every model parameter without storage.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hybrid.comm import CommLedger, Group
from hybrid.parallel_state import ParallelState
from hybrid.zero import stage3_build as build
from hybrid.zero.stage3_unit import ShardedUnit
from models.gpt.model import GPTModel
from models.gpt.sharding import canonical_init, shard_tensor
from tests.zero.test_stage3 import CONFIG, SEED

DP = 4


def _group(rank: int) -> Group:
    return Group("dp", list(range(DP)), rank, CommLedger())


def test_chunks_tile_every_unit_exactly_once_and_are_aligned():
    shapes = [(5, 3), (7,), (1,), (4, 4, 2)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    seen = torch.zeros(numel, dtype=torch.int64)
    for rank in range(DP):
        params = [(f"p{i}", nn.Parameter(torch.empty(s, device="meta"))) for i, s in enumerate(shapes)]
        unit = ShardedUnit("u", params, _group(rank), dtype=torch.bfloat16, device=torch.device("cpu"),
                           alignment=8)
        assert unit.chunk % 8 == 0 and unit.padded == unit.chunk * DP >= numel > unit.padded - 8 * DP
        assert unit.held_bytes() == 0 and not unit.gathered
        for seg in unit.segments:
            start = seg.slot.offset + seg.param_offset
            assert rank * unit.chunk <= start and start + seg.length <= (rank + 1) * unit.chunk
            assert seg.chunk_offset == start - rank * unit.chunk
            seen[start:start + seg.length] += 1
    assert bool((seen == 1).all())


def test_meta_gpt_is_materialised_one_parameter_at_a_time_into_its_chunks():
    full = {}   # canonical TP-local values, flattened, for checking the chunks
    for rank in range(DP):
        state = ParallelState.single_process()
        model = GPTModel(CONFIG, state, device="meta")
        alive: list[weakref.ref] = []

        def init_fn(name: str) -> torch.Tensor:
            assert all(r() is None for r in alive), "two initial values alive at once"
            value = shard_tensor(CONFIG, name, canonical_init(CONFIG, name, SEED), 0, 1)
            full[name] = value.reshape(-1).clone()
            alive.append(weakref.ref(value))
            return value

        modules = model.sharding_units()
        groups, small = build.assign_units(model, modules, threshold=0)
        init = build.initial_values(model, init_fn, SEED)
        units, kept = build.make_units(model, groups, small, _group(rank), dtype=torch.float32,
                                       device=torch.device("cpu"), alignment=4)
        for unit in units:
            unit.materialize(init)
        assert kept is None and all(r() is None for r in alive)
        for unit in units:
            for seg in unit.segments:
                want = full[seg.slot.name][seg.param_offset:seg.param_offset + seg.length]
                assert torch.equal(seg.of(unit.shard), want), seg.slot.name
        assert all(p.untyped_storage().nbytes() == 0 and not p.is_meta for p in model.parameters())
        assert model.embedding.word.weight is units[0].slots[0].param   # one object, tied use too
        assert build.tied_units(model, modules) == [0]
        assert build.backward_reads(modules) == [False] + [True] * (len(modules) - 1)


def test_parameters_outside_the_units_are_refused():
    state = ParallelState.single_process()
    model = GPTModel(CONFIG, state, device="meta")
    units = model.sharding_units()[:-1]          # final norm left out
    try:
        build.assign_units(model, units, threshold=0)
    except ValueError as err:
        assert "final_norm.weight" in str(err) and "sharding_units" in str(err)
    else:
        raise AssertionError("a parameter outside every unit was accepted")
