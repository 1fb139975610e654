"""Pipeline parallelism composed with the rest of the framework (issue 16, item 3), on CPU ranks
against the single-device oracle (tests/pipeline/test_pipeline.py's model, data and reference run):

* fp16 with dynamic loss scaling: a non-finite gradient produced on the first stage of one DP (or
  TP) replica only makes every rank of every stage skip the step and lower its scale the same way;
  the steps that are taken follow the fp32 oracle (fp16 and bf16 tolerances stated below);
* clipping by the global norm across PP stages, TP replicas counted once, the tied embedding counted
  once (the last stage's copy is outside its engine): the norm and clipped parameters of the oracle;
* recompute chosen per stage, including Pa and Pa+cpu (ZeRO-R), and optimizer offload (CPU Adam,
  NVMe): the same numbers as the run without them, bit for bit;
* ZeRO stage 2 with interleaving and gradient accumulation over DP 2; PP 4 x TP 2 x DP 2 (16 ranks,
  slow).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid import comm
from hybrid.offload import OffloadConfig
from hybrid.parallel_state import ParallelState
from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import ZeroConfig, build_zero_optimizer
from hybrid.zero.config import LossScaleConfig
from models.gpt import sharding
from tests.pipeline.test_pipeline import PipeTask, _pipeline_parity, _stage_chunks, _tied
from tests.zero.test_stages import reference_run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INITIAL_SCALE = 2.0 ** 12
# the in-device AdamW with the op order of the offload's exact CPU kernel: runs compare bitwise
FOREACH_ADAMW = dataclasses.replace(PipeTask.adamw, kernel="foreach")


def _state(world_size, tp, pp):
    return ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size,
                                             pipeline_parallel_size=pp))


def _train(state, task, data, *, schedule="1f1b", v=1, m=2, zero=1, recompute=None,
           precision="fp32", clip=0.0, offload=None, inject_step=None):
    """Train ``data`` through the pipeline; returns the step records, the losses (last stage, mean
    over DP) and this rank's parameters (fp32 copies, TP-local, by global name)."""
    config = PipelineConfig(state.pp_size, m, task.config.num_layers, schedule, v)
    chunks = _stage_chunks(task, state, config, False, recompute)
    engine = build_zero_optimizer(
        StageChunks(chunks), state,
        ZeroConfig(stage=zero, precision=precision, bucket_size=300, clip_grad=clip,
                   gradient_accumulation_steps=m * v,
                   loss_scale=LossScaleConfig(initial_scale=INITIAL_SCALE, hysteresis=1)),
        FOREACH_ADAMW, offload=offload)
    if precision != "fp32" and chunks[-1].output_weight is not None:   # the copy in 16-bit
        chunks[-1].output_weight = chunks[-1].output_weight.detach().to(DTYPES[precision]).requires_grad_()
    tied = _tied(state, chunks)
    b_local = task.batch // state.dp_size
    runner = PipelineRunner(state, config, chunks, dtype=DTYPES[precision], engine=engine, tied=tied,
                            activation_shape=(task.config.seq_length, b_local // m,
                                              task.config.hidden_size))
    records, losses = [], []
    for step, (tokens, labels) in enumerate(data):
        lo = state.dp_rank * b_local
        mbs = [(tokens[lo + i * b_local // m: lo + (i + 1) * b_local // m],
                labels[lo + i * b_local // m: lo + (i + 1) * b_local // m]) for i in range(m)]
        hook = None
        if step == inject_step and state.is_first_stage and state.dp_rank == 0 and state.tp_rank == 0:
            # an fp16 overflow in this replica's first stage only: its position-embedding gradient
            hook = chunks[0].embedding.position.weight.register_hook(
                lambda g: torch.full_like(g, float("inf")))
        before = [p.detach().clone() for p in engine.params]
        engine.zero_grad()
        out = runner.step(mbs)
        result = engine.step()
        if hook is not None:
            hook.remove()
        if tied is not None:   # the last stage's copy lands at the start of the next step
            tied.sync_weight(wait=False)
        unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, engine.params))
        records.append((result.skipped, result.loss_scale, engine.scaler.scale, unchanged,
                        result.grad_norm))
        if out.loss is not None:
            total = torch.tensor([out.loss])
            with comm.unrecorded(state.dp):
                comm.all_reduce(total, state.dp)
            losses.append(total.item() / state.dp_size)
    if tied is not None:
        tied.land_weight()
    params = {name: p.detach().float().clone() for c in chunks for name, p in c.named_parameters()}
    if chunks[-1].output_weight is not None:
        params["output_weight"] = chunks[-1].output_weight.detach().float().clone()
    return records, losses, params


def _check_params(task, state, params, ref_params, rtol, atol, what):
    for name, value in params.items():
        ref_name = sharding.WORD_EMBEDDING if name == "output_weight" else name   # the tied copy
        expected = sharding.shard_tensor(task.config, ref_name, ref_params[ref_name], state.tp_rank,
                                         state.tp_size)
        torch.testing.assert_close(value, expected, rtol=rtol, atol=atol,
                                   msg=lambda msg: f"{what} param {name}: {msg}")


# ---- fp16 loss scaling and bf16 ------------------------------------------------------------------
# 16-bit parameters, activations and p2p messages, fp32 master weights; tolerances against the fp32
# oracle after 5 steps (losses relative, 16-bit parameters absolute), about 10x and 2x the errors
# measured at PP 2 x DP 2 and PP 2 x TP 2: fp16 (10-bit mantissa) 1.1e-5 and 1.5e-3, bf16 (7-bit)
# 1.6e-4 and 1.3e-2.
TOLERANCES = {"fp16": (1e-4, 3e-3), "bf16": (1e-3, 2.5e-2)}


def _mixed_precision(rank, world_size, tp, zero):
    task = PipeTask()
    data = task.data()
    state = _state(world_size, tp, 2)
    inject = 1
    records, losses, params = _train(state, task, data, zero=zero, precision="fp16",
                                     inject_step=inject)
    kept = [d for i, d in enumerate(data) if i != inject]   # the oracle without the skipped step
    ref_losses, _, ref_params = reference_run(task, kept)
    rtol, atol = TOLERANCES["fp16"]
    if state.is_last_stage:
        taken = [loss for i, loss in enumerate(losses) if i != inject]
        torch.testing.assert_close(torch.tensor(taken), torch.tensor(ref_losses), rtol=rtol, atol=0)
    _check_params(task, state, params, ref_params, 0, atol, f"fp16 tp{tp} zero{zero}")
    _, bf16_losses, bf16_params = _train(state, task, data, zero=zero, precision="bf16")
    ref_losses, _, ref_params = reference_run(task, data)
    rtol, atol = TOLERANCES["bf16"]
    if state.is_last_stage:
        torch.testing.assert_close(torch.tensor(bf16_losses), torch.tensor(ref_losses), rtol=rtol,
                                   atol=0)
    _check_params(task, state, bf16_params, ref_params, 0, atol, f"bf16 tp{tp} zero{zero}")
    return [r[:4] for r in records]


@pytest.mark.parametrize("tp,zero", [(1, 2), (2, 0)])
def test_fp16_overflow_on_one_stage_is_skipped_by_every_rank(tp, zero):
    """PP 2 x DP 2 (ZeRO 2) and PP 2 x TP 2 (ZeRO 0): the inf appears in one replica's first stage;
    every rank skips step 1, leaves its parameters bit-equal and halves its scale (hysteresis 1);
    the other steps are taken at the same scale on every rank."""
    per_rank = run_on_ranks(_mixed_precision, 4, args=(tp, zero), timeout=600)
    expected = [(False, INITIAL_SCALE, INITIAL_SCALE, False),
                (True, INITIAL_SCALE, INITIAL_SCALE / 2, True)] + \
               [(False, INITIAL_SCALE / 2, INITIAL_SCALE / 2, False)] * 3
    assert per_rank == [expected] * 4


# ---- clipping across stages ----------------------------------------------------------------------
def test_clipping_norm_counts_tp_replicas_and_the_tied_embedding_once():
    """PP 2 x TP 2 (no SP: layer norms and biases are TP-replicated): the reported norm is the
    oracle's and the clipped parameters follow it, for ZeRO 1, 2 and interleaving with ZeRO 0."""
    clip = 0.3
    task = PipeTask()
    assert min(reference_run(task, task.data(), clip)[1]) > clip   # every step is clipped
    cases = [("1f1b", 1, 2, 1, None), ("interleaved", 2, 4, 0, None), ("gpipe", 1, 2, 2, None)]
    run_on_ranks(_pipeline_parity, 4, args=(2, 2, cases), kwargs={"clip": clip}, timeout=600)


# ---- recompute per stage and optimizer offload: the same numbers ---------------------------------
def _same_numbers(rank, world_size, tp, variants, tmpdir):
    task = PipeTask()
    data = task.data()
    state = _state(world_size, tp, 2)
    base = {}
    for what, kwargs in variants:
        layout = (kwargs.get("schedule", "1f1b"), kwargs.get("v", 1), kwargs.get("m", 2),
                  kwargs.get("zero", 1))
        if layout not in base:
            base[layout] = _train(state, task, data, schedule=layout[0], v=layout[1], m=layout[2],
                                  zero=layout[3])
            ref_losses, _, ref_params = reference_run(task, data)
            _check_params(task, state, base[layout][2], ref_params, 1e-5, 1e-6, f"{layout}")
            if state.is_last_stage:
                torch.testing.assert_close(torch.tensor(base[layout][1]), torch.tensor(ref_losses),
                                           rtol=1e-5, atol=1e-6)
        if "offload" in kwargs:
            kwargs = dict(kwargs, offload=OffloadConfig(kwargs["offload"], f"{tmpdir}/r{rank}",
                                                        block_elems=96, kernel="exact"))
        records, losses, params = _train(state, task, data, **kwargs)
        base_records, base_losses, base_params = base[layout]
        assert losses == base_losses, what
        assert [r[4] for r in records] == [r[4] for r in base_records], what   # grad norms
        for name, value in params.items():
            assert torch.equal(value, base_params[name]), f"{what}: {name}"
    return len(variants)


def test_recompute_per_stage_with_pa_and_pa_cpu_changes_nothing(tmp_path):
    """PP 2 x TP 2 without SP, so Pa really partitions the checkpoints across TP: per stage
    (full-pa, full-pa-cpu), (full-pa-cpu, selective) and (None, full), 1F1B and interleaved,
    equal bit for bit to the same layout without recompute (itself checked against the oracle)."""
    variants = [("pa / pa+cpu 1f1b", {"recompute": ("full-pa", "full-pa-cpu")}),
                ("pa+cpu / selective 1f1b", {"recompute": ("full-pa-cpu", "selective")}),
                ("none / full interleaved", {"recompute": (None, "full"), "schedule": "interleaved",
                                             "v": 2, "m": 4, "zero": 2})]
    assert run_on_ranks(_same_numbers, 4, args=(2, variants, str(tmp_path)),
                        timeout=600) == [3] * 4


def test_optimizer_offload_and_zero2_interleaved_accumulation_over_dp(tmp_path):
    """PP 2 x DP 2: ZeRO 2 with interleaving (v 2) over 4 micro-batches (8 backwards per step
    accumulated, reduced over DP) against the oracle; CPU-Adam offload with ZeRO 1 and 2 and NVMe
    offload with ZeRO 2 interleaved, equal bit for bit to the same runs without offload."""
    variants = [("cpu offload zero 1", {"zero": 1, "offload": "cpu"}),
                ("cpu offload zero 2", {"zero": 2, "m": 4, "offload": "cpu"}),
                ("nvme offload zero 2 interleaved", {"zero": 2, "schedule": "interleaved", "v": 2,
                                                     "m": 4, "offload": "nvme"})]
    assert run_on_ranks(_same_numbers, 4, args=(1, variants, str(tmp_path)),
                        timeout=600) == [3] * 4


# ---- the 3-D layout at 16 ranks ------------------------------------------------------------------
@pytest.mark.slow
def test_pipeline_sixteen_ranks_pp4_tp2_dp2():
    """PP 4 x TP 2 (+SP) x DP 2, 8 layers, global batch 16: 1F1B with ZeRO 1 and GPipe with ZeRO
    0 over 4 micro-batches, interleaved (v 2) with ZeRO 2 and full recompute over 8."""
    cases = [("1f1b", 1, 4, 1, None), ("interleaved", 2, 8, 2, "full"), ("gpipe", 1, 4, 0, None)]
    run_on_ranks(_pipeline_parity, 16, args=(2, 4, cases),
                 kwargs={"sequence_parallel": True, "layers": 8, "batch": 16}, timeout=1800)
