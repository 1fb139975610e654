"""Weighted blending of several GPT datasets (Megatron-LM's BlendedDataset, ``--data-path 0.3 a 0.7 b``).

Sample ``i`` of the blend comes from dataset ``dataset_index[i]`` at position
``dataset_sample_index[i]`` inside it. The interleaving is deterministic and low-discrepancy: the
k-th sample of dataset d is due at "time" (k + 1/2) / w_d, and the blend serves samples in order of
due time (ties by dataset order), so after any prefix of n samples dataset d has contributed
w_d * n samples up to rounding.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def parse_data_path(args: Sequence[str]) -> list[tuple[float, str]]:
    """``["a"]`` -> ``[(1.0, "a")]``; ``["0.3", "a", "0.7", "b"]`` -> weights normalised to sum 1."""
    args = list(args)
    if len(args) == 1:
        return [(1.0, args[0])]
    if not args or len(args) % 2:
        raise ValueError(f"--data-path {' '.join(args)!r}: give one prefix, or pairs 'WEIGHT PREFIX'")
    pairs = []
    for w, prefix in zip(args[0::2], args[1::2]):
        try:
            weight = float(w)
        except ValueError as e:
            raise ValueError(f"--data-path: {w!r} is not a weight; pairs are 'WEIGHT PREFIX'") from e
        if not weight >= 0 or math.isinf(weight):
            raise ValueError(f"--data-path: weight {w} of {prefix!r} must be a finite number >= 0")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError("--data-path: the weights sum to 0; give at least one positive weight")
    return [(w / total, p) for w, p in pairs]


def samples_per_dataset(weights: Sequence[float], num_samples: int, margin: float = 0.005) -> list[int]:
    """How many samples each child must provide for a blend of ``num_samples`` (with a small
    margin, as Megatron does, so rounding never runs a child dry)."""
    return [int(math.ceil(w * num_samples * (1 + margin))) + 1 for w in weights]


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    w = w / w.sum()
    times, owners, ranks = [], [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        k = np.arange(int(math.ceil(wd * num_samples)) + 1, dtype=np.int64)
        times.append((k + 0.5) / wd)
        owners.append(np.full(len(k), d, dtype=np.int16))
        ranks.append(k)
    times, owners, ranks = map(np.concatenate, (times, owners, ranks))
    order = np.lexsort((owners, times))[:num_samples]  # by due time, then dataset order
    return owners[order], ranks[order]


class BlendedDataset:
    """``ds[i]`` draws from the children by weight; ``len(ds) == num_samples``."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights, num_samples)
        for d, ds in enumerate(self.datasets):
            needed = int(np.sum(self.dataset_index == d))
            if needed > len(ds):
                raise ValueError(f"blend needs {needed} samples of dataset {d} but it has {len(ds)}; "
                                 "build it with samples_per_dataset()")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
