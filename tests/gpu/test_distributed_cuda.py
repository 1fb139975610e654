"""ZeRO stages 0-3 and tensor parallelism on CUDA against the CPU oracle (fp32, TF32 off).

* one GPU, one rank: stages 0-3 (the engines' CUDA buffers, fused AdamW on the GPU);
* two ranks sharing one GPU on **gloo** (NCCL refuses two ranks on one device; gloo carries the
  CUDA tensors through pinned host buffers; hybrid.comm's shared-memory transport, which the
  engines turn on for gloo DP groups, is for host tensors): TP 1 x DP 2 and TP 2 x DP 1, stages 0-3,
  and TP 2 recompute (Pa all-gathers across the TP pair) bit-equal to no recompute;
* optimizer offload on CUDA (pinned host state, side-stream copies, stage 3's parameter partitions
  in an NVMe file staged into the gather's own slot) against the same run without offload;
* the same on **NCCL** where the machine has a GPU per rank, otherwise skipped with that reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid.offload import OffloadConfig
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import RNGTracker
from hybrid.testing.multirank import run_on_ranks
from hybrid.zero.config import ZeroConfig
from models.gpt.model import GPTModel
from tests.gpu.cuda_helpers import (bitwise_reproducible, build_engine, compare_with_reference,
                                    ieee_fp32, nccl_reason, rank_state, train_on_device,
                                    trained_params)
from tests.gpu.test_model_cuda import DROPOUT_CONFIG, tokens_and_labels
from tests.recompute.test_gpt import MODES, _plan
from tests.zero.test_stages import GPTTask, reference_run

STAGES = (0, 1, 2, 3)


def _train_and_compare(task, state, stage, ref, accum=1) -> str:
    model, opt = build_engine(task, state, ZeroConfig(stage=stage, bucket_size=300,
                                                      gradient_accumulation_steps=accum), task.adamw)
    losses, results = train_on_device(task, state, opt, model, task.data(), accum)
    what = f"stage {stage} tp {state.tp_size} dp {state.dp_size} accum {accum} on {state.device}"
    compare_with_reference(task, state, losses, trained_params(opt, model), ref, what)
    torch.testing.assert_close(torch.tensor([r.grad_norm for r in results]), torch.tensor(ref[1]),
                               rtol=1e-4, atol=0, msg=lambda m: f"{what} grad norms: {m}")
    return what


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_on_one_gpu_matches_the_cpu_oracle(stage):
    task = GPTTask()
    ref = reference_run(task, task.data())
    with ieee_fp32():
        for accum in (1, 2):
            _train_and_compare(task, ParallelState.single_process("cuda"), stage, ref, accum)


def _zero_ranks(rank, world_size, backend):
    task = GPTTask()
    ref = reference_run(task, task.data())
    checked = []
    with ieee_fp32():
        for tp in (1, 2):
            state = rank_state(rank, world_size, tp, backend)
            for stage in STAGES:
                checked.append(f"{_train_and_compare(task, state, stage, ref)} ({backend})")
    return checked


def _recompute_ranks(rank, world_size, backend):
    """TP 2 (and TP 2 + sequence parallelism): every recompute mode bit-equal to none per rank."""
    state = rank_state(rank, world_size, 2, backend)
    tokens, labels = tokens_and_labels(DROPOUT_CONFIG, 2)
    checked = []
    with bitwise_reproducible():
        for sp in (False, True):
            runs = {}
            for name in ("none", *MODES):
                rng = RNGTracker(17, state.tp_rank, state.device)
                rng.seed_all()
                model = GPTModel(DROPOUT_CONFIG, state, sequence_parallel=sp, rng=rng,
                                 recompute=_plan(name, DROPOUT_CONFIG.num_layers))
                model.init_weights(5)
                state.ledger.reset()
                loss = model(tokens.to(state.device), labels.to(state.device)).mean()
                loss.backward()
                gathers = state.ledger.count("tp", "all_gather")
                runs[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                              gathers)
            ref_loss, ref_grads, ref_gathers = runs.pop("none")
            for name, (loss, grads, gathers) in runs.items():
                assert torch.equal(loss, ref_loss), (sp, name)
                for key, g in ref_grads.items():
                    assert torch.equal(grads[key], g), (sp, name, key)
                if name.startswith("full-pa") and not sp:   # Pa gathers one checkpoint per layer
                    assert gathers == ref_gathers + DROPOUT_CONFIG.num_layers, (name, gathers)
                checked.append((sp, name))
    return checked


def _run(fn, backend):
    if backend == "nccl" and nccl_reason(2):
        pytest.skip(nccl_reason(2))
    return run_on_ranks(fn, 2, args=(backend,), backend=backend, timeout=600)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_zero_stages_tp_and_dp_on_two_ranks(backend, figures):
    """TP 1 x DP 2 and TP 2 x DP 1, stages 0-3, against the CPU oracle on both ranks."""
    checked = _run(_zero_ranks, backend)
    assert len(checked[0]) == 2 * len(STAGES)
    figures("two-rank ZeRO/TP layouts checked", backend=backend, layouts=checked[0])


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_tp2_recompute_modes_are_bit_equal_on_two_ranks(backend):
    checked = _run(_recompute_ranks, backend)
    assert len(checked[0]) == 2 * len(MODES)


OFFLOADS = ((1, "cpu", "none"), (2, "nvme", "none"), (3, "cpu", "none"), (3, "nvme", "nvme"))


def _offload_cases(state, tmpdir: str) -> list[str]:
    """Each (stage, optimizer offload, parameter offload) against the same stage in device memory:
    losses and parameters within rtol 1e-5 (the host's CPU Adam against the GPU's kernel: the same
    operations, rounded alike except where the GPU contracts a multiply-add)."""
    task = GPTTask()
    checked = []
    for stage, mode, params in OFFLOADS:
        runs = []
        for offload in (None, OffloadConfig(mode, f"{tmpdir}/s{stage}{mode}{params}", block_elems=96,
                                            kernel="exact", params=params)):
            model, opt = build_engine(task, state, ZeroConfig(stage=stage, bucket_size=700),
                                      dataclasses.replace(task.adamw, kernel="foreach"), offload)
            losses, _ = train_on_device(task, state, opt, model, task.data())
            runs.append((losses, trained_params(opt, model)))
            if offload is not None:
                opt.optimizer_state.close()
        (base_losses, base), (losses, got) = runs
        what = f"stage {stage} offload {mode} params {params} dp {state.dp_size}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(base_losses), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{what} losses: {m}")
        for name, value in base.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what} param {name}: {m}")
        checked.append(what)
    return checked


def test_offload_on_one_gpu_matches_device_memory(tmp_path):
    with ieee_fp32():
        checked = _offload_cases(ParallelState.single_process("cuda"), str(tmp_path))
    assert len(checked) == len(OFFLOADS)


def _offload_ranks(rank, world_size, backend, tmpdir):
    with ieee_fp32():
        return _offload_cases(rank_state(rank, world_size, 1, backend), f"{tmpdir}/r{rank}")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_offload_on_two_ranks_matches_device_memory(backend, tmp_path):
    if backend == "nccl" and nccl_reason(2):
        pytest.skip(nccl_reason(2))
    checked = run_on_ranks(_offload_ranks, 2, args=(backend, str(tmp_path)), backend=backend,
                           timeout=600)
    assert len(checked[0]) == len(OFFLOADS)
