"""Where each token of a forward pass sits (issue 31): its position, its document and, under context
parallelism, its index in the whole sequence and the CP group that holds the rest.

One :class:`TokenLayout` goes with one forward (``GPTModel.forward(..., layout=...)``) and reaches
every part that depends on where a token is:

* the learned position embedding and rotary read ``position_ids`` ``[b, s_loc]`` (positions that
  restart at 0 after each end-of-document with ``--reset-position-ids``);
* the attention masks by ``document_ids`` ``[b, s_loc]`` (document of token t = number of EOD tokens
  strictly before t in its sample, so an EOD ends its own document: ``--reset-attention-mask``) and
  by ``token_index`` ``[s_loc]`` (the global index of each local token; query t sees key u iff
  ``token_index[u] <= token_index[t]`` and the documents agree);
* with ``cp_group`` of more than one rank the attention is
  :func:`hybrid.context_parallel.attention.context_parallel_attention` over ``cp_comm_type``.

A field left ``None`` means the plain case: positions ``0 .. s-1`` (or ``token_index`` when that is
set: without resets a token's position is its global index), one document, ``token_index = arange``.
``GPTModel.forward`` without a layout (or with :meth:`TokenLayout.is_plain`) runs exactly the path it
ran before this class existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    """The per-forward token layout (module docstring); every tensor on the model's device."""

    position_ids: torch.Tensor | None = None   # [b, s_loc] int64; None: token_index or 0 .. s-1
    document_ids: torch.Tensor | None = None   # [b, s_loc] int64; None: one document (causal only)
    token_index: torch.Tensor | None = None    # [s_loc] int64; None: arange(s_loc)
    cp_group: object | None = None             # hybrid.comm.Group of the CP ranks, or None
    cp_comm_type: str = "p2p"                  # "p2p" | "a2a" | "allgather"

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size

    @property
    def context_parallel(self) -> bool:
        """The attention runs across the CP group (more than one rank)."""
        return self.cp_size > 1

    def is_plain(self) -> bool:
        """Nothing here changes the model's default behaviour (no positions, documents or CP)."""
        return (self.position_ids is None and self.document_ids is None and self.token_index is None
                and not self.context_parallel)

    def positions(self) -> torch.Tensor | None:
        """Positions of the local tokens: ``position_ids`` [b, s_loc], else ``token_index`` [s_loc]
        (the global index), else None (the model's default ``0 .. s-1``)."""
        return self.position_ids if self.position_ids is not None else self.token_index

    def check(self, batch: int, seq: int, max_positions: int | None = None) -> None:
        """One clear error when a field does not match tokens ``[batch, seq]`` (host-side checks of
        shapes and, on CPU tensors, of the position range)."""
        for name in ("position_ids", "document_ids"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (batch, seq):
                raise ValueError(f"TokenLayout.{name} has shape {tuple(t.shape)}, but the tokens are "
                                 f"[{batch}, {seq}]: give one id per token")
        if self.token_index is not None and tuple(self.token_index.shape) != (seq,):
            raise ValueError(f"TokenLayout.token_index has shape {tuple(self.token_index.shape)}; "
                             f"expected [{seq}] (the global index of each local token)")
        if self.cp_comm_type not in ("p2p", "a2a", "allgather"):
            raise ValueError(f"TokenLayout.cp_comm_type {self.cp_comm_type!r}: choose p2p, a2a or "
                             f"allgather")
        pos = self.positions()
        if (max_positions is not None and pos is not None and pos.device.type == "cpu"
                and pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= max_positions)):
            raise ValueError(f"token positions must lie in [0, {max_positions}) (max position "
                             f"embeddings); got [{int(pos.min())}, {int(pos.max())}]")
