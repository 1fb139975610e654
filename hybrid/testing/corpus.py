"""A tiny real corpus for runs of the trainer in tests and benchmarks: a sentencepiece tokenizer
(vocabulary ~400) trained on a few standard-library sources, and 60 documents of random in-vocab
ids written as a Megatron .bin/.idx dataset."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hybrid.data.indexed_dataset import IndexedDatasetWriter
from hybrid.data.tokenizer import Tokenizer, train_tokenizer

STDLIB = Path(os.__file__).parent


def build_corpus(root: Path) -> dict[str, str]:
    """Tokenizer (vocab ~400) and a 60-document corpus of random in-vocab ids; returns paths."""
    root.mkdir(parents=True, exist_ok=True)
    texts = [(STDLIB / n).read_text() for n in ("textwrap.py", "bisect.py", "heapq.py")]
    model = train_tokenizer(texts, root / "tok", vocab_size=400)
    vocab = Tokenizer(model).vocab_size
    rng = np.random.default_rng(0)
    prefix = root / "corpus"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(60):
            w.add_document(rng.integers(3, vocab, int(rng.integers(20, 80))))
    return {"tokenizer": model, "prefix": str(prefix), "vocab": vocab, "root": str(root)}
