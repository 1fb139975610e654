"""The tensor-parallel GPT-2 transformer layer (Megatron-LM §3, Fig. 3; sequence parallelism:
Korthikanti et al. 2022 §4.2.2).

Layout is Megatron's ``[s, b, h]``. Attention splits its heads across the TP ranks: the fused QKV
projection is column-parallel (each rank computes whole heads), the output projection row-parallel
(one all-reduce). The MLP is column-parallel ``h -> 4h`` then row-parallel ``4h -> h`` (one
all-reduce). With sequence parallelism the LayerNorms, dropouts and residual adds run on sequence
shards ``[s/tp, b, h]``; each all-reduce becomes an all-gather in front of the column-parallel linear
and a reduce-scatter after the row-parallel one.

Dropout (Megatron's RNG rule): attention-probability dropout sees different heads on different TP
ranks, so it draws from the TP-region stream (``rng.fork()``); hidden dropout on replicated
activations draws from the default stream (same mask on every TP rank) unless sequence parallelism
shards them, when it uses the TP-region stream too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.comm import Group
from hybrid.recompute import checkpoint
from hybrid.tensor_parallel import ColumnParallelLinear, LayerNorm, RNGTracker, RowParallelLinear
from models.gpt.config import GPTConfig


def dropout(x: torch.Tensor, p: float, training: bool, rng: RNGTracker | None, tp_region: bool,
            tp_size: int) -> torch.Tensor:
    """Dropout on the TP-region stream when ``tp_region`` (activations that differ across TP
    ranks), on the default stream otherwise."""
    if not training or p == 0.0:
        return x
    with dropout_stream(rng, tp_region, tp_size):
        return F.dropout(x, p, training=True)


def dropout_stream(rng: RNGTracker | None, tp_region: bool, tp_size: int):
    """Context choosing the random stream for dropout (see module docstring)."""
    if not tp_region:
        return contextlib.nullcontext()
    if rng is None:
        if tp_size > 1:
            raise ValueError("dropout inside a tensor-parallel region needs the TP random stream: "
                             "build the model with rng=RNGTracker(seed, state.tp_rank, state.device)")
        return contextlib.nullcontext()
    return rng.fork()


class ParallelAttention(nn.Module):
    """Causal self-attention with ``heads / tp`` heads on this rank."""

    def __init__(self, config: GPTConfig, group: Group, sequence_parallel: bool, rng, device, dtype):
        super().__init__()
        h, tp = config.hidden_size, group.size
        self.local_heads, self.head_dim = config.num_attention_heads // tp, config.head_dim
        self.p, self.rng, self.tp = config.attention_dropout, rng, tp
        kw = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        # QKV rows interleaved per head ([q k v] of head 0, of head 1, ...), see sharding.py
        self.qkv = ColumnParallelLinear(h, 3 * h, group, **kw)
        self.proj = RowParallelLinear(h, h, group, **kw)
        self.recompute_core = False   # selective recompute (hybrid/recompute): rerun core() in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                                   # [s, b, 3h/tp]
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).unbind(dim=3)  # [s, b, a/tp, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))               # [b, a/tp, s, d]
        y = checkpoint(self.core, q, k, v, rng=self.rng) if self.recompute_core else self.core(q, k, v)
        y = y.permute(2, 0, 1, 3).reshape(s, b, -1)                          # [s, b, h/tp]
        return self.proj(y)                                                 # [s(/tp), b, h]

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with attention dropout: [b, a/tp, s, d] -> [b, a/tp, s, d]."""
        p = self.p if self.training else 0.0
        with dropout_stream(self.rng, p > 0, self.tp):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class ParallelMLP(nn.Module):
    """``h -> 4h`` (column-parallel), GELU, ``4h -> h`` (row-parallel)."""

    def __init__(self, config: GPTConfig, group: Group, sequence_parallel: bool, device, dtype):
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, group, **kw)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # [s, b, 4h/tp] inside


class TransformerLayer(nn.Module):
    """Pre-LayerNorm GPT-2 layer: ``x + drop(attn(ln1(x)))`` then ``x + drop(mlp(ln2(x)))``,
    on ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)."""

    def __init__(self, config: GPTConfig, group: Group, *, sequence_parallel: bool = False,
                 rng: RNGTracker | None = None, device=None, dtype=None):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        norm = dict(eps=eps, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.ln1 = LayerNorm(h, group, **norm)
        self.attn = ParallelAttention(config, group, sequence_parallel, rng, device, dtype)
        self.ln2 = LayerNorm(h, group, **norm)
        self.mlp = ParallelMLP(config, group, sequence_parallel, device, dtype)
        self.p, self.rng, self.tp = config.hidden_dropout, rng, group.size
        self.sequence_parallel = sequence_parallel

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.rng, self.sequence_parallel, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))
