"""Deleting a model and its ZeRO engine frees them (hybrid/zero/weak_hooks.py); the step's transient
memory is one fp32 gradient chunk.

The engines' gradient hooks live in the parameters; when they held the engine strongly, the cycle
ran through the C++ tensors and the garbage collector never freed it: parameters, the gradient
buffer and, at stage 3, shards, masters and moments stayed allocated for the life of the process
(found on a GPU, where a second engine in the same process started with the first one's memory in
use). Each case trains one step, deletes model and engine and checks by weak reference that the
model, the engine, a parameter and what holds the gradient buffers are gone; and that the hooks of an engine
that is gone do nothing when the parameters of a live model get gradients again.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.adamw_config import AdamWConfig
from hybrid.offload import OffloadConfig
from hybrid.parallel_state import ParallelState
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel

CONFIG = GPTConfig(2, 32, 4, vocab_size=64, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
CASES = [(0, "fp32", None), (1, "bf16", None), (2, "bf16", None), (3, "bf16", None),
         (2, "bf16", "cpu"), (1, "bf16", "compiled")]


def _tokens():
    return torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1),
                         generator=torch.Generator().manual_seed(0))


def _build(stage: int, precision: str, extra, tmp_path):
    state = ParallelState.single_process("cpu")
    model = GPTModel(CONFIG, state)
    offload = OffloadConfig("cpu", str(tmp_path)) if extra == "cpu" else None
    kernel = "compiled" if extra == "compiled" else "fused"
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision=precision),
                               AdamWConfig(lr=1e-3, kernel=kernel), offload=offload,
                               **({"seed": 1} if stage == 3 else {}))
    return model, opt


def _step(model, opt) -> None:
    tokens = _tokens()
    opt.zero_grad()
    opt.backward(model(tokens[:, :-1], tokens[:, 1:]).float().mean())
    opt.step()


def _gradient_owner(opt):
    """What holds the engine's gradient buffers: stages 0-2's gradients, stage 3's first unit."""
    return weakref.ref(opt.gradients if hasattr(opt, "gradients") else opt.all_units[0])


@pytest.mark.parametrize("stage,precision,extra", CASES)
def test_deleting_model_and_engine_frees_them(stage, precision, extra, tmp_path):
    if extra == "compiled":
        pytest.importorskip("torch._inductor")
    model, opt = _build(stage, precision, extra, tmp_path)
    _step(model, opt)
    refs = {"model": weakref.ref(model), "engine": weakref.ref(opt),
            "parameter": weakref.ref(next(model.parameters())), "gradients": _gradient_owner(opt)}
    del model, opt
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"stage {stage} {precision} {extra}: still alive after deletion: {alive}"


def test_the_hooks_of_a_collected_engine_do_nothing(tmp_path):
    """A model outliving its engine trains on with a new engine, whose result equals a model
    that never had another engine: the old hooks are gone (or inert)."""
    torch.manual_seed(0)
    model, opt = _build(2, "fp32", None, tmp_path)
    fresh = GPTModel(CONFIG, ParallelState.single_process("cpu"))
    fresh.load_state_dict(model.state_dict())
    del opt
    gc.collect()
    results = []
    for m in (model, fresh):
        opt = build_zero_optimizer(m, ParallelState.single_process("cpu"), ZeroConfig(stage=2),
                                   AdamWConfig(lr=1e-3))
        _step(m, opt)
        results.append({n: p.detach().clone() for n, p in m.named_parameters()})
    for name, value in results[1].items():
        assert torch.equal(results[0][name], value), name


class _LiveFp32Copies(TorchDispatchMode):
    """Counts the fp32 copies of 16-bit tensors alive at once (the most ever seen)."""

    def __init__(self):
        super().__init__()
        self.copies: list[weakref.ref] = []
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and out.dtype == torch.float32
                and args[0].dtype in (torch.bfloat16, torch.float16)):
            self.copies.append(weakref.ref(out))
            self.most = max(self.most, sum(ref() is not None for ref in self.copies))
        return out


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_the_mixed_precision_step_holds_one_fp32_gradient_chunk_at_a_time(kernel):
    """The fused and foreach AdamW kernels take fp32 gradients: the step casts one chunk at a time,
    so its transient is one bucket's fp32 copy, not 4 bytes per parameter of the partition (1.5B
    parameters: 5.8 GiB more at the step's peak, measured on a GPU before this)."""
    state = ParallelState.single_process("cpu")
    model = GPTModel(CONFIG, state)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=1, precision="bf16", bucket_size=2000),
                               AdamWConfig(lr=1e-3, kernel=kernel))
    assert len(opt.optimizer_state.masters) >= 3, "the case needs several chunks"
    tokens = _tokens()
    opt.zero_grad()
    opt.backward(model(tokens[:, :-1], tokens[:, 1:]).float().mean())
    with _LiveFp32Copies() as copies:
        opt.step()
    assert len(copies.copies) >= len(opt.optimizer_state.masters), "the step made no fp32 gradient copies"
    assert copies.most == 1, f"{copies.most} fp32 gradient chunks alive at once"
