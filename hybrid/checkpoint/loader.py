"""Checkpoint reader with resharding: load at any TP/DP degree and ZeRO stage (docs/design.md §8).

:class:`CheckpointReader` verifies the manifest, reads the piece index of every rank file (safetensors
headers only), and fills *target* pieces - the ranges the loading rank owns in its own layout:

    saved pieces of (kind, name)  --per saved tp_rank-->  flat TP-local buffers (coverage checked)
        --concat along partition_dim-->  canonical full tensor  --pad/trim vocab padding-->
        --slice for the target tp_rank, flatten-->  copy [offset, offset + numel) into the target

Expert tensors (issue 32) are assembled per saved EP rank the same way, then concatenated along
dim 0 (the experts), and sliced for the target's EP rank before its TP shard: a checkpoint saved at
EP 2 loads at EP 1 or 4.

When the loading layout has the saved TP degree (a resume, or a change of DP degree or ZeRO stage
only) a rank reads just the byte ranges that overlap what it owns, with ``safe_open(...).get_slice``.
Otherwise one parameter is assembled at a time, so peak extra memory is one full parameter.
Integrity - no byte is used before its hash is checked: every file's size is checked up front, the
metadata's sha256 before it is parsed, each rank file's safetensors header (its piece index) against
its own manifest hash before it is parsed, and the whole rank file's sha256 before the first tensor
is read from it (``verify="lazy"``; ``"all"`` hashes everything at once). Every file must name the
same run (``run_id``) as the manifest. Nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid.checkpoint.format import (FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, METADATA_FILE,
                                      CheckpointError, Piece, expert_shape, local_shape)
from hybrid.checkpoint.manifest import read_manifest, read_verified_header, verify_files

log = logging.getLogger(__name__)


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """``path`` is a save directory (its ``latest`` is used) or one ``iter_*`` directory."""
    path = Path(path)
    if (path / LATEST_FILE).is_file():
        name = (path / LATEST_FILE).read_bytes().decode(errors="replace").strip()
        if not name.startswith("iter_") or Path(name).name != name:
            raise CheckpointError(f"{path / LATEST_FILE} names {name[:80]!r}, not an iteration "
                                  f"directory of {path}; it was edited or corrupted - load an iter_* "
                                  f"directory of {path} directly")
        return path / name
    if (path / METADATA_FILE).is_file() or path.name.startswith("iter_"):
        return path
    raise CheckpointError(f"{path} holds no checkpoint (no '{LATEST_FILE}' marker and no "
                          f"{METADATA_FILE}); check --load")


class CheckpointReader:
    def __init__(self, path: str | Path, verify: str = "lazy"):
        self.directory = resolve_checkpoint_dir(path)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist; "
                                  f"'{LATEST_FILE}' points to a deleted checkpoint")
        if verify not in ("lazy", "all", "none"):
            raise ValueError(f"verify must be 'lazy', 'all' or 'none', got {verify!r}")
        manifest = read_manifest(self.directory)
        entries = self._manifest = manifest["files"]
        self._verify = verify
        if verify != "none":
            verify_files(self.directory, entries, hashes=verify == "all")
            verify_files(self.directory, entries, [METADATA_FILE])
        self._verified: set[str] = set(entries) if verify != "lazy" else {METADATA_FILE}
        self.metadata = self._read_metadata()
        if self.metadata.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{self.directory} uses checkpoint format "
                                  f"{self.metadata['format_version']}, newer than {FORMAT_VERSION}; "
                                  f"update the code to load it")
        self._rank_files = sorted(n for n in entries if n.startswith("rank_"))
        self._index: dict[tuple[str, str], list[dict]] = defaultdict(list)
        self._extra: dict[int, dict[str, tuple[str, str]]] = defaultdict(dict)
        run_ids = {MANIFEST_FILE: manifest.get("run_id"), METADATA_FILE: self.metadata.get("run_id")}
        run_ids.update(self._read_headers())
        self._check_one_run(run_ids)
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def _read_metadata(self) -> dict:
        try:
            with open(self.directory / METADATA_FILE) as f:
                metadata = json.load(f)
            if isinstance(metadata, dict):
                return metadata
        except (OSError, ValueError):
            pass
        raise CheckpointError(f"{self.directory / METADATA_FILE} is not a readable JSON object; load "
                              f"another iteration")

    def _read_headers(self) -> dict[str, str | None]:
        """Index every rank file's pieces from its verified header; returns each file's run id."""
        run_ids = {}
        for fname in self._rank_files:
            header = read_verified_header(self.directory, fname, self._manifest[fname],
                                          check=self._verify != "none")
            meta = header["__metadata__"]
            run_ids[fname] = meta.get("run_id")
            for entry in json.loads(meta["pieces"]):
                entry["file"] = fname
                self._index[(entry["kind"], entry["name"])].append(entry)
            for key in header:
                if key.startswith("extra:"):
                    self._extra[int(meta["rank"])][key[len("extra:"):]] = (fname, key)
        return run_ids

    def _check_one_run(self, run_ids: dict[str, str | None]) -> None:
        """Files of two runs in one checkpoint (two jobs shared a --save): refuse, naming them."""
        by_run = defaultdict(list)
        for fname, run_id in run_ids.items():
            by_run[run_id].append(fname)
        if len(by_run) > 1:
            parts = "; ".join(f"{', '.join(sorted(files)[:3])}{' ...' if len(files) > 3 else ''} "
                              f"from run {run_id or '(none)'}" for run_id, files in by_run.items())
            raise CheckpointError(f"{self.directory} mixes files of different runs ({parts}): two "
                                  f"jobs wrote into one --save; load another iteration")

    @property
    def run_id(self) -> str | None:
        """The run that wrote this checkpoint (None: written before checkpoints named their run)."""
        return self.metadata.get("run_id")

    def _read(self, fname: str, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor ``key`` of rank file ``fname`` (elements [lo, hi) of it if given), hash-checked
        the first time this file is read."""
        if fname not in self._verified:
            verify_files(self.directory, self._manifest, [fname])
            self._verified.add(fname)
        with safe_open(str(self.directory / fname), framework="pt") as f:
            return f.get_tensor(key) if lo is None else f.get_slice(key)[lo:hi]

    # ---- queries -----------------------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, name) in self._index if k == kind)

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self._index

    def extra(self, rank: int) -> dict[str, torch.Tensor]:
        """Per-rank extra tensors (RNG states) written by ``rank``."""
        return {name: self._read(fname, key)
                for name, (fname, key) in self._extra.get(rank, {}).items()}

    # ---- assembly ----------------------------------------------------------------------------
    def full_tensor(self, kind: str, name: str) -> torch.Tensor:
        """The canonical (TP-unsharded) tensor of one parameter, assembled from all pieces."""
        if self._cache is not None and self._cache[0] == (kind, name):
            return self._cache[1]
        entries = self._entries(kind, name)
        first = entries[0]
        full_shape, pdim, tp = tuple(first["full_shape"]), first["partition_dim"], first["tp_size"]
        ep = first.get("ep_size", 1)   # experts: dim 0 split over EP first (issue 32)
        shape = local_shape(expert_shape(full_shape, ep), pdim, tp)
        numel = torch.Size(shape).numel()
        ranks = [(x, t) for x in range(ep) for t in (range(tp) if pdim >= 0 else range(1))]
        buffers = {r: torch.empty(numel, dtype=getattr(torch, first["dtype"])) for r in ranks}
        covered = {r: torch.zeros(numel, dtype=torch.bool) for r in ranks}
        for e in entries:
            r = (e.get("ep_rank", 0), e["tp_rank"] if pdim >= 0 else 0)
            lo, hi = e["offset"], e["offset"] + e["numel"]
            buffers[r][lo:hi] = self._read(e["file"], _key(e))
            covered[r][lo:hi] = True
        for (x, t), mask in covered.items():
            if not bool(mask.all()):
                missing = int((~mask).sum())
                where = f"TP rank {t} of {tp}" + (f", EP rank {x} of {ep}" if ep > 1 else "")
                raise CheckpointError(f"missing shard: {kind} of {name!r} ({where}) lacks "
                                      f"{missing} of {numel} elements in {self.directory}; a rank file "
                                      f"is missing from the checkpoint")
        per_ep = []
        for x in range(ep):
            parts = [buffers[r].view(shape) for r in ranks if r[0] == x]
            per_ep.append(torch.cat(parts, dim=pdim) if pdim >= 0 else parts[0])
        full = torch.cat(per_ep, dim=0) if ep > 1 else per_ep[0]
        self._cache = ((kind, name), full)
        return full

    def _entries(self, kind: str, name: str) -> list[dict]:
        entries = self._index.get((kind, name))
        if not entries:
            raise CheckpointError(f"checkpoint {self.directory} has no {kind} state for parameter "
                                  f"{name!r}; the model has a parameter the checkpoint lacks (other "
                                  f"model dims?)")
        return entries

    def fill(self, target: Piece) -> None:
        """Copy the saved values of ``target``'s range (in the target layout) into ``target.tensor``."""
        first = self._entries(target.kind, target.name)[0]
        if (first["tp_size"] == target.tp_size and first["partition_dim"] == target.partition_dim
                and tuple(first["full_shape"]) == target.full_shape
                and first.get("ep_size", 1) == target.ep_size):
            self._fill_same_tp(target)
            return
        saved_rows = self._index[(target.kind, target.name)][0].get("valid_rows") \
            if (target.kind, target.name) in self._index else None
        full = _fit_shape(self.full_tensor(target.kind, target.name), target, saved_rows,
                          self.directory)
        if target.ep_size > 1:   # this EP rank's experts, then its TP shard of them
            full = full.narrow(0, *_ep_range(full.shape[0], target))
        if target.partition_dim >= 0:
            local = full.chunk(target.tp_size, dim=target.partition_dim)[target.tp_rank]
        else:
            local = full
        flat = local.reshape(-1)
        n = target.tensor.numel()
        if target.offset + n > flat.numel():
            raise CheckpointError(f"{target.kind} range [{target.offset}, {target.offset + n}) of "
                                  f"{target.name!r} exceeds its {flat.numel()} elements")
        with torch.no_grad():
            target.tensor.view(-1).copy_(flat[target.offset:target.offset + n])


    def _fill_same_tp(self, target: Piece) -> None:
        """Same TP layout: read only the overlapping ranges of this TP rank's saved pieces."""
        t = target.tp_rank if target.partition_dim >= 0 else 0   # replicated: saved by TP rank 0
        lo_t, n = target.offset, target.tensor.numel()
        out = target.tensor.view(-1)
        covered = torch.zeros(n, dtype=torch.bool)
        for e in self._entries(target.kind, target.name):
            lo, hi = max(lo_t, e["offset"]), min(lo_t + n, e["offset"] + e["numel"])
            if e["tp_rank"] != t or e.get("ep_rank", 0) != target.ep_rank or lo >= hi:
                continue
            with torch.no_grad():
                out[lo - lo_t:hi - lo_t].copy_(self._read(e["file"], _key(e), lo - e["offset"],
                                                          hi - e["offset"]))
            covered[lo - lo_t:hi - lo_t] = True
        if not bool(covered.all()):
            raise CheckpointError(f"missing shard: {target.kind} of {target.name!r} (TP rank {t} of "
                                  f"{target.tp_size}) lacks {int((~covered).sum())} of the {n} "
                                  f"elements this rank needs in {self.directory}; a rank file is "
                                  f"missing from the checkpoint")


