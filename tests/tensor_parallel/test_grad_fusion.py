"""Gradient-accumulation fusion (hybrid/tensor_parallel/grad_fusion.py) against autograd's own
accumulation, which the engines get with ``ZeroConfig(grad_accumulation_fusion=False)``.

- One micro-batch (a zeroed buffer): every gradient is BIT-EQUAL to autograd's, fp32 and bf16, for a
  GPT with a tied and with an untied output layer, ZeRO stage 1 (``param.grad`` views its buffer)
  and stage 2 (the products go into the staging bucket), at TP 1 and at TP 2 with sequence
  parallelism, and the fused path was taken for every weight it covers (counted).
- Gradient accumulation over micro-batches: stage 2 is bit-equal (each micro-batch stages afresh);
  stage 1 in bf16 on CPU adds as autograd adds (bit-equal) but for the tied embedding table, which
  gets two adds where autograd makes one; fp32's ``addmm_`` rounds each later sum once where
  autograd rounds twice (within a few units).
- Where the fusion must not run (turned off, stage 3, no ``allow``, autocast, ``torch.no_grad``),
  the layers give autograd's gradients and never write a buffer themselves.
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import grad_fusion
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import AdamWConfig, ZeroConfig, build_zero_optimizer
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel

TIED = "embedding.word.weight"


def _config(untied: bool, vocab=101):
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0,
                     untie_embeddings_and_output_weights=untied, make_vocab_size_divisible_by=4)


def _grads(state, config, precision, fusion, micro_batches=1, sequence_parallel=False,
           stage=1, count=None):
    """The engine's gradient buffer after ``micro_batches`` backwards of a fixed batch stream."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = GPTModel(config, state, device="meta", dtype=dtype, sequence_parallel=sequence_parallel)
    if stage < 3:   # stage 3 partitions the model from its canonical init
        model.init_weights(3)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision=precision,
                                                        gradient_accumulation_steps=micro_batches,
                                                        grad_accumulation_fusion=fusion),
                               AdamWConfig(lr=1e-3), **({"seed": 3} if stage == 3 else {}))
    gen = torch.Generator().manual_seed(5)
    opt.zero_grad()
    for _ in range(micro_batches):
        # many repeated ids: the lookup's per-token rows must be summed as autograd sums them
        tokens = torch.randint(0, 9, (2, config.seq_length + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean() / micro_batches
        opt.backward(loss)
    if stage < 3:
        opt.gradients.finish()
    if count is not None:
        count.append(sum(1 for name, p in model.named_parameters()   # learned positions: a slice
                         if getattr(p, grad_fusion._ALLOWED, False) and p.dim() == 2
                         and "position" not in name))
    if stage == 2:   # this rank's reduced gradient partition (no full gradient is kept)
        return {"partition": opt.gradients.storage.clone()}
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}


class _Counting:
    """Counts the buffers the fused layers wrote into (and whose weights)."""

    def __init__(self, monkeypatch):
        self.weights = set()
        real = grad_fusion._buffer

        def counted(param, dtype):
            buffer = real(param, dtype)
            if buffer is not None:
                self.weights.add(id(param))
            return buffer
        monkeypatch.setattr(grad_fusion, "_buffer", counted)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_one_micro_batch_is_bit_equal_to_autograd(monkeypatch, stage, precision, untied):
    state = ParallelState.single_process()
    config = _config(untied)
    counting = _Counting(monkeypatch)
    reference = _grads(state, config, precision, fusion=False, stage=stage)
    assert not counting.weights, "fusion ran although the engine turned it off"
    weights = []
    fused = _grads(state, config, precision, fusion=True, count=weights, stage=stage)
    # every 2-D weight but the learned positions is a linear, the output layer or the word
    # embedding: all fused
    assert len(counting.weights) == weights[0] > 0
    assert reference.keys() == fused.keys()
    for name in reference:
        assert torch.equal(fused[name], reference[name]), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_over_micro_batches(stage, precision):
    state = ParallelState.single_process()
    config = _config(untied=False)
    reference = _grads(state, config, precision, fusion=False, micro_batches=3, stage=stage)
    fused = _grads(state, config, precision, fusion=True, micro_batches=3, stage=stage)
    for name in reference:
        ref, got = reference[name].double(), fused[name].double()
        if stage == 2:   # every micro-batch's products land in a fresh staging bucket
            assert torch.equal(got, ref), name
        elif precision == "bf16" and name != TIED:   # the product, then autograd's add: bit-equal
            assert torch.equal(got, ref), name
        else:   # fp32's addmm_ rounds each later sum once instead of twice; the tied table adds
            # the output layer's product and the lookup's rows one after the other where
            # autograd adds their sum
            unit = 2.0 ** -8 if precision == "bf16" else 2.0 ** -23
            scale = ref.abs().max().item() or 1.0
            assert (got - ref).abs().max().item() <= 4 * unit * scale, name


def test_stage_3_takes_autograds_path(monkeypatch):
    state = ParallelState.single_process()
    counting = _Counting(monkeypatch)
    weights = []
    _grads(state, _config(untied=True), "fp32", fusion=True, stage=3, count=weights)
    assert weights == [0] and not counting.weights     # its hooks take the gathered gradients


def test_layers_fall_back_without_a_buffer_under_autocast_and_no_grad():
    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen))
    x = torch.randn(5, 4, generator=gen, requires_grad=True)
    ids = torch.tensor([[1, 1, 3], [5, 1, 0]])
    grad_fusion.allow([weight])
    # no buffer yet (grad None): autograd's gradient, bit for bit
    grad_fusion.linear(x, weight).square().sum().backward()
    expected = torch.nn.Parameter(weight.detach().clone())
    F.linear(x, expected).square().sum().backward()
    assert torch.equal(weight.grad, expected.grad)
    # with a buffer: the product is added into it (the accumulate of autograd's AccumulateGrad)
    before = weight.grad.clone()
    grad_fusion.embedding(ids, weight).sum().backward()
    lookup = torch.zeros_like(weight).index_put_((ids.reshape(-1),), torch.ones(6, 4), accumulate=True)
    assert torch.equal(weight.grad, before + lookup)
    # autocast: F.linear's own casts and backward; no_grad: plain F.linear, nothing recorded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grad_fusion.linear(x, weight)
    assert y.dtype == torch.bfloat16 and y.grad_fn.name() != "_LinearBackward"
    with torch.no_grad():
        assert grad_fusion.linear(x, weight).grad_fn is None
    grad_fusion.allow([weight], enabled=False)
    assert grad_fusion.accumulation_param(weight) is None


def _tp2_rank(rank, world_size, precision, untied, stage):
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    config = _config(untied, vocab=64)
    reference = _grads(state, config, precision, fusion=False, sequence_parallel=True, stage=stage)
    fused = _grads(state, config, precision, fusion=True, sequence_parallel=True, stage=stage)
    return [name for name in reference if not torch.equal(fused[name], reference[name])]


@pytest.mark.parametrize("precision,untied,stage", [("bf16", False, 2), ("fp32", True, 1)])
def test_tensor_parallel_with_sequence_parallelism_is_bit_equal(precision, untied, stage):
    for differing in run_on_ranks(_tp2_rank, 2, args=(precision, untied, stage)):
        assert differing == []
