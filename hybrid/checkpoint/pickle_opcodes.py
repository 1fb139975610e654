"""Read a pickle as data, without unpickling it (security review: no unpickling of checkpoint files).

A pickle is a program for a stack machine whose instructions can import any module and call any
function the file names. This module never runs that program: :func:`opcodes` splits the file
into opcodes and decodes their arguments (bytes to ints, floats, strings; nothing else) and
:func:`parse` interprets the few opcodes that plain data needs - numbers, strings, bytes, tuples, lists, dicts,
sets, the memo - building Python values itself. The classes and functions a file names (``GLOBAL``
/ ``STACK_GLOBAL``) are looked up, by their qualified name, in a fixed table the caller passes
(e.g. DCP's in :mod:`hybrid.checkpoint.dcp_reader`); each entry says what to build here:

    Constant(value)           the value itself (e.g. a ``torch.dtype`` such as ``torch.float32``)
    RecordType(name, ...)     ``NEWOBJ`` -> an inert :class:`Record` under that name, whose fields
                              ``BUILD`` sets from a dict (or a tuple, through a fixed function)
    EnumType(name, values)    ``REDUCE(n)`` -> an :class:`EnumValue`, ``n`` one of ``values``
    Function(name, build)     ``REDUCE(args)`` -> ``build(*args)``, a function of the table (never
                              one the file names), e.g. ``torch.Size`` from a tuple of ints

Nothing is imported or called by name: a global outside the table, an opcode outside the handled
set (``INST``, ``OBJ``, ``PERSID``, ``EXT*``, ``NEWOBJ_EX``, out-of-band buffers ...) or an opcode
applied to the wrong kind of value (``BUILD`` on a dict, ``SETITEMS`` on a record ...) refuses the
file with :class:`~hybrid.checkpoint.foreign_files.ForbiddenPickleError` naming it; a truncated or
malformed file with :class:`~hybrid.checkpoint.format.CheckpointError`.
"""

from __future__ import annotations

import reprlib
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hybrid.checkpoint.foreign_files import ForbiddenPickleError
from hybrid.checkpoint.format import CheckpointError

HIGHEST_PROTOCOL = 5


class Record:
    """An inert stand-in for an object of an allowed class: the class's qualified name
    (``type(r).qualified_name``) and the fields the file gave, as attributes. Hashable by
    identity (DCP uses ``MetadataIndex`` objects as dict keys)."""

    qualified_name = "?"

    @reprlib.recursive_repr()
    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True)
class EnumValue:
    """A member of an allowed enum, by its value (``WriteItemType(2)``)."""

    qualified_name: str
    value: int


@dataclass(frozen=True)
class Constant:
    value: object


@dataclass(frozen=True)
class Function:
    """``REDUCE`` builds ``build(*args)``; ``build`` checks its arguments' types itself."""

    qualified_name: str
    build: Callable


@dataclass(frozen=True)
class EnumType:
    qualified_name: str
    values: frozenset

    def build(self, *args):
        if len(args) != 1 or type(args[0]) is not int or args[0] not in self.values:
            raise ValueError(f"{self.qualified_name}{args!r} is not one of its values {sorted(self.values)}")
        return EnumValue(self.qualified_name, args[0])


class RecordType:
    """``NEWOBJ`` of this class makes a :class:`Record` subclass instance with ``defaults`` as its
    fields; ``BUILD`` with a dict updates them, with a tuple goes through ``from_tuple`` (a
    ``__setstate__`` of the real class, redone here: tuple -> field dict)."""

    def __init__(self, qualified_name: str, defaults: Mapping[str, object] | None = None,
                 from_tuple: Callable[[tuple], dict] | None = None):
        self.qualified_name, self.defaults, self.from_tuple = qualified_name, dict(defaults or {}), from_tuple
        self.cls = type(qualified_name.rpartition(".")[2], (Record,), {"qualified_name": qualified_name})

    def new(self) -> Record:
        record = self.cls()
        vars(record).update(self.defaults)
        return record


