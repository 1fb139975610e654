"""Megatron indexed-dataset format: byte layout, reader/writer round trip, error messages."""

import pickle
import struct

import numpy as np
import pytest

from hybrid.data.indexed_dataset import (IndexedDataset, IndexedDatasetError, IndexedDatasetWriter,
                                         best_token_dtype)


def write_megatron_by_hand(prefix, docs_of_sequences, dtype=np.uint16, code=8, magic=b"MMIDIDX\x00\x00",
                           version=1, modes=False):
    """Megatron's layout written field by field with struct, independent of our writer."""
    seqs = [np.asarray(s, dtype=dtype) for doc in docs_of_sequences for s in doc]
    doc_idx, n = [0], 0
    for doc in docs_of_sequences:
        n += len(doc)
        doc_idx.append(n)
    item = np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        for s in seqs:
            f.write(struct.pack("<i", len(s)))
        ptr = 0
        for s in seqs:
            f.write(struct.pack("<q", ptr))
            ptr += len(s) * item
        for d in doc_idx:
            f.write(struct.pack("<q", d))
        if modes:
            f.write(bytes(len(seqs)))
    return seqs


def test_reads_megatron_layout_written_by_hand(tmp_path):
    docs = [[[5, 6, 7], [8, 2]], [[9, 10, 11, 12, 2]], [[2]]]  # doc 0 is sentence-split
    seqs = write_megatron_by_hand(tmp_path / "m", docs)
    ds = IndexedDataset(tmp_path / "m")
    assert len(ds) == 4 and ds.num_documents == 3 and ds.dtype == np.uint16
    assert list(ds.document_indices) == [0, 2, 3, 4]
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds.get(1, 1, 1), [2])
    assert ds.num_tokens == 11 and ds.max_token() == 12
    clone = pickle.loads(pickle.dumps(ds))  # pickled as its path, not its data
    assert len(pickle.dumps(ds)) < 200 and np.array_equal(clone[2], seqs[2])


def test_reads_int32_and_multimodal_modes(tmp_path):
    docs = [[[70000, 1, 2]], [[3, 99999]]]
    write_megatron_by_hand(tmp_path / "m", docs, dtype=np.int32, code=4, modes=True)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32
    np.testing.assert_array_equal(ds[1], [3, 99999])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_writer_matches_hand_layout_bytes(tmp_path, dtype):
    rng = np.random.default_rng(0)
    hi = 200 if dtype == np.uint8 else 60000
    docs = [rng.integers(0, hi, size=n) for n in (7, 1, 0, 33)]
    with IndexedDatasetWriter(tmp_path / "ours", dtype) as w:
        for d in docs:
            w.add_document(d)
    code = {np.uint16: 8, np.int32: 4, np.int64: 5, np.uint8: 1}[dtype]
    write_megatron_by_hand(tmp_path / "ref", [[d] for d in docs], dtype=dtype, code=code)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    ds = IndexedDataset(tmp_path / "ours")
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)


def test_best_dtype_threshold():
    assert best_token_dtype(65499) == np.uint16 and best_token_dtype(65500) == np.int32


def _good(tmp_path):
    write_megatron_by_hand(tmp_path / "d", [[[1, 2, 3]], [[4, 5]]])
    return tmp_path / "d"


def _resize(path, delta):
    raw = path.read_bytes()
    path.write_bytes(raw[:delta] if delta < 0 else raw + bytes(delta))


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: (p.parent / "d.idx").unlink(), "does not exist"),
    (lambda p: (p.parent / "d.bin").unlink(), "does not exist"),
    (lambda p: _patch(p.parent / "d.idx", 0, b"XXIDIDX"), "magic"),
    (lambda p: _patch(p.parent / "d.idx", 9, struct.pack("<Q", 2)), "version 2"),
    (lambda p: _patch(p.parent / "d.idx", 17, bytes([9])), "unknown dtype code 9"),
    (lambda p: (p.parent / "d.idx").write_bytes((p.parent / "d.idx").read_bytes()[:-3]), "truncated"),
    (lambda p: (p.parent / "d.idx").write_bytes(b"MMIDIDX"), "truncated"),
    (lambda p: _resize(p.parent / "d.bin", -2), "do not belong"),
    (lambda p: _resize(p.parent / "d.bin", +2), "do not belong"),
])
def test_bad_files_raise_clear_errors(tmp_path, corrupt, message):
    prefix = _good(tmp_path)
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(prefix)


def test_writer_rejects_ids_that_do_not_fit_and_cleans_up(tmp_path):
    with pytest.raises(IndexedDatasetError, match="do not fit"):
        with IndexedDatasetWriter(tmp_path / "w", np.uint16) as w:
            w.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []  # no half-written pair left behind
