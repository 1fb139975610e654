"""Read the tensors of a torch.distributed.checkpoint (DCP) directory, whole, without DCP's loader.

DCP's own ``FileSystemReader`` unpickles ``.metadata``, which imports and calls whatever the file
names. Here nothing is unpickled: ``.metadata`` (a protocol-4 pickle that
torch's weights-only unpickler cannot parse) is read as data by :func:`read_metadata` - its opcode
stream, interpreted by :mod:`hybrid.checkpoint.pickle_opcodes`, with the names it may hold in the
fixed table :data:`METADATA_GLOBALS` (DCP's metadata dataclasses become inert records, ``torch.Size``,
dtypes and layouts real torch values; any other name refuses the file before anything runs); the
``torch.save`` chunks go through torch's weights-only loader
(:func:`hybrid.checkpoint.foreign_files.load_torch`). The layout (torch's filesystem storage, as
Megatron's ``torch_dist`` format writes it):

    .metadata          pickled ``Metadata``: per tensor key its global size, dtype and chunks
                       (``ChunkStorageMetadata``: offsets and sizes in the global tensor); per chunk
                       (``MetadataIndex(key, offsets)``) a ``_StorageInfo``: which file, byte offset,
                       length; megatron-core adds its save plans (``all_local_plans``)
    __R_I.distcp       the chunks rank R wrote (thread I): each a ``torch.save`` blob at its offset,
                       or raw bytes for non-tensor items (``BytesStorageMetadata``)

:meth:`DCPReader.full_tensor` allocates the global tensor and copies each chunk into its place.
Chunks stored with a transform (compression, torch's optional ``transform_descriptors``) are
refused by name.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path, PurePosixPath

import torch

from hybrid.checkpoint.foreign_files import load_torch
from hybrid.checkpoint.format import CheckpointError
from hybrid.checkpoint.pickle_opcodes import Constant, EnumType, Function, Record, RecordType, parse

METADATA_FILE = ".metadata"
_DCP, _FS, _PLANNER = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                      "torch.distributed.checkpoint.planner")


def _is(value, qualified: str) -> bool:
    return isinstance(value, Record) and type(value).qualified_name == qualified


def _ints(value) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _check_tensor_entry(path: Path, key: str, meta) -> None:
    """A TensorStorageMetadata record holds a dtype, a size and chunks of that rank (parsed data
    can be any shape: say what is wrong instead of failing deep in :meth:`DCPReader.full_tensor`)."""
    props, size, chunks = (getattr(meta, f, None) for f in ("properties", "size", "chunks"))
    good = (_is(props, f"{_DCP}.TensorProperties") and isinstance(getattr(props, "dtype", None), torch.dtype)
            and _ints(size) and isinstance(chunks, list)
            and all(_is(c, f"{_DCP}.ChunkStorageMetadata") and _ints(getattr(c, "offsets", None))
                    and _ints(getattr(c, "sizes", None)) and len(c.offsets) == len(c.sizes) == len(size)
                    for c in chunks))
    if not good:
        raise CheckpointError(f"{path}: the entry of {key} is not a tensor's metadata (a dtype, a "
                              f"size and chunks of that rank): {meta!r}"[:400])


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
        if not _is(metadata, f"{_DCP}.Metadata") or not isinstance(entries, dict) or not isinstance(storage, dict):
            raise CheckpointError(f"{path} does not hold torch.distributed.checkpoint metadata "
                                  f"with storage information (state_dict_metadata, storage_data)")
        self._tensors = {k: v for k, v in entries.items() if _is(v, f"{_DCP}.TensorStorageMetadata")}
        for key, meta in self._tensors.items():
            _check_tensor_entry(path, key, meta)
        # (key, chunk offsets) -> where its bytes are; MetadataIndex compares only these two
        self._storage = {}
        for index, info in storage.items():
            if not (_is(index, f"{_DCP}.MetadataIndex") and _is(info, f"{_FS}._StorageInfo")
                    and type(getattr(info, "relative_path", None)) is str
                    and all(type(getattr(info, f, None)) is int for f in ("offset", "length"))):
                raise CheckpointError(f"{path}: storage_data maps {index!r} to {info!r}, not a "
                                      f"MetadataIndex to a _StorageInfo (file, offset, length)"[:400])
            self._storage[(index.fqn, tuple(index.offset or ()))] = info

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


# torch.memory_format cannot be pickled: TensorProperties stores _MEM_FORMAT_ENCODING's value instead
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}   # "torch.strided"
_DTYPES = {f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _tensor_properties(state: tuple) -> dict:
    """TensorProperties.__setstate__, redone: (dtype, layout, requires_grad, format code, pinned)."""
    if len(state) != 5 or getattr(state[3], "qualified_name", "") != f"{_DCP}._MEM_FORMAT_ENCODING":
        raise ValueError(f"TensorProperties state {state!r} is not (dtype, layout, requires_grad, "
                         f"memory format, pin_memory)")
    dtype, layout, requires_grad, code, pin_memory = state
    return {"dtype": dtype, "layout": layout, "requires_grad": requires_grad,
            "memory_format": _MEMORY_FORMATS[code.value], "pin_memory": pin_memory}


def _size(dims=()) -> torch.Size:
    if type(dims) not in (tuple, list) or not all(type(d) is int for d in dims):
        raise ValueError(f"torch.Size({dims!r}) is not of a sequence of ints")
    return torch.Size(dims)


def _layout(name) -> torch.layout:
    if name not in _LAYOUTS:
        raise ValueError(f"{name!r} is not one of torch's layouts {sorted(_LAYOUTS)}")
    return _LAYOUTS[name]


def _path(*parts) -> PurePosixPath:
    if not all(type(p) is str for p in parts):
        raise ValueError(f"a path of parts {parts!r} that are not strings")
    return PurePosixPath(*parts)


def _latin1(text, encoding="latin1") -> bytes:
    """``_codecs.encode``: how protocol-2 pickles spell bytes."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise ValueError(f"_codecs.encode{(text, encoding)!r} is not bytes spelled in latin1")
    return text.encode("latin1")


