"""Key/value cache for incremental decoding (the standard decoder trick: GPT-2's ``past`` / Megatron's
inference key-value memory), tensor-parallel like the attention itself.

Each layer keeps the keys and values of every position seen so far, ``[b, g/tp, max_len, d]`` on its
TP rank (this rank's query groups only, so the cache shards exactly like the heads and needs no
communication). A forward of ``n`` new tokens at positions ``length .. length + n - 1`` writes their
k and v and attends over ``0 .. length + n - 1``; decoding then costs one token's forward per step
instead of the whole context's.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's keys and values; buffers allocated on the first write (dtype/device of k)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.keys: torch.Tensor | None = None     # [b, g/tp, max_len, d]
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ``[b, g/tp, n, d]`` at ``start``; return all keys and values so far."""
        if self.keys is None:
            b, g, _, d = k.shape
            self.keys = k.new_empty(b, g, self.max_len, d)
            self.values = v.new_empty(b, g, self.max_len, d)
        end = start + k.size(2)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Keys and values of every layer for ``max_len`` positions; ``length`` positions are filled."""

    def __init__(self, num_layers: int, max_len: int):
        self.max_len, self.length = max_len, 0
        self.layers = [LayerKVCache(max_len) for _ in range(num_layers)]

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {self.length} are used and "
                             f"{n} more do not fit - start a new cache (max positions of the model)")

    def advance(self, n: int) -> None:
        self.length += n
