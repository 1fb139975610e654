"""Save and resume a training run with the layout-independent checkpoint format (docs/design.md §8).

What a checkpoint holds, and where it comes from:

    model parameters        model.named_parameters() (stage 0-2: DP rank 0 writes; TP-replicated
                            tensors only from TP rank 0) or optimizer.named_local_params() (stage 3)
    fp32 master + moments   optimizer.owned_fragments(): the DP range each rank owns (ZeRO §5)
    loss scaler, step count optimizer.scaler.state_dict() / optimizer.step_count
    RNG states              every rank's default and TP-region streams
    data position           TrainState.consumed_train_samples (the sampler resumes there)
    config                  the resolved TrainConfig (so a run can rebuild itself)

Loading builds the same list of pieces for the *loading* layout and fills each from the checkpoint
(:class:`hybrid.checkpoint.loader.CheckpointReader` reassembles the canonical tensors). RNG states
are restored only when the layout is unchanged; otherwise each rank reseeds from (seed, iteration).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from hybrid.checkpoint.format import CheckpointError, Piece, full_shape_of, partition_dim_of
from hybrid.checkpoint.loader import CheckpointReader
from hybrid.checkpoint.writer import agree_on_failure, save_checkpoint
from hybrid.parallel_state import ParallelState

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Progress of a run: what a resume must continue from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0


def _layout(state: ParallelState, zero_stage: int) -> dict:
    return {"world_size": state.world_size, "tensor_model_parallel_size": state.tp_size,
            "data_parallel_size": state.dp_size, "zero_stage": zero_stage}


def _valid_rows(model: nn.Module) -> dict[str, int]:
    """Parameters padded along dim 0 and their real rows: the GPT word embedding and an untied
    output layer (vocab padded to a multiple of 128 x TP), so a checkpoint loads at another TP
    degree."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        return {}
    from models.gpt.sharding import VOCAB_TABLES
    return {name: config.vocab_size for name in VOCAB_TABLES}


def model_pieces(model: nn.Module, optimizer, state: ParallelState, *, for_save: bool) -> list[Piece]:
    """Pieces of the 16-bit (or fp32) model parameters this rank writes (for_save) or must load."""
    params = dict(model.named_parameters())
    tp = state.tp_size
    if hasattr(optimizer, "named_local_params"):      # ZeRO stage 3: parameters are DP-partitioned
        items = [(name, offset, t) for name, (offset, t) in optimizer.named_local_params().items()]
        for_save_here = True
    else:
        items = [(name, 0, p.data.view(-1)) for name, p in params.items()]
        for_save_here = state.dp_rank == 0
    out, rows = [], _valid_rows(model)
    for name, offset, tensor in items:
        p = params[name]
        pdim = partition_dim_of(p)
        if for_save and (not for_save_here or (pdim < 0 and state.tp_rank != 0)):
            continue
        out.append(Piece(name, "model", full_shape_of(p, tp), pdim, state.tp_rank, tp, offset, tensor,
                         rows.get(name)))
    return out


def optimizer_pieces(model: nn.Module, optimizer, state: ParallelState, *, for_save: bool,
                     dp_replicated: bool = False) -> tuple[list[Piece], list]:
    """Pieces of fp32 master weights and Adam moments (and the raw fragments, for load_fragments)."""
    params = dict(model.named_parameters())
    fragments = optimizer.owned_fragments()
    out, rows = [], _valid_rows(model)
    for f in fragments:
        p = params[f.param_name]
        pdim = partition_dim_of(p)
        if for_save and ((dp_replicated and state.dp_rank != 0) or (pdim < 0 and state.tp_rank != 0)):
            continue
        out.append(Piece(f.param_name, f.kind, full_shape_of(p, state.tp_size), pdim, state.tp_rank,
                         state.tp_size, f.offset, f.tensor, rows.get(f.param_name)))
    return out, fragments


def _scaler_state(optimizer) -> dict:
    scaler = getattr(optimizer, "scaler", None)
    return scaler.state_dict() if scaler is not None else {}


def rng_tensors(rng) -> dict[str, torch.Tensor]:
    if rng is None:
        return {"cpu": torch.get_rng_state()}
    s = rng.get_states()
    out = {"cpu": s.cpu, "tp": s.tp}
    if s.cuda is not None:
        out["cuda"] = s.cuda
    return out