def _ordered_dict(items=()) -> OrderedDict:
    if type(items) not in (list, tuple) or not all(type(i) is tuple and len(i) == 2 for i in items):
        raise ValueError("OrderedDict of something other than (key, value) pairs")
    return OrderedDict(items)


def _records(module: str, names: str, **special) -> dict:
    return {f"{module}.{n}": special.get(n) or RecordType(f"{module}.{n}") for n in names.split()}


# What a DCP .metadata may name (as torch 2.x and megatron-core 0.16 write it; docs/checkpoints.md)
# and what is built here for each. Default field values are those of torch's dataclasses that a
# file may leave out (_StorageInfo pickles only its fields that are not None).
METADATA_GLOBALS: dict = {
    **_records(_DCP, "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata "
                     "MetadataIndex StorageMeta",
               Metadata=RecordType(f"{_DCP}.Metadata", {"planner_data": None, "storage_data": None,
                                                        "storage_meta": None, "version": None}),
               MetadataIndex=RecordType(f"{_DCP}.MetadataIndex", {"offset": None, "index": None})),
    f"{_DCP}.TensorProperties": RecordType(f"{_DCP}.TensorProperties", from_tuple=_tensor_properties),
    f"{_DCP}._MEM_FORMAT_ENCODING": EnumType(f"{_DCP}._MEM_FORMAT_ENCODING", frozenset(_MEMORY_FORMATS)),
    f"{_FS}._StorageInfo": RecordType(f"{_FS}._StorageInfo", {"transform_descriptors": None}),
    # megatron-core keeps its save plans in Metadata (all_local_plans)
    **_records(_PLANNER, "SavePlan WriteItem TensorWriteData BytesIOWriteData"),
    # WriteItemType's members are auto(): TENSOR 1, SHARD 2, BYTE_IO 3
    f"{_PLANNER}.WriteItemType": EnumType(f"{_PLANNER}.WriteItemType", frozenset({1, 2, 3})),
    "torch.Size": Function("torch.Size", _size),
    "torch.serialization._get_layout": Function("torch.serialization._get_layout", _layout),
    **{name: Constant(dtype) for name, dtype in _DTYPES.items()},
    "collections.OrderedDict": Function("collections.OrderedDict", _ordered_dict),
    "_codecs.encode": Function("_codecs.encode", _latin1),
    # StorageMeta.checkpoint_id: the directory DCP wrote to (a pure path: it touches no file)
    **{f"pathlib.{p}{c}": Function(f"pathlib.{p}{c}", _path)
       for p in ("", "_local.") for c in ("PosixPath", "PurePosixPath")},
}


def read_metadata(path: str | Path):
    """DCP's ``.metadata``: records and plain values parsed from its pickle opcodes (nothing is
    unpickled; a name outside :data:`METADATA_GLOBALS` refuses the file)."""
    path = Path(path)
    return parse(path.read_bytes(), METADATA_GLOBALS, str(path))
