"""The tensor-parallel GPT transformer layer (Megatron-LM §3, Fig. 3; sequence parallelism:
Korthikanti et al. 2022 §4.2.2), GPT-2 by default, Llama-style with the config's options.

Layout is Megatron's ``[s, b, h]``. Attention splits its heads across the TP ranks: the fused QKV
projection is column-parallel (each rank computes whole heads), the output projection row-parallel
(one all-reduce). The MLP is column-parallel ``h -> 4h`` then row-parallel ``4h -> h`` (one
all-reduce). With sequence parallelism the LayerNorms, dropouts and residual adds run on sequence
shards ``[s/tp, b, h]``; each all-reduce becomes an all-gather in front of the column-parallel linear
and a reduce-scatter after the row-parallel one.

Options (:class:`~models.gpt.config.GPTConfig`): RMSNorm instead of LayerNorm; rotary positions applied
to q and k after the QKV projection (whole sequence even under SP, see models/gpt/rotary.py);
grouped-query attention, where the QKV rows are ordered per query group ``[q of the group's heads,
k, v]`` so a contiguous row slice gives each TP rank whole groups, and SDPA shares each group's keys
and values among its heads; SwiGLU, whose gate and up projections are ONE column-parallel linear with
their rows interleaved (gate row i, up row i, ...) so every rank's slice holds the matching halves
``gate_r`` and ``up_r`` whatever the TP degree, and the input is all-gathered once under SP; no
linear biases.

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
from hybrid.recompute.checkpoint import checkpoint
from hybrid.tensor_parallel import (ColumnParallelLinear, LayerNorm, RMSNorm, RNGTracker,
                                    RowParallelLinear)
from models.gpt.attention_core import attention_core, packed_attention_core
from models.gpt.config import GPTConfig
from models.gpt.document_attention import document_attention
from models.gpt.gelu import gelu_tanh
from models.gpt.kv_cache import LayerKVCache
from models.gpt.rotary import RotaryEmbedding
from models.gpt.token_layout import TokenLayout

# SDPA shares key/value heads among query heads itself from torch 2.5 (``enable_gqa``)
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# selective recompute's checkpoint saves RNG states and reruns the core in backward: under a compiled
# layer (models/gpt/compile.py) it runs eagerly, a graph break around the attention core
_checkpoint_eagerly = torch.compiler.disable(checkpoint)


def build_norm(config: GPTConfig, group: Group, sequence_parallel: bool, device, dtype) -> nn.Module:
    """The config's normalization over h (LayerNorm or RMSNorm), replicated across TP."""
    kind = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return kind(config.hidden_size, group, eps=config.norm_epsilon,
                sequence_parallel=sequence_parallel, device=device, dtype=dtype)


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
    """Causal self-attention with ``heads / tp`` query heads and ``groups / tp`` key/value heads on
    this rank (groups = heads without grouped-query attention)."""

    def __init__(self, config: GPTConfig, group: Group, sequence_parallel: bool, rng, device, dtype):
        super().__init__()
        h, tp = config.hidden_size, group.size
        self.local_heads, self.head_dim = config.num_attention_heads // tp, config.head_dim
        self.local_groups = config.query_groups // tp
        self.p, self.rng, self.tp = config.attention_dropout, rng, tp
        kw = dict(bias=config.add_bias_linear, sequence_parallel=sequence_parallel, device=device,
                  dtype=dtype)
        # QKV rows per query group ([q of its heads, k, v] of group 0, of group 1, ...), see sharding.py
        self.qkv = ColumnParallelLinear(h, config.qkv_size, group,
                                        **{**kw, "bias": config.add_bias_linear or config.add_qkv_bias})
        self.proj = RowParallelLinear(h, h, group, **kw)
        self.rotary = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.recompute_core = False   # selective recompute (hybrid/recompute): rerun core() in backward
        self.core_in_fp32 = config.attention_softmax_in_fp32

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None, start: int = 0,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """``cache``: keys/values of positions ``0 .. start-1`` (decoding); x holds positions
        ``start ..``, whose k and v are appended to it. ``layout``: the tokens' positions (rotary),
        documents and context-parallel group (:meth:`layout_core`); None: causal over ``0 .. s-1``."""
        qkv = self.qkv(x)                                                   # [s, b, (a + 2g) d/tp]
        s, b, _ = qkv.shape
        per_group = self.local_heads // self.local_groups                   # query heads per group
        qkv = qkv.view(s, b, self.local_groups, per_group + 2, self.head_dim)
        masked = layout is not None and (layout.document_ids is not None or layout.context_parallel)
        if cache is None and self.rotary is None and not masked and qkv.device.type == "cpu":
            if self.recompute_core:
                y = _checkpoint_eagerly(self.packed_core, qkv, rng=self.rng)
            else:
                y = self.packed_core(qkv)                                   # [s, b, a/tp, d]
            return self.proj(y.view(s, b, -1))                              # [s(/tp), b, h]
        q = qkv[:, :, :, :per_group].reshape(s, b, self.local_heads, self.head_dim)  # [s, b, a/tp, d]
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]         # [s, b, g/tp, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))               # [b, heads, s, d]
        if self.rotary is not None:
            q, k = self.rotary(q, k, start, layout.positions() if layout is not None else None)
        if cache is not None:
            k, v = cache.append(k, v, start)                                # [b, g/tp, start + s, d]
            y = self.core(q, k, v, start)
        elif masked and self.recompute_core:   # the layout rides along as a plain argument
            y = _checkpoint_eagerly(self.layout_core, q, k, v, layout, rng=self.rng)
        elif masked:
            y = self.layout_core(q, k, v, layout)
        elif self.recompute_core:
            y = _checkpoint_eagerly(self.core, q, k, v, rng=self.rng)
        else:
            y = self.core(q, k, v)
        y = y.permute(2, 0, 1, 3).reshape(s, b, -1)                          # [s, b, h/tp]
        return self.proj(y)                                                 # [s(/tp), b, h]

    def packed_core(self, qkv: torch.Tensor) -> torch.Tensor:
        """The CPU core straight from the QKV output ``[s, b, g/tp, a/g + 2, d]`` (no rotary, no
        cache): :func:`~models.gpt.attention_core.packed_attention_core` -> ``[s, b, a/tp, d]``,
        the same values and dropout mask as :meth:`core`; its backward writes one QKV gradient
        instead of three zero-filled slice gradients summed by autograd."""
        p = self.p if self.training else 0.0
        with dropout_stream(self.rng, p > 0, self.tp):
            return packed_attention_core(qkv, dropout_p=p, compute_dtype=self._core_dtype())

    @torch.compiler.disable   # host-side block planning and CP communication: eager under compile
    def layout_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layout: TokenLayout) -> torch.Tensor:
        """The core under a :class:`~models.gpt.token_layout.TokenLayout` with documents or context
        parallelism (issue 31), q [b, a/tp, s, d], k and v [b, g/tp, s, d] -> [b, a/tp, s, d]:
        across the CP group by
        :func:`~hybrid.context_parallel.attention.context_parallel_attention` when it has more than
        one rank, else causal within each document
        (:func:`~models.gpt.document_attention.document_attention`)."""
        p = self.p if self.training else 0.0
        if layout.context_parallel:
            if p > 0:
                raise ValueError("attention dropout is not supported with context parallelism; set "
                                 "--attention-dropout 0")
            if layout.token_index is None:
                raise ValueError("context-parallel attention needs TokenLayout.token_index (the "
                                 "global index of each local token)")
            # imported here: the CP library is optional for every other path
            from hybrid.context_parallel.attention import context_parallel_attention
            return context_parallel_attention(q, k, v, group=layout.cp_group,
                                              comm_type=layout.cp_comm_type,
                                              token_index=layout.token_index,
                                              document_ids=layout.document_ids,
                                              compute_dtype=self._core_dtype())
        with dropout_stream(self.rng, p > 0, self.tp):
            return document_attention(q, k, v, layout.document_ids, dropout_p=p,
                                      compute_dtype=self._core_dtype())

    def _core_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.core_in_fp32 else None

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with attention dropout: q [b, a/tp, s, d], k and v
        [b, g/tp, start + s, d] -> [b, a/tp, s, d]; query head j reads key/value head j // (a/g).
        Query i sits at position start + i and sees keys 0 .. start + i (causal). With
        ``attention_softmax_in_fp32`` a bf16/fp16 core runs on fp32 copies and returns the input
        dtype. On CPU the core is :func:`~models.gpt.attention_core.attention_core`, which returns
        a view of an ``[s, b, a/tp, d]`` tensor (the output projection reads it without a copy);
        elsewhere torch's SDPA (flash kernels on CUDA)."""
        p = self.p if self.training else 0.0
        if q.device.type == "cpu":   # explicit products beat SDPA's CPU kernels (attention_core.py)
            with dropout_stream(self.rng, p > 0, self.tp):
                return attention_core(q, k, v, start=start, dropout_p=p,
                                      compute_dtype=self._core_dtype())
        mask = dict(is_causal=True)
        if start:   # queries after cached keys: one query sees all of them, several a causal band
            s, total = q.size(2), k.size(2)
            mask = {} if s == 1 else dict(attn_mask=torch.ones(s, total, dtype=torch.bool,
                                                               device=q.device).tril(start))
        gqa = {}
        if self.local_groups != self.local_heads:
            if _SDPA_HAS_GQA:
                gqa = dict(enable_gqa=True)
            else:
                repeat = self.local_heads // self.local_groups
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dtype = q.dtype
        if self.core_in_fp32:   # --attention-softmax-in-fp32: the core's inputs and softmax in fp32
            q, k, v = q.float(), k.float(), v.float()
        with dropout_stream(self.rng, p > 0, self.tp):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **mask, **gqa).to(dtype)


