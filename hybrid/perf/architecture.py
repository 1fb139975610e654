"""The GPT architecture options that change the counts of the perf models (docs/design.md §7):
grouped-query attention (smaller K/V), SwiGLU (three f x h matrices), linear biases, RMSNorm,
an untied output layer and learned vs rotary positions. Pure numbers; the defaults are GPT-2.

Per layer, with head size d = h / a and g query groups (g = a without GQA):

    matrices  h (h + 2 g d)  QKV  +  h^2  projection  +  (3 if SwiGLU else 2) h f  MLP
    biases    h + 2 g d  QKV  +  h  projection  +  (2f if SwiGLU else f) + h  MLP     (if any)
    norms     2 x (h for RMSNorm, 2h for LayerNorm)

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

    def ffn(self, hidden: int) -> int:
        return 4 * hidden if self.ffn_hidden is None else self.ffn_hidden

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

    def layer_split(self, hidden: int, heads: int | None = None) -> tuple[int, int]:
        """(TP-sharded, TP-replicated) parameters of one layer: matrices and column-parallel
        biases are sharded; the norms and the two row-parallel biases replicated."""
        h, f = hidden, self.ffn(hidden)
        sharded, replicated = self.matmul_params(h, heads), 2 * self.norm_params(h)
        if self.bias:
            sharded += h + 2 * self.kv_hidden(h, heads) + (2 * f if self.swiglu else f)
            replicated += 2 * h
        return sharded, replicated

    def saved_sharded_elements(self, hidden: int, heads: int | None = None) -> float:
        """Per token, in units of h: the 16-bit activations a layer keeps that TP shards, outside the
        attention scores (24 for GPT-2: q, k 4, v 2, projection input 2, MLP 16). GQA shrinks k and
        v to g d; SwiGLU keeps gate and up (4f), silu(gate) (2f) and the product (2f) instead of
        GELU's input and output (4f); see :meth:`core_input_copies` for rotary and GQA."""
        kv = self.kv_hidden(hidden, heads) / hidden
        mlp = (8 if self.swiglu else 4) * self.ffn(hidden) / hidden
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
