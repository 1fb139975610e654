"""Resume bookkeeping of a training run on top of the checkpoint format (docs/design.md §8).

The state itself travels through :mod:`hybrid.checkpoint.state`: the ZeRO engine hands out its
parameters, fp32 master, Adam moments and counters (step count, loss scaler) as pieces, the model
says where each parameter sits in its full tensor. What is left here belongs to the run:

    data position           TrainState (iteration, consumed samples; the sampler resumes there)
    learning-rate schedule  TrainState.lr_schedule (pretrain.resume_schedule compares it)
    RNG states              every rank's default and TP-region streams
    config                  the resolved TrainConfig and the model's GPTConfig (so a run can rebuild
                            itself), the layout that wrote the checkpoint

RNG states are restored only when the layout is unchanged; otherwise each rank reseeds from
(seed, iteration). Megatron's loading options: ``--no-load-rng`` always reseeds;
``--no-load-optim`` loads the weights (the fp32 master) into a fresh optimizer (zero Adam moments,
step count 0, the initial loss scale); ``--finetune`` is both (the caller restarts at iteration 0).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid import comm
from hybrid.checkpoint.format import CheckpointError
from hybrid.checkpoint.lock import new_run_id
from hybrid.checkpoint.loader import CheckpointReader
from hybrid.checkpoint.state import CheckpointState, load_state, save_state
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel.random import RNGStates
from models.gpt.config import GPTConfig
from hybrid.pipeline.stage import StageChunks
from models.gpt.model import GPTModel
from pretrain.sections import found_by_every_rank

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Progress of a run: what a resume must continue from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    run_id: str | None = None   # the run's identity, kept across resumes (hybrid.checkpoint.lock)
    lr_schedule: dict | None = None   # LRSchedule.record() of the run (None: older checkpoints)


def fresh_run_id(state: ParallelState, keep: str | None = None) -> str:
    """Collective over ``state.world``: rank 0's new run id (``keep``: that one, e.g. the run an
    in-job restart starts again), on every rank."""
    text = torch.zeros(32, dtype=torch.uint8)
    if state.rank == 0:
        raw = (keep or new_run_id()).encode()
        text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(state.device)
    with comm.unrecorded(state.world):
        comm.broadcast(text, state.world)
    return bytes(text.cpu().tolist()).rstrip(b"\0").decode()


def _layout(state: ParallelState, zero_stage: int) -> dict:
    return {"world_size": state.world_size, "tensor_model_parallel_size": state.tp_size,
            "pipeline_model_parallel_size": state.pp_size, "data_parallel_size": state.dp_size,
            "context_parallel_size": state.cp_size, "zero_stage": zero_stage}


def rng_tensors(rng) -> dict[str, torch.Tensor]:
    if rng is None:
        return {"cpu": torch.get_rng_state()}
    s = rng.get_states()
    out = {"cpu": s.cpu, "tp": s.tp}
    if s.cuda is not None:
        out["cuda"] = s.cuda
    return out


def save(path: str | Path, train_state: TrainState, model: GPTModel | StageChunks, optimizer: CheckpointState,
         state: ParallelState, config, *, rng=None, keep_last: int = 2, background=None) -> Path:
    """Collective over ``state.world``: write one checkpoint of the current iteration, marked with
    the run's id (``--overwrite``: the first one replaces other runs' checkpoints in ``path``);
    ``background``: --async-save's writer (hybrid.checkpoint.async_save)."""
    metadata = {"train_state": dataclasses.asdict(train_state), "config": config.to_dict(),
                "model_config": model.config.to_dict(),
                "layout": _layout(state, config.parallel.zero_stage)}
    biases = _expert_biases(model, state)
    if biases:
        metadata["moe_expert_bias"] = biases
    return save_state(path, train_state.iteration, optimizer, model.checkpoint_layout(), state,
                      extra=rng_tensors(rng), metadata=metadata, keep_last=keep_last,
                      run_id=train_state.run_id, replace_other_runs=config.checkpoint.overwrite,
                      background=background)


def _bias_holders(model) -> dict[int, torch.Tensor]:
    out = {}
    for module in model.modules():
        if hasattr(module, "expert_biases"):
            out.update(module.expert_biases())
    return out


def _expert_biases(model, state: ParallelState) -> dict[str, list[float]]:
    """DeepSeek-V3's expert biases (MoE routers' buffers, the same on every rank holding the layer)
    of all layers, for the checkpoint's metadata: one world all-reduce of [layers, E] plus a holder
    count, so a pipeline stage's layers reach the writer rank. Collective (save is)."""
    config = model.config
    if config.num_experts is None or not config.moe_router_enable_expert_bias:
        return {}
    rows = torch.zeros(config.num_layers, config.num_experts + 1, device=state.device)
    for index, bias in _bias_holders(model).items():
        rows[index, :-1] = bias
        rows[index, -1] = 1.0
    with comm.unrecorded(state.world):
        comm.all_reduce(rows, state.world)
    rows = rows.cpu().double()
    return {str(i): (row[:-1] / row[-1]).tolist() for i, row in enumerate(rows) if row[-1] > 0}


def _restore_expert_biases(model, saved: dict) -> None:
    for index, bias in _bias_holders(model).items():
        if str(index) in saved:
            bias.copy_(torch.tensor(saved[str(index)], dtype=bias.dtype))


