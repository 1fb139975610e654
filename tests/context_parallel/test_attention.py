"""Context-parallel attention (ring p2p, all-to-all a2a, all-gather baseline) equals full masked
attention of the whole sequence on one process, in the output and in the gradients of q, k and v
(fp32, rtol 1e-5), causal and document-masked, GQA and MHA; and the ledger's CP bytes equal the
formulas of docs/context-parallel.md."""

import math

import pytest
import torch

from hybrid.context_parallel.layout import local_positions, merge_sequence, split_sequence
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


def cases(cp):
    heads = [(4, 2), (4, 4)] if cp == 2 else [(8, 4), (4, 4)]
    return [(comm_type, a, g, masked) for comm_type in COMM_TYPES for a, g in heads
            for masked in (False, True)]


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
    from hybrid.context_parallel.attention import context_parallel_attention
    ledger = CommLedger()
    group = Group("cp", list(range(world)), rank, ledger, pg=dist.group.WORLD)
    index = local_positions(seq, rank, world)
    results = []
    for n, (comm_type, a, g, masked) in enumerate(case_list):
        q, k, v, dout = (split_sequence(x, 2, rank, world) for x in inputs(a, g, seq, n))
        docs = split_sequence(document_ids(seq), 1, rank, world) if masked else None
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        ledger.reset()
        out = context_parallel_attention(q, k, v, group=group, comm_type=comm_type,
                                         token_index=index, document_ids=docs)
        forward_bytes = _cp_bytes(ledger)
        ledger.reset()
        out.backward(dout)
        backward_bytes = _cp_bytes(ledger)
        results.append((*(t.detach().numpy() for t in (out, q.grad, k.grad, v.grad)),
                        forward_bytes, backward_bytes))   # numpy: pickled by value
    return results


def check(cp, seq):
    case_list = cases(cp)
    per_rank = run_on_ranks(_rank, cp, args=(seq, case_list), timeout=300)
    for n, (comm_type, a, g, masked) in enumerate(case_list):
        q, k, v, dout = (x.double().requires_grad_() for x in inputs(a, g, seq, n))
        docs = document_ids(seq) if masked else None
        out = reference(q, k, v, docs)
        out.backward(dout.double())
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = merge_sequence([torch.from_numpy(r[n][i]) for r in per_rank], 2)
            want = (out.detach(), q.grad, k.grad, v.grad)[i].float()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{comm_type} a={a} g={g} masked={masked} "
                                                     f"{name}: {m}")
        b, d, s = 4, 8, seq // cp
        forward, backward = expected_bytes(comm_type, cp, b, a, g, s, d, masked)
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
    for comm_type in COMM_TYPES:
        out = context_parallel_attention(q, k, v, group=group, comm_type=comm_type,
                                         token_index=torch.arange(seq), document_ids=docs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


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
