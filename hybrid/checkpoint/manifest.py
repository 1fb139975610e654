"""Integrity manifest of a checkpoint directory: sha256 and byte size of every file.

Written last inside the directory (before the directory is renamed into place) and checked on load,
so a truncated shard, a flipped bit or a missing file is reported by name instead of surfacing as a
wrong loss curve.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from hybrid.checkpoint.format import FORMAT_VERSION, MANIFEST_FILE, CheckpointError

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_json_durably(path: Path, obj) -> None:
    """Write JSON to a temporary name, fsync, rename: readers see the old or the new file, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_manifest(directory: Path, entries: dict[str, dict]) -> None:
    """``entries``: file name -> {"sha256", "bytes"}; every other file of the directory must be
    listed."""
    present = {p.name for p in directory.iterdir() if p.name != MANIFEST_FILE}
    unlisted = present - set(entries)
    if unlisted:
        raise CheckpointError(f"files {sorted(unlisted)} in {directory} have no manifest entry")
    write_json_durably(directory / MANIFEST_FILE, {"format_version": FORMAT_VERSION, "files": entries})


def read_manifest(directory: Path) -> dict[str, dict]:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST_FILE}: it is not a complete checkpoint "
                              f"(an interrupted save?); load an earlier iteration directory")
    with open(path) as f:
        manifest = json.load(f)
    version = manifest.get("format_version", 0)
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{directory} was written with checkpoint format {version}, newer than "
                              f"this code's {FORMAT_VERSION}; update the code to load it")
    return manifest["files"]


def verify_files(directory: Path, entries: dict[str, dict], names: list[str] | None = None, *,
                 hashes: bool = True) -> None:
    """Check size (and sha256 unless ``hashes=False``) of ``names`` (default: all) against the
    manifest."""
    for name in names if names is not None else sorted(entries):
        if name not in entries:
            raise CheckpointError(f"{directory / name} is not listed in the manifest")
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"missing shard {path} (listed in the manifest); the checkpoint is "
                                  f"incomplete - copy the file back or load another iteration")
        expected = entries[name]
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"truncated shard {path}: {size} bytes, the manifest says "
                                  f"{expected['bytes']}; the copy is incomplete - copy it again or "
                                  f"load another iteration")
        if hashes and sha256_file(path) != expected["sha256"]:
            raise CheckpointError(f"hash mismatch for {path}: the file is corrupted (sha256 differs "
                                  f"from the manifest); copy it again or load another iteration")
