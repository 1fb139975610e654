"""Read the pickled checkpoint files of other frameworks with torch's weights-only unpickler.

A pickle names every class and function it needs and the unpickler imports and calls them: a
crafted file can name ``os.system``. Our own checkpoints hold no pickle (safetensors + JSON,
docs/design.md §8); foreign ones do - Megatron-LM's ``model_optim_rng.pt`` and ``common.pt``,
torch.distributed.checkpoint's ``.metadata`` and the ``torch.save`` blobs in its ``.distcp`` files.
The ``torch.save`` files are read only by torch's weights-only unpickler
(``torch.load(weights_only=True)``), which resolves tensors, containers and torch's own types,
plus the names of :data:`ALLOWED` that a file really holds, granted for that one load through
``torch.serialization.safe_globals`` by :func:`grant`:

    containers frozenset, slice
    metadata   argparse.Namespace (Megatron-LM's ``args``); numpy arrays, dtypes and scalars (the
               numpy RNG state); io.BytesIO (Transformer Engine's ``_extra_state``)

Megatron's own classes (enums in ``args`` such as ``AttnBackend``) are granted as inert
:class:`ForeignObject` placeholders under their names: Megatron is never imported and nothing of
theirs runs. Any other name is refused with :class:`ForbiddenPickleError` naming it and the file.
DCP's ``.metadata`` is no ``torch.save`` file and is never unpickled at all: it is parsed as data
from its opcodes (:mod:`hybrid.checkpoint.pickle_opcodes`, :mod:`hybrid.checkpoint.dcp_reader`),
which raise the same :class:`ForbiddenPickleError`. No module of the framework imports ``pickle``
(tests/project/test_security.py).
"""

from __future__ import annotations

import importlib
import io
from pathlib import Path

import torch

from hybrid.checkpoint.format import CheckpointError

# what torch's weights-only unpickler does not grant itself (it has tensors, storages, torch.Size,
# dtypes, devices, OrderedDict, set): only names torch.serialization.get_unsafe_globals_in_checkpoint
# reports reach grant()
ALLOWED = frozenset({
    "argparse.Namespace", "_io.BytesIO", "builtins.frozenset", "builtins.slice",
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
})
_PLACEHOLDER_PACKAGES = ("megatron",)


class ForbiddenPickleError(CheckpointError):
    """A pickled file names a class or function outside the allow-list (or, in a ``.metadata``
    read by :mod:`hybrid.checkpoint.pickle_opcodes`, uses an opcode that plain data does not)."""


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


def _placeholder(qualified: str) -> type:
    if qualified not in _placeholders:
        name = qualified.rpartition(".")[2]
        _placeholders[qualified] = type(name, (ForeignObject,), {"qualified_name": qualified})
    return _placeholders[qualified]


def _allowed(qualified: str) -> bool:
    module, _, name = qualified.rpartition(".")
    return qualified in ALLOWED or (module == "numpy.dtypes" and name.endswith("DType"))   # numpy >= 1.25


def grant(qualified: str, label: str):
    """What ``safe_globals`` grants for the pickle's name ``qualified``: the allowed object, or a
    placeholder under that name; anything else is refused before it is imported."""
    if _allowed(qualified):
        module, _, name = qualified.rpartition(".")
        return getattr(importlib.import_module(module), name)
    if qualified.split(".")[0] in _PLACEHOLDER_PACKAGES:
        return (_placeholder(qualified), qualified)
    raise ForbiddenPickleError(
        f"{label} holds a pickled {qualified}, which is not one of the tensor and metadata types a "
        f"checkpoint needs (docs/checkpoints.md, From Megatron-LM and DCP interop); refusing to "
        f"unpickle it, since that could run arbitrary code. Import only checkpoints written by "
        f"Megatron-LM, megatron-core, torchtitan or torch.distributed.checkpoint")


def load_torch(source: str | Path | bytes, *, name: str | None = None):
    """``torch.load(weights_only=True)`` of a file (or of the bytes of one, named ``name`` in
    errors), granting the allowed names it holds; tensors land on the CPU."""
    label = name or str(source)
    stream = (lambda: io.BytesIO(source)) if isinstance(source, bytes) else (lambda: source)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(stream())
    except Exception as err:
        raise CheckpointError(f"{label} is not a readable torch.save file ({err}); is it "
                              f"truncated?") from None
    granted = [grant(n, label) for n in unsafe]
    if "numpy.dtype" in unsafe:   # the unpickler builds a dtype as its class (numpy.dtypes.*DType)
        import numpy.dtypes
        granted += [getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType")]
    with torch.serialization.safe_globals(granted):
        try:
            return torch.load(stream(), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{label} is not a readable torch.save file ({err}); is it "
                                  f"truncated?") from None
