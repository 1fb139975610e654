"""The canonical GPT parameter layout and its mapping to tensor-parallel shards (Megatron-LM §3).

The canonical layout is the single-device reference's state dict (:mod:`models.gpt.reference`):
true vocab, fused QKV rows ordered ``[q; k; v]`` with the heads contiguous inside each (q has ``a``
heads, k and v ``g`` query groups each), SwiGLU's fused MLP-in rows ``[gate; up]``. The TP model
(:mod:`models.gpt.model`) uses the same parameter names with these differences, handled here:

- the word embedding (and an untied output layer) is padded with zero rows to
  ``config.padded_vocab_size(tp)``, then split by rows;
- fused QKV rows are grouped per query group, ``[group 0: q of its a/g heads, k, v | group 1: ...]``
  (per head ``[q k v]`` without GQA), so a contiguous row slice gives each TP rank whole groups;
- SwiGLU's MLP-in rows are interleaved ``[gate 0, up 0, gate 1, up 1, ...]``, so a contiguous slice
  holds matching rows of gate and up at any TP degree;
- column-parallel weights (QKV, MLP in) split along rows (dim 0, with their biases), row-parallel
  weights (attention out, MLP out) along columns (dim 1); everything else is replicated.

Initial values are defined here too (:func:`canonical_init`), keyed by canonical name, so the
reference and every TP degree start from the same weights (docs/design.md §4).
"""

from __future__ import annotations

import math

import torch

from hybrid import comm
from hybrid.checkpoint.state import ParamLayout
from hybrid.comm import Group
from hybrid.tensor_parallel.init import full_init, shard
from models.gpt.config import GPTConfig

_COLUMN_PARALLEL = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                    "mlp.shared_expert.fc1.weight")
_ROW_PARALLEL = ("attn.proj.weight", "mlp.fc2.weight", "mlp.shared_expert.fc2.weight")
# MoE experts [E, 2f, h] / [E, h, f] (issue 32): experts on dim 0 (over EP), then TP like the dense
# column/row-parallel pair: fc1's rows (dim 1), fc2's columns (dim 2)
EXPERT_FC1, EXPERT_FC2 = "mlp.experts.fc1.weight", "mlp.experts.fc2.weight"
_SWIGLU_ROWS = ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.shared_expert.fc1.weight")
WORD_EMBEDDING = "embedding.word.weight"
OUTPUT_LAYER = "output_layer.weight"   # only with untie_embeddings_and_output_weights
VOCAB_TABLES = (WORD_EMBEDDING, OUTPUT_LAYER)   # rows padded to the TP degree's vocab


def canonical_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the canonical layout and its full shape, in model order (norm
    biases only for LayerNorm, linear biases only with ``add_bias_linear``, positions only when
    learned, the output layer only when untied)."""
    h, f, qkv = config.hidden_size, config.ffn_hidden_size, config.qkv_size
    mlp_in = 2 * f if config.swiglu else f
    shapes = {WORD_EMBEDDING: (config.vocab_size, h)}
    if config.position_embedding_type == "learned_absolute":
        shapes["embedding.position.weight"] = (config.max_position_embeddings, h)
    layer = {"ln1.weight": (h,), "ln1.bias": (h,), "attn.qkv.weight": (qkv, h),
             "attn.qkv.bias": (qkv,), "attn.proj.weight": (h, h), "attn.proj.bias": (h,),
             "ln2.weight": (h,), "ln2.bias": (h,), "mlp.fc1.weight": (mlp_in, h),
             "mlp.fc1.bias": (mlp_in,), "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    layer = {k: v for k, v in layer.items() if _present(config, k)}
    moe_layer = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
    moe_layer.update(_moe_shapes(config) if config.num_experts is not None else {})
    for i in range(config.num_layers):
        chosen = moe_layer if config.is_moe_layer(i) else layer
        shapes.update({f"layers.{i}.{k}": v for k, v in chosen.items()})
    shapes["final_norm.weight"] = (h,)
    if config.normalization == "LayerNorm":
        shapes["final_norm.bias"] = (h,)
    if config.untie_embeddings_and_output_weights:
        shapes[OUTPUT_LAYER] = (config.vocab_size, h)
    return shapes


def _moe_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The MoE block's parameters (no biases): router, experts, shared expert and its gate."""
    h, e, f = config.hidden_size, config.num_experts, config.moe_ffn_hidden_size
    out = {"mlp.router.weight": (e, h), EXPERT_FC1: (e, 2 * f, h), EXPERT_FC2: (e, h, f)}
    fs = config.moe_shared_expert_intermediate_size
    if fs is not None:
        out.update({"mlp.shared_expert.fc1.weight": (2 * fs, h),
                    "mlp.shared_expert.fc2.weight": (h, fs)})
        if config.moe_shared_expert_gate:
            out["mlp.shared_expert_gate.weight"] = (1, h)
    return out


