"""Load GPT weights from any source into a tensor-parallel :class:`GPTModel` (docs/design.md §8).

The common currency is the canonical state dict (:mod:`models.gpt.sharding`: the single-device
reference's names and shapes). Three sources give one, whatever layout produced them:

    a training checkpoint      <save>/ or <save>/iter_N/ (hybrid.checkpoint; any TP/DP/ZeRO stage)
    a Hugging Face directory   config.json + model.safetensors of a GPT2LMHeadModel (models/gpt/hf.py)
    a canonical .safetensors   one file, canonical names, the GPTConfig as JSON in its metadata

and :func:`build_model` shards the canonical tensors for the TP degree of a ``ParallelState``
(vocab padding and the per-head QKV interleave are added by ``shard_tensor``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hybrid.checkpoint import CheckpointError, CheckpointReader
from hybrid.checkpoint.state import state_pieces
from hybrid.parallel_state import ParallelState
from models.gpt.config import GPTConfig
from models.gpt.hf import is_hf_directory, load_hf_directory
from models.gpt.model import GPTModel
from models.gpt.sharding import WORD_EMBEDDING, canonical_shapes, from_tp_layout, shard_tensor

log = logging.getLogger(__name__)

_CONFIG_KEY = "gpt_config"


def save_canonical(path: str | Path, state_dict: dict[str, torch.Tensor], config: GPTConfig) -> Path:
    """One safetensors file of canonical tensors with the model config in its metadata."""
    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, str(path), metadata={_CONFIG_KEY: json.dumps(config.to_dict())})
    return path


def load_canonical(path: str | Path, kind: str = "master") -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """``(canonical state dict, GPTConfig)`` from a checkpoint, an HF directory or a canonical file.

    For a training checkpoint ``kind`` picks the fp32 ``master`` weights (falling back to the
    ``model`` weights when no optimizer state was saved) or the 16-bit ``model`` weights."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return _load_canonical_file(path)
    if path.is_dir() and is_hf_directory(path):
        return load_hf_directory(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a checkpoint directory (--save of a "
                                f"training run), a Hugging Face GPT-2 directory or a .safetensors file")
    if kind == "master" and not CheckpointReader(path).has("master", WORD_EMBEDDING):
        log.info("%s holds no fp32 master weights; using the model weights", path)
        kind = "model"
    state_dict, config = canonical_state_dict(path, kind)
    return {k: v.float() for k, v in state_dict.items()}, GPTConfig.from_dict(config)


def canonical_state_dict(path: str | Path, kind: str = "master") -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, gpt_config_dict)`` of the training checkpoint at ``path`` (a save dir or an
    iter dir) in the canonical layout of ``models/gpt/reference.py``, whatever layout trained it.

    Pieces are stored in the TP model's full layout (QKV rows interleaved per head, word embedding
    padded); :func:`from_tp_layout` undoes both. ``kind="master"`` gives the fp32 master weights
    (exact training state); ``"model"`` the 16-bit parameters the forward pass used."""
    reader = CheckpointReader(path)
    config = GPTConfig.from_dict(_model_config(reader))
    out = {name: from_tp_layout(config, name, reader.full_tensor(kind, name)).clone()
           for name in canonical_shapes(config)}
    return out, reader.metadata["model_config"]


def _model_config(reader: CheckpointReader) -> dict:
    config = reader.metadata.get("model_config")
    if config is None:
        raise CheckpointError(f"{reader.directory} stores no model_config; it was not written by "
                              f"a training run of this framework (pretrain.resume)")
    return config


def _load_canonical_file(path: Path) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state_dict = {k: f.get_tensor(k).float() for k in f.keys()}
    except (SafetensorError, OSError) as err:   # a damaged or foreign file
        raise ValueError(f"{path} is not a readable safetensors file ({err}); restore it or "
                         f"write it again with tools/import_hf.py") from None
    if _CONFIG_KEY not in meta:
        raise ValueError(f"{path} has no '{_CONFIG_KEY}' metadata; write it with "
                         f"models.gpt.weights.save_canonical")
    return state_dict, GPTConfig.from_dict(json.loads(meta[_CONFIG_KEY]))


def build_model(config: GPTConfig, state: ParallelState, state_dict: dict[str, torch.Tensor], *,
                dtype: torch.dtype = torch.float32) -> GPTModel:
    """A :class:`GPTModel` at the TP degree of ``state`` holding ``state_dict`` (canonical), in eval
    mode. Built on meta and filled once: no throw-away random initialisation."""
    model = GPTModel(config, state, device="meta", dtype=dtype)
    model.to_empty(device=state.device)
    model.device = state.device
    model.load_canonical_state_dict(state_dict)
    return model.eval()


def load_model(path: str | Path, state: ParallelState, *, kind: str = "master",
               dtype: torch.dtype = torch.float32, dropout: bool = False) -> GPTModel:
    """A :class:`GPTModel` at the TP degree of ``state`` with the weights at ``path`` (dropout off
    unless asked: inference). A training checkpoint fills each parameter's shard straight from the
    reader (peak: one full parameter); other sources go through the canonical state dict."""
    path = Path(path)
    if path.is_dir() and not is_hf_directory(path):
        return _load_from_checkpoint(path, state, kind, dtype, dropout)
    state_dict, config = load_canonical(path, kind)
    return build_model(_inference(config, dropout), state, state_dict, dtype=dtype)


def _inference(config: GPTConfig, dropout: bool) -> GPTConfig:
    return config if dropout else config.replace(hidden_dropout=0.0, attention_dropout=0.0)


def _load_from_checkpoint(path: Path, state: ParallelState, kind: str, dtype: torch.dtype,
                          dropout: bool) -> GPTModel:
    reader = CheckpointReader(path)
    config = _inference(GPTConfig.from_dict(_model_config(reader)), dropout)
    if kind == "master" and not reader.has("master", WORD_EMBEDDING):
        log.info("%s holds no fp32 master weights; using the model weights", path)
        kind = "model"
    model = GPTModel(config, state, device="meta", dtype=dtype)
    model.to_empty(device=state.device)
    model.device = state.device
    for piece in state_pieces(model, model.checkpoint_layout(), state, for_save=False):
        piece.kind = kind
        reader.fill(piece)
    return model.eval()


def init_from_pretrained(model: GPTModel, path: str | Path, *, kind: str = "master") -> None:
    """Overwrite the weights of an existing ``model`` (any TP degree, e.g. a trainer's, before its
    optimizer is built) with those of a checkpoint / HF GPT-2 directory / canonical file of the same
    dims. Dropout and the vocab padding multiple of ``model.config`` are kept."""
    state_dict, source = load_canonical(path, kind)
    _check_same_dims(path, source, model.config)
    model.load_canonical_state_dict(state_dict)


def _check_same_dims(path, source: GPTConfig, target: GPTConfig) -> None:
    keys = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size",
            "max_position_embeddings", "position_embedding_type", "normalization", "swiglu",
            "query_groups", "add_bias_linear", "untie_embeddings_and_output_weights",
            "add_qkv_bias", "num_experts", "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_pattern")

    def value(config, key):
        v = getattr(config, key)
        return v() if callable(v) else v
    diffs = [f"{k}: {value(source, k)} there vs {value(target, k)} here" for k in keys
             if value(source, k) != value(target, k)]
    if diffs:
        raise ValueError(f"{path} holds a model of other dims ({'; '.join(diffs)}); set the model "
                         f"flags to match it")


def pretrained_init_fn(path: str | Path, model: GPTModel, *, kind: str = "master"):
    """``init_fn(name) -> this TP rank's full local tensor`` for ZeRO stage 3, whose meta-built model
    is materialised partition by partition (``ParameterPartitioning(..., init_fn=...)``): the stage-3
    counterpart of :func:`init_from_pretrained`. The canonical tensors are loaded once."""
    state_dict, source = load_canonical(path, kind)
    _check_same_dims(path, source, model.config)
    config, tp_rank, tp = model.config, model.state.tp_rank, model.state.tp_size
    return lambda name: shard_tensor(config, name, state_dict[name], tp_rank, tp)
