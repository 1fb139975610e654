"""Parameter counts and model FLOPs of a dense GPT (Megatron-LM, Narayanan et al. 2021, §5.1 / App. A).

Pure arithmetic on model dimensions (docs/design.md §7): no torch, no configs, no process groups.

Parameters (docs/design.md §Paper):      Ψ ≈ 12 l h² (1 + 13/(12h) + (V + s)/(12 l h))
Model FLOPs per iteration:  F = 72 B s l h² (1 + s/(6h) + V/(12 l h))
With full activation recompute the hardware executes one more forward pass of every layer:
                            F_hw = 96 B s l h² (1 + s/(6h) + V/(16 l h))
B is the global batch (sequences per iteration), s the sequence length, l layers, h hidden, V vocab.
With the options of :class:`~hybrid.perf.architecture.Architecture` the 12 h^2 GEMM weights of a
layer become ``arch.matmul_params`` M (GQA's K/V, SwiGLU's third matrix):
                            F = 3 (2 B s l M + 4 B s^2 l h + 2 B s h V)   (+ one layer forward: full recompute)
Mixture of experts (issue 32): in a MoE layer M's MLP part is what a token multiplies, the router
E h, k experts k 3 h f_e, the shared expert 3 h f_s and its gate h (``Architecture.moe_mlp_params``
with ``active``), so MFU counts active FLOPs, never the E - k experts a token skips.
"""

from __future__ import annotations

import math

from hybrid.perf.architecture import GPT2, Architecture


def pad_vocab(vocab: int, tp: int = 1, multiple: int = 128) -> int:
    """Megatron's padded vocab: rounded up to a multiple of ``multiple * tp`` so each TP rank holds an
    equal, GEMM-friendly slice of the embedding."""
    _positive(vocab=vocab, tp=tp, multiple=multiple)
    step = multiple * tp
    return math.ceil(vocab / step) * step


