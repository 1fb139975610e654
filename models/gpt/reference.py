"""Single-device GPT-2 in plain PyTorch: the numerical oracle of the tests (docs/design.md §4).

Written independently of the tensor-parallel model on purpose: ``[b, s, h]`` layout, ``nn.Linear`` /
``nn.Embedding``, attention spelled out as softmax(QK^T / sqrt(d)) V with an explicit causal mask,
and ``F.cross_entropy`` over the true (unpadded) vocab. Its state dict is the canonical layout of
:mod:`models.gpt.sharding`; :meth:`ReferenceGPT.init_weights` gives the same values as the TP model's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gpt.config import GPTConfig
from models.gpt.sharding import canonical_init


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads, h = config.num_attention_heads, config.hidden_size
        self.qkv = nn.Linear(h, 3 * h)   # rows [q; k; v]
        self.proj = nn.Linear(h, h)
        self.dropout = nn.Dropout(config.attention_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)                                   # 3 x [b, s, h]
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [b, a, s, d]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))               # [b, a, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = self.dropout(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, s, h)                        # [b, s, h]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        eps = config.layernorm_epsilon
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.dropout(self.word(tokens) + self.position(positions))      # [b, s, h]


class ReferenceGPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The canonical initial values (same as every TP degree of the model)."""
        for name, p in self.named_parameters():
            p.copy_(canonical_init(self.config, name, seed))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, V], or per-token loss [b, s] (fp32) given labels [b, s]."""
        if tokens.size(1) > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {tokens.size(1)} tokens is longer than max position "
                             f"embeddings {self.config.max_position_embeddings}")
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.final_norm(x) @ self.embedding.word.weight.t()           # tied: [b, s, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return loss.view_as(labels)
