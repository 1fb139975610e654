"""Pipeline parallelism (hybrid/pipeline): layouts, schedules without communication, and training
on CPU ranks against the single-device oracle.

Parity: GPTModel split into stages (x TP, +SP, x DP) with each schedule, gradient accumulation
(m micro-batches), ZeRO stages 0-2, a recompute mode and clipping, 5 fp32 steps vs ReferenceGPT with
torch.optim.AdamW on the whole batch: losses, gradient norms and final parameters within rtol 1e-5.
Interleaved cases run m = 2p micro-batches, so besides the warm-up and cool-down every stage also
runs the steady state of alternating forwards and backwards of different chunks (m = p would be
all warm-up); 1F1B runs m = 2p at PP 4 in the default suite.

Volume: per step and PP column, every boundary of the (virtual) pipeline carries one activation
forward and one gradient back per micro-batch: 2 m (p v - 1) messages of b s h elements (b s h / t
with sequence parallelism, whose p2p tensor is the sequence shard). The ledger's ``pp`` sends are
checked against that count per rank and in total.

Bubble: stages whose forward and backward sleep a fixed time (100 ms and 200 ms per micro-batch, so
CPU contention does not blur the compute) measure idle time over the pipeline's step time; the mean
over stages (best of 3 steps) is checked against (p - 1) / (v m + p - 1) at two m each (1F1B and
GPipe p 4: m 4 and 8, and 4 and 16 in the slow suite; interleaved p 2 v 2: m 2 and 4): within
-0.02 / +0.08 absolute, and the fall from the first m to the second within 20% (relative) of the
formula's ratio. The absolute error is one-sided and about constant: gloo's p2p latency and the
wake-up delay of a loaded machine add a fixed time per message to the critical path (idle time on
the other stages), so it does not scale with the bubble; the ratio cancels most of it. Measured
values are printed (``-s``); docs/choosing-parallelism.md records a run. The same runs count the
activations the runner holds: 1F1B stage s at most p - s micro-batches, GPipe all m, interleaved
its warm-up count of chunk activations plus the one in flight of the steady state.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.pipeline import (PipelineConfig, PipelineConfigError, PipelineRunner, StageChunks,
                             TiedEmbedding, bubble_formula, build_schedule, simulate)
from hybrid.recompute import RecomputePlan
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology, TopologyError
from hybrid.zero import ZeroConfig, build_zero_optimizer
from models.gpt import GPTConfig
from models.gpt import sharding
from models.gpt.model import GPTModel
from tests.zero.test_stages import GPTTask, reference_run


# ---- layouts -------------------------------------------------------------------------------------
def test_rank_grid_is_tp_then_dp_then_pp():
    topo = Topology(16, 2, gpus_per_node=4, pipeline_parallel_size=2)
    assert topo.grid3d.tolist() == torch.arange(16).view(2, 4, 2).tolist()
    assert topo.tp_group_of(13) == [12, 13]
    assert topo.dp_group_of(13) == [9, 11, 13, 15]
    assert topo.pp_group_of(13) == [5, 13]
    assert topo.embedding_group_of(5) == [5, 13]
    assert topo.mp_group_of(13) == [4, 5, 12, 13]
    c = topo.coords(13)
    assert (c.pp_rank, c.dp_rank, c.tp_rank) == (1, 2, 1)
    assert topo.rank_of(1, 2, 1) == 13
    for rank in range(16):   # every rank is in exactly one group of each kind
        for groups in (topo.tp_groups(), topo.dp_groups(), topo.pp_groups()):
            assert sum(rank in g for g in groups) == 1


def test_pp_one_keeps_the_two_dimensional_grid():
    topo = Topology(400, 16, gpus_per_node=16)
    assert topo.pp_size == 1 and topo.grid.tolist() == torch.arange(400).view(25, 16).tolist()
    assert topo.pp_groups() == [[r] for r in range(400)]
    assert "PP" not in topo.describe()


def test_thousands_of_ranks_with_four_stages_describe_without_torch_distributed():
    topo = Topology(3072, 8, gpus_per_node=8, pipeline_parallel_size=64)   # Megatron's 1T layout
    assert topo.dp_size == 6 and len(topo.pp_groups()) == 48
    assert topo.pp_group_of(0) == list(range(0, 3072, 48))
    state = ParallelState.dry_run(topo, rank=3071)
    assert (state.pp_rank, state.pp_size, state.is_last_stage) == (63, 64, True)
    assert state.embedding.ranks == [47, 3071] and state.mp.size == 512


def test_invalid_layouts_are_clear_errors():
    with pytest.raises(TopologyError, match="not divisible by tensor-model-parallel size 2 x "
                                             "pipeline-model-parallel size 3"):
        Topology(8, 2, gpus_per_node=8, pipeline_parallel_size=3)
    with pytest.raises(PipelineConfigError, match="6 layers do not split evenly into 2 pipeline "
                                                  "stages x 2 virtual stages"):
        PipelineConfig(2, 4, 6, "interleaved", 2)
    with pytest.raises(PipelineConfigError, match="multiple of the pipeline-model-parallel size 4"):
        PipelineConfig(4, 2, 8, "interleaved", 2)
    with pytest.raises(PipelineConfigError, match="need the interleaved schedule"):
        PipelineConfig(2, 4, 8, "1f1b", 2)
    with pytest.raises(PipelineConfigError, match="choose a divisor of 4"):
        PipelineConfig.from_layers_per_virtual_stage(2, 4, 8, 3)
    assert PipelineConfig.from_layers_per_virtual_stage(2, 4, 8, 2).num_model_chunks == 2


def test_zero3_with_pipeline_is_refused_with_the_reason():
    state = ParallelState.dry_run(Topology(4, 1, gpus_per_node=4, pipeline_parallel_size=2), 0)
    with pytest.raises(ValueError, match="ZeRO stage 3 with pipeline parallelism is not supported.*"
                                         "2m times"):
        build_zero_optimizer(nn.Linear(2, 2), state, ZeroConfig(stage=3), GPTTask.adamw)


# ---- schedules without communication -------------------------------------------------------------
@pytest.mark.parametrize("schedule,p,v", [("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
                                          ("interleaved", 2, 2), ("interleaved", 4, 2),
                                          ("interleaved", 2, 3)])
@pytest.mark.parametrize("m_over_p", [1, 2, 4])
def test_schedules_complete_and_their_bubble_is_the_formula(schedule, p, v, m_over_p):
    m = p * m_over_p
    config = PipelineConfig(p, m, p * v * 2, schedule, v)
    per_stage = build_schedule(config)
    for actions in per_stage:   # every forward and backward of every chunk exactly once
        assert sorted((a.kind, a.micro_batch, a.chunk) for a in actions) == sorted(
            (k, i, c) for k in "FB" for i in range(m) for c in range(v))
    sim = simulate(config)
    assert sim.bubble == pytest.approx(bubble_formula(config), rel=1e-9)
    if schedule == "1f1b":   # activations held: at most p - stage micro-batches
        assert sim.peak_in_flight == [min(p - s, m) for s in range(p)]
    if schedule == "gpipe":
        assert sim.peak_in_flight == [m] * p


# ---- training parity against the oracle ----------------------------------------------------------
class PipeTask(GPTTask):
    config = GPTConfig(4, 32, 4, vocab_size=101, seq_length=8, hidden_dropout=0.0,
                       attention_dropout=0.0, make_vocab_size_divisible_by=4)


def _stage_chunks(task, state, config, sequence_parallel, recompute):
    """``recompute``: one mode for every stage, or a tuple of one mode (or None) per stage."""
    if isinstance(recompute, tuple):
        recompute = recompute[state.pp_rank]
    chunks = []
    for c in range(config.num_model_chunks):
        start, stop = config.layer_range(state.pp_rank, c)
        plan = RecomputePlan.uniform(recompute, stop - start) if recompute else None
        chunk = GPTModel(task.config, state, device="meta", sequence_parallel=sequence_parallel,
                         layers=(start, stop), pre_process=config.is_first(state.pp_rank, c),
                         post_process=config.is_last(state.pp_rank, c), recompute=plan)
        chunk.init_weights(11)
        chunks.append(chunk)
    return chunks


def _tied(state, chunks):
    if state.is_first_stage:
        return TiedEmbedding(state, lambda: chunks[0].embedding.word.weight)
    if state.is_last_stage:
        return TiedEmbedding(state, lambda: chunks[-1].output_weight)
    return None


def _pipeline_parity(rank, world_size, tp, pp, cases, sequence_parallel=False, clip=0.0, layers=4,
                     prefetch=None, batch=8):
    """``cases``: (schedule, v, m, ZeRO stage, recompute) each; ``batch``: the global batch (the
    oracle's too), so that m = 2p micro-batches per DP rank exist at DP 2."""
    task = PipeTask()
    task.config = dataclasses.replace(task.config, num_layers=layers)
    task.batch = batch
    data = task.data()
    ref_losses, ref_norms, ref_params = reference_run(task, data, clip)
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size,
                                              pipeline_parallel_size=pp))
    b_local = task.batch // state.dp_size
    checked = []
    for schedule, v, m, stage, recompute in cases:
        config = PipelineConfig(pp, m, task.config.num_layers, schedule, v)
        chunks = _stage_chunks(task, state, config, sequence_parallel, recompute)
        engine = build_zero_optimizer(StageChunks(chunks), state,
                                      ZeroConfig(stage=stage, bucket_size=300, clip_grad=clip,
                                                 gradient_accumulation_steps=m * v), task.adamw)
        s = task.config.seq_length // (tp if sequence_parallel and tp > 1 else 1)
        shape = (s, b_local // m, task.config.hidden_size)
        tied = _tied(state, chunks)
        runner = PipelineRunner(state, config, chunks, activation_shape=shape, engine=engine,
                                tied=tied, prefetch=prefetch)
        losses, norms, pp_sends = [], [], []
        for tokens, labels in data:
            lo = state.dp_rank * b_local
            mbs = [(tokens[lo + i * b_local // m: lo + (i + 1) * b_local // m],
                    labels[lo + i * b_local // m: lo + (i + 1) * b_local // m]) for i in range(m)]
            engine.zero_grad()
            mark = state.ledger.position
            out = runner.step(mbs)
            pp_sends.append(sum(r.bytes_per_rank for r in state.ledger.since(mark)
                                if r.group == "pp" and r.op == "send"))
            result = engine.step()
            if tied is not None:
                tied.sync_weight()
            norms.append(result.grad_norm)
            if out.loss is not None:
                total = torch.tensor([out.loss])
                with comm.unrecorded(state.dp):
                    comm.all_reduce(total, state.dp)
                losses.append(total.item() / state.dp_size)
        what = f"{schedule} v{v} m{m} zero{stage} recompute {recompute} pp{pp} tp{tp} dp{state.dp_size}"
        if state.is_last_stage:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                       atol=1e-6, msg=lambda msg: f"{what} losses: {msg}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=lambda msg: f"{what} grad norms: {msg}")
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                expected = sharding.shard_tensor(task.config, name, ref_params[name],
                                                 state.tp_rank, state.tp_size)
                torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda msg: f"{what} param {name}: {msg}")
            if chunk.output_weight is not None:   # the last stage's copy follows the first's
                expected = sharding.shard_tensor(task.config, sharding.WORD_EMBEDDING,
                                                 ref_params[sharding.WORD_EMBEDDING],
                                                 state.tp_rank, state.tp_size)
                torch.testing.assert_close(chunk.output_weight.detach(), expected, rtol=1e-5,
                                           atol=1e-6)
        # the schedule's count: one activation forward per F not on the last virtual stage, one
        # gradient back per B not on the first; each [s(/t), b, h] fp32
        sends = sum(1 for a in runner.actions
                    if (a.kind == "F" and not config.is_last(state.pp_rank, a.chunk))
                    or (a.kind == "B" and not config.is_first(state.pp_rank, a.chunk)))
        message = shape[0] * shape[1] * shape[2] * 4
        assert pp_sends == [sends * message] * len(data), what
        checked.append((what, pp_sends[0]))
    return checked


def _total_pp_bytes(results, i):
    return sum(rank_results[i][1] for rank_results in results)


def _expected_total(pp, v, m, dp, tp, b_local, s, sequence_parallel):
    h = PipeTask.config.hidden_size
    per_message = (s // (tp if sequence_parallel and tp > 1 else 1)) * (b_local // m) * h * 4
    return 2 * m * (pp * v - 1) * per_message * dp * tp   # per PP column, times the columns


def test_pipeline_two_stages_each_schedule_matches_reference():
    """PP 2 x TP 1 x DP 1: GPipe, 1F1B with accumulation over 4 micro-batches (ZeRO 1), interleaved
    (v 2, ZeRO 2, 4 micro-batches)."""
    cases = [("gpipe", 1, 2, 0, None), ("1f1b", 1, 4, 1, None), ("interleaved", 2, 4, 2, None)]
    results = run_on_ranks(_pipeline_parity, 2, args=(1, 2, cases), timeout=600)
    for i, (_, v, m, _, _) in enumerate(cases):
        assert _total_pp_bytes(results, i) == _expected_total(2, v, m, 1, 1, 8, 8, False)


def test_pipeline_with_tensor_parallel_sequence_parallel_and_recompute():
    """PP 2 x TP 2 (+SP): the p2p tensor is the sequence shard (/t); full recompute per stage."""
    cases = [("1f1b", 1, 2, 1, "full"), ("interleaved", 2, 4, 0, None), ("gpipe", 1, 2, 2, None)]
    results = run_on_ranks(_pipeline_parity, 4, args=(2, 2, cases),
                           kwargs={"sequence_parallel": True}, timeout=600)
    for i, (_, v, m, _, _) in enumerate(cases):
        assert _total_pp_bytes(results, i) == _expected_total(2, v, m, 1, 2, 8, 8, True)


def test_pipeline_with_data_parallel_zero_and_clipping():
    """PP 2 x DP 2, ZeRO 0-2, clipped by the global norm across PP and DP; 1F1B with selective
    recompute."""
    cases = [("gpipe", 1, 2, 2, None), ("1f1b", 1, 4, 1, "selective"), ("interleaved", 2, 4, 0, None)]
    results = run_on_ranks(_pipeline_parity, 4, args=(1, 2, cases), kwargs={"clip": 0.5},
                           timeout=600)
    for i, (_, v, m, _, _) in enumerate(cases):
        assert _total_pp_bytes(results, i) == _expected_total(2, v, m, 2, 1, 4, 8, False)


def test_batched_posting_runs_every_schedule():
    """The NCCL posting pattern (the runner's exchange groups: a group's sends batched with the next
    group's receives), exercised on gloo: every schedule completes with the same numbers, the
    interleaved one also in its steady state (m = 2p; one batch per action hung there,
    tests/pipeline/test_posting.py)."""
    cases = [("gpipe", 1, 2, 0, None), ("1f1b", 1, 4, 0, None), ("interleaved", 2, 2, 1, None),
             ("interleaved", 2, 4, 2, None)]
    run_on_ranks(_pipeline_parity, 2, args=(1, 2, cases), kwargs={"prefetch": False}, timeout=600)


@pytest.mark.slow
def test_pipeline_eight_ranks_pp2_tp2_dp2():
    cases = [("1f1b", 1, 2, 2, None), ("interleaved", 2, 4, 1, "selective"),
             ("gpipe", 1, 2, 0, None)]
    run_on_ranks(_pipeline_parity, 8, args=(2, 2, cases), kwargs={"sequence_parallel": True},
                 timeout=900)


def test_pipeline_four_stages_1f1b_steady_state():
    """PP 4 x TP 1 x DP 1, 1F1B over 8 micro-batches (ZeRO 1): stages 0-2 run warm-up, steady
    state and cool-down."""
    cases = [("1f1b", 1, 8, 1, None)]
    results = run_on_ranks(_pipeline_parity, 4, args=(1, 4, cases), timeout=600)
    assert _total_pp_bytes(results, 0) == _expected_total(4, 1, 8, 1, 1, 8, 8, False)


@pytest.mark.slow
def test_pipeline_four_stages():
    """PP 4 x TP 1 x DP 1 (world 4, slow: many steps of small messages) and PP 4 x DP 2 (world 8,
    global batch 16 so that DP 2 has 8 micro-batches), each schedule (interleaved: 8 layers, v 2,
    m 8)."""
    cases = [("gpipe", 1, 4, 0, None), ("1f1b", 1, 4, 2, "full")]
    run_on_ranks(_pipeline_parity, 4, args=(1, 4, cases), timeout=900)
    interleaved = [("interleaved", 2, 8, 1, None)]
    run_on_ranks(_pipeline_parity, 4, args=(1, 4, interleaved), kwargs={"layers": 8}, timeout=900)
    run_on_ranks(_pipeline_parity, 8, args=(1, 4, [("1f1b", 1, 4, 1, None), ("gpipe", 1, 4, 2, None)]),
                 timeout=900)
    run_on_ranks(_pipeline_parity, 8, args=(1, 4, interleaved), kwargs={"layers": 8, "batch": 16},
                 timeout=900)


@pytest.mark.slow
def test_pipeline_four_stages_with_tensor_parallel_and_interleaving():
    """PP 4 x TP 2 (+SP), 8 layers: interleaved with v 2 over 8 micro-batches, GPipe and 1F1B."""
    cases = [("interleaved", 2, 8, 1, None), ("gpipe", 1, 4, 2, "full"), ("1f1b", 1, 4, 0, None)]
    run_on_ranks(_pipeline_parity, 8, args=(2, 4, cases),
                 kwargs={"sequence_parallel": True, "layers": 8}, timeout=1200)


# ---- the bubble measured on CPU ranks ------------------------------------------------------------
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _SleepChunk(nn.Module):
    def __init__(self, shape, forward_s, backward_s, last):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.shape, self.times, self.last = shape, (forward_s, backward_s), last

    def forward(self, tokens, labels, hidden_states=None):
        x = hidden_states if hidden_states is not None else torch.ones(self.shape)
        y = _Sleep.apply(x * self.w, *self.times)
        return y.sum(dim=(0, 2)) if self.last else y


def _measure_bubble(rank, world_size, schedule, v, ms, forward_s):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=world_size))
    shape, out = (4, 1, 8), []
    for n, m in enumerate(ms):
        config = PipelineConfig(world_size, m, world_size * v, schedule, v)
        chunks = [_SleepChunk(shape, forward_s / v, 2 * forward_s / v,
                              config.is_last(state.pp_rank, c)) for c in range(v)]
        runner = PipelineRunner(state, config, chunks, activation_shape=shape)
        batch = [(torch.zeros(1, 4, dtype=torch.long),) * 2] * m
        if n == 0:
            runner.step(batch)   # warm up the connections
        bubbles = []
        for _ in range(3):
            comm.barrier(state.world)   # stages start together, as after an optimizer step
            step = runner.step(batch)
            bubbles.append(runner.bubble(step))
        out.append((m, min(bubbles), step.peak_held))
    return out


# formula - 0.02 <= measured <= formula + 0.08: the overhead is per message, not per unit of bubble
BUBBLE_BELOW, BUBBLE_ABOVE = 0.02, 0.08
# the bubble's fall from one m to the next: measured ratio within 20% of the formula's
BUBBLE_RATIO_RTOL = 0.2


@pytest.mark.parametrize("schedule,p,v,m_over_p", [
    ("interleaved", 2, 2, (1, 2)),
    pytest.param("1f1b", 4, 1, (1, 2), marks=pytest.mark.slow),   # 30 s; interleaved covers it
    pytest.param("1f1b", 4, 1, (1, 4), marks=pytest.mark.slow),
    pytest.param("gpipe", 4, 1, (1, 2), marks=pytest.mark.slow)])
def test_measured_bubble_matches_the_formula(schedule, p, v, m_over_p):
    ms = [p * k for k in m_over_p]
    results = run_on_ranks(_measure_bubble, p, args=(schedule, v, ms, 0.1), timeout=300)
    measured, expected = [], []
    for i, m in enumerate(ms):
        measured.append(sum(r[i][1] for r in results) / p)
        expected.append(bubble_formula(PipelineConfig(p, m, p * v, schedule, v)))
        print(f"bubble {schedule} p {p} v {v} m {m}: measured {measured[-1]:.3f}, "
              f"formula {expected[-1]:.3f}")
        assert expected[-1] - BUBBLE_BELOW <= measured[-1] <= expected[-1] + BUBBLE_ABOVE, \
            (schedule, m, measured[-1], expected[-1])
        if schedule == "1f1b":   # activations held by stage s: at most p - s micro-batches
            assert [r[i][2] for r in results] == [min(p - s, m) for s in range(p)]
        if schedule == "gpipe":
            assert [r[i][2] for r in results] == [m] * p
        if schedule == "interleaved":   # chunk activations held: the warm-up forwards, plus the
            # steady state's one in flight (Megatron §2.2.2); m = p is all warm-up (m v)
            warmup = [m * v if m == p else min((p - s - 1) * 2 + (v - 1) * p, m * v)
                      for s in range(p)]
            assert [r[i][2] for r in results] == [w + (m > p) for w in warmup]
            assert [r[i][2] for r in results] == simulate(
                PipelineConfig(p, m, p * v, schedule, v)).peak_in_flight
    ratio, formula_ratio = measured[1] / measured[0], expected[1] / expected[0]
    assert ratio == pytest.approx(formula_ratio, rel=BUBBLE_RATIO_RTOL), (schedule, ms, measured)


# ---- overflow agreed across stages ---------------------------------------------------------------
def _overflow_on_first_stage(rank, world_size, zero_stage):
    task = PipeTask()
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=2))
    config = PipelineConfig(2, 2, task.config.num_layers, "1f1b")
    chunks = _stage_chunks(task, state, config, False, None)
    engine = build_zero_optimizer(StageChunks(chunks), state,
                                  ZeroConfig(stage=zero_stage, gradient_accumulation_steps=2),
                                  task.adamw)
    runner = PipelineRunner(state, config, chunks, activation_shape=(8, 4, 32), engine=engine,
                            tied=_tied(state, chunks))
    tokens, labels = task.data(steps=1)[0]
    before = [p.detach().clone() for p in engine.params]
    engine.zero_grad()
    runner.step([(tokens[:4], labels[:4]), (tokens[4:], labels[4:])])
    if state.is_first_stage:   # a non-finite gradient on one stage only
        chunks[0].embedding.position.weight.grad.view(-1)[0] = float("inf")
    result = engine.step()
    unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, engine.params))
    return result.skipped, unchanged


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_non_finite_gradient_on_one_stage_skips_the_step_on_every_stage(zero_stage):
    """The overflow check is the global norm: stage 0 sums it over TP x PP (mp), stages 1-2 over
    the world, so both stages see the first stage's inf and skip together."""
    assert run_on_ranks(_overflow_on_first_stage, 2, args=(zero_stage,)) == [(True, True)] * 2


