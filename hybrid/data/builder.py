"""Train / valid / test GPT datasets from Megatron-style ``--data-path`` and ``--split`` arguments
(the data side of the training setup; see Megatron-LM's BlendedMegatronDatasetBuilder).

With one prefix each split is a :class:`GPTDataset` over its document range; with weighted prefixes
each split is a :class:`BlendedDataset` of the per-prefix splits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from hybrid.data.blending import BlendedDataset, parse_data_path, samples_per_dataset
from hybrid.data.gpt_dataset import GPTDataset, check_vocab, parse_split
from hybrid.data.indexed_dataset import IndexedDataset, IndexedDatasetError

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def build_gpt_datasets(data_path: Sequence[str], split: str, seq_length: int,
                       num_samples: Sequence[int], seed: int, *, vocab_size: int | None = None,
                       cache_dir: str | Path | None = None) -> list:
    """``num_samples`` = (train, valid, test) sample counts; a split with weight 0 or 0 samples
    gives ``None``. Returns ``[train, valid, test]``. Sample indices are cached in
    ``cache_dir/gpt-index`` (not cached if ``cache_dir`` is None)."""
    if len(num_samples) != 3:
        raise ValueError(f"num_samples needs 3 counts (train, valid, test), got {list(num_samples)}")
    blend = parse_data_path(data_path)
    index_dir = Path(cache_dir) / "gpt-index" if cache_dir is not None else None
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    for ds in indexed:
        if ds.num_documents == 0:
            raise IndexedDatasetError(f"data prefix {ds.prefix} is an empty corpus (0 documents); "
                                      f"preprocess a non-empty corpus or drop it from --data-path")
    if vocab_size is not None:
        for ds in indexed:
            check_vocab(ds, vocab_size)
    ranges = [parse_split(split, ds.num_documents) for ds in indexed]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s])
        if n <= 0 or all(r[s][0] == r[s][1] for r in ranges):
            out.append(None)
            continue
        # a prefix too small to have documents in this split drops out of its blend
        members = [(w, ds, r[s]) for (w, _), ds, r in zip(blend, indexed, ranges) if r[s][0] < r[s][1]]
        if len(members) < len(blend):
            log.warning("%s: %d of %d data prefixes have no documents in this split",
                        name, len(blend) - len(members), len(blend))
        weights = [w for w, _, _ in members]
        counts = samples_per_dataset(weights, n) if len(members) > 1 else [n]
        parts = [GPTDataset(ds, docs, seq_length, c, seed, cache_dir=index_dir, name=name)
                 for (_, ds, docs), c in zip(members, counts)]
        out.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, n))
    return out


def distinct_samples(dataset) -> int:
    """How many leading samples of ``dataset`` come from a single pass over each dataset's documents;
    a dataset built for at most this many samples repeats no document (a larger request cycles)."""
    if isinstance(dataset, BlendedDataset):
        per_epoch = np.array([d.samples_per_epoch for d in dataset.datasets])
        repeats = np.nonzero(dataset.dataset_sample_index >= per_epoch[dataset.dataset_index])[0]
        return int(repeats[0]) if len(repeats) else len(dataset)
    return min(len(dataset), dataset.samples_per_epoch)
