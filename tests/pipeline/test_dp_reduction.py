"""With pipeline parallelism, gradients are reduced across DP once per step, after the last
micro-batch (issue 16's composition rule), at ZeRO stages 0, 1 and 2.

Each stage's parameters get m backwards per step (m v when interleaved). The ledger's DP bytes of
one optimizer step must equal one step's volume of ZeRO §7 for the stage's own parameters (2Ψ(n-1)/n
per rank, Ψ in bytes: all-reduce at stage 0, reduce-scatter + all-gather at stages 1-2), not m times
it. Stage 2 keeps no full-size gradient, so with PP it runs as stage 1
(:func:`hybrid.zero_policy.stage_with_pipeline`); the test would see m x the volume otherwise.
"""

from __future__ import annotations

import pytest

from hybrid.parallel_state import ParallelState
from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import ZeroConfig, build_zero_optimizer
from hybrid.zero.flat import OptimizerStatePartitioning
from hybrid.zero_policy import stage_with_pipeline
from tests.pipeline.test_pipeline import PipeTask, _stage_chunks, _tied


def _dp_bytes_per_step(rank, world_size, cases):
    task = PipeTask()
    data = task.data()[:2]
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=2))
    b_local = task.batch // state.dp_size
    rows = []
    for schedule, v, m, stage in cases:
        config = PipelineConfig(2, m, task.config.num_layers, schedule, v)
        chunks = _stage_chunks(task, state, config, False, None)
        engine = build_zero_optimizer(StageChunks(chunks), state,
                                      ZeroConfig(stage=stage, bucket_size=300,
                                                 gradient_accumulation_steps=m * v), task.adamw)
        runner = PipelineRunner(state, config, chunks, engine=engine, tied=_tied(state, chunks),
                                activation_shape=(task.config.seq_length, b_local // m,
                                                  task.config.hidden_size))
        for tokens, labels in data:
            lo = state.dp_rank * b_local
            step = b_local // m
            engine.zero_grad()
            runner.step([(tokens[lo + i * step: lo + (i + 1) * step],
                          labels[lo + i * step: lo + (i + 1) * step]) for i in range(m)])
            engine.step()
            report = engine.comm_report()
            rows.append((f"{schedule} v{v} m{m} zero{stage}", engine.stage, report.dp_bytes,
                         report.expected_dp_bytes,
                         isinstance(engine, OptimizerStatePartitioning)))
    return rows


def test_gradients_reduce_once_per_step_at_every_stage_and_schedule():
    cases = [("1f1b", 1, 4, 0), ("1f1b", 1, 4, 1), ("1f1b", 1, 4, 2), ("interleaved", 2, 2, 2),
             ("gpipe", 1, 4, 2)]
    for rank_rows in run_on_ranks(_dp_bytes_per_step, 4, args=(cases,)):   # PP 2 x DP 2
        for what, engine_stage, measured, expected, partitions_optimizer in rank_rows:
            assert expected > 0, what
            assert measured == pytest.approx(expected, rel=0.01), what   # m x it before
            if "zero2" in what:
                assert engine_stage == 1 and partitions_optimizer, what


def test_stage_two_runs_as_stage_one_only_with_pipeline_parallelism():
    assert [stage_with_pipeline(s, 1) for s in range(4)] == [0, 1, 2, 3]
    assert [stage_with_pipeline(s, 4) for s in range(4)] == [0, 1, 1, 3]