def megatron_param_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Ψ ≈ 12 l h² (1 + 13/(12h) + (V + s)/(12 l h)) - the formula of the Megatron-LM paper."""
    _positive(layers=layers, hidden=hidden, vocab=vocab, seq=seq)
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def _arch(arch: Architecture, ffn_hidden: int | None) -> Architecture:
    """``arch`` with an explicit ``ffn_hidden`` taking precedence."""
    if ffn_hidden is None:
        return arch
    return Architecture(**{**arch.__dict__, "ffn_hidden": ffn_hidden})


def layer_param_count(hidden: int, ffn_hidden: int | None = None, *, heads: int | None = None,
                      arch: Architecture = GPT2) -> int:
    """One pre-norm layer; GPT-2: 2 LayerNorms 4h, QKV 3h² + 3h, projection h² + h, MLP 2hf + f + h
    (``heads`` is needed with grouped-query attention)."""
    return sum(_arch(arch, ffn_hidden).layer_split(hidden, heads))


def gpt_param_count(layers: int, hidden: int, vocab_padded: int, positions: int, *,
                    ffn_hidden: int | None = None, tp: int = 1, heads: int | None = None,
                    arch: Architecture = GPT2, ep: int = 1) -> int:
    """Exact parameters held by ONE of ``tp`` tensor-parallel ranks (tp=1: the whole model); with
    MoE layers, of one of ``ep`` expert-parallel ranks too (routed experts split over EP x TP).

    Sharded across TP: QKV and MLP-in weights and biases, projection and MLP-out weights, the word
    embedding (tied with the output layer, counted once; an untied output layer as much again).
    Replicated: norms, the two row-parallel biases, learned position embeddings and the final norm.
    """
    _positive(layers=layers, hidden=hidden, vocab_padded=vocab_padded, tp=tp)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 0:
        raise ValueError(f"positions must be a non-negative integer, got {positions!r}")
    h, arch = hidden, _arch(arch, ffn_hidden)
    _positive(ep=ep)
    sharded_per_layer, replicated_per_layer = arch.layer_split(h, heads)
    for name, value in (("hidden", h), ("ffn hidden", arch.ffn(h)), ("padded vocab", vocab_padded)):
        if value % tp:
            raise ValueError(f"{name} {value} is not divisible by TP degree {tp}; pick a TP degree "
                             f"that divides it")
    per_layer = sharded_per_layer // tp + replicated_per_layer
    tables = 2 if arch.untied else 1
    position_params = positions * h if arch.learned_positions else 0
    layer_params = layers * per_layer
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ValueError(f"{arch.num_experts} experts cannot be split across EP degree {ep}; "
                             f"pick an EP degree that divides {arch.num_experts}")
        moe = arch.moe_layers(layers)
        dense_sharded, experts, replicated = arch.moe_layer_split(h, heads)
        layer_params = (layer_params - moe * per_layer
                        + moe * (dense_sharded // tp + experts // (ep * tp) + replicated))
    return int(tables * vocab_padded * h // tp + position_params + layer_params
               + arch.norm_params(h))


def expert_params_per_rank(layers: int, hidden: int, arch: Architecture, *, tp: int = 1,
                           ep: int = 1) -> float:
    """Routed-expert parameters one TP x EP rank holds over ``layers`` layers (0 when dense)."""
    if not arch.is_moe:
        return 0.0
    return arch.moe_layers(layers) * arch.num_experts * arch.expert_params(hidden) / (ep * tp)


def active_param_count(layers: int, hidden: int, vocab_padded: int, positions: int, *,
                       heads: int | None = None, arch: Architecture = GPT2) -> int:
    """Parameters one token uses (the whole model, TP 1): :func:`gpt_param_count` less the E - k
    routed experts it skips in every MoE layer (= the total for a dense model)."""
    total = gpt_param_count(layers, hidden, vocab_padded, positions, heads=heads, arch=arch)
    if not arch.is_moe:
        return total
    skipped = (arch.num_experts - arch.moe_topk) * arch.expert_params(hidden)
    return int(total - arch.moe_layers(layers) * skipped)


def moe_mlp_flops_per_token(hidden: int, arch: Architecture) -> float:
    """Forward FLOPs of one MoE layer's MLP for one token: 2 per active weight (router E h, k
    experts, shared expert and its gate); backward twice that. Softmax, top-k and the weighted sum
    of the k outputs are O(E + k h), left out like the other elementwise work."""
    return 2.0 * arch.moe_mlp_params(hidden, active=True)


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int, *,
                              full_recompute: bool = False, heads: int | None = None,
                              arch: Architecture = GPT2) -> float:
    """FLOPs of one training iteration over ``batch`` sequences (all GPUs together).

    ``full_recompute=False``: model FLOPs 72 B s l h² (1 + s/(6h) + V/(12 l h)) - forward + backward
    (3 x forward). ``True``: hardware FLOPs with one extra forward of the transformer layers, 96 B s l h²
    (1 + s/(6h) + V/(16 l h)) (the output layer is not recomputed, hence the 16).
    """
    _positive(batch=batch, seq=seq, layers=layers, hidden=hidden, vocab=vocab)
    b, s, l, h = batch, seq, layers, hidden
    if arch != GPT2:
        layers_forward = _layers_forward_flops(b, s, l, h, heads, arch)
        return 3 * (layers_forward + 2 * b * s * h * vocab) + (layers_forward if full_recompute else 0)
    if full_recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + vocab / (12 * l * h))


def _layers_forward_flops(b: int, s: int, l: int, h: int, heads: int | None,
                          arch: Architecture) -> float:
    """``l`` layers' forward: 2 B s M for the GEMMs (M: the weights a token multiplies, MoE layers'
    active ones) + 4 B s^2 h per layer for QK^T and the scores x V."""
    return 2.0 * b * s * arch.forward_matmul_params(l, h, heads) + 4.0 * b * s * s * h * l


def recompute_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, mode: str, *,
                                  heads: int | None = None, arch: Architecture = GPT2) -> float:
    """Extra FLOPs of activation recompute per iteration (Korthikanti et al. 2022, §5):
    "full" reruns every layer's forward, 24 B s l h² (1 + s/(6h)); "selective" reruns only the
    attention core (QK^T and scores x V), 4 B s² h l; "none" adds nothing."""
    _positive(batch=batch, seq=seq, layers=layers, hidden=hidden)
    b, s, l, h = batch, seq, layers, hidden
    full = (_layers_forward_flops(b, s, l, h, heads, arch) if arch != GPT2
            else 24.0 * b * s * l * h * h * (1 + s / (6 * h)))
    extra = {"none": 0.0, "selective": 4.0 * b * s * s * h * l, "full": full}
    if mode not in extra:
        raise ValueError(f"recompute must be one of {sorted(extra)}, got {mode!r}")
    return extra[mode]


def flops_per_gpu(batch: int, seq: int, layers: int, hidden: int, vocab: int, gpus: int, *,
                  full_recompute: bool = False, heads: int | None = None,
                  arch: Architecture = GPT2) -> float:
    """An iteration's FLOPs divided evenly across ``gpus`` (TP splits a replica's work, DP its batch)."""
    _positive(gpus=gpus)
    return model_flops_per_iteration(batch, seq, layers, hidden, vocab, full_recompute=full_recompute,
                                     heads=heads, arch=arch) / gpus


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
