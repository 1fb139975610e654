"""--attention-softmax-in-fp32: a bf16 model's attention core on fp32 copies of q, k, v. Exactly the
default path for an fp32 model; for bf16, at least as close to the fp32 model (loss and every
gradient) as bf16 attention is, and unchanged under selective recompute of the core."""

import pytest
import torch

from hybrid.parallel_state import ParallelState
from models.gpt.config import GPTConfig, ConfigError
from models.gpt.model import GPTModel

DIMS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
            hidden_dropout=0.0, attention_dropout=0.0)


def _loss_and_grads(dtype, fp32_core, recompute=None):
    config = GPTConfig(**DIMS, attention_softmax_in_fp32=fp32_core)
    model = GPTModel(config, ParallelState.single_process(), device="meta", dtype=dtype,
                     **({"recompute": recompute} if recompute else {}))
    model.init_weights(3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32), generator=g)
    labels = torch.randint(0, 256, (2, 32), generator=g)
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _error(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    rel = max(float((grads_a[n] - grads_b[n]).norm() / grads_b[n].norm().clamp(min=1e-12))
              for n in grads_b)
    return abs(float(loss_a - loss_b)), rel


def test_fp32_model_is_unchanged():
    loss, grads = _loss_and_grads(torch.float32, False)
    loss2, grads2 = _loss_and_grads(torch.float32, True)
    assert torch.equal(loss, loss2)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_bf16_core_in_fp32_is_as_close_to_fp32_as_bf16_attention():
    truth = _loss_and_grads(torch.float32, False)
    default_loss, default_grad = _error(_loss_and_grads(torch.bfloat16, False), truth)
    fp32_loss, fp32_grad = _error(_loss_and_grads(torch.bfloat16, True), truth)
    assert fp32_loss < 2e-2 and fp32_grad < 5e-2                   # bf16's documented tolerance
    assert fp32_loss <= default_loss * 1.5 + 1e-3
    assert fp32_grad <= default_grad * 1.5 + 1e-3


def test_selective_recompute_of_the_fp32_core_changes_nothing():
    from hybrid.recompute.plan import RecomputePlan
    plain = _loss_and_grads(torch.bfloat16, True)
    recomputed = _loss_and_grads(torch.bfloat16, True,
                                 recompute=RecomputePlan.uniform("selective", DIMS["num_layers"]))
    assert torch.equal(plain[0], recomputed[0])
    assert all(torch.equal(plain[1][n], recomputed[1][n]) for n in plain[1])


def test_flag_must_be_boolean():
    with pytest.raises(ConfigError, match="attention_softmax_in_fp32 must be true or false"):
        GPTConfig(**DIMS, attention_softmax_in_fp32="yes")
