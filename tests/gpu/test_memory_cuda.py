"""ZeRO-R's CB and MD (ZeRO §6.2-6.3) against PyTorch's CUDA caching allocator, and the memory
report's model-state bytes (hybrid/zero/report.py) against what the allocator actually handed out.

MD: 50 training steps of a GPT with full recompute whose micro-batch and sequence length change every
step (activations of varied sizes and lifetimes: checkpoints live from forward to backward, the
recomputed activations for one layer's backward), once with the checkpoints in the allocator and
once in an MD arena. From ``torch.cuda.memory_stats()``: fragmentation (reserved minus allocated,
at the peaks and averaged over the steps' ends; ``inactive_split_bytes``) and allocation retries
(``num_alloc_retries``, the allocator freeing its cache to satisfy a request). Asserted: CB - the
arena's chunks are the same storages from the first step to the last; MD - neither fragmentation
nor retries grow with the arena (within one arena chunk of slack).
"""

from __future__ import annotations

import gc
import statistics

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.adamw_config import AdamWConfig
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from tests.gpu.cuda_helpers import INIT_SEED, build_engine, train_on_device
from tests.zero.test_stages import GPTTask

STEPS = 50
CONFIG = GPTConfig(6, 512, 8, vocab_size=2048, seq_length=256, hidden_dropout=0.0,
                   attention_dropout=0.0)
SHAPES = [(4, 256), (6, 192), (3, 128), (5, 224), (8, 96), (2, 160)]   # (micro-batch, seq) cycle
ARENA_CHUNK = 16 << 20


def _fresh_allocator() -> dict:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_stats()


def _fifty_steps(md: bool) -> dict:
    before = _fresh_allocator()
    state = ParallelState.single_process("cuda")
    plan = RecomputePlan.uniform("full", CONFIG.num_layers, arena_chunk_bytes=ARENA_CHUNK if md else 0)
    model = GPTModel(CONFIG, state, recompute=plan)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=0), AdamWConfig(lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    ends, storages = [], []
    for step in range(STEPS):
        b, s = SHAPES[step % len(SHAPES)]
        tokens = torch.randint(0, CONFIG.vocab_size, (b, s + 1), generator=gen).cuda()
        opt.zero_grad()
        opt.backward(model(tokens[:, :-1], tokens[:, 1:]).mean())
        opt.step()
        torch.cuda.synchronize()
        ends.append(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        if md:
            storages.append(model.recomputer.device_arena.chunk_pointers())
    stats = torch.cuda.memory_stats()
    out = {"fragmentation_peak": stats["reserved_bytes.all.peak"] - stats["allocated_bytes.all.peak"],
           "fragmentation_mean_end_of_step": statistics.mean(ends),
           "inactive_split_peak": stats["inactive_split_bytes.all.peak"],
           "alloc_retries": stats["num_alloc_retries"] - before["num_alloc_retries"],
           "reserved_peak": stats["reserved_bytes.all.peak"],
           "allocated_peak": stats["allocated_bytes.all.peak"]}
    if md:
        out["arena"] = str(model.recomputer.device_arena)
        out["arena_constant"] = bool(storages[0]) and all(s == storages[0] for s in storages)
        assert model.recomputer.device_arena.live == 0
    del model, opt
    return out


def test_md_arena_against_the_caching_allocator(figures):
    without, with_md = _fifty_steps(md=False), _fifty_steps(md=True)
    figures("fragmentation over 50 steps", without_md=without, with_md=with_md)
    assert with_md["arena_constant"], "CB: the arena changed its chunks after the first step"
    assert with_md["alloc_retries"] <= without["alloc_retries"]
    assert with_md["fragmentation_peak"] <= without["fragmentation_peak"] + ARENA_CHUNK
    assert with_md["fragmentation_mean_end_of_step"] <= without["fragmentation_mean_end_of_step"] \
        + ARENA_CHUNK


def _engine(stage: int, state: ParallelState, task: GPTTask):
    """bf16 engine of ``stage``; stage 3 from a meta-built model, never whole on the GPU."""
    cfg, adamw = ZeroConfig(stage=stage, precision="bf16", bucket_size=4096), task.adamw
    if stage < 3:
        return build_engine(task, state, cfg, adamw)
    model = GPTModel(task.config, state, device="meta", dtype=torch.bfloat16)
    return model, build_zero_optimizer(model, state, cfg, adamw, seed=INIT_SEED)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_matches_the_allocator(stage, figures):
    """Right after building, the device memory the allocator handed out is the report's model
    states plus its constant buffers (within 2% + 1 MiB: nothing else, e.g. no fp32 copy of the
    parameters, stays behind); during a step the peak is at least the model states."""
    task = GPTTask()
    _fresh_allocator()
    base = torch.cuda.memory_allocated()
    state = ParallelState.single_process("cuda")
    model, opt = _engine(stage, state, task)
    gc.collect()
    allocated = torch.cuda.memory_allocated() - base
    report = opt.memory_report()
    held = report.measured_model_states + report.measured["buffers"]
    torch.cuda.reset_peak_memory_stats()
    train_on_device(task, state, opt, model, task.data(steps=1))
    peak = torch.cuda.max_memory_allocated() - base
    figures(f"stage {stage} memory report vs allocator", report_model_states=report.measured_model_states,
            report_buffers=report.measured["buffers"], allocated_after_build=allocated,
            max_allocated_during_step=peak, formula_model_states=report.formula_model_states)
    assert held <= allocated, (report.measured, allocated)
    assert allocated - held <= 0.02 * held + (1 << 20), (report.measured, allocated)
    assert peak >= report.measured_model_states
