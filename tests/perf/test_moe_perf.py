"""The perf layer with mixture-of-experts layers (issue 32 item 6; hybrid/perf/architecture.py,
hybrid/perf/flops.py): total vs active parameters and the FLOPs MFU counts, against closed forms
written out here, against the canonical shapes (models/gpt/sharding.py) and GPTConfig's own count
(models/gpt/config.py, written independently), and at the full-size presets."""

import math

import pytest

from hybrid.perf.architecture import Architecture
from hybrid.perf.flops import (active_param_count, gpt_param_count, model_flops_per_iteration,
                               moe_mlp_flops_per_token, recompute_flops_per_iteration)
from models.gpt.config import GPTConfig
from models.gpt.presets import get_config
from models.gpt.sharding import canonical_shapes

# 4 layers, MoE at 0 and 2 (freq 2); h 64, 8 heads in 2 groups; dense ffn 96; 6 experts of 32, top-2;
# shared expert 48 with its gate; QKV biases
CONFIG = GPTConfig(4, 64, 8, vocab_size=250, seq_length=32, ffn_hidden_size=96,
                   make_vocab_size_divisible_by=1, position_embedding_type="rope",
                   normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=True,
                   group_query_attention=True, num_query_groups=2,
                   untie_embeddings_and_output_weights=True, num_experts=6, moe_router_topk=2,
                   moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
                   moe_shared_expert_gate=True, moe_layer_freq=2)
H, V, L, E, K, FE, FS, F = 64, 250, 4, 6, 2, 32, 48, 96
KV = 2 * 8                      # g d: 2 groups of head size 8
ATTN = H * (H + 2 * KV) + H * H + (H + 2 * KV)       # QKV, projection, QKV bias
NORMS = 2 * H
DENSE_LAYER = ATTN + NORMS + 3 * H * F
MOE_TOTAL = ATTN + NORMS + E * H + E * 3 * H * FE + 3 * H * FS + H
MOE_ACTIVE = ATTN + NORMS + E * H + K * 3 * H * FE + 3 * H * FS + H
EMBED = 2 * V * H + H           # word embedding, untied output layer, final norm


def test_total_and_active_parameters_closed_form():
    total = EMBED + 2 * DENSE_LAYER + 2 * MOE_TOTAL
    active = EMBED + 2 * DENSE_LAYER + 2 * MOE_ACTIVE
    assert CONFIG.num_parameters() == total
    assert sum(math.prod(s) for s in canonical_shapes(CONFIG).values()) == total
    assert CONFIG.num_active_parameters() == active
    arch = CONFIG.perf_architecture()
    assert arch.moe_layers(L) == 2 and arch.moe_layers(2) == 1        # a 2-layer stage: pro rata
    assert gpt_param_count(L, H, V, 0, heads=8, arch=arch) == total
    assert active_param_count(L, H, V, 0, heads=8, arch=arch) == active


def test_per_rank_parameters_over_tp_and_ep():
    """Experts split over EP x TP, attention and the shared expert over TP, router / gate / norms
    replicated; at EP 1 this is GPTConfig's own per-rank count."""
    arch, tp, ep = CONFIG.perf_architecture(), 2, 3
    sharded_attn = H * (H + 2 * KV) + H * H + (H + 2 * KV)
    moe_rank = sharded_attn // tp + 3 * H * FS // tp + E * 3 * H * FE // (tp * ep) + NORMS + E * H + H
    dense_rank = (sharded_attn + 3 * H * F) // tp + NORMS
    expected = 2 * V * H // tp + H + 2 * dense_rank + 2 * moe_rank
    assert gpt_param_count(L, H, V, 0, heads=8, arch=arch, tp=tp, ep=ep) == expected
    assert gpt_param_count(L, H, V, 0, heads=8, arch=arch, tp=tp) == CONFIG.num_parameters_per_rank(tp)
    with pytest.raises(ValueError, match="6 experts cannot be split across EP degree 4"):
        gpt_param_count(L, H, V, 0, heads=8, arch=arch, ep=4)


def test_moe_flops_count_the_active_experts_only():
    """F = 3 (2 B s M_active + 4 B s^2 h l + 2 B s h V): the GEMM weights a token multiplies are the
    active parameters less the embedding table, the norms and the QKV bias."""
    arch, b, s = CONFIG.perf_architecture(), 3, 32
    gemm = (2 * (ATTN - (H + 2 * KV)) + 2 * 3 * H * F
            + 2 * (ATTN - (H + 2 * KV) + E * H + K * 3 * H * FE + 3 * H * FS + H))
    # + V h: the output layer; the embedding lookup, norms and bias are no GEMM weights
    assert gemm + V * H == CONFIG.num_active_parameters() - V * H - (2 * L + 1) * H - L * (H + 2 * KV)
    forward = 2 * b * s * gemm + 4 * b * s * s * H * L + 2 * b * s * H * V
    assert model_flops_per_iteration(b, s, L, H, V, heads=8, arch=arch) == pytest.approx(3 * forward)
    layers_forward = 2 * b * s * gemm + 4 * b * s * s * H * L
    assert model_flops_per_iteration(b, s, L, H, V, heads=8, arch=arch, full_recompute=True) == \
        pytest.approx(3 * forward + layers_forward)
    assert recompute_flops_per_iteration(b, s, L, H, "full", heads=8, arch=arch) == \
        pytest.approx(layers_forward)
    assert moe_mlp_flops_per_token(H, arch) == 2 * (E * H + K * 3 * H * FE + 3 * H * FS + H)
    # all E experts counted would be more: MFU must not count the skipped ones
    every = Architecture(**{**arch.__dict__, "moe_topk": E})
    assert model_flops_per_iteration(b, s, L, H, V, heads=8, arch=every) > 3 * forward


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
                                               ("qwen1.5-moe-a2.7b", 14_315_784_192, 2_689_173_504)])
def test_presets_flops_per_token_are_twice_the_active_gemm_weights(name, total, active):
    """At full size (no biases but Qwen's QKV bias): forward FLOPs per token at s -> 0 are twice
    the active parameters less the embedding table, the norms and the biases."""
    c = get_config(name)
    assert (c.num_parameters(), c.num_active_parameters()) == (total, active)
    h, l = c.hidden_size, c.num_layers
    biases = l * c.qkv_size if c.add_qkv_bias else 0
    gemm = active - c.vocab_size * h - (2 * l + 1) * h - biases
    per_token = model_flops_per_iteration(1, 1, l, h, c.vocab_size, heads=c.num_attention_heads,
                                          arch=c.perf_architecture()) / 3 - 4 * h * l
    assert per_token == pytest.approx(2 * gemm, rel=1e-12)