def save(path: str | Path, train_state: TrainState, model: nn.Module, optimizer, state: ParallelState,
         config, *, rng=None, keep_last: int = 2) -> Path:
    """Collective over ``state.world``: write one checkpoint of the current iteration."""
    pieces = model_pieces(model, optimizer, state, for_save=True)
    # stage 0 keeps the whole optimizer state on every DP rank: only DP rank 0 writes it
    pieces += optimizer_pieces(model, optimizer, state, for_save=True,
                               dp_replicated=config.parallel.zero_stage == 0)[0]
    agree_on_failure(state.world, lambda: _check_finite(pieces, train_state.iteration),
                     f"checking the weights of iteration {train_state.iteration} before saving",
                     state.device)
    model_config = model.config.to_dict() if hasattr(model, "config") else None
    metadata = {"train_state": dataclasses.asdict(train_state), "config": config.to_dict(),
                "model_config": model_config,
                "layout": _layout(state, config.parallel.zero_stage),
                "optimizer": {"step_count": optimizer.step_count,
                              "loss_scaler": _scaler_state(optimizer)}}
    return save_checkpoint(path, train_state.iteration, pieces, rng_tensors(rng), metadata, state.world,
                           keep_last=keep_last, device=state.device)


def _check_finite(pieces: list[Piece], iteration: int) -> None:
    """Never write NaN/Inf weights or optimizer state over a good checkpoint history."""
    bad = sorted({f"{p.kind}:{p.name}" for p in pieces if not bool(torch.isfinite(p.tensor).all())})
    if bad:
        raise CheckpointError(f"refusing to save iteration {iteration}: non-finite values in "
                              f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; the previous "
                              f"checkpoints are kept - resume from them with a lower --lr")


_DIMS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
         "max_position_embeddings", "vocab_size", "position_embedding_type", "normalization",
         "swiglu", "num_query_groups", "add_bias_linear", "untie_embeddings_and_output_weights")


def check_model_compatible(saved: dict, mine: dict) -> None:
    """The model dims (resolved GPTConfig dicts) must match; parallel layout, batch sizes, precision,
    dropout and recompute may change."""
    from models.gpt.config import GPTConfig
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}   # older checkpoints
    diffs = [f"{k.replace('_', '-')}: checkpoint {saved.get(k, defaults[k])!r} vs this run "
             f"{mine.get(k, defaults[k])!r}"
             for k in _DIMS if saved.get(k, defaults[k]) != mine.get(k, defaults[k])]
    if diffs:
        raise CheckpointError("the checkpoint was written by a model with other dims (" +
                              "; ".join(diffs) + "); use the checkpoint's dims (its metadata.json "
                              "holds its config) or another checkpoint")


def load(path: str | Path, model: nn.Module, optimizer, state: ParallelState, config, *,
         rng=None) -> TrainState:
    """Fill model and optimizer of this rank (any layout) from a checkpoint; return its TrainState.
    Model and optimizer state are always loaded together: the engines rebuild the 16-bit parameters
    from the loaded fp32 master (and, with parameters on NVMe, write them through the store), so a
    model-only load would leave master and parameters disagreeing.
    Collective: if reading fails on any rank (e.g. a corrupted file only it reads), every rank raises."""
    found = {}

    def read() -> None:
        reader = found["reader"] = CheckpointReader(path)
        if reader.metadata.get("model_config") and hasattr(model, "config"):
            check_model_compatible(reader.metadata["model_config"], model.config.to_dict())
        for piece in model_pieces(model, optimizer, state, for_save=False):
            reader.fill(piece)
        pieces, found["fragments"] = optimizer_pieces(model, optimizer, state, for_save=False)
        for piece in pieces:
            reader.fill(piece)

    agree_on_failure(state.world, read, f"loading checkpoint {path}", state.device)
    reader = found["reader"]
    meta_opt = reader.metadata["optimizer"]
    optimizer.step_count = meta_opt["step_count"]
    optimizer.load_fragments(found["fragments"])   # in place already; refreshes the 16-bit copies
    if getattr(optimizer, "scaler", None) is not None and meta_opt["loss_scaler"]:
        optimizer.scaler.load_state_dict(meta_opt["loss_scaler"])
    train_state = TrainState(**reader.metadata["train_state"])
    _restore_rng(reader, state, config, rng, train_state.iteration)
    saved = reader.metadata["layout"]
    log.info("loaded checkpoint %s (iteration %d, written at TP %d x DP %d, ZeRO stage %d)",
             reader.directory, train_state.iteration, saved["tensor_model_parallel_size"],
             saved["data_parallel_size"], saved["zero_stage"])
    return train_state


def _restore_rng(reader: CheckpointReader, state: ParallelState, config, rng, iteration: int) -> None:
    saved = reader.metadata["layout"]
    same = (saved["world_size"] == state.world_size
            and saved["tensor_model_parallel_size"] == state.tp_size)
    if same:
        t = reader.extra(state.rank)
        if rng is not None and "tp" in t:
            from hybrid.tensor_parallel.random import RNGStates
            rng.set_states(RNGStates(t["cpu"], t.get("cuda"), t["tp"]))
        else:
            torch.set_rng_state(t["cpu"])
        return
    log.info("layout changed since the checkpoint: reseeding RNG streams from seed + iteration")
    torch.manual_seed(config.training.seed + iteration)
    if rng is not None:
        rng.seed = config.training.seed + iteration
        rng.seed_all()
