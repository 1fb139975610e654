"""The canonical GPT parameter layout and its mapping to tensor-parallel shards (Megatron-LM §3).

The canonical layout is the single-device reference's state dict (:mod:`models.gpt.reference`):
true vocab, fused QKV rows ordered ``[q; k; v]`` with the heads contiguous inside each. The TP model
(:mod:`models.gpt.model`) uses the same parameter names with three differences, handled here:

- the word embedding is padded with zero rows to ``config.padded_vocab_size(tp)``, then split by rows;
- fused QKV rows are interleaved per head, ``[head 0: q k v | head 1: q k v | ...]``, so a contiguous
  row slice gives each TP rank whole heads of q, k and v;
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

_COLUMN_PARALLEL = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias")
_ROW_PARALLEL = ("attn.proj.weight", "mlp.fc2.weight")
WORD_EMBEDDING = "embedding.word.weight"


def canonical_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the canonical layout and its full shape, in model order."""
    h, f = config.hidden_size, config.ffn_hidden_size
    shapes = {WORD_EMBEDDING: (config.vocab_size, h),
              "embedding.position.weight": (config.max_position_embeddings, h)}
    layer = {"ln1.weight": (h,), "ln1.bias": (h,), "attn.qkv.weight": (3 * h, h),
             "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h), "attn.proj.bias": (h,),
             "ln2.weight": (h,), "ln2.bias": (h,), "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,),
             "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    for i in range(config.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    shapes.update({"final_norm.weight": (h,), "final_norm.bias": (h,)})
    return shapes


def canonical_init(config: GPTConfig, name: str, seed: int) -> torch.Tensor:
    """GPT-2 initial value of canonical parameter ``name`` (fp32, CPU): normal(0, std) weights,
    output projections scaled by 1/sqrt(2 * layers) (GPT-2 §2.3), zero biases, unit LayerNorm gains."""
    shape = canonical_shapes(config)[name]
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name or ".ln" in name:
        return torch.ones(shape)
    std = config.init_method_std
    if name.endswith(_ROW_PARALLEL):
        std /= math.sqrt(2.0 * config.num_layers)
    return full_init(name, shape, std, seed)


def partition_dim(name: str) -> int:
    """Dimension along which the TP model splits parameter ``name`` (-1: replicated)."""
    if name == WORD_EMBEDDING or name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return -1


def checkpoint_layout(config: GPTConfig, local: dict[str, torch.Tensor],
                      tp: int) -> dict[str, ParamLayout]:
    """TP-local parameters (this rank's shapes) -> their full shapes in the TP model's layout
    (vocab padded), split dims and real vocab rows: what a checkpoint piece records."""
    out = {}
    for name, t in local.items():
        dim, shape = partition_dim(name), list(t.shape)
        if dim >= 0:
            shape[dim] *= tp
        out[name] = ParamLayout(tuple(shape), dim, config.vocab_size if name == WORD_EMBEDDING else None)
    return out


def to_tp_layout(config: GPTConfig, name: str, full: torch.Tensor, tp: int) -> torch.Tensor:
    """Canonical full tensor -> the full tensor in the TP model's layout (padded, interleaved)."""
    if name == WORD_EMBEDDING:
        pad = config.padded_vocab_size(tp) - config.vocab_size
        return torch.cat([full, full.new_zeros(pad, full.size(1))])   # [V_padded, h]
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        heads, hd = config.num_attention_heads, config.head_dim
        rest = full.shape[1:]
        # [3, heads, hd, ...] -> [heads, 3, hd, ...]: each head's q, k, v rows side by side
        return full.view(3, heads, hd, *rest).transpose(0, 1).reshape(full.shape)
    return full


def from_tp_layout(config: GPTConfig, name: str, full: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_tp_layout` (drops the vocab padding rows)."""
    if name == WORD_EMBEDDING:
        return full[:config.vocab_size]
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        heads, hd = config.num_attention_heads, config.head_dim
        rest = full.shape[1:]
        return full.view(heads, 3, hd, *rest).transpose(0, 1).reshape(full.shape)
    return full


def shard_tensor(config: GPTConfig, name: str, full: torch.Tensor, tp_rank: int,
                 tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of canonical tensor ``full``."""
    return shard(to_tp_layout(config, name, full, tp_size), partition_dim(name), tp_rank, tp_size)


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
