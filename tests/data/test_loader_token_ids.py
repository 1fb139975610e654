"""Issue 36: the token-id range check runs in the data loader on the host (numpy, before the copy
to the device) instead of reading ``ids.min()/max()`` from the device in every forward; a bad id
still stops the run with one clear error, and the trainer's model leaves the check to the loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.data.loader import PrefetchLoader, collate
from hybrid.parallel_state import ParallelState
from models.gpt.model import GPTModel
from models.gpt.presets import PRESETS


class _Samples:
    def __init__(self, bad_at: int | None):
        self.bad_at = bad_at

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        sample = np.arange(5, dtype=np.int64) + i
        if i == self.bad_at:
            sample[2] = 300   # outside a vocabulary of 256
        return sample


def test_collate_refuses_ids_outside_the_vocabulary():
    good = collate([_Samples(None)[0]], vocab_size=256)
    assert good["tokens"].tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\).*\[1, 300\].*--vocab-size"):
        collate([_Samples(1)[1]], vocab_size=256)


def test_the_loader_raises_the_clear_error_at_the_bad_batch():
    with PrefetchLoader(_Samples(bad_at=3), ([i] for i in range(8)), vocab_size=256) as loader:
        batches = [next(loader) for _ in range(3)]          # samples 0-2 are fine
        assert [b["tokens"][0, 0].item() for b in batches] == [0, 1, 2]
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
            next(loader)


def test_model_leaves_the_check_to_the_loader():
    model = GPTModel(PRESETS["tiny"].replace(vocab_size=500), ParallelState.single_process(),
                     device="meta")
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(torch.full((1, 8), 505, dtype=torch.long))
    model.leave_id_checks_to_loader()
    assert not model.check_ids and not model.embedding.word.check_ids