def _present(config: GPTConfig, layer_key: str) -> bool:
    """Whether a layer parameter exists under the config's options."""
    if not layer_key.endswith(".bias"):
        return True
    if layer_key.startswith("ln"):
        return config.normalization == "LayerNorm"
    return config.add_bias_linear


def canonical_init(config: GPTConfig, name: str, seed: int) -> torch.Tensor:
    """GPT-2 initial value of canonical parameter ``name`` (fp32, CPU): normal(0, std) weights,
    output projections scaled by 1/sqrt(2 * layers) (GPT-2 §2.3), zero biases, unit LayerNorm gains."""
    shape = canonical_shapes(config)[name]
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name or ".ln" in name:
        return torch.ones(shape)
    std = config.init_method_std
    if name.endswith(_ROW_PARALLEL + (EXPERT_FC2,)):
        std /= math.sqrt(2.0 * config.num_layers)
    return full_init(name, shape, std, seed)


def partition_dim(name: str) -> int:
    """Dimension along which the TP model splits parameter ``name`` (-1: replicated)."""
    if name in VOCAB_TABLES or name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    if name.endswith(EXPERT_FC1):
        return 1
    if name.endswith(EXPERT_FC2):
        return 2
    return -1


def checkpoint_layout(config: GPTConfig, local: dict[str, torch.Tensor],
                      tp: int, ep: int = 1) -> dict[str, ParamLayout]:
    """TP-local parameters (this rank's shapes) -> their full shapes in the TP model's layout
    (vocab padded), split dims and real vocab rows: what a checkpoint piece records. Expert
    tensors hold this EP rank's experts (of ``ep``): their full shape has all of them."""
    out = {}
    for name, t in local.items():
        dim, shape = partition_dim(name), list(t.shape)
        if dim >= 0:
            shape[dim] *= tp
        expert = name.endswith((EXPERT_FC1, EXPERT_FC2))
        if expert:
            shape[0] *= ep
        out[name] = ParamLayout(tuple(shape), dim, config.vocab_size if name in VOCAB_TABLES else None,
                                expert=expert)
    return out


