"""Context-parallel attention (ring p2p, all-to-all a2a, all-gather baseline) equals full masked
attention of the whole sequence on one process, in the output and in the gradients of q, k and v
(fp32, rtol 1e-5), causal and document-masked, GQA and MHA; and the ledger's CP bytes equal the
formulas of docs/context-parallel.md (and the communication model's, hybrid/perf/context_parallel.py)."""

import math

import pytest
import torch

from hybrid.context_parallel.layout import local_positions, merge_sequence, split_sequence
from hybrid.perf.context_parallel import cp_bytes_per_layer
from hybrid.testing.multirank import run_on_ranks

COMM_TYPES = ("p2p", "a2a", "allgather")


def document_ids(seq: int) -> torch.Tensor:
    """[4, seq] document ids (= EOD tokens strictly before each token) of the hard cases: a document
    crossing a chunk border and one of length 1; no EOD; every token an EOD; EOD at random places."""
    eod = torch.zeros(4, seq, dtype=torch.bool)
    chunk = seq // 8 if seq >= 32 else seq // 4
    eod[0, [1, chunk + 1, chunk + 2]] = True   # doc [2 .. chunk+1] crosses; doc {chunk+2} is 1 long
    eod[2] = True
    eod[3] = torch.rand(seq, generator=torch.Generator().manual_seed(seq)) < 0.2
    before = torch.cumsum(eod.long(), dim=1) - eod.long()
    return before


