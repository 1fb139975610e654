"""The CPU attention core (models/gpt/attention_core.py) against torch's SDPA: outputs and the
gradients of q, k and v, causal, after cached keys, with grouped-query attention, at shapes with one
and several causal blocks, in fp64 (exact), fp32, bf16 and fp16; dropout by its own gradient check
and reproducibility."""

import pytest
import torch
import torch.nn.functional as F

from models.gpt.attention_core import attention_core, packed_attention_core

# (b, query heads, key/value heads, s, d, start): one block, two and four causal blocks (fp32 and
# fp64 from s = 128, 16-bit from s = 256), GQA (also in blocks), queries after cached keys (a band;
# s = 1 sees every key)
SHAPES = [(2, 4, 4, 32, 16, 0), (4, 4, 4, 128, 64, 0), (1, 12, 12, 256, 64, 0),
          (1, 4, 4, 512, 16, 0), (2, 4, 2, 128, 32, 0), (1, 4, 2, 256, 32, 0), (2, 2, 1, 128, 32, 0),
          (2, 4, 2, 8, 16, 5), (1, 4, 4, 1, 16, 9), (1, 4, 2, 128, 16, 3)]


def _inputs(b, a, g, s, d, start, dtype):
    gen = torch.Generator().manual_seed(b * 1000 + a * 100 + s + start)
    t = start + s
    q, k, v = (torch.randn(b, n, length, d, generator=gen, dtype=torch.float64)
               for n, length in ((a, s), (g, t), (g, t)))
    grad = torch.randn(b, a, s, d, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], grad.to(dtype)


def _sdpa(q, k, v, start):
    s, t = q.size(2), k.size(2)
    mask = torch.ones(s, t, dtype=torch.bool).tril(start)     # query i sees keys 0 .. start + i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.size(1) != q.size(1))


def _output_and_grads(core, inputs, grad):
    out = core(*inputs)
    grads = torch.autograd.grad(out, inputs, grad)
    return [out.detach().float()] + [g.float() for g in grads]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape", SHAPES)
def test_exact_in_fp64(shape):
    inputs, grad = _inputs(*shape, torch.float64)
    start = shape[-1]
    ours = _output_and_grads(lambda *x: attention_core(*x, start=start), inputs, grad)
    ref = _output_and_grads(lambda *x: _sdpa(*x, start), inputs, grad)
    for mine, theirs in zip(ours, ref):
        assert _rel(mine, theirs) < 1e-12


@pytest.mark.parametrize("shape", SHAPES[:5])
@pytest.mark.parametrize("dtype,compute", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, None), (torch.float16, torch.float32),
                                           (torch.float16, None)])
def test_low_precision_as_close_to_fp64_as_sdpa(shape, dtype, compute):
    """Each result at most as far from the fp64 truth as SDPA's in the same dtype (fp32 compute
    for a bf16/fp16 model: SDPA on fp32 copies, as --attention-softmax-in-fp32 did), and in the
    input dtype."""
    truth_inputs, grad = _inputs(*shape, torch.float64)
    start = shape[-1]
    truth = _output_and_grads(lambda *x: _sdpa(*x, start), truth_inputs, grad)
    inputs, low_grad = _inputs(*shape, dtype)
    out = attention_core(*inputs, start=start, compute_dtype=compute)
    assert out.dtype == dtype
    ours = _output_and_grads(lambda *x: attention_core(*x, start=start, compute_dtype=compute),
                             inputs, low_grad)

    def sdpa_in(*x):
        wide = compute or dtype
        return _sdpa(*(t.to(wide) for t in x), start).to(dtype)
    ref = _output_and_grads(sdpa_in, inputs, low_grad)
    floor = 1e-6 if (compute or dtype) == torch.float32 else 1e-3
    for mine, theirs, exact in zip(ours, ref, truth):
        assert _rel(mine, exact.float()) <= 1.5 * _rel(theirs, exact.float()) + floor


def test_dropout_gradient_and_reproducibility(monkeypatch):
    import models.gpt.attention_core as core_module
    monkeypatch.setattr(core_module, "BLOCK", 4)       # four causal blocks at s = 16: a small gradcheck
    inputs, _ = _inputs(1, 2, 1, 16, 2, 0, torch.float64)

    def core(*x):
        torch.manual_seed(7)   # the same mask on every evaluation of gradcheck
        return attention_core(*x, dropout_p=0.3)
    assert torch.autograd.gradcheck(core, inputs)
    out = core(*inputs)
    assert torch.equal(out, core(*inputs))
    torch.manual_seed(8)
    assert not torch.equal(out, attention_core(*inputs, dropout_p=0.3))


@pytest.mark.parametrize("dtype,compute", [(torch.float32, None), (torch.bfloat16, torch.float32)])
def test_packed_core_equals_the_core_on_views(dtype, compute):
    """From the QKV output [s, b, g, r + 2, d]: the same output, dropout mask and QKV gradient
    (bitwise) as the core on its q, k, v views."""
    s, b, g, r, d = 128, 2, 2, 2, 16
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(s, b, g, r + 2, d, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(s, b, g * r, d, generator=gen).to(dtype)

    def views(x):
        q = x[:, :, :, :r].reshape(s, b, g * r, d)
        return [t.permute(1, 2, 0, 3) for t in (q, x[:, :, :, r], x[:, :, :, r + 1])]
    torch.manual_seed(5)
    packed = packed_attention_core(qkv, dropout_p=0.2, compute_dtype=compute)
    (packed_grad,) = torch.autograd.grad(packed, qkv, grad)
    torch.manual_seed(5)
    plain = attention_core(*views(qkv), dropout_p=0.2, compute_dtype=compute).permute(2, 0, 1, 3)
    (plain_grad,) = torch.autograd.grad(plain, qkv, grad)
    assert torch.equal(packed, plain) and torch.equal(packed_grad, plain_grad)


def test_rejects_mismatched_shapes():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="expected k and v"):
        attention_core(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match="expected k and v"):
        attention_core(q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    with pytest.raises(ValueError, match="expected \\[s, b, groups"):
        packed_attention_core(torch.randn(8, 1, 2, 2, 16))
