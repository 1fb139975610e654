"""Document-masked attention (issue 31, models/gpt/document_attention.py) against a dense reference
written here (explicit scores, -inf outside the document or after the query, fp64 softmax):
forward and q/k/v gradients of the blocked variable-length core and the dense SDPA fallback, with
grouped-query heads, fp32 and bf16 (fp32 compute), and documents that cross block borders; the block
plan skips the keys left of each block's document; FlexAttention refuses CPU backward (why the
blocked core is the CPU path)."""

from __future__ import annotations

import pytest
import torch

from models.gpt.attention_core import BLOCK
from models.gpt.document_attention import document_attention, plan_blocks


def _reference(q, k, v, documents):
    """softmax(q k^T / sqrt(d) + mask) v in fp64, GQA by indexing each head's group."""
    a, g = q.size(1), k.size(1)
    q, k, v = q.double(), k.double(), v.double()
    k, v = k[:, [j // (a // g) for j in range(a)]], v[:, [j // (a // g) for j in range(a)]]
    s = q.size(2)
    index = torch.arange(s)
    seen = (documents[:, :, None] == documents[:, None, :]) & (index[None, None, :] <= index[None, :, None])
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _documents(b, s, lengths_by_sample):
    """Document ids [b, s] from each sample's document lengths (EOD-count layout)."""
    ids = torch.zeros(b, s, dtype=torch.long)
    for i, lengths in enumerate(lengths_by_sample):
        pos = 0
        for d, n in enumerate(lengths):
            ids[i, pos:pos + n] = d
            pos += n
        ids[i, pos:] = len(lengths)
    return ids


CASES = {   # (b, a, g, s, d, document lengths per sample)
    "gqa-cross-blocks": (2, 4, 2, 2 * BLOCK + 40, 16, [[1, 70, 50, 3], [130]]),
    "mha-one-block": (1, 2, 2, 24, 8, [[1, 1, 5]]),
    "mqa-many-short": (1, 4, 1, 3 * BLOCK, 8, [[7] * 27]),
}


DEFAULT = [(case, "blocked", torch.float32) for case in CASES] + [
    ("gqa-cross-blocks", "blocked", torch.bfloat16), ("mha-one-block", "dense", torch.float32)]
SLOW = [(case, backend, dtype) for case in CASES for backend in ("blocked", "dense")
        for dtype in (torch.float32, torch.bfloat16) if (case, backend, dtype) not in DEFAULT]


@pytest.mark.parametrize("case, backend, dtype", DEFAULT + [pytest.param(*c, marks=pytest.mark.slow)
                                                           for c in SLOW])
def test_matches_the_dense_reference(case, backend, dtype):
    b, a, g, s, d, lengths = CASES[case]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=dtype).requires_grad_()
               for h in (a, g, g))
    documents = _documents(b, s, lengths)
    grad = torch.randn(b, a, s, d, generator=gen)
    compute = torch.float32 if dtype == torch.bfloat16 else None
    out = document_attention(q, k, v, documents, compute_dtype=compute, backend=backend)
    assert out.dtype == dtype and out.shape == (b, a, s, d)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    ref = _reference(q, k, v, documents)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for name, x, y in zip("qkv", got, want):
        torch.testing.assert_close(x.double(), y.double(), **tol, msg=lambda m: f"d{name}: {m}")


def test_blocks_skip_the_keys_left_of_their_document():
    """Documents of 2 blocks each at s = 8 blocks: every block's keys start at its document's
    first token, so the core multiplies a third of the causal core's (query, key) products."""
    s = 8 * BLOCK
    documents = torch.arange(s).div(2 * BLOCK, rounding_mode="floor")[None]
    plan = plan_blocks(documents, torch.float32)
    assert [klo for _, _, klo in plan] == [lo - lo % (2 * BLOCK) for lo, _, _ in plan]
    keys = sum((hi - lo) * (hi - klo) for lo, hi, klo in plan)
    causal = sum((hi - lo) * hi for lo, hi, _ in plan)
    assert (keys, causal) == (12 * BLOCK ** 2, 36 * BLOCK ** 2)
    # ids that do not grow along the sequence (not the EOD count): no skipping, still exact
    assert all(klo == 0 for _, _, klo in plan_blocks(documents.flip(1), torch.float32))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_forward_matches_the_reference():
    """The FlexAttention backend's block mask and GQA, forward only (CPU has no flex backward;
    on CUDA the same mask runs compiled, with its backward)."""
    b, a, g, s, d, lengths = CASES["gqa-cross-blocks"]
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for h in (a, g, g))
    documents = _documents(b, s, lengths)
    with torch.no_grad():
        out = document_attention(q, k, v, documents, backend="flex")
    torch.testing.assert_close(out.double(), _reference(q, k, v, documents), rtol=1e-5, atol=1e-5)


def test_flex_attention_has_no_cpu_backward():
    """Why the CPU path is the blocked core: torch 2.13's FlexAttention refuses CPU backward."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)


def test_bad_shapes_are_one_clear_error():
    q = torch.randn(1, 4, 8, 4)
    with pytest.raises(ValueError, match="document_ids"):
        document_attention(q, q[:, :2], q[:, :2], torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="g dividing"):
        document_attention(q, q[:, :3], q[:, :3], torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="backend"):
        document_attention(q, q, q, torch.zeros(1, 8, dtype=torch.long), backend="ring")