# ---- activation memory held by a stage -----------------------------------------------------------
def _activation_peaks(rank, world_size, m):
    from hybrid.recompute import ActivationMeter
    task = PipeTask()
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=world_size))
    tokens, labels = task.data(steps=1)[0]
    peaks = {}
    for schedule, micro in (("1f1b", 1), ("gpipe", m // 2), ("gpipe", m), ("1f1b", m)):
        config = PipelineConfig(world_size, micro, task.config.num_layers, schedule)
        chunks = _stage_chunks(task, state, config, False, None)
        runner = PipelineRunner(state, config, chunks, activation_shape=(8, 1, 32),
                                tied=_tied(state, chunks))
        batch = [(tokens[i:i + 1], labels[i:i + 1]) for i in range(micro)]
        with ActivationMeter(exclude=[p for c in chunks for p in c.parameters()]) as meter:
            runner.step(batch)
        peaks[(schedule, micro)] = meter.peak_total
    return peaks


def test_activation_memory_of_a_stage_is_bounded_by_p_micro_batches_in_1f1b():
    """Measured with the activation meter (saved tensors, forward + backward): the peak is a
    constant (storages shared by every micro-batch) plus a per micro-batch share ``a``, found from
    GPipe at m/2 and m. GPipe grows with all m micro-batches, 1F1B holds at most p - stage."""
    p, m = 2, 4
    results = run_on_ranks(_activation_peaks, p, args=(m,))
    for stage, peaks in enumerate(results):
        one = peaks[("1f1b", 1)]
        per_micro_batch = (peaks[("gpipe", m)] - peaks[("gpipe", m // 2)]) / (m - m // 2)
        assert per_micro_batch > 0.5 * one, (stage, peaks)
        assert peaks[("gpipe", m)] == pytest.approx(one + (m - 1) * per_micro_batch, rel=0.02)
        assert peaks[("1f1b", m)] <= (one + (p - stage - 1) * per_micro_batch) * 1.02, (stage, peaks)
        assert peaks[("1f1b", m)] < peaks[("gpipe", m)]


# ---- mixed precision -----------------------------------------------------------------------------
def _bf16_pipeline(rank, world_size):
    task = PipeTask()
    data = task.data()
    ref_losses = reference_run(task, data)[0]
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=2))
    config = PipelineConfig(2, 2, task.config.num_layers, "1f1b")
    chunks = _stage_chunks(task, state, config, False, None)
    engine = build_zero_optimizer(StageChunks(chunks), state,
                                  ZeroConfig(stage=1, precision="bf16", gradient_accumulation_steps=2),
                                  task.adamw)
    if chunks[-1].output_weight is not None:   # the tied copy in the engine's 16-bit dtype
        chunks[-1].output_weight = chunks[-1].output_weight.detach().to(torch.bfloat16).requires_grad_()
    tied = _tied(state, chunks)
    runner = PipelineRunner(state, config, chunks, activation_shape=(8, 4, 32),
                            dtype=torch.bfloat16, engine=engine, tied=tied)
    losses = []
    for tokens, labels in data:
        engine.zero_grad()
        out = runner.step([(tokens[:4], labels[:4]), (tokens[4:], labels[4:])])
        engine.step()
        tied.sync_weight()
        if out.loss is not None:
            losses.append(out.loss)
    return losses, ref_losses


def test_bf16_pipeline_tracks_the_fp32_reference():
    """bf16 parameters, activations and p2p messages, fp32 master: the losses follow the fp32
    oracle to 2e-2 relative (the bound of tests/zero/test_precision.py)."""
    losses, ref = run_on_ranks(_bf16_pipeline, 2)[-1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=0)
