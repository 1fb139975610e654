"""Command line of ``launch/pretrain_gpt.py``: a YAML/TOML config file plus Megatron-named overrides.

Precedence: dataclass defaults < ``--config FILE`` (YAML, JSON or TOML, nested by section) < flags.
Every flag of ours is generated from a field of :mod:`pretrain.config` (``--tensor-model-parallel-size``
sets ``parallel.tensor_model_parallel_size``), so there is no field that cannot be set; its help
ends with its default. Booleans take ``--flag`` / ``--no-flag`` so a flag can undo a preset.
Megatron-LM's other flags are mapped onto these fields, accepted as no-ops or refused with their
meaning, as the catalogue :mod:`pretrain.megatron_flags` says. An unknown flag is an error that
suggests only a flag it is a typo or a prefix of.
A negative number is a flag's value (``--lr -1e-3``), which the section's check then judges.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import get_args, get_type_hints

import yaml

from pretrain import megatron_flags
from pretrain.config import SECTIONS, TrainConfig, TrainConfigError
from pretrain.sections import MODEL_DEFAULTS

PRESET_DIR = Path(__file__).resolve().parent / "presets"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml")
# A negative number as a flag's value: argparse's own test takes -1e-3 for a flag (no exponents).
_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf|-nan", re.IGNORECASE)


@dataclass
class LaunchOptions:
    """What to do with the config (not part of it, not stored in checkpoints)."""

    dry_run: bool = False
    dry_run_rank: int = 0


def load_config_file(path: str | Path) -> dict:
    """Read a nested ``{section: {key: value}}`` dict from ``.yaml``/``.yml``, ``.json`` or ``.toml``."""
    path = Path(path)
    if not path.is_file():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []
        what = "is not a file" if path.exists() else "does not exist"
        raise TrainConfigError(f"config file {str(path)!r} {what}; presets in {PRESET_DIR}: "
                               f"{', '.join(names)}")
    if path.suffix not in CONFIG_SUFFIXES:
        raise TrainConfigError(f"config file {str(path)!r} must end in .yaml, .yml, .json or .toml")
    try:
        data = _parse_config_text(path)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        kind = {".toml": "TOML", ".json": "JSON"}.get(path.suffix, "YAML")
        raise TrainConfigError(f"config file {str(path)!r} is not valid {kind}: "
                               f"{' '.join(str(err).split())}; fix the line it names") from None
    if not isinstance(data, dict):
        raise TrainConfigError(f"config file {str(path)!r} must hold a mapping of sections "
                               f"(model:, parallel:, ...), got {type(data).__name__}")
    return data


def _parse_config_text(path: Path):
    if path.suffix == ".toml":
        return tomllib.loads(path.read_text(encoding="utf-8"))
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def resolve_preset(name_or_path: str) -> Path:
    """A file path, or the name of a preset in pretrain/presets/ (``tiny-cpu`` -> tiny-cpu.yaml)."""
    path = Path(name_or_path)
    if path.suffix in CONFIG_SUFFIXES or path.is_file():
        return path
    return PRESET_DIR / f"{name_or_path}.yaml"


def _field_type(section_cls: type, name: str):
    return get_type_hints(section_cls)[name]


def _add_field_flag(group, section: str, f: dataclasses.Field, section_cls: type) -> None:
    hint = _field_type(section_cls, f.name)
    flag = "--" + f.name.replace("_", "-")
    text = f.metadata.get("help") or ""
    if "default:" not in text:   # the help that explains its default says it itself
        text += f" (default: {_default_text(section, f)})"
    kw = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS, help=text)
    if hint is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        if f.metadata.get("off_flag"):   # Megatron's spelling, e.g. --disable-bias-linear
            group.add_argument(f.metadata["off_flag"], action="store_false", dest=kw["dest"],
                               default=argparse.SUPPRESS, help=f"same as --no-{flag[2:]}")
    elif hint == list[str]:
        group.add_argument(flag, nargs="+", metavar="ITEM", **kw)
    elif list[int] in (hint, *get_args(hint)) or tuple[int, ...] in get_args(hint):
        # int | tuple[int, ...] (--moe-layer-freq): one value, or several (a 0/1 pattern)
        group.add_argument(flag, nargs="+", type=int, metavar="INT", **kw)
    else:
        base = next(t for t in (*get_args(hint), hint) if t in (int, float, str))  # X | None -> X
        group.add_argument(flag, type=base, metavar=base.__name__.upper(), **kw)


def _default_text(section: str, f: dataclasses.Field) -> str:
    if section == "model" and f.name in MODEL_DEFAULTS:
        value = MODEL_DEFAULTS[f.name]
    elif f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    text = "none" if value is None or value == [] else str(value)
    return text.replace("%", "%%")


class _Parser(argparse.ArgumentParser):
    """argparse that raises (one-line message) instead of printing usage and exiting."""

    def error(self, message: str):
        raise TrainConfigError(f"{message}; run with --help for the list of flags")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py", allow_abbrev=False,
        description="GPT pretraining with tensor parallelism x ZeRO data parallelism.")
    parser.add_argument("--config", help="YAML/JSON/TOML config file or a preset name in pretrain/presets/")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the layout at its full GPU count on this machine, no communication")
    parser.add_argument("--dry-run-rank", type=int, default=0, help="which rank --dry-run reports")
    for section, section_cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(section_cls):
            _add_field_flag(group, section, f, section_cls)
    megatron_flags.add_to_parser(parser)
    return parser


def _reject_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    known = [s for a in parser._actions for s in a.option_strings]
    msgs = []
    for arg in unknown:
        if not arg.startswith("-"):
            msgs.append(f"unexpected value {arg!r}")
            continue
        close = megatron_flags.suggest(arg.split("=")[0], known)
        msgs.append(f"unknown flag {arg!r}" + (f" (did you mean {close}?)" if close else ""))
    raise TrainConfigError("; ".join(msgs) + "; run with --help for the list of flags")


def _attach_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--flag -1e-3`` as ``--flag=-1e-3`` for each flag that takes one value, so argparse reads
    the number as the flag's value instead of as another flag."""
    takes_value = {s for a in parser._actions if a.nargs is None and a.option_strings
                   for s in a.option_strings}
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and _NEGATIVE_NUMBER.fullmatch(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, LaunchOptions]:
    """Parse ``argv`` into a validated :class:`TrainConfig` and the :class:`LaunchOptions`."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    ns, unknown = parser.parse_known_args(_attach_negative_values(parser, argv))
    if unknown:
        _reject_unknown(parser, unknown)
    nested = load_config_file(resolve_preset(ns.config)) if ns.config else {}
    for dest, value in vars(ns).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            if nested.get(section) is None:
                nested[section] = {}
            if isinstance(nested[section], dict):   # else TrainConfig.from_dict names the section
                nested[section][key] = value
    checks = megatron_flags.apply_flags(vars(ns), nested)
    cfg = TrainConfig.from_dict(nested)
    for check in checks:
        check(cfg)
    return cfg, LaunchOptions(dry_run=ns.dry_run, dry_run_rank=ns.dry_run_rank)
