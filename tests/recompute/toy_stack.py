"""A small tensor-parallel transformer stack for the recompute tests (no GPT model needed).

Pre-LayerNorm layers built from hybrid.tensor_parallel, Megatron's [s, b, h] layout, with an
explicit attention core (scores, causal mask, softmax, dropout on the TP-region stream, times V) so
selective recompute has a core to rerun, and hidden dropout on the default stream (TP-region with SP).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.recompute import Recomputer
from hybrid.recompute.checkpoint import checkpoint
from hybrid.tensor_parallel import (ColumnParallelLinear, LayerNorm, RowParallelLinear,
                                    scatter_to_sequence)


class ToyLayer(nn.Module):
    def __init__(self, index: int, hidden: int, heads: int, group, sp: bool, rng, p: float):
        super().__init__()
        kw = dict(sequence_parallel=sp)
        self.ln1, self.ln2 = LayerNorm(hidden, group, **kw), LayerNorm(hidden, group, **kw)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group, **kw)
        self.proj = RowParallelLinear(hidden, hidden, group, **kw)
        self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, group, **kw)
        self.fc2 = RowParallelLinear(4 * hidden, hidden, group, **kw)
        for name in ("qkv", "proj", "fc1", "fc2"):
            getattr(self, name).init_weights(7, prefix=f"layers.{index}.{name}.")
        self.heads, self.head_dim = heads // group.size, hidden // heads
        self.rng, self.p, self.sp = rng, p, sp
        self.recompute_core = False

    def core(self, q, k, v):                                    # [b, a/tp, s, d] each
        s = q.size(2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        with self.rng.fork():
            probs = F.dropout(probs, self.p, training=True)
        return probs @ v

    def _drop(self, x):
        if self.sp:
            with self.rng.fork():
                return F.dropout(x, self.p, training=True)
        return F.dropout(x, self.p, training=True)

    def forward(self, x):                                       # [s(/tp), b, h]
        qkv = self.qkv(self.ln1(x))                             # [s, b, 3h/tp]
        s, b, _ = qkv.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.view(s, b, self.heads, 3, self.head_dim).unbind(3))
        y = checkpoint(self.core, q, k, v, rng=self.rng) if self.recompute_core else self.core(q, k, v)
        x = x + self._drop(self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1)))
        return x + self._drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ToyStack(nn.Module):
    """``layers`` ToyLayers between an input projection and a squared-sum loss."""

    def __init__(self, layers: int, hidden: int, heads: int, group, sp: bool, rng, p: float, plan=None):
        super().__init__()
        self.group, self.sp = group, sp
        self.layers = nn.ModuleList(ToyLayer(i, hidden, heads, group, sp, rng, p) for i in range(layers))
        self.recomputer = None
        if plan is not None:
            self.recomputer = Recomputer(plan, group, sequence_parallel=sp, rng=rng)
            for i, layer in enumerate(self.layers):
                layer.recompute_core = plan.selective(i)

    def forward(self, x):                                       # x [s, b, h], replicated
        if self.sp:
            x = scatter_to_sequence(x, self.group)              # [s/tp, b, h]
        if self.recomputer is not None:
            return self.recomputer.run(self.layers, x)
        for layer in self.layers:
            x = layer(x)
        return x
