"""The GPT architecture options that change the counts of the perf models (docs/design.md §7):
grouped-query attention (smaller K/V), SwiGLU (three f x h matrices), linear biases, RMSNorm,
an untied output layer and learned vs rotary positions. Pure numbers; the defaults are GPT-2.

Per layer, with head size d = h / a and g query groups (g = a without GQA):

    matrices  h (h + 2 g d)  QKV  +  h^2  projection  +  (3 if SwiGLU else 2) h f  MLP
    biases    h + 2 g d  QKV  +  h  projection  +  (2f if SwiGLU else f) + h  MLP     (if any)
    norms     2 x (h for RMSNorm, 2h for LayerNorm)

Mixture of experts (issue 32): in a MoE layer the MLP is replaced by a router ``E h`` (fp32,
no bias), E experts of width f_e (SwiGLU: 3 h f_e each, GELU 2 h f_e), an optional shared expert of
width f_s (3 h f_s) and its optional sigmoid gate ``h``; no biases. A token passes through the
router, k experts and the shared expert, so

    total  MoE MLP   E h + E * 3 h f_e + 3 h f_s (+ h gate)
    active MoE MLP   E h + k * 3 h f_e + 3 h f_s (+ h gate)

and the model's active parameters (what one token's forward multiplies, the FLOP count of MFU) are
the total minus (E - k) experts per MoE layer. ``moe_pattern`` says which layers are MoE.

``models.gpt.config.GPTConfig.perf_architecture`` gives the instance of a model config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    ffn_hidden: int | None = None     # None: 4h
    query_groups: int | None = None   # key/value heads; None: one per attention head
    swiglu: bool = False
    bias: bool = True
    rmsnorm: bool = False
    untied: bool = False
    learned_positions: bool = True
    qkv_bias: bool = False            # QKV bias even without the other biases (Qwen2)
    # ---- mixture of experts ----
    num_experts: int | None = None    # None: dense
    moe_topk: int = 2
    moe_ffn_hidden: int | None = None          # one expert's width; None: ffn
    shared_expert_ffn: int | None = None       # the shared expert's width; None: no shared expert
    shared_expert_gate: bool = False
    moe_pattern: tuple[int, ...] | None = None  # 1 per MoE layer of the whole model; None: all MoE

    def ffn(self, hidden: int) -> int:
        return 4 * hidden if self.ffn_hidden is None else self.ffn_hidden

    # ---- mixture of experts ----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layers(self, layers: int) -> float:
        """How many of ``layers`` layers are MoE layers: exact for the whole model (the pattern's
        length), pro rata for a part of it (a pipeline stage)."""
        if not self.is_moe:
            return 0
        if self.moe_pattern is None:
            return layers
        moe = sum(self.moe_pattern)
        return moe if layers == len(self.moe_pattern) else layers * moe / len(self.moe_pattern)

    def expert_params(self, hidden: int) -> int:
        """One routed expert: (3 if SwiGLU else 2) h f_e."""
        f = self.ffn(hidden) if self.moe_ffn_hidden is None else self.moe_ffn_hidden
        return (3 if self.swiglu else 2) * hidden * f

    def moe_mlp_params(self, hidden: int, *, active: bool = False) -> int:
        """A MoE layer's MLP: router E h, E (or k when ``active``) experts, the shared expert 3 h f_s
        and its gate h."""
        h, e = hidden, self.num_experts
        experts = self.moe_topk if active else e
        shared = 3 * h * self.shared_expert_ffn if self.shared_expert_ffn else 0
        return e * h + experts * self.expert_params(h) + shared + (h if self.shared_expert_gate else 0)

    def dense_mlp_params(self, hidden: int) -> int:
        """A dense layer's MLP weights (3 h f with SwiGLU, else 2 h f)."""
        return (3 if self.swiglu else 2) * hidden * self.ffn(hidden)

    def attention_params(self, hidden: int, heads: int | None = None) -> int:
        """QKV h (h + 2 g d) and the projection h^2 (weights only)."""
        h = hidden
        return h * (h + 2 * self.kv_hidden(h, heads)) + h * h

    def layer_params(self, hidden: int, heads: int | None = None, *, moe: bool = False,
                     active: bool = False) -> int:
        """Every parameter of one layer (weights, biases, norms), a MoE layer when ``moe``; with
        ``active`` only the k routed experts a token uses. MoE layers have no MLP biases."""
        h = hidden
        params = self.attention_params(h, heads) + 2 * self.norm_params(h)
        if self.bias or self.qkv_bias:
            params += h + 2 * self.kv_hidden(h, heads)          # QKV bias
        if self.bias:
            params += h                                          # projection bias
        if moe:
            return params + self.moe_mlp_params(h, active=active)
        f = self.ffn(h)
        return params + self.dense_mlp_params(h) + ((2 * f if self.swiglu else f) + h if self.bias else 0)

    def layers_params(self, layers: int, hidden: int, heads: int | None = None, *,
                      active: bool = False) -> float:
        """All parameters of ``layers`` layers with the MoE pattern (total or active)."""
        moe = self.moe_layers(layers)
        return ((layers - moe) * self.layer_params(hidden, heads)
                + moe * self.layer_params(hidden, heads, moe=True, active=active))

    def forward_matmul_params(self, layers: int, hidden: int, heads: int | None = None) -> float:
        """GEMM weights one token multiplies in ``layers`` layers (2 FLOPs each, forward): attention,
        and per dense layer its MLP, per MoE layer the router, k experts, the shared expert and its
        gate (the active parameters less biases and norms)."""
        h = hidden
        moe = self.moe_layers(layers)
        mlp = (layers - moe) * self.dense_mlp_params(h)
        if moe:
            mlp += moe * self.moe_mlp_params(h, active=True)
        return layers * self.attention_params(h, heads) + mlp

    def kv_hidden(self, hidden: int, heads: int | None) -> int:
        """g d: the width of K (and of V)."""
        if self.query_groups is None:
            return hidden
        if heads is None:
            raise ValueError("grouped-query attention: pass the number of attention heads too")
        return self.query_groups * (hidden // heads)

    def norm_params(self, hidden: int) -> int:
        return hidden if self.rmsnorm else 2 * hidden

    def matmul_params(self, hidden: int, heads: int | None = None) -> int:
        """Weights of one layer's GEMMs (12 h^2 for GPT-2): 2 FLOPs per weight per token forward."""
        h, f = hidden, self.ffn(hidden)
        return h * (h + 2 * self.kv_hidden(h, heads)) + h * h + (3 if self.swiglu else 2) * h * f

    def moe_layer_split(self, hidden: int, heads: int | None = None) -> tuple[int, int, int]:
        """(TP-sharded dense, expert, TP-replicated) parameters of one MoE layer: attention's
        matrices, QKV bias and the shared expert are sharded over TP; the routed experts over EP
        (and TP); norms, the projection bias, the router and the shared-expert gate replicated."""
        h = hidden
        sharded = self.attention_params(h, heads) + (3 * h * self.shared_expert_ffn
                                                     if self.shared_expert_ffn else 0)
        if self.bias or self.qkv_bias:
            sharded += h + 2 * self.kv_hidden(h, heads)
        replicated = (2 * self.norm_params(h) + (h if self.bias else 0) + self.num_experts * h
                      + (h if self.shared_expert_gate else 0))
        return sharded, self.num_experts * self.expert_params(h), replicated

    def layer_split(self, hidden: int, heads: int | None = None) -> tuple[int, int]:
        """(TP-sharded, TP-replicated) parameters of one dense layer: matrices and column-parallel
        biases are sharded; the norms and the two row-parallel biases replicated."""
        h, f = hidden, self.ffn(hidden)
        sharded, replicated = self.matmul_params(h, heads), 2 * self.norm_params(h)
        if self.bias:
            sharded += h + 2 * self.kv_hidden(h, heads) + (2 * f if self.swiglu else f)
            replicated += 2 * h
        elif self.qkv_bias:
            sharded += h + 2 * self.kv_hidden(h, heads)
        return sharded, replicated

    def saved_sharded_elements(self, hidden: int, heads: int | None = None) -> float:
        """Per token, in units of h: the 16-bit activations a layer keeps that TP shards, outside the
        attention scores (24 for GPT-2: q, k 4, v 2, projection input 2, MLP 16). GQA shrinks k and
        v to g d; SwiGLU keeps gate and up (4f), silu(gate) (2f) and the product (2f) instead of
        GELU's input and output (4f); see :meth:`core_input_copies` for rotary and GQA. A MoE
        layer keeps per token k routed copies of its input (2k) and each route's expert
        activations (8 f_e / h for SwiGLU), plus the shared expert's (8 f_s / h); with a
        ``moe_pattern`` the dense and MoE MLP terms are averaged over the pattern's layers."""
        kv = self.kv_hidden(hidden, heads) / hidden
        per_width = 8 if self.swiglu else 4
        mlp = per_width * self.ffn(hidden) / hidden
        if self.is_moe:
            f_e = self.ffn(hidden) if self.moe_ffn_hidden is None else self.moe_ffn_hidden
            moe = (self.moe_topk * (2 + per_width * f_e / hidden)
                   + (8 * self.shared_expert_ffn / hidden if self.shared_expert_ffn else 0))
            share = 1.0 if self.moe_pattern is None else sum(self.moe_pattern) / len(self.moe_pattern)
            mlp = (1 - share) * mlp + share * moe
        return 2 + 2 * kv + 2 * kv + 2 + mlp + self.core_input_copies(hidden, heads)

    def core_input_copies(self, hidden: int, heads: int | None = None) -> float:
        """Per token, in units of h: q and k the attention core keeps as tensors of their own, beside
        the fused QKV output that v (a view of it) keeps alive. Rotary embeddings produce new q and
        k (2 + 2 g d / h); grouped-query attention a new q (its heads are not one strided view of
        the per-group QKV rows: 2); GPT-2's q and k are views (0)."""
        kv = self.kv_hidden(hidden, heads) / hidden
        if not self.learned_positions:
            return 2 + 2 * kv
        return 2.0 if self.query_groups is not None else 0.0


GPT2 = Architecture()
