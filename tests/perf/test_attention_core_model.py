"""The activation model counts the attention core that runs (issue 31): the blocked CPU core's saved
bytes measured with the activation meter against :func:`hybrid.perf.activations.attention_core_bytes`
("cpu"), its block size against the kernel's, and the Llama-3 8B seq 8192 estimate with SDPA's
fused kernels ("flash": no [s, s] term) against the paper's explicit core."""

from __future__ import annotations

import pytest
import torch

from hybrid.perf import activations as act
from hybrid.perf.architecture import Architecture
from hybrid.recompute import ActivationMeter
from models.gpt import attention_core as kernel


def test_cpu_core_block_sizes_are_the_kernels():
    assert act.CPU_CORE_BLOCK[4] == kernel.BLOCK
    assert act.CPU_CORE_BLOCK[2] == kernel.BLOCK_16BIT


@pytest.mark.parametrize("seq,dropout", [(256, 0.1), (256, 0.0), (96, 0.1)])
def test_cpu_core_saved_bytes_are_the_model(seq, dropout):
    """fp32, b 1, 2 heads of 16: 4 causal blocks of 64 rows at s 256, one s x s block at s 96
    (< 2 x 64); beside the core's contiguous q, k, v the probabilities and the bool mask."""
    b, a, d = 1, 2, 16
    q, k, v = (torch.randn(b, a, seq, d, requires_grad=True) for _ in range(3))
    with ActivationMeter(exclude=[q, k, v]) as meter:
        out = kernel.attention_core(q, k, v, dropout_p=dropout)
        saved = meter.total()
        out.sum().backward()
    qkv_copies = 3 * b * a * seq * d * 4
    want = act.attention_core_bytes(seq, b, a * d, a, core="cpu", dropout=dropout > 0,
                                    value_bytes=4)
    assert saved - qkv_copies == want
    if seq == 256:   # the causal blocks keep 10 of 16 block pairs
        assert want == b * a * 64 * 64 * 10 * (4 + (dropout > 0))


def test_llama3_8b_seq8192_counts_no_scores_with_flash():
    """The dry run's old 397 GB per rank was the paper's 5 a s^2 b term; SDPA keeps the output and
    an fp32 log-sum-exp per row instead: about 1.6 GB a layer, not 12."""
    arch = Architecture(ffn_hidden=14336, query_groups=8, swiglu=True, bias=False, rmsnorm=True,
                        untied=True, learned_positions=False)
    dims = (8192, 1, 4096, 32)
    paper = act.activation_bytes_per_layer(*dims, arch=arch)
    flash = act.activation_bytes_per_layer(*dims, arch=arch, core="flash", attention_dropout=False)
    outside = act.activation_bytes_per_layer(*dims, arch=arch, recompute="selective")
    assert paper - outside == 5 * 32 * 8192 ** 2
    assert flash - outside == 32 * 8192 * (128 * 2 + 4)       # out + lse of every row and head
    assert 32 * paper > 390e9 and 32 * flash < 55e9


def test_context_parallel_divides_activations():
    """Per CP rank every term is that of s / C tokens, the attention too (ring: out + lse)."""
    dims = (8192, 1, 4096, 32)
    one = act.activation_bytes_per_layer(*dims, core="flash")
    for cp in (2, 4, 8):
        for comm in ("p2p", "a2a"):
            assert act.activation_bytes_per_layer(*dims, core="flash", cp=cp, cp_comm_type=comm) \
                == pytest.approx(one / cp)
    # the all-gather baseline also keeps the gathered K and V of the whole sequence
    gather = act.activation_bytes_per_layer(*dims, core="flash", cp=4, cp_comm_type="allgather")
    assert gather - one / 4 == pytest.approx(2 * 8192 * 4096 * 2)