def _key(entry: dict) -> str:
    ep = f":ep{entry['ep_rank']}" if entry.get("ep_size", 1) > 1 else ""
    return f"{entry['kind']}:{entry['name']}:tp{entry['tp_rank']}{ep}:{entry['offset']}"


def _ep_range(experts: int, target: Piece) -> tuple[int, int]:
    """(first expert, count) that EP rank ``target.ep_rank`` of ``target.ep_size`` holds."""
    count = expert_shape((experts,), target.ep_size)[0]
    return target.ep_rank * count, count


def _fit_shape(full: torch.Tensor, target: Piece, saved_rows: int | None,
               directory: Path) -> torch.Tensor:
    """Reconcile saved and target full shapes. Only padding rows of dim 0 may differ (the vocab is
    padded to a multiple of 128 x TP): both sides must declare the same number of real rows; extra
    rows are zeros, padding never reaches the loss."""
    saved, wanted = tuple(full.shape), target.full_shape
    if saved == wanted:
        return full
    pdim = 0
    padding_only = (len(saved) == len(wanted) and saved[1:] == wanted[1:]
                    and target.valid_rows is not None and saved_rows == target.valid_rows
                    and target.valid_rows <= min(saved[0], wanted[0]))
    if not padding_only:
        raise CheckpointError(f"parameter {target.name!r} has shape {list(saved)} in {directory} but "
                              f"{list(wanted)} in this model: the model dims differ (num layers, hidden "
                              f"size, heads?); load with the config stored in the checkpoint")
    if wanted[pdim] < saved[pdim]:
        return full.narrow(pdim, 0, wanted[pdim])
    pad_shape = list(saved)
    pad_shape[pdim] = wanted[pdim] - saved[pdim]
    return torch.cat([full, full.new_zeros(pad_shape)], dim=pdim)