_DIMS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
         "max_position_embeddings", "vocab_size", "position_embedding_type", "normalization",
         "swiglu", "num_query_groups", "add_bias_linear", "untie_embeddings_and_output_weights",
         "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
         "moe_shared_expert_gate", "moe_layer_freq")


def check_model_compatible(saved: dict, mine: dict) -> None:
    """The model dims (resolved GPTConfig dicts) must match; parallel layout, batch sizes, precision,
    dropout and recompute may change."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}   # older checkpoints
    saved, mine = ({k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}   # JSON lists
                   for d in (saved, mine))
    diffs = [f"{k.replace('_', '-')}: checkpoint {saved.get(k, defaults[k])!r} vs this run "
             f"{mine.get(k, defaults[k])!r}"
             for k in _DIMS if saved.get(k, defaults[k]) != mine.get(k, defaults[k])]
    if diffs:
        raise found_by_every_rank(CheckpointError(
            "the checkpoint was written by a model with other dims (" + "; ".join(diffs) + "); use "
            "the checkpoint's dims (its metadata.json holds its config) or another checkpoint"))


def load(path: str | Path, model: GPTModel | StageChunks, optimizer: CheckpointState, state: ParallelState, config,
         *, rng=None) -> TrainState:
    """Fill model and optimizer of this rank (any layout) from a checkpoint; return its TrainState.
    Model and optimizer state are always loaded together: the engines rebuild the 16-bit parameters
    from the loaded fp32 master (and, with parameters on NVMe, write them through the store), so a
    model-only load would leave master and parameters disagreeing.
    Collective: if reading fails on any rank (e.g. a corrupted file only it reads), every rank raises."""
    def same_model(metadata: dict) -> None:
        if metadata.get("model_config"):
            check_model_compatible(metadata["model_config"], model.config.to_dict())

    c = config.checkpoint
    weights_only = c.finetune or not c.load_optim
    holder = WeightsOnly(optimizer) if weights_only else optimizer
    reader = load_state(path, holder, model.checkpoint_layout(), state, check_metadata=same_model)
    train_state = TrainState(**{**reader.metadata["train_state"], "run_id": reader.run_id})
    _restore_expert_biases(model, reader.metadata.get("moe_expert_bias", {}))
    if weights_only:
        log.info("loaded the weights only (%s): fresh optimizer state",
                 "--finetune" if c.finetune else "--no-load-optim")
    if c.load_rng and not c.finetune:
        _restore_rng(reader, state, config, rng, train_state.iteration)
    else:
        _reseed(config, rng, 0 if c.finetune else train_state.iteration)
    saved = reader.metadata["layout"]
    log.info("loaded checkpoint %s (iteration %d, written at TP %d x CP %d x PP %d x DP %d, ZeRO "
             "stage %d)", reader.directory, train_state.iteration,
             saved["tensor_model_parallel_size"], saved.get("context_parallel_size", 1),
             saved.get("pipeline_model_parallel_size", 1), saved["data_parallel_size"],
             saved["zero_stage"])
    return train_state


def _restore_rng(reader: CheckpointReader, state: ParallelState, config, rng, iteration: int) -> None:
    saved = reader.metadata["layout"]
    same = (saved["world_size"] == state.world_size
            and saved["tensor_model_parallel_size"] == state.tp_size
            and saved.get("pipeline_model_parallel_size", 1) == state.pp_size
            and saved.get("context_parallel_size", 1) == state.cp_size)
    if same:
        t = reader.extra(state.rank)
        if rng is not None and "tp" in t:
            rng.set_states(RNGStates(t["cpu"], t.get("cuda"), t["tp"]))
        else:
            torch.set_rng_state(t["cpu"])
        return
    log.info("layout changed since the checkpoint: reseeding RNG streams from seed + iteration")
    _reseed(config, rng, iteration)


def _reseed(config, rng, iteration: int) -> None:
    torch.manual_seed(config.training.seed + iteration)
    if rng is not None:
        rng.seed = config.training.seed + iteration
        rng.seed_all()


class WeightsOnly:
    """A checkpoint-state holder that takes only the weights of a checkpoint: the engine's fp32
    master is filled (the 16-bit parameters are rebuilt from it), its Adam moments are zeroed and its
    counters (step count, loss scaler) stay fresh, as a newly built optimizer's."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def optimizer_state_replicated(self) -> bool:
        return self.engine.optimizer_state_replicated

    @property
    def parameters_replicated(self) -> bool:
        return self.engine.parameters_replicated

    @property
    def state_replica(self) -> int:
        return self.engine.state_replica

    @property
    def expert_state_replica(self) -> int:
        return self.engine.expert_state_replica

    def checkpoint_pieces(self):
        return self.engine.checkpoint_pieces()

    def checkpoint_counters(self) -> dict:
        return self.engine.checkpoint_counters()

    def load_checkpoint_pieces(self, pieces, counters: dict) -> None:
        fresh = self.engine.checkpoint_counters()
        for piece in pieces:
            if piece.kind in ("exp_avg", "exp_avg_sq"):
                piece.tensor.zero_()
        self.engine.load_checkpoint_pieces(pieces, {**fresh, "loss_scaler": None})
