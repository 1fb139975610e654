"""GPT pretraining samples over concatenated documents (Megatron-LM's GPTDataset semantics).

The documents of a split, repeated for as many epochs as the requested number of samples needs,
are shuffled and laid end to end; sample ``i`` is the ``seq_length + 1`` tokens starting at global
token ``i * seq_length`` of that stream, so samples cross document boundaries and consecutive
samples share one token (the last label of one is the first input of the next). The samples are
then shuffled. As in Megatron, when the last epoch is needed for less than 80% of its samples it is
shuffled separately (documents and samples), so its few samples are not spread over the whole run
while most of it goes unused. Three index arrays describe this, built with one seeded
``numpy.random.RandomState`` (the same draws as Megatron-LM's GPTDataset, so a seed gives the same
sample order) and cached on disk as ``.npy`` files named by a hash of everything they depend on:

    document_index  int32[E * D]     document ids, E shuffled epochs of the split's D documents
    sample_index    int64[N + 1, 2]  (position in document_index, token offset) of sample starts
    shuffle_index   int64[N]         the order in which samples are served
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hybrid.data.indexed_dataset import IndexedDataset

log = logging.getLogger(__name__)

INDEX_VERSION = 2  # bump when the index construction changes, so old caches are not reused
Indices = tuple[np.ndarray, np.ndarray, np.ndarray]  # document, sample, shuffle index


def parse_split(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's ``--split 98,2,0``: weights of train/valid/test, normalised, as document
    ranges ``[begin, end)``. Missing trailing weights count as 0."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",") if w.strip()]
    except ValueError as e:
        raise ValueError(f"split {split!r} must be comma-separated numbers like '98,2,0'") from e
    if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r} must have 1-3 non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    # cumulative fractions rounded to document boundaries (Megatron's split matrix)
    fractions = list(itertools.accumulate([w / sum(weights) for w in weights], initial=0.0))
    bounds = [int(round(f * num_documents)) for f in fractions]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


@dataclass(frozen=True)
class GPTIndexConfig:
    """Everything the sample index depends on; its hash names the cache files. The data enters
    through the hash of its document lengths, so a copied dataset keeps its cache and a rebuilt
    one gets a new index."""
    lengths_sha256: str
    doc_begin: int
    doc_end: int
    seq_length: int
    num_samples: int
    seed: int
    version: int = INDEX_VERSION

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """``num_epochs`` copies of ``documents`` shuffled together; with ``separate_final_epoch`` the
    first ``num_epochs - 1`` copies and the last are shuffled separately."""
    if separate_final_epoch and num_epochs > 1:
        return np.concatenate([build_document_index(documents, num_epochs - 1, rng, False),
                               build_document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(doc_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """(position in document_index, offset) of every sample start, vectorised.

    ``doc_lengths[k]`` is the length of the k-th document of the (shuffled) stream. Sample ``i``
    starts at global token ``i * seq_length``; the last row marks where the last sample ends.
    """
    total = int(doc_lengths.sum())
    n = (total - 1) // seq_length
    starts = np.arange(n + 1, dtype=np.int64) * seq_length             # [n + 1]
    ends = np.cumsum(doc_lengths, dtype=np.int64)                     # exclusive end of each doc
    pos = np.searchsorted(ends, starts, side="right")                 # skips empty documents
    offset = starts - (ends[pos] - doc_lengths[pos])
    return np.stack([pos, offset], axis=1)


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    # samples available after e epochs: (e * tokens - 1) // seq_length
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def samples_before_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                               num_epochs: int) -> int | None:
    """Samples of the first ``num_epochs - 1`` epochs if the final epoch is to be shuffled
    separately (it contributes < 80% of an epoch's samples), else ``None``."""
    if num_epochs == 1:
        return None
    before = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return before if num_samples - before < int(0.8 * per_epoch) else None


class GPTDataset:
    """``ds[i]`` -> int64 array of ``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``).

    ``len(ds)`` is every sample the chosen epochs provide (>= ``num_samples``).
    """

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], seq_length: int,
                 num_samples: int, seed: int, *, vocab_size: int | None = None,
                 cache_dir: str | Path | None = None, name: str = "train"):
        begin, end = doc_range
        if not 0 <= begin < end <= indexed.num_documents:
            raise ValueError(f"{name} split has documents [{begin}, {end}) of "
                             f"{indexed.num_documents}: empty or out of range; change --split")
        if seq_length < 1 or num_samples < 1:
            raise ValueError(f"seq_length ({seq_length}) and num_samples ({num_samples}) must be >= 1")
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        if vocab_size is not None:
            check_vocab(indexed, vocab_size)
        # documents are single sequences in our files; Megatron's sentence-split files have several
        self._doc_seq = indexed.document_indices
        self._lengths = self._doc_token_counts()
        tokens = int(self._lengths[begin:end].sum())
        if tokens < 2:
            raise ValueError(f"{name} split has {tokens} tokens; a sample needs at least 2")
        self.tokens_per_epoch = tokens
        digest = hashlib.sha256(np.ascontiguousarray(self._lengths, dtype="<i8").tobytes()).hexdigest()
        cfg = GPTIndexConfig(digest, begin, end, seq_length, num_samples, seed)
        self.document_index, self.sample_index, self.shuffle_index = load_or_build_index(
            cfg, self._lengths, cache_dir, describe=os.path.abspath(indexed.prefix))
        log.info("%s: %d samples of %d+1 tokens over docs [%d, %d) (%d tokens/epoch)",
                 name, len(self), seq_length, begin, end, tokens)

    def _doc_token_counts(self) -> np.ndarray:
        per_seq = np.concatenate([[0], np.cumsum(self.indexed.sequence_lengths, dtype=np.int64)])
        return per_seq[self._doc_seq[1:]] - per_seq[self._doc_seq[:-1]]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    @property
    def samples_per_epoch(self) -> int:
        """Samples one pass over the split's documents gives (more than this repeats documents)."""
        return (self.tokens_per_epoch - 1) // self.seq_length

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        parts = [self._doc_tokens(int(self.document_index[d])) for d in range(d0, d1 + 1)]
        parts[-1] = parts[-1][:o1 + 1]  # the end token is inclusive: it is the last label
        parts[0] = parts[0][o0:]
        sample = np.concatenate(parts).astype(np.int64)
        assert len(sample) == self.seq_length + 1, (len(sample), i)
        return sample

    def _doc_tokens(self, doc: int) -> np.ndarray:
        s0, s1 = int(self._doc_seq[doc]), int(self._doc_seq[doc + 1])
        if s1 - s0 == 1:
            return self.indexed[s0]
        return np.concatenate([self.indexed[s] for s in range(s0, s1)])


