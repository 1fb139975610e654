"""Megatron's memory-mapped indexed dataset: token documents in a ``.bin`` file, described by an
``.idx`` index (the data pipeline of Megatron-LM, which the ZeRO paper's GPT runs train on).

Byte layout of the index, all little endian, compatible with files written by Megatron-LM's own
``tools/preprocess_data.py``::

    offset 0   9 bytes   magic  b"MMIDIDX\\x00\\x00"
    offset 9   uint64    version (always 1)
    offset 17  uint8     dtype code of the tokens in .bin (see DTYPE_CODES)
    offset 18  uint64    S = number of sequences
    offset 26  uint64    D = number of document-index entries (documents + 1)
    offset 34  int32[S]  sequence lengths (tokens)
               int64[S]  sequence pointers (byte offset of each sequence in .bin)
               int64[D]  document indices: document k is sequences [doc[k], doc[k+1])
               int8[S]   (optional, multimodal files only) sequence modes

The ``.bin`` file is the raw concatenation of all sequences in the dtype named by the code.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 sequence count + 8 document count

# Megatron's numeric dtype codes (megatron/core/datasets/indexed_dataset.py, class DType).
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that cannot be read; the message names the file and the fix."""


def index_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def data_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def best_token_dtype(vocab_size: int) -> type:
    """uint16 halves the file when every id fits (Megatron's threshold is 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _check_exists(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise IndexedDatasetError(
            f"{what} file {path!r} does not exist; pass the data prefix without the .bin/.idx "
            "suffix and build it with tools/preprocess_data.py")


class IndexedDataset:
    """Read-only, memory-mapped view of a ``prefix.bin`` / ``prefix.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapped file, do not write);
    ``ds.get(i, offset, length)`` reads a slice without touching the rest of the sequence.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx, binf = index_path(prefix), data_path(prefix)
        _check_exists(idx, "index (.idx)")
        _check_exists(binf, "data (.bin)")
        self._read_index(idx)
        self._map_data(binf)

    def __getstate__(self) -> dict:
        # pickle (e.g. to DataLoader worker processes) as the path, never as the mapped data
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    # ---- index ---------------------------------------------------------------------------------
    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        if size < HEADER_BYTES:
            raise IndexedDatasetError(f"index {path!r} is truncated ({size} bytes < the "
                                      f"{HEADER_BYTES}-byte header); rebuild it")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:9] != MAGIC:
            raise IndexedDatasetError(f"index {path!r} has magic {header[:9]!r}, expected {MAGIC!r}: "
                                      "not a Megatron mmap indexed dataset")
        version, code = struct.unpack_from("<QB", header, 9)
        if version != VERSION:
            raise IndexedDatasetError(f"index {path!r} has version {version}; only version "
                                      f"{VERSION} is supported")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"index {path!r} has unknown dtype code {code}; known codes "
                                      f"are {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", header, 18)
        expected = HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
        # multimodal Megatron files append one int8 mode per sequence
        if size not in (expected, expected + n_seq):
            raise IndexedDatasetError(
                f"index {path!r} is {size} bytes but its header ({n_seq} sequences, {n_doc} "
                f"document entries) implies {expected}: truncated or corrupt, rebuild it")
        mm = np.memmap(path, mode="r", dtype=np.uint8)
        o = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(mm, np.int32, n_seq, o)
        self.sequence_pointers = np.frombuffer(mm, np.int64, n_seq, o + 4 * n_seq)
        self.document_indices = np.frombuffer(mm, np.int64, n_doc, o + 12 * n_seq)
        self._idx_map = mm
        self._validate_index(path)

    def _validate_index(self, path: str) -> None:
        doc = self.document_indices
        n_seq = len(self.sequence_lengths)
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != n_seq or np.any(np.diff(doc) < 0):
            raise IndexedDatasetError(f"index {path!r} has inconsistent document indices (must rise "
                                      f"from 0 to the sequence count); rebuild it")
        if np.any(self.sequence_lengths < 0):
            raise IndexedDatasetError(f"index {path!r} has negative sequence lengths; rebuild it")

    # ---- data ----------------------------------------------------------------------------------
    def _map_data(self, path: str) -> None:
        size = os.path.getsize(path)
        item = self.dtype.itemsize
        expected = 0
        if len(self.sequence_lengths):
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item
        if size != expected:
            raise IndexedDatasetError(
                f"data {path!r} is {size} bytes but its index needs {expected} "
                f"({self.num_tokens} tokens of {self.dtype}): .bin and .idx do not belong together "
                "or one is truncated; rebuild both with tools/preprocess_data.py")
        # np.memmap cannot map an empty file
        self._bin = np.memmap(path, mode="r", dtype=self.dtype) if size else np.empty(0, self.dtype)

    # ---- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {i} of length {n}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def tokens(self) -> np.ndarray:
        """All tokens of the file as one (mapped) array."""
        return self._bin

    def max_token(self) -> int:
        """Largest token id, scanned in chunks so a huge file is not loaded at once."""
        best, chunk = -1, 1 << 24
        for s in range(0, len(self._bin), chunk):
            best = max(best, int(self._bin[s:s + chunk].max()))
        return best


class IndexedDatasetWriter:
    """Writes a ``prefix.bin`` / ``prefix.idx`` pair in Megatron's layout, one document at a time.

    Files are written under temporary names and renamed on :meth:`finalize` (``.bin`` first, then
    ``.idx``), so a crash never leaves a pair that looks complete. Use as a context manager.
    """

    def __init__(self, prefix: str | Path, dtype: type = np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise IndexedDatasetError(f"dtype {self.dtype} has no Megatron code; use one of "
                                      f"{[np.dtype(t).name for t in DTYPE_CODES.values()]}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = data_path(prefix) + f".tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]

    def add_document(self, tokens) -> None:
        """Append one document stored as a single sequence (Megatron's default without sentence
        splitting)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D token array, got shape {arr.shape}")
        if arr.size and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise IndexedDatasetError(f"token ids in [{arr.min()}, {arr.max()}] do not fit "
                                          f"{self.dtype}; write with dtype=np.int32")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self._doc_indices.append(len(self._lengths))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        tmp_idx = index_path(self.prefix) + f".tmp{os.getpid()}"
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], len(lengths),
                                len(self._doc_indices)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.asarray(self._doc_indices, dtype="<i8").tobytes())
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(tmp_idx, index_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
