"""One micro-batch as this rank feeds it to the model (issue 31): its part of every sequence under
context parallelism, and the :class:`~models.gpt.token_layout.TokenLayout` that says where its
tokens sit.

Every CP rank of a DP rank reads the same samples (the sampler goes by DP rank). Each keeps the two
load-balanced chunks of :mod:`hybrid.context_parallel.layout` of the tokens, labels, loss mask and,
when the loader delivers them (``--reset-position-ids`` / ``--reset-attention-mask``), the position
and document ids, all along the sequence dimension (dim 1 of ``[b, s]``):

    tokens, labels, loss_mask, position_ids, document_ids   [b, s] -> [b, s / C]
    token_index = local_positions(s, cp_rank, C)             [s / C]  (global index of each token)

The loss is token-weighted exactly as at CP 1: each CP rank returns its tokens' share,
``sum(loss x mask over its tokens) / sum(mask over the whole sample)``. The denominator comes from
the whole loss mask every CP rank holds (no communication); the shares of the C ranks add up to the
CP-1 loss, and so do their gradients, which the ZeRO engine sums over DP x CP and divides by DP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.context_parallel.layout import local_positions, split_sequence
from hybrid.parallel_state import ParallelState
from models.gpt.token_layout import TokenLayout
from pretrain.batches import batch_tensors

SPLIT_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")   # batch_tensors' order



@dataclass
class LocalMicroBatch:
    """This rank's part of a micro-batch. ``kept_tokens``: the loss mask's sum over the WHOLE
    samples (a 0-dim tensor on the device), the denominator of the token-weighted mean loss."""

    tokens: torch.Tensor               # [b, s/C] int64
    labels: torch.Tensor               # [b, s/C] int64
    loss_mask: torch.Tensor            # [b, s/C]
    kept_tokens: torch.Tensor          # 0-dim
    layout: TokenLayout | None         # None: the model's default path (CP 1, no resets)

    def loss(self, per_token: torch.Tensor) -> torch.Tensor:
        """This rank's share of the micro-batch's mean loss over kept tokens (0-dim)."""
        mask = self.loss_mask.to(per_token.dtype)
        return (per_token * mask).sum() / self.kept_tokens.to(per_token.dtype).clamp(min=1.0)


def split_micro_batch(batch: dict, state: ParallelState, cp_comm_type: str = "p2p",
                      device: torch.device | None = None) -> LocalMicroBatch:
    """``batch`` (the loader's dict of ``[b, s]`` tensors: tokens, labels, loss_mask and optionally
    position_ids, document_ids) -> this rank's :class:`LocalMicroBatch` on ``device`` (default: the
    state's). At CP 1 without position or document ids the tensors are the batch's own and the
    layout is None."""
    device = device if device is not None else state.device
    cp, rank = state.cp_size, state.cp_rank
    full = {k: v for k, v in zip(SPLIT_KEYS, batch_tensors(batch, device)) if v is not None}
    kept = full["loss_mask"].sum()
    local = {k: split_sequence(v, 1, rank, cp) for k, v in full.items()}
    layout = None
    if cp > 1 or "position_ids" in local or "document_ids" in local:
        seq = full["tokens"].size(1)
        layout = TokenLayout(
            position_ids=local.get("position_ids"), document_ids=local.get("document_ids"),
            token_index=local_positions(seq, rank, cp, device=device) if cp > 1 else None,
            cp_group=state.cp if cp > 1 else None, cp_comm_type=cp_comm_type)
    return LocalMicroBatch(local["tokens"], local["labels"], local["loss_mask"], kept, layout)


def model_loss(model, mb: LocalMicroBatch) -> torch.Tensor:
    """``model``'s per-token loss on ``mb`` reduced to this rank's share (:meth:`LocalMicroBatch.loss`);
    the model is called as before this module when there is no layout."""
    if mb.layout is None:
        per_token = model(mb.tokens, mb.labels)                             # [b, s]
    else:
        per_token = model(mb.tokens, mb.labels, layout=mb.layout)           # [b, s/C]
    return mb.loss(per_token)
