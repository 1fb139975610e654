"""Integrity manifest of a checkpoint directory: sha256 and byte size of every file.

Written last inside the directory (before the directory is renamed into place) and checked on load,
so a truncated shard, a flipped bit or a missing file is reported by name instead of surfacing as a
wrong loss curve. A rank file's entry also hashes its safetensors header (the 8-byte length and the
JSON piece index) on its own: a reader verifies the header before parsing it, and the rest of the
file before reading any tensor from it - no byte is used before its hash is checked. The manifest
is the root of trust; it also names the run that wrote the checkpoint (``run_id``).
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


def header_entry(path: Path) -> dict:
    """Size and sha256 of a safetensors file's header: the 8-byte length and the JSON after it."""
    with open(path, "rb") as f:
        head = f.read(8)
        header = head + f.read(int.from_bytes(head, "little"))
    return {"header_bytes": len(header), "header_sha256": hashlib.sha256(header).hexdigest()}


def read_verified_header(directory: Path, name: str, entry: dict, *, check: bool = True) -> dict:
    """The parsed safetensors header of rank file ``name``, its bytes checked against the manifest
    first (a manifest without header hashes: the whole file's hash is checked first)."""
    path = directory / name
    if not check:
        entry = {"bytes": entry["bytes"]}
    elif "header_sha256" not in entry:
        verify_files(directory, {name: entry}, [name])
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= length <= entry["bytes"] - 8:
            raise CheckpointError(f"corrupted header in {path}: it declares {length} header bytes in "
                                  f"a {entry['bytes']}-byte file; copy the file again or load "
                                  f"another iteration")
        header = head + f.read(length)
    if "header_sha256" in entry and (len(header) != entry["header_bytes"] or
                                     hashlib.sha256(header).hexdigest() != entry["header_sha256"]):
        raise CheckpointError(f"hash mismatch for the safetensors header of {path}: its piece index "
                              f"was altered or corrupted (sha256 differs from the manifest); copy "
                              f"the file again or load another iteration")
    try:
        parsed = json.loads(header[8:])
        metadata = parsed["__metadata__"]
        json.loads(metadata["pieces"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} has no readable piece index in its safetensors header; it "
                              f"was not written by this framework") from None
    return parsed


def write_manifest(directory: Path, entries: dict[str, dict], run_id: str | None = None) -> None:
    """``entries``: file name -> {"sha256", "bytes"[, "header_sha256", "header_bytes"]}; every other
    file of the directory must be listed. ``run_id``: the run that wrote the checkpoint."""
    present = {p.name for p in directory.iterdir() if p.name != MANIFEST_FILE}
    unlisted = present - set(entries)
    if unlisted:
        raise CheckpointError(f"files {sorted(unlisted)} in {directory} have no manifest entry")
    identity = {} if run_id is None else {"run_id": run_id}
    write_json_durably(directory / MANIFEST_FILE, {"format_version": FORMAT_VERSION, "files": entries,
                                                   **identity})


def read_manifest(directory: Path) -> dict:
    """The manifest: ``{"format_version", "files": {name: entry}[, "run_id"]}``, its shape checked."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST_FILE}: it is not a complete checkpoint "
                              f"(an interrupted save?); load an earlier iteration directory")
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        ok = all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                 and isinstance(e.get("bytes"), int) and Path(n).name == n not in ("", ".", "..")
                 for n, e in files.items())
        version = manifest.get("format_version", 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not a valid checkpoint manifest (corrupted or edited); "
                              f"load another iteration")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{directory} was written with checkpoint format {version}, newer than "
                              f"this code's {FORMAT_VERSION}; update the code to load it")
    return manifest


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
