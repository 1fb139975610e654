"""A micro-batch of the loader as the model's inputs (issue 31): tokens, labels, loss mask and, with
``--reset-position-ids`` / ``--reset-attention-mask``, the per-token positions and document ids
(:mod:`hybrid.data.documents`) that reach the model as a
:class:`~models.gpt.token_layout.TokenLayout`.

Pure functions of the batch, so a caller that reshapes the tokens first (context parallelism splits
each of these five tensors along the sequence) uses the same ones.
"""

from __future__ import annotations

import torch

from models.gpt.token_layout import TokenLayout


def batch_tensors(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor | None, torch.Tensor | None]:
    """``(tokens, labels, loss_mask, position_ids, document_ids)`` on ``device`` (each ``[b, s]``;
    the last two None when the batch has none), copied without a wait (the loader pins them)."""
    def move(key):
        t = batch.get(key)
        return None if t is None else t.to(device, non_blocking=True)
    return (move("tokens"), move("labels"), move("loss_mask"), move("position_ids"),
            move("document_ids"))


def token_layout(position_ids: torch.Tensor | None,
                 document_ids: torch.Tensor | None) -> TokenLayout | None:
    """The model's layout for these ids; None (the default path) when both are None."""
    if position_ids is None and document_ids is None:
        return None
    return TokenLayout(position_ids=position_ids, document_ids=document_ids)
