"""Cross-check against Megatron-LM itself: megatron-core 0.16.1 from the test-only environment of
tests/checkpoint/megatron_env.py (built by launch/run_tests.sh, or here on first use), put on this
process's path, so the check runs wherever the tests run and never skips.

Checks that our .bin/.idx files are byte-identical to Megatron's IndexedDatasetBuilder output and
that our GPTDataset serves exactly Megatron's GPTDataset samples for the same seed.
"""

import numpy as np
import pytest
import torch

from hybrid.data.gpt_dataset import GPTDataset, parse_split
from hybrid.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.checkpoint import megatron_env

megatron_env.put_on_path()
from megatron.core.datasets import gpt_dataset as mgpt  # noqa: E402 (needs the path above)
from megatron.core.datasets import indexed_dataset as midx  # noqa: E402
from megatron.core.datasets import utils as mutils  # noqa: E402


class _Tok:
    vocab_size, eod, pad = 70000, 0, -1
    unique_identifiers = {"class": "_Tok"}


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, 60000, size=int(rng.integers(0, 60))), 0) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_byte_identical_to_megatron_builder(tmp_path, dtype):
    docs = _docs(40, 0)
    builder = midx.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    with IndexedDatasetWriter(tmp_path / "o", dtype) as w:
        for d in docs:
            w.add_document(d)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"o.{ext}").read_bytes() == (tmp_path / f"m.{ext}").read_bytes()


@pytest.mark.parametrize("ndocs, seq, num_samples, seed", [(30, 16, 50, 1), (30, 16, 400, 2),
                                                           (40, 7, 333, 3), (30, 16, 117, 5)])
def test_gpt_samples_identical_to_megatron(tmp_path, ndocs, seq, num_samples, seed):
    with IndexedDatasetWriter(tmp_path / "g", np.uint16) as w:
        for d in _docs(ndocs, seed):
            w.add_document(d)
    cfg = mgpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=None, split="90,10,0",
                                tokenizer=_Tok(), reset_position_ids=False,
                                reset_attention_mask=False, eod_mask_loss=False)
    (b, e), _, _ = parse_split("90,10,0", ndocs)
    theirs = mgpt.GPTDataset(midx.IndexedDataset(str(tmp_path / "g")), str(tmp_path / "g"),
                             np.arange(b, e, dtype=np.int32), num_samples, mutils.Split.train, cfg)
    ours = GPTDataset(IndexedDataset(tmp_path / "g"), (b, e), seq, num_samples, seed)
    assert len(theirs) == len(ours)
    for i in range(len(ours)):
        t = theirs[i]
        np.testing.assert_array_equal(np.append(t["tokens"].numpy(), t["labels"].numpy()[-1]), ours[i])