def reference(q, k, v, docs):
    """Dense masked attention of the whole sequence (float64)."""
    seq, d = q.size(2), q.size(3)
    kk = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    vv = v.repeat_interleave(q.size(1) // k.size(1), dim=1)
    index = torch.arange(seq)
    mask = (index[None, :] <= index[:, None])[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    scores = (q @ kk.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    return torch.softmax(scores, dim=-1) @ vv


def inputs(heads, groups, seq, seed):
    g = torch.Generator().manual_seed(seed)
    b, d = 4, 8
    q = torch.randn(b, heads, seq, d, generator=g)
    k = torch.randn(b, groups, seq, d, generator=g)
    v = torch.randn(b, groups, seq, d, generator=g)
    dout = torch.randn(b, heads, seq, d, generator=g)
    return q, k, v, dout


# (kernel, finest tile of the batched products): the CPU flash kernel, the products on whole chunks,
# and the products on tiles of 2 tokens (the chunks cut into several parts and merged back into
# longer products, as long sequences are cut)
KERNELS = (("flash", 128), ("bmm", 128), ("bmm", 2))


def cases(cp):
    """(comm type, heads, kv heads, document mask, kernel, finest tile, dtype): fp32 everywhere,
    and bf16 (error norm < 1% of the result's, the ledger's bytes at 2 per element) for GQA with
    documents."""
    heads = [(4, 2), (4, 4)] if cp == 2 else [(8, 4), (4, 4)]
    fp32 = [(comm_type, a, g, masked, kernel, part, torch.float32) for comm_type in COMM_TYPES
            for a, g in heads for masked in (False, True) for kernel, part in KERNELS]
    return fp32 + [(comm_type, *heads[0], True, kernel, 128, torch.bfloat16)
                   for comm_type in COMM_TYPES for kernel in ("flash", "bmm")]


def expected_bytes(comm_type, cp, b, a, g, s, d, masked, e=4):
    """The CP bytes per rank per step (docs/context-parallel.md): (forward, backward) sends."""
    m = 1 + b if masked else 1
    kv = 2 * b * g * s * d
    if comm_type == "p2p":
        return (cp - 1) * (kv * e + 8 * m * s), (cp - 1) * (kv * e + kv * 4)
    if comm_type == "a2a":
        qkv, o = b * (a + 2 * g) * s * d * e, b * a * s * d * e
        return (cp - 1) / cp * (qkv + o) + (cp - 1) * 8 * m * s, (cp - 1) / cp * (o + qkv)
    return (cp - 1) * (kv * e + 8 * m * s), (cp - 1) * kv * 4


def _cp_bytes(ledger):
    """What one rank sent under the cp group (a p2p receive records as much as the send)."""
    return sum(r.bytes_per_rank for r in ledger.records if r.group == "cp" and r.op != "recv")


def _rank(rank, world, seq, case_list):
    import torch.distributed as dist

    from hybrid.comm import CommLedger, Group
    from hybrid.context_parallel import block_attention
    from hybrid.context_parallel.attention import context_parallel_attention
    ledger = CommLedger()
    group = Group("cp", list(range(world)), rank, ledger, pg=dist.group.WORLD)
    index = local_positions(seq, rank, world)
    results = []
    for n, (comm_type, a, g, masked, kernel, part, dtype) in enumerate(case_list):
        block_attention.KERNEL, block_attention.PART = kernel, part
        q, k, v, dout = (split_sequence(x, 2, rank, world).to(dtype)
                         for x in inputs(a, g, seq, n))
        docs = split_sequence(document_ids(seq), 1, rank, world) if masked else None
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        ledger.reset()
        out = context_parallel_attention(q, k, v, group=group, comm_type=comm_type,
                                         token_index=index, document_ids=docs)
        forward_bytes = _cp_bytes(ledger)
        ledger.reset()
        out.backward(dout)
        backward_bytes = _cp_bytes(ledger)
        results.append((*(t.detach().float().numpy() for t in (out, q.grad, k.grad, v.grad)),
                        forward_bytes, backward_bytes))   # numpy: pickled by value
    return results


def check(cp, seq):
    case_list = cases(cp)
    per_rank = run_on_ranks(_rank, cp, args=(seq, case_list), timeout=300)
    for n, (comm_type, a, g, masked, kernel, part, dtype) in enumerate(case_list):
        q, k, v, dout = (x.to(dtype).double().requires_grad_() for x in inputs(a, g, seq, n))
        docs = document_ids(seq) if masked else None
        out = reference(q, k, v, docs)
        out.backward(dout.double())
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = merge_sequence([torch.from_numpy(r[n][i]) for r in per_rank], 2)
            want = (out.detach(), q.grad, k.grad, v.grad)[i].float()
            where = f"{comm_type} a={a} g={g} masked={masked} {kernel} part={part} {name}"
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where}: {m}")
            else:   # bf16 products: the error of the whole tensor, relative to its norm
                error = float((got - want).norm() / want.norm())
                assert error < 1e-2, (where, error)
        b, d, s = 4, 8, seq // cp
        forward, backward = expected_bytes(comm_type, cp, b, a, g, s, d, masked, dtype.itemsize)
        model = cp_bytes_per_layer(comm_type=comm_type, cp=cp, micro_batch=b, seq=seq,
                                   hidden=a * d, heads=a, query_groups=g,
                                   bytes_per_element=dtype.itemsize, document_ids=masked)
        assert (model.forward, model.backward) == pytest.approx((forward, backward))  # the model
        for r in per_rank:
            assert r[n][4] == pytest.approx(forward) and r[n][5] == pytest.approx(backward), \
                (comm_type, masked, r[n][4:], (forward, backward))


def test_cp2_equals_full_attention_and_ledger_formula():
    check(2, 16)


@pytest.mark.slow
def test_cp4_equals_full_attention_and_ledger_formula():
    check(4, 32)


def test_single_rank_group_is_plain_masked_attention():
    """CP 1 (a one-rank group, odd length allowed): every comm type is the dense reference."""
    from hybrid.comm import CommLedger, Group
    from hybrid.context_parallel.attention import context_parallel_attention
    group = Group("cp", [0], 0, CommLedger())
    seq = 15
    q, k, v, dout = inputs(4, 2, seq, 0)
    docs = document_ids(16)[:, :seq]
    ref = reference(q.double(), k.double(), v.double(), docs).float()
    from hybrid.context_parallel import block_attention
    for comm_type in COMM_TYPES:
        for kernel in ("bmm", "flash"):
            block_attention.KERNEL = kernel
            out = context_parallel_attention(q, k, v, group=group, comm_type=comm_type,
                                             token_index=torch.arange(seq), document_ids=docs)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    block_attention.KERNEL = "auto"


def test_bad_input_is_one_clear_error():
    from hybrid.comm import CommLedger, Group
    from hybrid.context_parallel.attention import context_parallel_attention
    group = Group("cp", [0, 1], 0, CommLedger())     # never communicates: refused before
    q, k, v, _ = inputs(4, 2, 8, 0)
    index = local_positions(16, 0, 2)
    with pytest.raises(ValueError, match="comm type must be one of p2p, a2a, allgather"):
        context_parallel_attention(q, k, v, group=group, comm_type="ring", token_index=index)
    group4 = Group("cp", [0, 1, 2, 3], 0, CommLedger())
    with pytest.raises(ValueError, match="2 key/value groups .* divisible by 4"):
        context_parallel_attention(q, k, v, group=group4, comm_type="a2a",
                                   token_index=local_positions(32, 0, 4))
    with pytest.raises(ValueError, match="token_index must be int64"):
        context_parallel_attention(q, k, v, group=group, comm_type="p2p", token_index=index[:4])


def test_ring_steps_skip_hidden_halves_by_chunk_index_ranges():
    """Load-balanced layout at CP 2 (rank 0: chunks 0, 3; rank 1: chunks 1, 2): a block from a
    lower rank is seen by both query chunks in its first chunk only, one from a higher rank by the
    second query chunk only, both without a mask; the own block is two diagonal tiles (lower
    triangles, the flash kernel's causal mask) plus the fully visible chunk; a tile whose pairs all
    cross a document border is skipped."""
    from hybrid.context_parallel.block_attention import Tile, parts, plan
    r0, r1 = local_positions(16, 0, 2), local_positions(16, 1, 2)
    assert plan(parts(r1, 2), parts(r0, 2), r1, r0) == [Tile(0, 8, 0, 4, False)]
    assert plan(parts(r0, 2), parts(r1, 2), r0, r1) == [Tile(4, 8, 0, 8, False)]
    assert plan(parts(r0, 2), parts(r0, 2), r0, r0, flash=True) == [
        Tile(0, 4, 0, 4, True, True), Tile(4, 8, 0, 4, False), Tile(4, 8, 4, 8, True, True)]
    docs = torch.tensor([[0] * 4 + [1] * 4])               # chunks 0 and 3 of rank 0: a border
    assert plan(parts(r0, 2), parts(r0, 2), r0, r0, docs, docs, flash=True) == [
        Tile(0, 4, 0, 4, True, True), Tile(4, 8, 4, 8, True, True)]
    docs = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])        # a border inside chunk 0
    assert plan(parts(r0, 2), parts(r0, 2), r0, r0, docs, docs, flash=True) == [
        Tile(0, 4, 0, 4, True, False), Tile(4, 8, 0, 4, True), Tile(4, 8, 4, 8, True, True)]
