"""Rotary position embeddings (Su et al. 2021, "RoFormer", §3.4) with Llama-3.1's frequency scaling.

Channel ``i`` of the first half of a head is paired with channel ``i + d/2`` (the "rotate half"
layout of GPT-NeoX, Megatron-LM's default and Hugging Face Llama's), and the pair at position ``p``
is rotated by the angle ``p * theta_i``, ``theta_i = base^(-2i/d)``:

    q' = q * cos(p theta) + rotate_half(q) * sin(p theta),   rotate_half([x1, x2]) = [-x2, x1]

Llama-3.1 rescales the frequencies for long contexts (parameters ``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``): wavelengths ``2 pi / theta`` longer than
``original / low_freq_factor`` are divided by ``factor``, shorter than ``original / high_freq_factor``
kept, and those in between interpolated linearly in ``original / wavelength``.

The rotation has no parameters and acts on each head separately, so tensor parallelism (whole heads
per rank) needs nothing special. Under sequence parallelism the QKV projection all-gathers the
sequence first, so the positions here are always those of the whole sequence, ``0 .. s-1``, unless
the model's :class:`~models.gpt.token_layout.TokenLayout` gives each token its own (positions that
restart at every document, a context-parallel rank's global indices): then cos and sin are computed
per token instead of read from the cached table.
"""

from __future__ import annotations

import functools
import math

import torch

from models.gpt.config import GPTConfig


def inverse_frequencies(config: GPTConfig) -> torch.Tensor:
    """theta_i for i < d/2, fp32 [d/2], scaled per Llama-3.1 when ``config.use_rope_scaling``."""
    d = config.head_dim
    theta = config.rotary_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)    # [d/2]
    if not config.use_rope_scaling:
        return theta.float()
    original = config.rope_original_max_position_embeddings
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    ratio = original * theta / (2 * math.pi)           # original context / wavelength
    blend = ((ratio - low) / (high - low)).clamp(0.0, 1.0)   # 0: long waves, 1: short waves
    scaled = theta * (blend + (1 - blend) / config.rope_scaling_factor)
    return scaled.float()


class RotaryEmbedding(torch.nn.Module):
    """Applies the rotation to queries and keys ``[b, heads, s, d]`` at positions
    ``offset .. offset + s - 1`` (offset > 0: new tokens after a KV cache's positions)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: each token's position, [b, s] or [s] int64 (issue 31: positions that
        restart at each document, or a CP rank's global indices) instead of ``offset ..``."""
        if positions is not None:
            cos, sin = _cos_sin_at(self.config, positions, q.dtype)   # [b, 1, s, d] or [s, d]
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        # compiled (models/gpt/compile.py): the uncached function, traced into the layer's graph,
        # where inductor fuses the angles with the rotation (dynamo would skip the cache anyway)
        table = _cos_sin.__wrapped__ if torch.compiler.is_compiling() else _cos_sin
        cos, sin = table(self.config, offset + q.size(-2), q.device, q.dtype)
        cos, sin = cos[offset:], sin[offset:]                                   # [s, d]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


@functools.lru_cache(maxsize=8)
def _cos_sin(config: GPTConfig, s: int, device: torch.device, dtype: torch.dtype):
    """cos and sin of the angles [s, d], cached: every layer of a model shares one pair."""
    theta = inverse_frequencies(config).to(device)                               # [d/2]
    angles = torch.outer(torch.arange(s, device=device, dtype=torch.float32), theta)
    angles = torch.cat([angles, angles], dim=-1)                                 # [s, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _cos_sin_at(config: GPTConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of the angles at ``positions`` [b, s] -> [b, 1, s, d] (one per head), or
    [s] -> [s, d]; the same fp32 products as the cached table, so equal positions rotate equally."""
    theta = inverse_frequencies(config).to(positions.device)                     # [d/2]
    angles = positions.to(torch.float32).unsqueeze(-1) * theta                   # [..., s, d/2]
    angles = torch.cat([angles, angles], dim=-1)                                 # [..., s, d]
    if positions.dim() == 2:
        angles = angles.unsqueeze(1)                                             # [b, 1, s, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)                                                  # [..., d/2] each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
