"""DCP's ``.metadata`` read as data from its pickle opcodes (hybrid/checkpoint/pickle_opcodes.py,
hybrid/checkpoint/dcp_reader.py): no unpickling anywhere in the product (security review).

The oracles: the ``Metadata`` object ``torch.distributed.checkpoint.save`` returns (the one it
pickled), and Python's own unpickler, used here in the test only (:func:`unpickled`, the one
``pickle.load`` tests/project/test_security.py allows). A ``.metadata`` torch writes (tensors of four
dtypes, a non-tensor item so that ``BytesStorageMetadata`` appears, and an int) parses into records
equal, field by field, to both, and :class:`DCPReader` gives back the saved tensors (megatron-core's
sharded TP 2 files, with its save plans, are compared with :func:`unpickled` in
test_import_megatron.py). Plain data pickled at protocols 0 to 5 comes back equal, its shared
objects shared. Refused, naming the problem, with nothing imported or run: a file naming ``os.system``,
``builtins.eval``, any other global (a sentinel module on ``sys.path`` stays unimported), an allowed
class used as a function, opcodes plain data does not need, a byte that is no opcode, a truncated
file, and metadata whose tensor entry is not a tensor's.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import sys
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from hybrid.checkpoint.dcp_reader import DCPReader, read_metadata
from hybrid.checkpoint.foreign_files import ForbiddenPickleError
from hybrid.checkpoint.format import CheckpointError
from hybrid.checkpoint.pickle_opcodes import EnumValue, Record

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def unpickled(path):
    """The test oracle: ``path`` unpickled by Python (a file a test or megatron-core just wrote)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def assert_same_as_unpickled(ours, real, where: str = "metadata") -> None:
    """``ours`` (records and plain values) equals ``real`` (what ``pickle.load`` built) field by
    field: each record under its class's qualified name with every dataclass field and attribute."""
    if isinstance(ours, Record):
        assert type(ours).qualified_name == f"{type(real).__module__}.{type(real).__qualname__}", where
        names = {f.name for f in dataclasses.fields(real)} | set(vars(real)) | set(vars(ours))
        for name in names:
            assert_same_as_unpickled(getattr(ours, name), getattr(real, name), f"{where}.{name}")
    elif isinstance(ours, EnumValue):
        assert isinstance(real, enum.Enum) and ours.value == real.value, where
        assert ours.qualified_name == f"{type(real).__module__}.{type(real).__qualname__}", where
    elif isinstance(ours, dict):
        assert isinstance(real, dict) and len(ours) == len(real), where
        for (key, value), (real_key, real_value) in zip(ours.items(), real.items()):
            assert_same_as_unpickled(key, real_key, f"{where} key {real_key!r}")
            assert_same_as_unpickled(value, real_value, f"{where}[{real_key!r}]")
    elif isinstance(ours, (list, tuple)):
        assert type(ours) is type(real) and len(ours) == len(real), (where, ours, real)
        for i, (a, b) in enumerate(zip(ours, real)):
            assert_same_as_unpickled(a, b, f"{where}[{i}]")
    else:   # str, int, bool, None, torch.dtype / layout / memory_format, a path
        assert ours == real, (where, ours, real)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dcp")
    torch.manual_seed(0)
    state = {"w": torch.randn(4, 3), "b": torch.randn(5).bfloat16(), "h": torch.ones(2, 2).half(),
             "i": torch.arange(3), "extra": io.BytesIO(b"not a tensor"), "step": 7}
    written = dcp.save(state, checkpoint_id=directory)
    return directory, state, written


def test_torch_dcp_metadata_parses_to_what_pickle_builds(saved):
    directory, state, written = saved
    ours = read_metadata(directory / ".metadata")
    assert_same_as_unpickled(ours, written)
    assert_same_as_unpickled(ours, unpickled(directory / ".metadata"))
    kinds = {k: type(v).__name__ for k, v in ours.state_dict_metadata.items()}
    assert kinds == {"w": "TensorStorageMetadata", "b": "TensorStorageMetadata",
                     "h": "TensorStorageMetadata", "i": "TensorStorageMetadata",
                     "extra": "BytesStorageMetadata", "step": "BytesStorageMetadata"}
    assert ours.state_dict_metadata["b"].properties.dtype is torch.bfloat16
    assert type(ours.state_dict_metadata["w"].size) is torch.Size

    reader = DCPReader(directory)
    assert reader.tensor_shapes() == {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}
    for key in ("w", "b", "h", "i"):
        full = reader.full_tensor(key)
        assert full.dtype == state[key].dtype and torch.equal(full, state[key])


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_plain_data_of_every_protocol(tmp_path, protocol):
    """The opcodes of each protocol (PUT/GET or MEMOIZE, INT/LONG or BININT*, bytes as
    ``_codecs.encode`` before protocol 3, OrderedDict, sets) give back the data and its sharing."""
    shared = [1, -2, 2**40, -2**70, 1.5, None, True, False]
    data = {"a": shared, "again": shared, "b": (b"\x00\xff", "\u00fc\n", ()), "c": OrderedDict(x=(1,)),
            "t": (1, 2, 3, 4), "n": {1: {"deep": [[]]}}}
    if protocol >= 4:   # older protocols spell sets as a call of builtins.set, refused
        data["s"], data["f"] = {1, 2}, frozenset({3})
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    ours = read_metadata(path)
    assert ours == data and type(ours["c"]) is OrderedDict and type(ours["b"][0]) is bytes
    assert ours["a"] is ours["again"]


