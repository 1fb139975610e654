"""Text / JSONL -> Megatron indexed dataset (the preprocessing step of Megatron-LM's pipeline).

Every document is tokenized, followed by the end-of-document id (unless ``append_eod`` is off),
and stored as one sequence of a ``prefix.bin`` / ``prefix.idx`` pair (see
:mod:`hybrid.data.indexed_dataset`). The tokenizer is a model file or a
:class:`~hybrid.data.tokenizer_types.TokenizerSpec` of Megatron's flags. Tokenization runs in a
pool of worker processes (spawned: a script calling :func:`preprocess` with ``workers > 1`` needs
the usual ``if __name__ == "__main__":`` guard); results are consumed in input order, so the output
bytes do not depend on the number of workers.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from hybrid.data.indexed_dataset import IndexedDatasetWriter, best_token_dtype
from hybrid.data.tokenizer import Tokenizer
from hybrid.data.tokenizer_types import NullTokenizer, TokenizerSpec

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".json")


def read_documents(paths: Sequence[str | Path], json_key: str = "text") -> Iterator[str]:
    """Documents of ``paths`` in order: each line of a .jsonl/.json file is a JSON object whose
    ``json_key`` holds one document; any other file is one document as a whole."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise FileNotFoundError(f"input file {str(path)!r} {what}; pass text or JSONL files "
                                    f"to --input")
        if path.suffix not in JSON_SUFFIXES:
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield _json_text(line, json_key, path, lineno)


def _json_text(line: str, key: str, path: Path, lineno: int) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); expect one object per line") from e
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}:{lineno} has no key {key!r}; choose the text field with --json-key")
    return str(obj[key])


@functools.lru_cache(maxsize=4)
def _processor(spec: TokenizerSpec) -> Tokenizer | NullTokenizer:
    # one loaded model per process and spec; workers load it on their first batch
    return spec.build()


@dataclass(frozen=True)
class _BatchEncoder:
    """Picklable encoder: only the tokenizer's spec crosses the process boundary."""
    spec: TokenizerSpec
    append_eod: bool

    def __call__(self, docs: list[str]) -> list[np.ndarray]:
        tok = _processor(self.spec)
        out = []
        for ids in tok.encode_batch(docs):
            if self.append_eod:
                ids.append(tok.eod)
            out.append(np.asarray(ids, dtype=np.int32))  # half the bytes back from workers
        return out


def _batches(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        if d.strip():  # blank documents would only be an eod token: skipped
            batch.append(d)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    seconds: float
    dtype: str


def preprocess(paths: Sequence[str | Path], output_prefix: str | Path,
               tokenizer_model: str | Path | TokenizerSpec, *, workers: int = 1,
               json_key: str = "text", append_eod: bool = True, batch_docs: int = 64,
               token_dtype: str | None = None, log_interval: int = 10_000) -> PreprocessStats:
    """Tokenize ``paths`` into ``output_prefix.bin/.idx`` with ``tokenizer_model`` (a model file, or a
    :class:`TokenizerSpec` of Megatron's tokenizer flags). Tokens are ``token_dtype`` if given, else
    uint16 when the vocab fits and int32 otherwise."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    spec = (tokenizer_model if isinstance(tokenizer_model, TokenizerSpec)
            else TokenizerSpec(model=str(tokenizer_model)))
    tok = _processor(spec)   # a readable tokenizer, or TokenizerError naming the file
    vocab = tok.vocab_size
    if append_eod:
        _ = tok.eod   # ValueError naming the file when the tokenizer has no end-of-document id
    encoder = _BatchEncoder(spec, append_eod)
    batches = _batches(read_documents(paths, json_key), batch_docs)
    t0, docs, tokens = time.perf_counter(), 0, 0
    dtype = np.dtype(token_dtype) if token_dtype else best_token_dtype(vocab)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for arrays in _encoded(batches, encoder, workers):
            for arr in arrays:
                writer.add_document(arr)
                docs, tokens = docs + 1, tokens + arr.size
                if docs % log_interval == 0:
                    rate = docs / (time.perf_counter() - t0)
                    log.info("processed %d documents (%.0f docs/s), %d tokens", docs, rate, tokens)
        if docs == 0:
            raise ValueError(f"no non-blank documents in {list(map(str, paths))}: empty corpus "
                             "(for JSONL check --json-key)")
    stats = PreprocessStats(docs, tokens, time.perf_counter() - t0, np.dtype(writer.dtype).name)
    log.info("preprocessed %d documents, %d tokens (%s) in %.1fs with %d workers -> %s",
             docs, tokens, stats.dtype, stats.seconds, workers, output_prefix)
    return stats


def _encoded(batches: Iterator[list[str]], encoder: _BatchEncoder,
             workers: int) -> Iterator[list[np.ndarray]]:
    """Encoded batches in input order (so the output is identical for any worker count).

    At most ``2 * workers`` batches are in flight, so memory stays bounded for any corpus size
    (``Pool.imap`` would read the whole input ahead), and a worker that dies raises
    ``BrokenProcessPool`` instead of hanging."""
    if workers == 1:
        yield from map(encoder, batches)
        return
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.submit(encoder, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
