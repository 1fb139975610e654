"""What a rank owns of the model, piece by piece: one :class:`OwnedPiece` row per parameter piece
in its partition (ZeRO §5.1: a partition is a few flat chunks that cut through parameters), and the
merged runs of adjacent pieces that the norm and the AdamW kernels read as long views."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OwnedPiece:
    """Elements [param_offset, +numel) of the flattened TP-local parameter ``name`` live at
    [offset, +numel) of chunk ``chunk`` of this rank's partition (params, grads, master, moments)."""

    name: str
    chunk: int
    offset: int
    param_offset: int
    numel: int
    decay: bool          # AdamW weight decay applies (matrices, embeddings)
    tp_sharded: bool     # False: replicated over TP, counted once in the global norm
    param_class: int = 0  # which parameter class (hybrid.zero.param_classes): 0 dense, 1 expert

    def of(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        return chunks[self.chunk].narrow(0, self.offset, self.numel)


def merged_spans(pieces: list[OwnedPiece], key) -> list[tuple[int, int, int, bool]]:
    """(chunk, offset, numel, key(piece)) runs of adjacent pieces with the same key, so kernels see a
    few long views instead of one per parameter."""
    spans: list[list] = []
    for p in sorted(pieces, key=lambda p: (p.chunk, p.offset)):
        k = key(p)
        last = spans[-1] if spans else None
        if last and last[0] == p.chunk and last[1] + last[2] == p.offset and last[3] == k:
            last[2] += p.numel
        else:
            spans.append([p.chunk, p.offset, p.numel, k])
    return [tuple(s) for s in spans]


def views(chunks: list[torch.Tensor], spans) -> list[torch.Tensor]:
    """The views of ``chunks`` that ``spans`` (rows of :func:`merged_spans`) name."""
    return [chunks[c].narrow(0, offset, numel) for c, offset, numel, _ in spans]
