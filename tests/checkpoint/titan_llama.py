"""A plain-PyTorch Llama with torchtitan's parameter names and its rotary convention, for the DCP
interop tests (issue 34): written apart from models/gpt on purpose. Module names as torchtitan's
Llama (``tok_embeddings``, ``layers.i.attention.wq``, ``layers.i.feed_forward.w1`` ...); rotary
embeddings rotate the interleaved channel pairs (2i, 2i+1) of each head as complex numbers
(Meta's layout), so a checkpoint in our rotate-half layout gives other logits unless the export
permuted the q/k rows. Grouped-query attention repeats each key/value head for its query heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [b, s, heads, d]: pairs (2i, 2i+1) times e^{i p base^(-2i/d)}."""
    b, s, n, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)          # [d/2]
    angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)                # [s, d/2]
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)[None, :, None, :]
    pairs = torch.view_as_complex(x.float().reshape(b, s, n, d // 2, 2))
    return torch.view_as_real(pairs * rot).reshape(b, s, n, d).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, theta):
        super().__init__()
        self.n_heads, self.n_kv, self.d, self.theta = n_heads, n_kv_heads, dim // n_heads, theta
        self.wq = nn.Linear(dim, n_heads * self.d, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.d, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.d, bias=False)
        self.wo = nn.Linear(n_heads * self.d, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = rotate_interleaved(self.wq(x).view(b, s, self.n_heads, self.d), self.theta)
        k = rotate_interleaved(self.wk(x).view(b, s, self.n_kv, self.d), self.theta)
        v = self.wv(x).view(b, s, self.n_kv, self.d)
        rep = self.n_heads // self.n_kv
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, eps, theta):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, theta)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    def __init__(self, vocab, dim, n_layers, n_heads, n_kv_heads, hidden, eps=1e-5, theta=10000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden, eps, theta)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)

    @classmethod
    def of(cls, config) -> "TitanLlama":
        """The model of a GPTConfig's dims."""
        return cls(config.vocab_size, config.hidden_size, config.num_layers,
                   config.num_attention_heads, config.query_groups, config.ffn_hidden_size,
                   config.norm_epsilon, config.rotary_base)

    def forward(self, tokens):                        # [b, s] -> logits [b, s, V]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