# The opcodes, by byte (the pickle format, protocols 0-5). Each handled one's argument is read by
# the named reader below; an opcode without a reader is still named (so a refusal can name it)
# and its argument is never read: :class:`_Machine` refuses it first.
_OPCODES = {
    b"(": ("MARK", None), b".": ("STOP", None), b"0": ("POP", None), b"1": ("POP_MARK", None),
    b"2": ("DUP", None), b"F": ("FLOAT", "float_line"), b"I": ("INT", "int_line"),
    b"J": ("BININT", "s4"), b"K": ("BININT1", "u1"), b"L": ("LONG", "long_line"),
    b"M": ("BININT2", "u2"), b"N": ("NONE", None), b"P": ("PERSID", None),
    b"Q": ("BINPERSID", None), b"R": ("REDUCE", None), b"S": ("STRING", None),
    b"T": ("BINSTRING", None), b"U": ("SHORT_BINSTRING", None), b"V": ("UNICODE", "text_line"),
    b"X": ("BINUNICODE", "text4"), b"a": ("APPEND", None), b"b": ("BUILD", None),
    b"c": ("GLOBAL", "global_lines"), b"d": ("DICT", None), b"}": ("EMPTY_DICT", None),
    b"e": ("APPENDS", None), b"g": ("GET", "int_line"), b"h": ("BINGET", "u1"),
    b"i": ("INST", None), b"j": ("LONG_BINGET", "u4"), b"l": ("LIST", None),
    b"]": ("EMPTY_LIST", None), b"o": ("OBJ", None), b"p": ("PUT", "int_line"),
    b"q": ("BINPUT", "u1"), b"r": ("LONG_BINPUT", "u4"), b"s": ("SETITEM", None),
    b"t": ("TUPLE", None), b")": ("EMPTY_TUPLE", None), b"u": ("SETITEMS", None),
    b"G": ("BINFLOAT", "f8"), b"\x80": ("PROTO", "u1"), b"\x81": ("NEWOBJ", None),
    b"\x82": ("EXT1", None), b"\x83": ("EXT2", None), b"\x84": ("EXT4", None),
    b"\x85": ("TUPLE1", None), b"\x86": ("TUPLE2", None), b"\x87": ("TUPLE3", None),
    b"\x88": ("NEWTRUE", None), b"\x89": ("NEWFALSE", None), b"\x8a": ("LONG1", "long1"),
    b"\x8b": ("LONG4", "long4"), b"B": ("BINBYTES", "bytes4"), b"C": ("SHORT_BINBYTES", "bytes1"),
    b"\x8c": ("SHORT_BINUNICODE", "text1"), b"\x8d": ("BINUNICODE8", "text8"),
    b"\x8e": ("BINBYTES8", "bytes8"), b"\x8f": ("EMPTY_SET", None), b"\x90": ("ADDITEMS", None),
    b"\x91": ("FROZENSET", None), b"\x92": ("NEWOBJ_EX", None), b"\x93": ("STACK_GLOBAL", None),
    b"\x94": ("MEMOIZE", None), b"\x95": ("FRAME", "u8"), b"\x96": ("BYTEARRAY8", None),
    b"\x97": ("NEXT_BUFFER", None), b"\x98": ("READONLY_BUFFER", None),
}
_FIXED = {"u1": "<B", "u2": "<H", "s4": "<i", "u4": "<I", "u8": "<Q", "f8": ">d"}
_SIZED = {"text1": ("<B", "text"), "text4": ("<I", "text"), "text8": ("<Q", "text"),
          "bytes1": ("<B", "bytes"), "bytes4": ("<I", "bytes"), "bytes8": ("<Q", "bytes"),
          "long1": ("<B", "long"), "long4": ("<i", "long")}


