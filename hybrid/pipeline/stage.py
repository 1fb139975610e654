"""The model chunks of one pipeline stage seen as one model (what its ZeRO engine and checkpoints see).

A stage holds ``v`` chunks (one without interleaving). :class:`StageChunks` lists their parameters
under the chunks' own names, which are the whole model's (layers by global index: the embedding on
the first stage, the final norm on the last), so checkpoint pieces carry the same names at every
pipeline degree and a checkpoint saved at PP 2 loads at PP 1 or 4 (docs/design.md §8).
"""

from __future__ import annotations

from itertools import chain

from torch import nn


class StageChunks(nn.Module):
    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    @property
    def config(self):
        """The whole model's config (every chunk holds it)."""
        return self.chunks[0].config

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Every chunk's parameters under its own (global) names."""
        return chain.from_iterable(c.named_parameters(prefix, recurse, remove_duplicate)
                                   for c in self.chunks)

    def checkpoint_layout(self) -> dict:
        """The union of the chunks' layouts (name -> :class:`hybrid.checkpoint.state.ParamLayout`)."""
        layout = {}
        for chunk in self.chunks:
            layout.update(chunk.checkpoint_layout())
        return layout
