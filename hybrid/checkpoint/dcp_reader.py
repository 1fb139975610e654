"""Read the tensors of a torch.distributed.checkpoint (DCP) directory, whole, without DCP's loader.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``, which imports and
calls whatever the file names. Here the ``torch.save`` chunks go through torch's weights-only
loader (:func:`hybrid.checkpoint.foreign_files.load_torch`), and ``.metadata`` - a protocol-4
pickle that torch's weights-only unpickler cannot parse - through :func:`read_metadata`, an
unpickler whose only way to reach a class or function is the allow-list of
:func:`~hybrid.checkpoint.foreign_files.grant` (Python's "restricting globals"): a name outside it is
refused before it is imported. This module is the only one in the framework that imports
``pickle`` (tests/project/test_security.py checks that). The layout (torch's filesystem storage,
as Megatron's ``torch_dist`` format writes it):

    .metadata          pickled ``Metadata``: per tensor key its global size, dtype and chunks
                       (``ChunkStorageMetadata``: offsets and sizes in the global tensor); per chunk
                       (``MetadataIndex(key, offsets)``) a ``_StorageInfo``: which file, byte offset,
                       length
    __R_I.distcp       the chunks rank R wrote (thread I): each a ``torch.save`` blob at its offset,
                       or raw bytes for non-tensor items (``BytesStorageMetadata``)

:meth:`DCPReader.full_tensor` allocates the global tensor and copies each chunk into its place.
Chunks stored with a transform (compression, torch's optional ``transform_descriptors``) are
refused by name.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from hybrid.checkpoint.foreign_files import ForbiddenPickleError, grant, load_torch
from hybrid.checkpoint.format import CheckpointError

METADATA_FILE = ".metadata"


class DCPReader:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / METADATA_FILE
        if not path.is_file():
            raise CheckpointError(f"{self.directory} has no {METADATA_FILE}: it is not a "
                                  f"torch.distributed.checkpoint directory")
        metadata = read_metadata(path)
        entries = getattr(metadata, "state_dict_metadata", None)
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(entries, dict) or not isinstance(storage, dict):
            raise CheckpointError(f"{path} does not hold torch.distributed.checkpoint metadata "
                                  f"with storage information (state_dict_metadata, storage_data)")
        self._tensors = {k: v for k, v in entries.items() if hasattr(v, "chunks")}
        # (key, chunk offsets) -> where its bytes are; MetadataIndex compares only these two
        self._storage = {(index.fqn, tuple(index.offset or ())): info for index, info in storage.items()}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor key and its global shape (non-tensor items, e.g. extra states, left out)."""
        return {key: tuple(meta.size) for key, meta in self._tensors.items()}

    def full_tensor(self, key: str) -> torch.Tensor:
        """The global tensor ``key``, assembled from its chunks (each element written once)."""
        meta = self._tensors[key]
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            data = self._read_chunk(key, offsets)
            if tuple(data.shape) != sizes:
                raise CheckpointError(f"{self.directory}: chunk {offsets} of {key} holds shape "
                                      f"{list(data.shape)}, the metadata says {list(sizes)}")
            target = full
            for dim, (start, size) in enumerate(zip(offsets, sizes)):
                target = target.narrow(dim, start, size)
            target.copy_(data)
            covered += data.numel()
        if covered != full.numel():
            raise CheckpointError(f"{self.directory}: the chunks of {key} cover {covered} of its "
                                  f"{full.numel()} elements; the checkpoint is incomplete")
        return full

    def _read_chunk(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        info = self._storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{self.directory}/{METADATA_FILE} lists chunk {list(offsets)} "
                                  f"of {key} but no file holding it")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{key} in {self.directory} is stored with transforms "
                                  f"{info.transform_descriptors} (e.g. compression), which this "
                                  f"reader does not undo; save it without them")
        path = self.directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        if len(blob) != info.length:
            raise CheckpointError(f"{path} ends before byte {info.offset + info.length}, where "
                                  f"chunk {list(offsets)} of {key} ends: the file is truncated")
        tensor = load_torch(blob, name=f"{path} (chunk {list(offsets)} of {key})")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path} holds a {type(tensor).__name__} where chunk "
                                  f"{list(offsets)} of {key} should be a tensor")
        return tensor


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves a pickle's names only through the allow-list (a placeholder for Megatron's)."""

    def __init__(self, file, label: str):
        super().__init__(file)
        self.label = label

    def find_class(self, module: str, name: str):
        granted = grant(f"{module}.{name}", self.label)
        return granted[0] if isinstance(granted, tuple) else granted


def read_metadata(path: str | Path):
    """DCP's ``.metadata`` pickle, unpickled with names resolved only by the allow-list."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            return _AllowListUnpickler(f, str(path)).load()
        except ForbiddenPickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{path} is not a readable pickle ({err}); is it truncated?") from None
