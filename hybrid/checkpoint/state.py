"""The seam between checkpoints and what they save: one small state protocol (docs/design.md §8).

Whatever holds training state - a ZeRO engine (any stage, with or without offload) or, for
inference loading, the model itself - satisfies :class:`CheckpointState` structurally: it hands out
its state as :class:`~hybrid.zero.results.Fragment` rows (1-D views addressed by parameter name,
kind and element offset in the flattened TP-local parameter), takes them back after a load, and
says which of them every DP rank holds identically (only DP rank 0 writes those). Nothing here
asks a holder what it is: no stage numbers, no probing for attributes.

What a fragment does not say - where its TP-local parameter sits in the canonical full tensor - the
model says once, as a :class:`ParamLayout` per parameter name. Together they give the
:class:`~hybrid.checkpoint.format.Piece` rows the writer stores and the reader fills:

    holder.checkpoint_pieces()  x  layout[name]  -->  Piece(name, kind, full_shape, partition_dim,
                                                           tp_rank, tp_size, offset, tensor, valid_rows)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol

import torch

from hybrid.checkpoint.format import CheckpointError, Piece
from hybrid.checkpoint.loader import CheckpointReader
from hybrid.checkpoint.writer import agree_on_failure, save_checkpoint
from hybrid.parallel_state import ParallelState
from hybrid.zero.results import Fragment

COUNTERS_KEY = "optimizer"   # metadata.json key of the holder's counters (step count, loss scaler)


@dataclass(frozen=True)
class ParamLayout:
    """How one TP-local parameter sits in its full tensor (the TP model's layout, vocab padded)."""

    full_shape: tuple[int, ...]   # shape of the whole (TP-unsharded) parameter
    partition_dim: int            # dim split across TP, -1 if every TP rank holds all of it
    valid_rows: int | None = None  # rows of dim 0 that are real; the rest is padding (vocab)
    # an expert tensor (issue 32): ``full_shape`` holds every expert, dim 0 is split over the EP
    # group before TP splits ``partition_dim``, and its copies are replicated over expert-DP
    expert: bool = False


class CheckpointState(Protocol):
    """State pieces out, state pieces in, and which of them are replicated over DP."""

    @property
    def optimizer_state_replicated(self) -> bool:
        """Every DP rank holds the same fp32 master and moments (plain DP): DP rank 0 saves them."""

    @property
    def parameters_replicated(self) -> bool:
        """Every DP rank holds the whole parameters (all but ZeRO stage 3): DP rank 0 saves them."""

    @property
    def state_replica(self) -> int:
        """Which copy of the state it partitions over DP this rank holds: 0, except with hybrid
        sharding (one copy per host), where the ranks of copy 0 save the partitioned pieces."""

    def checkpoint_pieces(self) -> list[Fragment]:
        """Every piece of state this rank holds: kind ``model`` (the parameters as trained) and
        ``master`` / ``exp_avg`` / ``exp_avg_sq``; views, so a load may fill them in place."""

    def checkpoint_counters(self) -> dict:
        """JSON-able counters (optimizer step count, loss-scaler state)."""

    def load_checkpoint_pieces(self, pieces: list[Fragment], counters: dict) -> None:
        """Take the state of ``pieces`` (filled from a checkpoint) and ``counters``; collective over
        DP for engines (they rebuild and re-gather the parameters from the master)."""


def state_pieces(holder: CheckpointState, layout: Mapping[str, ParamLayout], state: ParallelState,
                 *, for_save: bool) -> list[Piece]:
    """``holder``'s pieces in the checkpoint's terms: all of them to load, those this rank writes to
    save (replicated state once: TP-replicated tensors from TP rank 0, DP-replicated from DP x CP
    rank 0)."""
    return [_piece(f, layout[f.param_name], state) for f in holder.checkpoint_pieces()
            if not for_save or _writes(holder, f.kind, layout[f.param_name], state)]


def _piece(fragment: Fragment, spec: ParamLayout, state: ParallelState) -> Piece:
    ep = _ep_group(state) if spec.expert else None
    return Piece(fragment.param_name, fragment.kind, spec.full_shape, spec.partition_dim,
                 state.tp_rank, state.tp_size, fragment.offset, fragment.tensor, spec.valid_rows,
                 *((ep.rank, ep.size) if ep is not None else ()))


def _ep_group(state: ParallelState):
    """The EP group (``state.ep``, issue 32), None when experts are not split."""
    ep = getattr(state, "ep", None)
    return ep if ep is not None and ep.size > 1 else None


def _writes(holder: CheckpointState, kind: str, layout: ParamLayout, state: ParallelState) -> bool:
    if layout.partition_dim < 0 and state.tp_rank != 0:
        return False
    replicated = holder.parameters_replicated if kind == "model" else holder.optimizer_state_replicated
    if replicated and layout.expert and _ep_group(state) is not None:
        return state.expert_dp.rank == 0   # each EP rank's experts: one copy per expert-DP group
    if not replicated and layout.expert:   # hybrid sharding: the expert class's own host copies
        return getattr(holder, "expert_state_replica", holder.state_replica) == 0
    # replicated over DP x CP (CP ranks hold the same model states as their DP rank's): once
    return state.dp_cp.rank == 0 if replicated else holder.state_replica == 0


def save_state(save_dir: str | Path, iteration: int, holder: CheckpointState,
               layout: Mapping[str, ParamLayout], state: ParallelState, *,
               extra: dict[str, torch.Tensor], metadata: dict, keep_last: int,
               run_id: str | None = None, replace_other_runs: bool = False,
               background=None) -> Path:
    """Collective over ``state.world``: write ``holder``'s state as the checkpoint of ``iteration``
    (``extra``: this rank's RNG states; ``metadata``: JSON-able, taken from rank 0; ``run_id`` and
    ``replace_other_runs``: see :func:`hybrid.checkpoint.writer.save_checkpoint`). ``background``:
    an :class:`~hybrid.checkpoint.async_save.AsyncCheckpointWriter` that writes it while training
    goes on (committed later), instead of writing it now."""
    pieces = state_pieces(holder, layout, state, for_save=True)
    agree_on_failure(state.world, lambda: _check_finite(pieces, iteration),
                     f"checking the weights of iteration {iteration} before saving", state.device)
    metadata = {**metadata, COUNTERS_KEY: holder.checkpoint_counters()}
    if background is not None:
        return background.save(save_dir, iteration, pieces, extra, metadata, keep_last=keep_last,
                               run_id=run_id, replace_other_runs=replace_other_runs)
    return save_checkpoint(save_dir, iteration, pieces, extra, metadata, state.world,
                           keep_last=keep_last, device=state.device, run_id=run_id,
                           replace_other_runs=replace_other_runs)


def _check_finite(pieces: list[Piece], iteration: int) -> None:
    """Never write NaN/Inf weights or optimizer state over a good checkpoint history."""
    bad = sorted({f"{p.kind}:{p.name}" for p in pieces if not bool(torch.isfinite(p.tensor).all())})
    if bad:
        raise CheckpointError(f"refusing to save iteration {iteration}: non-finite values in "
                              f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; the previous "
                              f"checkpoints are kept - resume from them with a lower --lr")


def load_state(path: str | Path, holder: CheckpointState, layout: Mapping[str, ParamLayout],
               state: ParallelState, *,
               check_metadata: Callable[[dict], None] | None = None) -> CheckpointReader:
    """Fill ``holder`` (any layout) from the checkpoint at ``path``; returns the reader (metadata,
    per-rank extras). Collective: if reading fails on any rank (e.g. a corrupted file only it reads),
    every rank raises. ``check_metadata`` may refuse the checkpoint before anything is filled."""
    found = {}

    def read() -> None:
        reader = found["reader"] = CheckpointReader(path)
        if check_metadata is not None:
            check_metadata(reader.metadata)
        found["pieces"] = holder.checkpoint_pieces()
        for fragment in found["pieces"]:   # the same views the holder takes back below
            reader.fill(_piece(fragment, layout[fragment.param_name], state))

    agree_on_failure(state.world, read, f"loading checkpoint {path}", state.device)
    reader = found["reader"]
    holder.load_checkpoint_pieces(found["pieces"], reader.metadata[COUNTERS_KEY])
    return reader