def check_vocab(indexed: IndexedDataset, vocab_size: int) -> None:
    top = indexed.max_token()
    if top >= vocab_size:
        raise ValueError(f"{indexed.prefix}.bin holds token id {top} >= vocab size {vocab_size}: "
                         "the data was tokenized with a different tokenizer; re-run "
                         "tools/preprocess_data.py with the model's tokenizer")


def load_or_build_index(cfg: GPTIndexConfig, doc_lengths: np.ndarray, cache_dir: str | Path | None,
                        describe: str = "") -> Indices:
    names = ("document_index", "sample_index", "shuffle_index")
    paths = [Path(cache_dir) / f"{cfg.digest()}-{n}.npy" for n in names] if cache_dir else []
    if paths and all(p.is_file() for p in paths):
        log.info("loading cached GPT sample index %s", paths[0].name)
        return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
    arrays = build_index(cfg, doc_lengths)
    if paths:
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for p, a in zip(paths, arrays):
            _save_atomic(p, a)
        _save_atomic_text(paths[0].with_name(f"{cfg.digest()}-description.json"),
                          json.dumps({**asdict(cfg), "data_prefix": describe}, indent=1))
    return arrays


def build_index(cfg: GPTIndexConfig, doc_lengths: np.ndarray) -> Indices:
    documents = np.arange(cfg.doc_begin, cfg.doc_end, dtype=np.int64)
    tokens = int(doc_lengths[documents].sum())
    epochs = num_epochs_for(tokens, cfg.seq_length, cfg.num_samples)
    before_final = samples_before_final_epoch(tokens, cfg.seq_length, cfg.num_samples, epochs)
    rng = np.random.RandomState(cfg.seed)
    document_index = build_document_index(documents, epochs, rng, before_final is not None)
    sample_index = build_sample_index(doc_lengths[document_index], cfg.seq_length)
    shuffle_index = build_shuffle_index(len(sample_index) - 1, before_final, rng)
    return document_index, sample_index, shuffle_index


def build_shuffle_index(num_samples: int, separate_from: int | None,
                        rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``range(num_samples)``; with ``separate_from`` the ranges before and after
    it are permuted separately (the separately shuffled final epoch)."""
    cut = num_samples if separate_from is None else separate_from
    parts = [np.arange(0, cut, dtype=np.int64), np.arange(cut, num_samples, dtype=np.int64)]
    for part in parts:
        if len(part):
            rng.shuffle(part)
    return np.concatenate(parts)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _save_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
