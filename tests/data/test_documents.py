"""Issue 31: --reset-position-ids / --reset-attention-mask in the data path. The loader's position and
document ids equal Megatron-LM's definition (get_ltor_masks_and_position_ids, written here as its
loop over EOD indices) on the hard cases: a document of length 1, no EOD, all EOD, an EOD last; the
pretrain batch helper turns them into the model's TokenLayout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.data.documents import document_ids, document_tensors, reset_position_ids
from hybrid.data.loader import PrefetchLoader, collate
from pretrain.batches import batch_tensors, token_layout

EOD = 0
CASES = {
    "mixed": [5, 0, 7, 8, 0, 0, 9, 4],       # a document of length 1 (the lone EOD at 5)
    "no-eod": [5, 6, 7, 8, 9, 4, 3, 2],
    "all-eod": [0] * 8,
    "eod-first-and-last": [0, 6, 7, 8, 9, 4, 3, 0],
}


def _megatron(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's loop: for each EOD at i, positions after i restart and queries after i see no
    key <= i; returns (position ids [s], allowed [s, s])."""
    s = len(tokens)
    position = torch.arange(s)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    prev = 0
    for i in [i for i, t in enumerate(tokens) if t == EOD]:
        allowed[i + 1:, :i + 1] = False
        position[i + 1:] -= i + 1 - prev
        prev = i + 1
    return position, allowed


@pytest.mark.parametrize("case", CASES)
def test_ids_match_megatrons_masks_and_positions(case):
    tokens = torch.tensor([CASES[case]])
    position, allowed = _megatron(CASES[case])
    assert torch.equal(reset_position_ids(tokens, EOD)[0], position)
    docs = document_ids(tokens, EOD)[0]
    index = torch.arange(tokens.size(1))
    ours = (docs[:, None] == docs[None, :]) & (index[None, :] <= index[:, None])
    assert torch.equal(ours, allowed)


def test_loader_batches_carry_the_ids_and_the_layout():
    samples = [np.array(CASES[c] + [1], dtype=np.int64) for c in ("mixed", "no-eod")]
    batch = collate(samples, EOD, documents=(EOD, True, True))
    tokens = batch["tokens"]
    assert torch.equal(batch["position_ids"], reset_position_ids(tokens, EOD))
    assert torch.equal(batch["document_ids"], document_ids(tokens, EOD))
    assert batch["loss_mask"][0].tolist() == [1, 0, 1, 1, 0, 0, 1, 1]    # --eod-mask-loss as before
    only_positions = collate(samples, documents=(EOD, True, False))
    assert "document_ids" not in only_positions and "position_ids" in only_positions
    assert set(collate(samples)) == {"tokens", "labels", "loss_mask"}

    tokens, labels, mask, positions, documents = batch_tensors(batch, "cpu")
    layout = token_layout(positions, documents)
    assert layout.position_ids is positions and layout.document_ids is documents
    assert token_layout(None, None) is None


def test_resets_without_an_eod_token_are_one_clear_error():
    with pytest.raises(ValueError, match="end-of-document token id"):
        document_tensors(torch.zeros(1, 4, dtype=torch.long), None, reset_positions=True,
                         reset_attention=False)
    with pytest.raises(ValueError, match="end-of-document token id"):
        PrefetchLoader([np.zeros(5, dtype=np.int64)], [[0]], reset_attention_mask=True)
