"""Pipeline parallelism on NCCL (hybrid/pipeline; issue 16) against the CPU oracle, fp32 with TF32
off: PP 2 on two GPUs (rank r on GPU r), 5 steps of tests/pipeline/test_pipeline.py's 4-layer GPT with each
schedule - GPipe (ZeRO 0), 1F1B over 4 micro-batches (ZeRO 1), interleaved with v 2 at m = p and
in its steady state at m = 2p (ZeRO 2) - and the tied embedding synchronised over NCCL. The runner
uses NCCL's batched posting (its exchange groups: a group's sends in one ``batch_isend_irecv`` with
the next group's receives; tests/pipeline/test_posting.py models it). Skipped with the reason
where the machine has fewer than 2 GPUs or torch has no NCCL.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import ZeroConfig, build_zero_optimizer
from models.gpt import sharding
from tests.gpu.cuda_helpers import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, ieee_fp32, nccl_reason
from tests.pipeline.test_pipeline import PipeTask, _stage_chunks, _tied
from tests.zero.test_stages import reference_run

CASES = [("gpipe", 1, 2, 0), ("1f1b", 1, 4, 1), ("interleaved", 2, 2, 2),
         ("interleaved", 2, 4, 2)]   # schedule, v, m, ZeRO


def _pipeline_ranks(rank, world_size, cases):
    task = PipeTask()
    data = task.data()
    ref_losses, ref_norms, ref_params = reference_run(task, data)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=world_size),
                                     backend="nccl", device=device)
    c, checked = task.config, []
    with ieee_fp32():
        for schedule, v, m, stage in cases:
            config = PipelineConfig(world_size, m, c.num_layers, schedule, v)
            chunks = _stage_chunks(task, state, config, False, None)
            engine = build_zero_optimizer(StageChunks(chunks), state,
                                          ZeroConfig(stage=stage, bucket_size=300,
                                                     gradient_accumulation_steps=m * v), task.adamw)
            tied = _tied(state, chunks)
            b = task.batch // m
            runner = PipelineRunner(state, config, chunks, activation_shape=(c.seq_length, b,
                                                                             c.hidden_size),
                                    engine=engine, tied=tied)
            assert not runner.prefetch, "NCCL groups take the batched posting"
            losses, norms = [], []
            for tokens, labels in data:
                tokens, labels = tokens.to(device), labels.to(device)
                engine.zero_grad()
                out = runner.step([(tokens[i * b:(i + 1) * b], labels[i * b:(i + 1) * b])
                                   for i in range(m)])
                norms.append(engine.step().grad_norm)
                tied.sync_weight()
                if out.loss is not None:
                    losses.append(out.loss)
            what = f"{schedule} v{v} m{m} zero{stage} on NCCL stage {state.pp_rank}"
            if state.is_last_stage:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                           rtol=LOSS_RTOL, atol=0,
                                           msg=lambda msg: f"{what} losses: {msg}")
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4,
                                       atol=0, msg=lambda msg: f"{what} grad norms: {msg}")
            params = {n: p for chunk in chunks for n, p in chunk.named_parameters()}
            if chunks[-1].output_weight is not None:   # the last stage's tied copy
                params[sharding.WORD_EMBEDDING + " (tied copy)"] = chunks[-1].output_weight
            for name, p in params.items():
                expected = ref_params[name.removesuffix(" (tied copy)")]
                torch.testing.assert_close(p.detach().cpu(), expected, rtol=PARAM_RTOL,
                                           atol=PARAM_ATOL,
                                           msg=lambda msg: f"{what} param {name}: {msg}")
            checked.append(what)
    return checked


def test_pipeline_two_stages_on_nccl_matches_the_cpu_oracle():
    reason = nccl_reason(2)
    if reason:   # its first clause: no NCCL, or fewer GPUs than ranks (no gloo variant here)
        pytest.skip(reason.split(";")[0])
    checked = run_on_ranks(_pipeline_ranks, 2, args=(CASES,), backend="nccl", timeout=600)
    assert [len(c) for c in checked] == [len(CASES)] * 2
