"""GPT samples across document boundaries, split, cached shuffle index, blending, DP sampler, loader."""

import numpy as np
import pytest
import torch

from hybrid.data.blending import (BlendedDataset, build_blending_indices, parse_data_path,
                                  samples_per_dataset)
from hybrid.data.builder import build_gpt_datasets
from hybrid.data.gpt_dataset import GPTDataset, parse_split
from hybrid.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from hybrid.data.loader import PrefetchLoader, build_pretraining_loader
from hybrid.data.sampler import PretrainingSampler

EOD = 0


def make_dataset(path, n_docs=20, seed=0, base=1):
    """Documents of random lengths whose tokens are unique stream positions (+base), so every
    sample can be traced back; each ends with EOD."""
    rng = np.random.default_rng(seed)
    docs, nxt = [], base
    for _ in range(n_docs):
        n = int(rng.integers(1, 30))
        docs.append(np.concatenate([np.arange(nxt, nxt + n), [EOD]]))
        nxt += n
    with IndexedDatasetWriter(path, np.int32) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(path), docs


def test_samples_are_seq_plus_one_and_cover_the_epochs(tmp_path):
    ds, docs = make_dataset(tmp_path / "d")
    seq = 8
    gpt = GPTDataset(ds, (0, 20), seq, num_samples=100, seed=1)
    tokens_per_epoch = sum(map(len, docs))
    assert len(gpt) >= 100
    samples = [gpt[i] for i in range(len(gpt))]
    assert all(s.shape == (seq + 1,) and s.dtype == np.int64 for s in samples)
    # un-shuffle: consecutive samples share one token, and the stream is whole epochs of the docs
    by_pos = [None] * len(gpt)
    for i, s in enumerate(samples):
        by_pos[int(gpt.shuffle_index[i])] = s
    stream = np.concatenate([by_pos[0]] + [s[1:] for s in by_pos[1:]])
    for a, b in zip(by_pos, by_pos[1:]):
        assert a[-1] == b[0]
    expected = np.concatenate([docs[d] for d in gpt.document_index])
    np.testing.assert_array_equal(stream, expected[:len(stream)])
    assert len(expected) - len(stream) < seq  # nothing but the tail of the last epoch is dropped
    epochs = len(gpt.document_index) // 20
    assert (epochs - 1) * tokens_per_epoch < 100 * seq + 1 <= epochs * tokens_per_epoch
    assert np.all(np.bincount(gpt.document_index, minlength=20) == epochs)  # each doc once per epoch


def test_index_is_deterministic_and_cached(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    a = GPTDataset(ds, (0, 20), 8, 50, seed=3, cache_dir=cache)
    files = sorted(p.name for p in cache.iterdir())
    assert len([f for f in files if f.endswith(".npy")]) == 3 and not any(".tmp" in f for f in files)
    b = GPTDataset(ds, (0, 20), 8, 50, seed=3, cache_dir=cache)  # loaded from cache
    assert isinstance(b.shuffle_index, np.memmap)
    c = GPTDataset(ds, (0, 20), 8, 50, seed=3)  # rebuilt without cache
    d = GPTDataset(ds, (0, 20), 8, 50, seed=4, cache_dir=cache)
    for x in (b, c):
        for name in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(a, name), getattr(x, name))
    assert not np.array_equal(a.shuffle_index, d.shuffle_index)
    assert len(list(cache.glob("*.npy"))) == 6
    # the cache is keyed by the data's document lengths: a copy reuses it, other data does not
    for ext in (".bin", ".idx"):
        (tmp_path / f"copy{ext}").write_bytes((tmp_path / f"d{ext}").read_bytes())
    GPTDataset(IndexedDataset(tmp_path / "copy"), (0, 20), 8, 50, seed=3, cache_dir=cache)
    assert len(list(cache.glob("*.npy"))) == 6
    other, _ = make_dataset(tmp_path / "other", seed=9)
    GPTDataset(other, (0, 20), 8, 50, seed=3, cache_dir=cache)
    assert len(list(cache.glob("*.npy"))) == 9


def test_split_document_ranges_and_vocab_check(tmp_path):
    assert parse_split("98,2,0", 100) == [(0, 98), (98, 100), (100, 100)]
    assert parse_split("1", 10) == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError, match="split"):
        parse_split("a,b", 10)
    ds, docs = make_dataset(tmp_path / "d")
    train, valid, test = build_gpt_datasets([str(tmp_path / "d")], "90,10,0", 4, (20, 5, 5), seed=0,
                                            cache_dir=tmp_path / "c")
    assert test is None and len(list((tmp_path / "c" / "gpt-index").glob("*.npy"))) == 6
    valid_docs = set(range(18, 20))
    assert set(np.unique(valid.document_index)) == valid_docs
    assert not set(np.unique(train.document_index)) & valid_docs
    with pytest.raises(ValueError, match="token id .* >= vocab size"):
        GPTDataset(ds, (0, 20), 4, 10, seed=0, vocab_size=int(ds.max_token()))
    with pytest.raises(ValueError, match="empty or out of range"):
        GPTDataset(ds, (20, 20), 4, 10, seed=0)