def to_tp_layout(config: GPTConfig, name: str, full: torch.Tensor, tp: int) -> torch.Tensor:
    """Canonical full tensor -> the full tensor in the TP model's layout (padded, interleaved)."""
    if name in VOCAB_TABLES:
        pad = config.padded_vocab_size(tp) - config.vocab_size
        return torch.cat([full, full.new_zeros(pad, full.size(1))])   # [V_padded, h]
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        q, k, v = full.split(_qkv_rows(config), dim=0)
        g, rest = config.query_groups, full.shape[1:]
        # per group: [q rows of its a/g heads, k rows, v rows] side by side
        grouped = [t.reshape(g, -1, *rest) for t in (q, k, v)]
        return torch.cat(grouped, dim=1).reshape(full.shape)
    if config.swiglu and name.endswith(_SWIGLU_ROWS):
        # [2, f, ...] -> [f, 2, ...]: gate row i next to up row i
        return full.view(2, -1, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
    if name.endswith(EXPERT_FC1):   # per expert, the same interleave: [E, 2, f, h] -> [E, f, 2, h]
        e, rows, h = full.shape
        return full.view(e, 2, rows // 2, h).transpose(1, 2).reshape(full.shape)
    return full


def from_tp_layout(config: GPTConfig, name: str, full: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_tp_layout` (drops the vocab padding rows)."""
    if name in VOCAB_TABLES:
        return full[:config.vocab_size]
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        g, rest = config.query_groups, full.shape[1:]
        q_rows, k_rows, _ = _qkv_rows(config)
        grouped = full.reshape(g, -1, *rest)                           # [g, (a/g + 2) d, ...]
        q, k, v = grouped.split([q_rows // g, k_rows // g, k_rows // g], dim=1)
        return torch.cat([t.reshape(-1, *rest) for t in (q, k, v)]).reshape(full.shape)
    if config.swiglu and name.endswith(_SWIGLU_ROWS):
        return full.view(-1, 2, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
    if name.endswith(EXPERT_FC1):
        e, rows, h = full.shape
        return full.view(e, rows // 2, 2, h).transpose(1, 2).reshape(full.shape)
    return full


def _qkv_rows(config: GPTConfig) -> list[int]:
    """Rows of q, k and v in the fused QKV projection: a d, g d, g d."""
    kv = config.query_groups * config.head_dim
    return [config.hidden_size, kv, kv]


def shard_tensor(config: GPTConfig, name: str, full: torch.Tensor, tp_rank: int,
                 tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of canonical tensor ``full``."""
    return shard(to_tp_layout(config, name, full, tp_size), partition_dim(name), tp_rank, tp_size)


def is_expert(name: str) -> bool:
    """Whether ``name`` is a stacked expert weight (split over EP along dim 0)."""
    return name.endswith((EXPERT_FC1, EXPERT_FC2))


def expert_slice(name: str, full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    """EP rank ``ep_rank``'s experts of a canonical expert tensor [E, ...]: experts
    ``ep_rank * E/EP .. (ep_rank + 1) * E/EP - 1`` (issue 32, contract 2); other tensors whole."""
    if ep_size == 1 or not is_expert(name):
        return full
    per_rank = full.size(0) // ep_size
    return full.narrow(0, ep_rank * per_rank, per_rank)


def gather_experts(tensors: dict[str, torch.Tensor], ep: Group) -> dict[str, torch.Tensor]:
    """Canonical tensors whose expert weights hold this EP rank's experts -> every expert, by one
    all-gather over ``ep`` per expert tensor (the inverse of :func:`expert_slice`)."""
    if ep.size == 1:
        return tensors
    out = dict(tensors)
    for name, t in tensors.items():
        if is_expert(name):
            full = t.new_empty((ep.size * t.size(0), *t.shape[1:]))
            comm.all_gather_into(full, t.contiguous(), ep)
            out[name] = full
    return out


def shard_state_dict(config: GPTConfig, state_dict: dict[str, torch.Tensor], tp_rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """Reference (canonical) state dict -> the local state dict of TP rank ``tp_rank`` of ``tp_size``."""
    config.validate_for_tp(tp_size)
    return {name: shard_tensor(config, name, t, tp_rank, tp_size) for name, t in state_dict.items()}


def unshard_state_dict(config: GPTConfig, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Local state dicts (or gradient dicts) of all TP ranks, in TP-rank order -> canonical layout.

    Replicated tensors are taken from rank 0 (they are equal on every rank; tests check that).
    """
    out = {}
    for name in shards[0]:
        dim = partition_dim(name)
        full = shards[0][name] if dim == -1 else torch.cat([s[name] for s in shards], dim=dim)
        out[name] = from_tp_layout(config, name, full)
    return out


def gather_canonical(config: GPTConfig, local: dict[str, torch.Tensor], group: Group) -> dict[str, torch.Tensor]:
    """This rank's local state dict (or gradients) -> the full canonical dict, on every TP rank,
    by one all-gather per sharded tensor over ``group`` (for export and checks; every rank must call)."""
    out = {}
    for name, t in local.items():
        dim = partition_dim(name)
        if dim == -1 or group.size == 1:
            full = t.detach()
        else:
            moved = t.detach().movedim(dim, 0).contiguous()            # partition dim first
            gathered = moved.new_empty((group.size * moved.size(0), *moved.shape[1:]))
            comm.all_gather_into(gathered, moved, group)               # shards side by side on dim 0
            full = gathered.movedim(0, dim)
        out[name] = from_tp_layout(config, name, full).clone()
    return out