def _stack_global(module: str, name: str) -> bytes:
    """Protocol 4: push ``module`` and ``name``, STACK_GLOBAL."""
    return (b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)])
            + name.encode() + b"\x93")


def _call(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle of ``module.name(argument)`` (STACK_GLOBAL, TUPLE1, REDUCE)."""
    return (b"\x80\x04" + _stack_global(module, name) + b"\x8c" + bytes([len(argument)])
            + argument.encode() + b"\x85R.")


@pytest.mark.parametrize("payload", ["os.system, protocol 0", "builtins.eval", "sentinel module",
                                     "unknown class", "getattr dtype"])
def test_unknown_globals_refused_before_anything_is_imported(tmp_path, monkeypatch, payload):
    marker = tmp_path / "ran"
    sentinel = "hybrid_sentinel_never_imported"
    (tmp_path / f"{sentinel}.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef boom(x): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data, name = {
        "os.system, protocol 0": (b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.", "os.system"),
        "builtins.eval": (_call("builtins", "eval", f"open({str(marker)!r}, 'w')"), "builtins.eval"),
        "sentinel module": (_call(sentinel, "boom", "x"), f"{sentinel}.boom"),
        "unknown class": (_call("collections", "Counter", "abc"), "collections.Counter"),
        "getattr dtype": (_call("builtins", "getattr", "float32"), "builtins.getattr"),
    }[payload]
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    modules = set(sys.modules)
    with pytest.raises(ForbiddenPickleError) as err:
        read_metadata(path)
    assert f"names {name}," in str(err.value) and str(path) in str(err.value)
    assert "refusing the file" in str(err.value)
    assert set(sys.modules) == modules and sentinel not in sys.modules
    assert not marker.exists()


@pytest.mark.parametrize("body, what", [
    # an allowed class called as a function, and a state built onto a dict
    (_stack_global("torch.distributed.checkpoint.metadata", "Metadata") + b")R", r"calls \(REDUCE\) torch.distributed"),
    (b"}}b", "applies the pickle opcode BUILD to a dict"),
    (b"\x82\x01", "opcode EXT1"),                       # the extension registry (copyreg)
    (b"(ios\npath\n", "opcode INST"),                  # protocol 0 construction by name
    (b"\x8c\x01x\x94Q", "opcode BINPERSID"),            # persistent ids: the loader's own hook
    (_stack_global("torch.distributed.checkpoint.metadata", "Metadata") + b")}\x92",
     "opcode NEWOBJ_EX"),
], ids=["class called", "BUILD on a dict", "EXT1", "INST", "BINPERSID", "NEWOBJ_EX"])
def test_opcodes_beyond_plain_data_refused(tmp_path, body, what):
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x04" + body + b".")
    with pytest.raises(ForbiddenPickleError, match=what):
        read_metadata(path)


def test_malformed_and_truncated_files_are_one_clear_error(saved, tmp_path):
    whole = (saved[0] / ".metadata").read_bytes()
    for name, data, expected in [("truncated", whole[: len(whole) // 2], "truncated"),
                                 ("empty", b"", "truncated"),
                                 ("no opcode", b"\x80\x04\xff.", r"opcode b'\\xff' unknown"),
                                 ("underflow", b"\x80\x04t.", "no MARK"),
                                 ("bad memo", b"\x80\x04h\x07.", "memo entry 7")]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=expected) as err:
            read_metadata(path)
        assert not isinstance(err.value, ForbiddenPickleError) and str(path) in str(err.value)


def test_metadata_that_is_not_a_tensors_is_one_clear_error(tmp_path):
    bad = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size="3x4", chunks=[])
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata({"w": bad}, storage_data={})))
    with pytest.raises(CheckpointError, match="the entry of w is not a tensor's metadata"):
        DCPReader(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}, "storage_data": {}}))
    with pytest.raises(CheckpointError, match="does not hold torch.distributed.checkpoint metadata"):
        DCPReader(tmp_path)