class ParallelMLP(nn.Module):
    """``h -> f`` (column-parallel), GELU, ``f -> h`` (row-parallel); with SwiGLU ``h -> 2f``
    (gate and up, rows interleaved) then ``silu(gate) * up`` and ``f -> h``."""

    def __init__(self, config: GPTConfig, group: Group, sequence_parallel: bool, device, dtype):
        super().__init__()
        kw = dict(bias=config.add_bias_linear, sequence_parallel=sequence_parallel, device=device,
                  dtype=dtype)
        f = config.ffn_hidden_size
        self.swiglu = config.swiglu
        self.fc1 = ColumnParallelLinear(config.hidden_size, 2 * f if self.swiglu else f, group, **kw)
        self.fc2 = RowParallelLinear(f, config.hidden_size, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)                                             # [s, b, f/tp] (2f/tp SwiGLU)
        if self.swiglu:
            gate, up = y.view(*y.shape[:-1], -1, 2).unbind(dim=-1)  # [s, b, f/tp] each
            return self.fc2(F.silu(gate) * up)
        return self.fc2(gelu_tanh(y))


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x + drop(attn(ln1(x)))`` then ``x + drop(mlp(ln2(x)))``, on ``[s, b, h]``
    (``[s/tp, b, h]`` with sequence parallelism); ln1/ln2 are LayerNorm or RMSNorm. With ``moe``
    the MLP is a :class:`~models.gpt.moe.MoELayer` sharing ``aux_scale`` with the model."""

    def __init__(self, config: GPTConfig, group: Group, *, sequence_parallel: bool = False,
                 rng: RNGTracker | None = None, device=None, dtype=None, moe: bool = False,
                 aux_scale=None, ep: Group | None = None):
        super().__init__()
        self.ln1 = build_norm(config, group, sequence_parallel, device, dtype)
        self.attn = ParallelAttention(config, group, sequence_parallel, rng, device, dtype)
        self.ln2 = build_norm(config, group, sequence_parallel, device, dtype)
        if moe:   # a mixture-of-experts layer (models/gpt/moe.py; config.is_moe_layer)
            from models.gpt.moe import MoELayer
            self.mlp = MoELayer(config, group, sequence_parallel=sequence_parallel,
                                aux_scale=aux_scale, device=device, dtype=dtype, ep=ep)
        else:
            self.mlp = ParallelMLP(config, group, sequence_parallel, device, dtype)
        self.p, self.rng, self.tp, self.moe = config.hidden_dropout, rng, group.size, moe
        self.sequence_parallel = sequence_parallel

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.rng, self.sequence_parallel, self.tp)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None, start: int = 0,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """``layout``: the tokens' :class:`~models.gpt.token_layout.TokenLayout` (None: the default
        causal layout); ``cache`` and ``start``: KV-cache decoding."""
        x = x + self._drop(self.attn(self.ln1(x), cache, start, layout))
        if self.moe:   # the MoE router reduces its statistics over the layout's CP group
            return x + self._drop(self.mlp(self.ln2(x), layout))
        return x + self._drop(self.mlp(self.ln2(x)))
