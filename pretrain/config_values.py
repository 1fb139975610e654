"""Config-file values read as the types of the fields they set (docs/design.md §9).

A YAML/TOML preset or a checkpoint's stored config gives raw values; the command line is typed by
argparse already. YAML 1.1 (PyYAML) reads ``1e-3`` and ``5e6`` as strings because they lack a dot, so
a numeric string is accepted for a number field; anything else of the wrong type is refused with the
``section.key`` it came from and an example of a valid value, before any section checks its values.
"""

from __future__ import annotations

import math
from typing import get_args, get_type_hints

from pretrain.sections import TrainConfigError

_EXAMPLES = {bool: "true", int: "8", float: "0.001", str: "a string"}


def coerce_section(section: str, section_cls: type, values: dict) -> dict:
    """``values`` with every value converted to its field's type (or TrainConfigError)."""
    hints = get_type_hints(section_cls)
    return {key: coerce_value(f"{section}.{key}", hints[key], value) for key, value in values.items()}


def coerce_value(where: str, hint, value):
    optional = type(None) in get_args(hint)
    base = next((t for t in get_args(hint) if t is not type(None)), hint) if optional else hint
    if value is None:
        if optional:
            return None
        raise TrainConfigError(f"{where} has no value; give one (e.g. {_example(base)}) or remove "
                               f"the key to use the default")
    if base == list[str]:
        return _as_list(where, value)
    if base == list[int]:   # a YAML list, or '16 16 5859375'
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise _wrong(where, value, "a list of integers", "[16, 16, 5859375]")
        return [_as_int(where, v) for v in items]
    if tuple[int, ...] in get_args(base):   # int | tuple[int, ...]: N, [1, 0, 1] or '1 0 1'
        items = value.split() if isinstance(value, str) else value
        if isinstance(items, (list, tuple)):
            return tuple(_as_int(where, v) for v in items)
        return _as_int(where, items)
    convert = {bool: _as_bool, int: _as_int, float: _as_float, str: _as_str}[base]
    return convert(where, value)


def _example(base) -> str:
    return _EXAMPLES.get(base, "a list of strings")


def _wrong(where: str, value, kind: str, example: str) -> TrainConfigError:
    return TrainConfigError(f"{where} must be {kind}, got {value!r} ({type(value).__name__}); "
                            f"write e.g. {where.split('.', 1)[1]}: {example}")


def _as_bool(where: str, value):
    if isinstance(value, bool):
        return value
    raise _wrong(where, value, "true or false", "true")


def _as_int(where: str, value):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    number = _number(value)
    if number is not None and math.isfinite(number) and number.is_integer():
        return int(number)
    raise _wrong(where, value, "an integer", "8")


def _as_float(where: str, value):
    number = _number(value)
    if number is None:
        raise _wrong(where, value, "a number", "1.0e-3")
    return number


def _number(value) -> float | None:
    """``value`` as a float when it is a number or a numeric string (``"1e-3"``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _as_str(where: str, value):
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)   # e.g. host_memory_budget: 8000000000
    raise _wrong(where, value, "a string", "'969,30,1'" if where.endswith("split") else "text")


def _as_list(where: str, value):
    if isinstance(value, str):
        return value   # DataSection splits 'w1 prefix1 w2 prefix2'
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                       for v in value):
        return [str(v) for v in value]
    raise _wrong(where, value, "a list of strings", "[0.7, data/a, 0.3, data/b]")