def test_blending_proportions_and_data_path():
    assert parse_data_path(["a"]) == [(1.0, "a")]
    assert parse_data_path(["1", "a", "3", "b"]) == [(0.25, "a"), (0.75, "b")]
    for bad in (["0.3", "a", "b"], ["x", "a"], ["-1", "a", "2", "b"], ["0", "a", "0", "b"]):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)
    w = [0.2, 0.5, 0.3]
    owners, ranks = build_blending_indices(w, 1000)
    for n in (10, 100, 1000):  # every prefix is within rounding of the weights
        counts = np.bincount(owners[:n], minlength=3)
        assert np.all(np.abs(counts - np.array(w) * n) <= 1), (n, counts)
    for d in range(3):  # each dataset is read in order 0, 1, 2, ...
        np.testing.assert_array_equal(ranks[owners == d], np.arange(np.sum(owners == d)))
    assert all(c >= np.sum(owners == d) for d, c in enumerate(samples_per_dataset(w, 1000)))


def test_blended_dataset_draws_from_children(tmp_path):
    a, _ = make_dataset(tmp_path / "a", seed=0, base=1)
    b, _ = make_dataset(tmp_path / "b", seed=1, base=100_000)
    blend = build_gpt_datasets(["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")],
                               "1", 4, (200, 0, 0), seed=0)[0]
    assert isinstance(blend, BlendedDataset) and len(blend) == 200
    from_b = sum(int(blend[i].max() >= 100_000) for i in range(200))
    assert from_b == 150
    # a prefix with no documents in a split drops out of that split's blend
    c, _ = make_dataset(tmp_path / "c", n_docs=1, seed=2, base=200_000)
    train, valid, _ = build_gpt_datasets(["0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "c")],
                                         "90,10,0", 4, (20, 10, 0), seed=0)
    assert isinstance(train, BlendedDataset) and isinstance(valid, GPTDataset)
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([blend.datasets[0]], [1.0], len(blend.datasets[0]) + 1)


def _global_batches(dp, mbs, global_batch, steps, consumed=0):
    """For each global batch, the union of the sample indices all DP ranks read."""
    samplers = [iter(PretrainingSampler(None, consumed, mbs, r, dp)) for r in range(dp)]
    out = []
    for _ in range(steps):
        batch = []
        for _ in range(global_batch // (mbs * dp)):  # micro-steps of gradient accumulation
            for s in samplers:
                batch += next(s)
        out.append(sorted(batch))
    return out


def test_sampler_global_batches_independent_of_dp_and_resume_exact():
    ref = _global_batches(dp=1, mbs=2, global_batch=8, steps=6)
    assert ref[0] == list(range(8)) and ref[5] == list(range(40, 48))
    for dp, mbs in ((2, 2), (4, 1), (4, 2), (2, 1)):
        assert _global_batches(dp, mbs, 8, 6) == ref
    # resume after 3 global batches with another DP degree: continues exactly, no repeat or skip
    for dp in (1, 2, 4):
        assert _global_batches(dp, 1, 8, 3, consumed=24) == ref[3:]
    s = PretrainingSampler(20, 8, 2, 1, 2)
    assert list(s) == [[10, 11], [14, 15], [18, 19]] and len(s) == 3
    with pytest.raises(ValueError, match="data_parallel_rank"):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_loader_prefetches_tokens_and_labels(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    gpt = GPTDataset(ds, (0, 20), 8, 40, seed=0)
    sampler = PretrainingSampler(40, 8, 4, 1, 2)
    with PrefetchLoader(gpt, sampler, prefetch=2) as loader:
        batches = list(loader)
    assert len(batches) == 4
    for k, batch in enumerate(batches):
        first = 8 + k * 8 + 4
        ref = np.stack([gpt[i] for i in range(first, first + 4)])
        assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (4, 8)
        np.testing.assert_array_equal(batch["tokens"].numpy(), ref[:, :-1])
        np.testing.assert_array_equal(batch["labels"].numpy(), ref[:, 1:])
        assert torch.all(batch["loss_mask"] == 1)
    # the same micro-batches from the one-call builder, with EOD inputs masked out of the loss
    with build_pretraining_loader(gpt, consumed_samples=8, micro_batch_size=4, data_parallel_rank=1,
                                  data_parallel_size=2, total_samples=40, eod_mask_loss=EOD) as loader:
        again = list(loader)
    assert len(again) == len(batches)
    for batch, ref in zip(again, batches):
        assert torch.equal(batch["tokens"], ref["tokens"])
        assert torch.equal(batch["loss_mask"] == 0, ref["tokens"] == EOD)


def test_loader_reraises_dataset_errors():
    class Broken:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise KeyError("disk on fire")

    loader = PrefetchLoader(Broken(), PretrainingSampler(4, 0, 2, 0, 1))
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(loader)
    with pytest.raises(StopIteration):
        next(loader)


def test_dropped_loader_stops_its_thread():
    import gc
    import threading
    import time

    before = threading.active_count()
    data = [np.arange(i, i + 5) for i in range(100)]
    loader = PrefetchLoader(data, PretrainingSampler(None, 0, 1, 0, 1), prefetch=1)
    next(loader)
    del loader  # never closed: an unbounded sampler must not leave a spinning thread behind
    gc.collect()
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before
