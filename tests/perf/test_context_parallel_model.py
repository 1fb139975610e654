"""The CP models of hybrid/perf/context_parallel.py (issue 31): the bytes per layer of ring (p2p),
all-to-all and all-gather-KV attention against the closed forms counted by hand for small shapes,
and their errors."""

from __future__ import annotations

import pytest

from hybrid.perf.context_parallel import (check_a2a_heads, cp_bytes_per_layer, cp_bytes_per_step,
                                          local_seq, ring_working_bytes)

SHAPE = dict(micro_batch=2, seq=64, hidden=32, heads=8, query_groups=2, tp=2, bytes_per_element=2)


def test_p2p_counts_kv_blocks_around_the_ring():
    # C 4: each rank holds 16 tokens; a TP rank has 1 kv head of size 4: k is 2 x 16 x 4 = 128
    # elements; forward: K and V 3 hops with 16 int64 indices; backward: K, V 3 hops (bf16) and
    # dK, dV 3 hops (fp32)
    got = cp_bytes_per_layer(comm_type="p2p", cp=4, **SHAPE)
    assert got.forward == 2 * 3 * 128 * 2 + 3 * 8 * 16
    assert got.backward == 2 * 3 * 128 * 2 + 2 * 3 * 128 * 4
    same = cp_bytes_per_layer(comm_type="p2p", cp=4, grad_bytes_per_element=2, document_ids=True,
                              **SHAPE)
    assert same.forward == 2 * 3 * 128 * 2 + 3 * 8 * 3 * 16    # index + 2 document-id rows
    assert same.backward == 4 * 3 * 128 * 2


def test_a2a_moves_q_k_v_out_and_their_gradients():
    # q: 2 x 16 x 32 / 2 = 512 elements, k: 128; (C - 1) / C of 2 q + 2 kv each way
    got = cp_bytes_per_layer(comm_type="a2a", cp=4, **SHAPE)
    assert got.backward == pytest.approx(0.75 * (2 * 512 + 2 * 128) * 2)
    assert got.forward == pytest.approx(got.backward + 3 * 8 * 16)
    gather = cp_bytes_per_layer(comm_type="allgather", cp=4, **SHAPE)
    assert gather.forward == 2 * 3 * 128 * 2 + 3 * 8 * 16
    assert gather.backward == 2 * 3 * 128 * 4


def test_step_bytes_scale_with_layers_micro_batches_and_recompute():
    one = cp_bytes_per_layer(comm_type="p2p", cp=2, **SHAPE)
    assert cp_bytes_per_step(layers=3, micro_batches=5, comm_type="p2p", cp=2, **SHAPE) \
        == 15 * one.total
    assert cp_bytes_per_step(layers=3, micro_batches=5, recompute="full", comm_type="p2p", cp=2,
                             **SHAPE) == 15 * (one.total + one.forward)
    assert cp_bytes_per_layer(comm_type="p2p", cp=1, **SHAPE).total == 0


def test_ring_working_set_is_one_block_pair():
    # 16 local tokens, 4 heads per TP rank, fp32 scores and probabilities of 16 x 16
    explicit = ring_working_bytes(cp=4, **SHAPE)
    assert explicit == 4 * 128 * 2 + 2 * 2 * 4 * 16 * 16 * 4
    assert ring_working_bytes(cp=4, explicit_scores=False, **SHAPE) == 4 * 128 * 2


def test_errors_name_the_fix():
    assert local_seq(64, 4) == 16
    with pytest.raises(ValueError, match="divisible by 2 x context-parallel size = 12"):
        local_seq(64, 6)
    with pytest.raises(ValueError, match="must be one of"):
        cp_bytes_per_layer(comm_type="ring", cp=2, **SHAPE)
    with pytest.raises(ValueError, match="use --cp-comm-type p2p"):
        check_a2a_heads(8, 2, 2, 2)     # 1 key/value head per TP rank cannot split over CP 2
    check_a2a_heads(8, 4, 2, 2)


def test_layout_model_divides_activations_and_flops_by_cp():
    """hybrid.perf.pipeline with CP: the same TP x PP x DP slice at CP 4 holds a quarter of the
    activations (every term is per token, the ring keeps out + lse) and does a quarter of the
    model FLOPs per GPU; its time pays the attention of its queries against all keys."""
    from hybrid.perf.pipeline import Layout, estimate_layout
    model = dict(layers=4, hidden=1024, heads=16, seq=32768, vocab=32000, global_batch=8,
                 attention_core="flash")
    one = estimate_layout(Layout(2, 1, 8, 1, 1, "none", 1, True), **model)
    four = estimate_layout(Layout(2, 1, 8, 1, 1, "none", 1, True, cp=4), **model)
    assert four.activation_bytes == pytest.approx(one.activation_bytes / 4)
    assert four.model_flops_per_gpu == pytest.approx(one.model_flops_per_gpu / 4)
    assert one.time_s / 4 < four.time_s < one.time_s
    with pytest.raises(ValueError, match="use --cp-comm-type p2p"):
        estimate_layout(Layout(2, 1, 8, 1, 1, "none", 1, True, cp=16, cp_comm_type="a2a"), **model)


def test_rank_layouts_enumerates_cp_for_long_sequences():
    from tools.rank_layouts import candidates, cp_degrees
    assert cp_degrees(2048, 1024) == [1]
    assert cp_degrees(131072, 128) == [1, 2, 4, 8, 16, 32, 64]
    assert cp_degrees(16384, 64) == [1, 2, 4, 8, 16]          # >= 1024 tokens a rank
    found = {(c.tp, c.cp, c.cp_comm_type) for c in candidates(4, 512, 8, 16384, 16, 16, 8)}
    assert (8, 2, "p2p") in found and (4, 2, "a2a") in found and (8, 2, "a2a") not in found