class _Reader:
    """A cursor over the file's bytes; every read past the end is a ValueError."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(f"an argument at byte {self.pos} is cut short")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise ValueError(f"a text argument at byte {self.pos} has no end of line")
        out = self.data[self.pos:end].decode("latin-1")
        self.pos = end + 1
        return out

    def arg(self, kind: str):
        if kind in _FIXED:
            fmt = _FIXED[kind]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if kind in _SIZED:
            fmt, what = _SIZED[kind]
            raw = self.take(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])
            return {"text": lambda: raw.decode("utf-8", "surrogatepass"), "bytes": lambda: raw,
                    "long": lambda: int.from_bytes(raw, "little", signed=True)}[what]()
        text = self.line()
        if kind == "int_line":   # protocol 0 writes True / False as I01 / I00
            return text == "01" if text in ("00", "01") else int(text)
        if kind == "long_line":
            return int(text[:-1] if text.endswith("L") else text)
        if kind == "float_line":
            return float(text)
        if kind == "text_line":
            return text.encode("latin-1").decode("raw-unicode-escape")
        return f"{text} {self.line()}"   # global_lines: "module name"


def opcodes(data: bytes):
    """(name, argument) of each opcode of ``data`` up to and including STOP."""
    reader = _Reader(data)
    while True:
        byte = reader.take(1)
        if byte not in _OPCODES:
            raise ValueError(f"at position {reader.pos - 1}, opcode {byte!r} unknown")
        name, kind = _OPCODES[byte]
        yield name, reader.arg(kind) if kind is not None else None
        if name == "STOP":
            return


Global = Constant | Function | EnumType | RecordType
_MARK = object()       # the MARK opcode's entry on the stack
_PUSH_ARG = {"BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4", "BINFLOAT", "FLOAT",
             "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINBYTES",
             "BINBYTES", "BINBYTES8"}
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


class _Machine:
    """The pickle machine's stack (MARK is an entry on it) and memo, holding only values built here."""

    def __init__(self, table: Mapping[str, Global], label: str):
        self.table, self.label = table, label
        self.stack: list = []
        self.memo: dict[int, object] = {}

    def refuse(self, what: str) -> ForbiddenPickleError:
        return ForbiddenPickleError(
            f"{self.label} {what}; refusing the file (it is read as data, never unpickled: nothing "
            f"in it was imported or run; docs/checkpoints.md, From Megatron-LM and DCP interop)")

    def pop(self):
        if not self.stack or self.stack[-1] is _MARK:
            raise ValueError("stack underflow")
        return self.stack.pop()

    def pop_mark(self) -> list:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1:]
                del self.stack[i:]
                return items
        raise ValueError("no MARK on the stack")

    def top(self, kinds: type | tuple, op: str):
        if not self.stack or self.stack[-1] is _MARK:
            raise ValueError(f"{op} on an empty stack")
        target = self.stack[-1]
        if not isinstance(target, kinds):
            raise self.refuse(f"applies the pickle opcode {op} to a {type(target).__name__}")
        return target

    def lookup(self, qualified: str) -> Global:
        entry = self.table.get(qualified)
        if entry is None:
            raise self.refuse(f"names {qualified}, which is not one of the classes and functions a "
                              f"checkpoint's metadata holds")
        return entry

    def step(self, name: str, arg) -> None:
        """Apply one opcode (``arg``: its argument as :func:`opcodes` decoded it)."""
        stack = self.stack
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _CONSTANTS:
            stack.append(_CONSTANTS[name])
        elif name == "MARK":
            stack.append(_MARK)
        elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET"):
            stack.append({"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_SET": set}[name]())
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = [self.pop() for _ in range(n)][::-1]
            stack.append(tuple(items))
        elif name == "TUPLE":
            stack.append(tuple(self.pop_mark()))
        elif name == "LIST":
            stack.append(self.pop_mark())
        elif name == "FROZENSET":
            stack.append(frozenset(self.pop_mark()))
        elif name == "DICT":
            items = self.pop_mark()
            stack.append(dict(zip(items[::2], items[1::2])))
        elif name == "APPEND":
            value = self.pop()
            self.top(list, name).append(value)
        elif name == "APPENDS":
            items = self.pop_mark()
            self.top(list, name).extend(items)
        elif name == "ADDITEMS":
            items = self.pop_mark()
            self.top(set, name).update(items)
        elif name == "SETITEM":
            value, key = self.pop(), self.pop()
            self.top(dict, name)[key] = value
        elif name == "SETITEMS":
            items = self.pop_mark()
            if len(items) % 2:
                raise ValueError("SETITEMS with an odd number of items")
            self.top(dict, name).update(zip(items[::2], items[1::2]))
        elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            if not stack or stack[-1] is _MARK:
                raise ValueError(f"{name} on an empty stack")
            self.memo[len(self.memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise ValueError(f"{name} of memo entry {arg}, which was never stored")
            stack.append(self.memo[arg])
        elif name == "POP":
            stack.pop() if stack and stack[-1] is _MARK else self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(self.top(object, name))
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = arg.partition(" ")
            else:
                attr, module = self.pop(), self.pop()
                if type(module) is not str or type(attr) is not str:
                    raise ValueError("STACK_GLOBAL of names that are not strings")
            entry = self.lookup(f"{module}.{attr}")
            stack.append(entry.value if isinstance(entry, Constant) else entry)
        elif name == "REDUCE":
            args, func = self.pop(), self.pop()
            if not isinstance(func, (Function, EnumType)):
                raise self.refuse(f"calls (REDUCE) {_describe(func)}")
            if type(args) is not tuple:
                raise ValueError(f"REDUCE of {func.qualified_name} with arguments that are not a tuple")
            stack.append(func.build(*args))
        elif name == "NEWOBJ":
            args, cls = self.pop(), self.pop()
            if not isinstance(cls, RecordType):
                raise self.refuse(f"makes an object (NEWOBJ) of {_describe(cls)}")
            if args != ():
                raise self.refuse(f"makes a {cls.qualified_name} with arguments {args!r}")
            stack.append(cls.new())
        elif name == "BUILD":
            state = self.pop()
            record = self.top(Record, name)
            self._build(record, state)
        else:
            raise self.refuse(f"uses the pickle opcode {name}, which a checkpoint's metadata does not need")

    def _build(self, record: Record, state) -> None:
        kind = type(record).qualified_name
        if type(state) is tuple:
            from_tuple = self.table[kind].from_tuple
            if from_tuple is None:
                raise self.refuse(f"gives {kind} a state tuple")
            state = from_tuple(state)
        if type(state) is not dict:
            raise self.refuse(f"gives {kind} a state of type {type(state).__name__}")
        for key in state:
            if type(key) is not str or not key.isidentifier() or key.startswith("__"):
                raise self.refuse(f"gives {kind} a field named {key!r}")
        vars(record).update(state)


def _describe(value) -> str:
    return getattr(value, "qualified_name", None) or f"a {type(value).__name__}"


def parse(data: bytes, table: Mapping[str, Global], label: str):
    """The value the pickle ``data`` describes, built from plain data and ``table`` alone.
    ``label`` names the file in errors."""
    machine = _Machine(table, label)
    try:
        for name, arg in opcodes(data):
            if name == "STOP":
                if len(machine.stack) != 1:
                    raise ValueError(f"STOP with {len(machine.stack)} values on the stack, not 1")
                return machine.stack[0]
            if name == "PROTO" and not 2 <= arg <= HIGHEST_PROTOCOL:
                raise ValueError(f"unsupported pickle protocol {arg}")
            if name not in ("PROTO", "FRAME"):   # FRAME only groups opcodes for buffered reads
                machine.step(name, arg)
    except CheckpointError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, UnicodeDecodeError) as err:
        # opcodes(): a byte that is no opcode, an argument cut short; the machine: stack misuse,
        # unhashable keys, a Function's argument check
        raise CheckpointError(f"{label} is not a well-formed pickle ({err}); is it truncated or "
                              f"damaged?") from None
