"""Documents inside packed samples (issue 31; Megatron-LM's ``get_ltor_masks_and_position_ids`` with
``--reset-position-ids`` / ``--reset-attention-mask``), as index tensors instead of a dense mask.

A training sample is a window of the concatenated corpus, so it holds the end of one document, whole
documents and the start of another, separated by end-of-document (EOD) tokens. For input tokens
``[b, s]``:

* ``document_ids[b, t]`` = number of EOD tokens strictly before t in the sample: the EOD token
  belongs to the document it ends (Megatron hides keys ``<= i`` from queries ``> i`` for an EOD at
  ``i``). Query t may attend key u iff ``u <= t`` and the two ids agree.
* ``position_ids[b, t]`` = t minus the index of the first token of t's document: positions restart
  at 0 on the token after each EOD (without ``--reset-position-ids``: t).

Both are computed on the host in the loader's thread, a few vector operations per micro-batch.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """int64 ``[b, s]``: EOD tokens strictly before each token of ``tokens [b, s]``."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(dim=1) - is_eod


def reset_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """int64 ``[b, s]``: each token's position inside its document (0 after every EOD)."""
    b, s = tokens.shape
    index = torch.arange(s, dtype=torch.int64).expand(b, s)
    after_eod = torch.zeros(b, s, dtype=torch.bool)
    after_eod[:, 1:] = tokens[:, :-1] == eod                                   # a document starts
    starts = torch.where(after_eod, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts


def document_tensors(tokens: torch.Tensor, eod: int | None, *, reset_positions: bool,
                     reset_attention: bool) -> dict[str, torch.Tensor]:
    """The batch entries the flags ask for: ``position_ids`` with ``reset_positions``,
    ``document_ids`` with ``reset_attention`` (each ``[b, s]`` int64; none without either flag)."""
    if not (reset_positions or reset_attention):
        return {}
    if eod is None:
        raise ValueError("--reset-position-ids / --reset-attention-mask need the end-of-document "
                         "token id: give the tokenizer (--tokenizer-model / --tokenizer-type) whose "
                         "EOD separates the documents")
    out = {}
    if reset_positions:
        out["position_ids"] = reset_position_ids(tokens, eod)
    if reset_attention:
        out["document_ids"] = document_ids(tokens, eod)
    return out
