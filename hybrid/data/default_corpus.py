"""The embedded default corpus: GPT pretraining data that every machine with this Python already has.

No download and no user data: the documents are the pure-Python sources of the standard library
(code, comments and docstrings, plus the ``pydoc_data`` help topics), in sorted path order up to a
size cap, test suites excluded. From them a BPE tokenizer is trained and a Megatron indexed dataset
is built, once; both are cached under ``$HYBRID_CACHE`` (default ``./data-cache``) in a directory
named by a hash of the inputs, so later calls only re-list the files and check a manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from hybrid.data.preprocess import preprocess
from hybrid.data.tokenizer import train_tokenizer

log = logging.getLogger(__name__)

BUILDER_VERSION = 1
DEFAULT_MAX_BYTES = 12_000_000     # the whole non-test stdlib of CPython 3.11 (~11 MB) fits
TOKENIZER_SAMPLE_BYTES = 4_000_000  # the tokenizer is trained on an evenly spread subset
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
DATA_NAME, TOKENIZER_NAME, MANIFEST = "text_document", "tokenizer", "manifest.json"


def default_cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_CACHE", "./data-cache"))


Source = tuple[str, Path, int]  # (path relative to the stdlib, path, size in bytes)


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> list[Source]:
    """``(relative path, path, size)`` of the corpus files: sorted, tests excluded, capped."""
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root_path):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root_path).as_posix(), path, path.stat().st_size))
    found.sort()
    chosen, total = [], 0
    for rel, path, size in found:
        if total + size > max_bytes:
            continue  # skip files that overflow the cap, keep filling with smaller ones
        chosen.append((rel, path, size))
        total += size
    if not chosen:
        raise ValueError(f"no standard-library sources under {root_path} fit in {max_bytes} bytes; "
                         "raise max_bytes")
    return chosen


def corpus_key(sources: list[Source], vocab_size: int, max_bytes: int) -> str:
    h = hashlib.sha256(json.dumps([BUILDER_VERSION, sys.version, vocab_size, max_bytes]).encode())
    for rel, path, size in sources:
        h.update(f"{rel}\0{size}\0{path.stat().st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def write_corpus(sources: list[Source], out: Path) -> tuple[int, str]:
    """One JSONL document per source file, headed by its path; returns (documents, sha256)."""
    h, n = hashlib.sha256(), 0
    with open(out, "w", encoding="utf-8") as f:
        for rel, path, _ in sources:
            text = path.read_text(encoding="utf-8", errors="replace")
            line = json.dumps({"text": f"# {rel}\n{text}"}, ensure_ascii=False) + "\n"
            f.write(line)
            h.update(line.encode("utf-8"))
            n += 1
    return n, h.hexdigest()


def tokenizer_sample(corpus: Path, budget: int) -> list[str]:
    """Every k-th document so the sample spans the whole library within ``budget`` characters."""
    docs = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    stride = max(1, -(-sum(map(len, docs)) // budget))
    return docs[::stride]


def ensure_default_dataset(cache_dir: str | Path | None = None, vocab_size: int = 8192, *,
                           max_bytes: int = DEFAULT_MAX_BYTES, workers: int = 1) -> tuple[str, str]:
    """Build (once) and return ``(data_prefix, tokenizer_model_path)`` of the default corpus.

    Safe to call from several processes at once: each builds in a private directory and the
    first to finish renames it into place; the others discard theirs.
    """
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    sources = stdlib_sources(max_bytes)
    final = base / "default-corpus" / corpus_key(sources, vocab_size, max_bytes)
    if not (final / MANIFEST).is_file():
        _build(sources, final, vocab_size, workers)
    return str(final / DATA_NAME), str(final / f"{TOKENIZER_NAME}.model")


def _build(sources: list[Source], final: Path, vocab_size: int, workers: int) -> None:
    t0 = time.perf_counter()
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        corpus = tmp / "corpus.jsonl"
        docs, digest = write_corpus(sources, corpus)
        model = train_tokenizer(tokenizer_sample(corpus, TOKENIZER_SAMPLE_BYTES),
                                tmp / TOKENIZER_NAME, vocab_size)
        stats = preprocess([corpus], tmp / DATA_NAME, model, workers=workers)
        manifest = {"builder_version": BUILDER_VERSION, "python": sys.version, "documents": docs,
                    "corpus_bytes": corpus.stat().st_size, "corpus_sha256": digest,
                    "tokens": stats.tokens, "vocab_size": vocab_size,
                    "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
            log.info("another process built %s first; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built the default corpus in %.1fs: %s", time.perf_counter() - t0, final)
