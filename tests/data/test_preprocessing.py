"""Tokenizer training, text/JSONL -> .bin/.idx preprocessing, and the embedded default corpus."""

import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid.data.default_corpus import _build, ensure_default_dataset, stdlib_sources
from hybrid.data.builder import build_gpt_datasets
from hybrid.data.gpt_dataset import GPTDataset
from hybrid.data.indexed_dataset import IndexedDataset
from hybrid.data.loader import build_pretraining_loader
from hybrid.data.preprocess import preprocess
from hybrid.data.tokenizer import Tokenizer, train_tokenizer
from tools import preprocess_data, train_tokenizer as train_tokenizer_cli

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRICKY = "def f(x):\n\tif x:  # tab, two spaces\n        return 'Ünïcödé 漢字 🙂'\n\n\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small JSONL corpus of real text (some stdlib modules) plus an odd document."""
    root = tmp_path_factory.mktemp("corpus")
    docs = [(STDLIB / name).read_text() for name in ("textwrap.py", "bisect.py", "colorsys.py")]
    docs += [TRICKY, "   ", "short"]
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    model = train_tokenizer([d for d in docs], root / "tok", vocab_size=600)
    return path, docs, model


def test_tokenizer_round_trips_any_text(corpus):
    _, docs, model = corpus
    tok = Tokenizer(model)
    assert 300 <= tok.vocab_size <= 600 and tok.eod == 2
    for text in docs[:4] + ["never seen: ∮ E⋅da = Q,  ÅΩ"]:
        ids = tok.encode(text)
        assert max(ids) < tok.vocab_size and tok.eod not in ids
        assert tok.decode(ids) == text
    again = train_tokenizer(docs, corpus[0].parent / "again", vocab_size=600)
    assert Path(again).read_bytes() == Path(model).read_bytes()  # deterministic training
    with pytest.raises(ValueError, match="empty corpus"):
        train_tokenizer(["", "  \n\n "], corpus[0].parent / "empty", 400)


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_text_to_bin_idx_round_trip(corpus, tmp_path, dtype):
    path, docs, model = corpus
    stats = preprocess([path], tmp_path / "out", model, json_key="body", token_dtype=dtype)
    tok = Tokenizer(model)
    kept = [d for d in docs if d.strip()]  # blank documents are skipped
    ds = IndexedDataset(tmp_path / "out")
    assert ds.dtype == np.dtype(dtype) and len(ds) == ds.num_documents == len(kept) == stats.documents
    for i, text in enumerate(kept):
        ids = ds[i]
        assert ids[-1] == tok.eod
        assert list(ids[:-1]) == tok.encode(text) and tok.decode(ids[:-1]) == text
    assert stats.tokens == ds.num_tokens
    # the GPT dataset over it validates tokens against the vocabulary
    GPTDataset(ds, (0, len(kept)), 16, 10, seed=0, vocab_size=tok.vocab_size)
    with pytest.raises(ValueError, match="vocab size"):
        GPTDataset(ds, (0, len(kept)), 16, 10, seed=0, vocab_size=100)


def test_workers_give_identical_bytes_and_cli(corpus, tmp_path):
    path, _, model = corpus
    common = ["--input", str(path), "--json-key", "body", "--tokenizer-model", model]
    preprocess_data.main(common + ["--output-prefix", str(tmp_path / "w1"), "--workers", "1"])
    preprocess([path], tmp_path / "w2", model, json_key="body", workers=2, batch_docs=1)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()


def test_preprocess_errors(corpus, tmp_path):
    path, _, model = corpus
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": " "}) + "\n\n")
    with pytest.raises(ValueError, match="empty corpus"):
        preprocess([empty], tmp_path / "e", model)
    assert not list(tmp_path.glob("e.*"))
    with pytest.raises(ValueError, match="--json-key"):
        preprocess([path], tmp_path / "k", model, json_key="text")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        preprocess([tmp_path / "missing.txt"], tmp_path / "m", model)


def test_train_tokenizer_cli_on_text_files(tmp_path):
    out = tmp_path / "cli"
    train_tokenizer_cli.main(["--input", str(STDLIB / "heapq.py"), str(STDLIB / "abc.py"),
                              "--vocab-size", "400", "--output-prefix", str(out)])
    tok = Tokenizer(f"{out}.model")
    assert tok.decode(tok.encode(TRICKY)) == TRICKY


def test_default_corpus_builds_once_and_is_cached(tmp_path):
    sources = stdlib_sources(max_bytes=150_000)
    assert sum(s for _, _, s in sources) <= 150_000 and [r for r, _, _ in sources] == sorted(
        r for r, _, _ in sources)
    assert not any("/test/" in f"/{r}" for r, _, _ in stdlib_sources())
    prefix, model = ensure_default_dataset(tmp_path, 500, max_bytes=150_000)
    manifest = Path(prefix).parent / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = ensure_default_dataset(tmp_path, 500, max_bytes=150_000)
    assert again == (prefix, model) and time.perf_counter() - t0 < 2.0
    assert manifest.stat().st_mtime_ns == stamp  # not rebuilt
    ds, tok = IndexedDataset(prefix), Tokenizer(model)
    assert ds.num_documents == len(sources) == json.loads(manifest.read_text())["documents"]
    rel, path, _ = sources[0]
    assert tok.decode(ds[0][:-1]) == f"# {rel}\n{path.read_text()}"
    # end to end: the first global batch of 4 is the same token rows for DP 1 and DP 2
    train = build_gpt_datasets([prefix], "1", 32, (16, 0, 0), seed=5, vocab_size=tok.vocab_size)[0]
    rows = {}
    for dp in (1, 2):
        got = []
        for rank in range(dp):
            with build_pretraining_loader(train, consumed_samples=4, micro_batch_size=2,
                                          data_parallel_rank=rank, data_parallel_size=dp,
                                          total_samples=8) as loader:
                got += [tuple(r) for b in loader for r in b["tokens"].tolist()]
        rows[dp] = sorted(got)
    assert len(rows[1]) == 4 and rows[1] == rows[2]
    # a second builder racing the first (another rank) finds the finished build and keeps it
    _build(sources, Path(prefix).parent, 500, workers=1)
    assert manifest.stat().st_mtime_ns == stamp
    assert not any(p.name.startswith(".tmp") for p in Path(prefix).parent.parent.iterdir())
