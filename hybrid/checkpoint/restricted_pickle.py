"""Read pickled checkpoint files of other frameworks without unpickling arbitrary objects.

A pickle names every class and function it needs (``GLOBAL module name``) and the unpickler
imports and calls them: a crafted file can name ``os.system`` and run a command. Our own checkpoints
hold no pickle (safetensors + JSON, docs/design.md §8); foreign ones - Megatron-LM's
``model_optim_rng.pt``, ``common.pt``, torch.distributed.checkpoint's ``.metadata`` and the
``torch.save`` blobs inside its ``.distcp`` files - do, so they are read by an unpickler that
resolves only the names on an allow-list of data types those files really hold:

    tensors          torch._utils._rebuild_tensor_v2 / _rebuild_parameter(_with_state), torch.Size,
                     torch dtypes, torch.device, torch.serialization._get_layout (storages are
                     resolved by torch.load itself)
    containers       collections.OrderedDict, set, frozenset, slice, _codecs.encode (bytes in
                     protocol 2), io.BytesIO (Transformer Engine's ``_extra_state``)
    metadata         argparse.Namespace (Megatron-LM's ``args``), numpy arrays, dtypes and scalars
                     (the numpy RNG state), the dataclasses of torch.distributed.checkpoint's
                     ``.metadata`` (Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...)

Objects of Megatron's own classes (enums in ``args`` such as ``AttnBackend``) become inert
:class:`ForeignObject` placeholders holding the class name and the arguments: Megatron is never
imported and nothing of theirs runs. Any other name is refused with :class:`ForbiddenPickleError`
naming it and the file, before it is imported.
"""

from __future__ import annotations

import io
import pickle
import types
from pathlib import Path

import torch

from hybrid.checkpoint.format import CheckpointError

_DCP_METADATA = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_DCP_PLANNER = ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
ALLOWED = frozenset({
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("_codecs", "encode"), ("_io", "BytesIO"), ("argparse", "Namespace"),
    ("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA),
    *(("torch.distributed.checkpoint.planner", name) for name in _DCP_PLANNER),
})
_PLACEHOLDER_PACKAGES = ("megatron",)


class ForbiddenPickleError(CheckpointError):
    """A pickled file names a class or function outside the allow-list."""


class ForeignObject:
    """Inert stand-in for an object of a foreign framework's class (e.g. a Megatron enum in
    ``args``): records what the pickle asked for, runs none of that class's code."""

    qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name}{self.args!r} (not imported)>"


_placeholders: dict[str, type] = {}


def _placeholder(module: str, name: str) -> type:
    qualified = f"{module}.{name}"
    if qualified not in _placeholders:
        _placeholders[qualified] = type(name, (ForeignObject,), {"qualified_name": qualified})
    return _placeholders[qualified]


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _unpickler_class(source: str) -> type:
    class RestrictedUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if _allowed(module, name):
                return super().find_class(module, name)
            if module.split(".")[0] in _PLACEHOLDER_PACKAGES:
                return _placeholder(module, name)
            raise ForbiddenPickleError(
                f"{source} holds a pickled {module}.{name}, which is not one of the tensor and "
                f"metadata types a checkpoint needs (docs/checkpoints.md, From Megatron-LM); "
                f"refusing to unpickle it, since that could run arbitrary code. Import only "
                f"checkpoints written by Megatron-LM or megatron-core")

    return RestrictedUnpickler


def _pickle_module(source: str) -> types.ModuleType:
    """A stand-in for the ``pickle`` module that torch.load uses to read the file's pickles."""
    unpickler = _unpickler_class(source)
    module = types.ModuleType("restricted_pickle")
    module.Unpickler = unpickler
    module.load = lambda f, **kwargs: unpickler(f, **kwargs).load()
    return module


def load_pickle(path: str | Path):
    """Unpickle a plain pickle file (torch.distributed.checkpoint's ``.metadata``), restricted."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            return _unpickler_class(str(path))(f).load()
        except ForbiddenPickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{path} is not a readable pickle ({err}); is it truncated?") from None


def load_torch(source: str | Path | bytes, *, name: str | None = None):
    """``torch.load`` of a file (or of the bytes of one, named ``name`` in errors), restricted to
    the allow-list; tensors land on the CPU."""
    label = name or str(source)
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        return torch.load(stream, map_location="cpu", weights_only=False,
                          pickle_module=_pickle_module(label))
    except ForbiddenPickleError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError) as err:
        raise CheckpointError(f"{label} is not a readable torch.save file ({err}); is it "
                              f"truncated?") from None
