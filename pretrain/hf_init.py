"""``--init-from-hf``: the run starts from the weights of a Hugging Face GPT-2 directory.

:func:`initial_weights` is the step between building the model and building its ZeRO engine: the
engine is built from the :class:`InitialWeights` it returns, so the weights are in place before the
engine copies them (stages 0-2: the model's tensors, overwritten here) or partitions them (stage 3:
the meta-built model's partitions are filled by ``init_fn``). Resuming from ``--load`` skips it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pretrain.config import TrainConfig

log = logging.getLogger(__name__)

# our model flag, the HF config.json key and our GPTConfig field it must match
_HF_DIMS = (("--num-layers", "n_layer", "num_layers"), ("--hidden-size", "n_embd", "hidden_size"),
            ("--num-attention-heads", "n_head", "num_attention_heads"),
            ("--vocab-size", "vocab_size", "vocab_size"), ("--ffn-hidden-size", "n_inner", "ffn_hidden_size"),
            ("--max-position-embeddings", "n_positions", "max_position_embeddings"))


@dataclass(frozen=True)
class InitialWeights:
    """The model the ZeRO engine takes over, with its initial weights in place, and stage 3's
    source of each partition's initial values (``init_fn(name)``; None: the seeded init)."""

    model: object
    init_fn: Callable | None = None


def initial_weights(cfg: TrainConfig, model, resuming: bool) -> InitialWeights:
    """--init-from-hf (not when ``resuming``: the checkpoint's weights win): overwrite ``model``'s
    weights in place (stages 0-2; each chunk of a pipeline stage), or give stage 3 the ``init_fn``
    that fills each partition of the meta-built model."""
    from models.gpt.weights import init_from_pretrained, pretrained_init_fn
    path = cfg.checkpoint.init_from_hf
    if not path:
        return InitialWeights(model)
    if resuming:
        log.info("resuming from %s: --init-from-hf is not used", cfg.checkpoint.load)
        return InitialWeights(model)
    check_hf_dims(path, model.config)
    log.info("initialising the model from the Hugging Face directory %s", path)
    if cfg.parallel.zero_stage == 3:
        return InitialWeights(model, pretrained_init_fn(path, model))
    for chunk in getattr(model, "chunks", [model]):   # a pipeline stage: each of its chunks
        init_from_pretrained(chunk, path)
    return InitialWeights(model)


def check_hf_dims(path: str, model_config) -> None:
    """Refuse an HF GPT-2 directory whose dims differ from the model the flags describe, naming the
    flags that would match it."""
    from models.gpt.hf import CONFIG_FILE, gpt_config_from_hf, is_hf_directory
    if not is_hf_directory(path):
        raise FileNotFoundError(f"--init-from-hf {path!r} is not a Hugging Face GPT-2 directory "
                                f"({CONFIG_FILE} + model.safetensors); export one with "
                                f"tools/export_hf.py or pass the directory save_pretrained wrote")
    source = gpt_config_from_hf(json.loads((Path(path) / CONFIG_FILE).read_text()))
    diffs = [(flag, key, getattr(source, field), getattr(model_config, field))
             for flag, key, field in _HF_DIMS if getattr(source, field) != getattr(model_config, field)]
    if diffs:
        raise ValueError(
            f"--init-from-hf {path}: the model has other dims ("
            + "; ".join(f"{key} {theirs} there, {flag} {ours} here" for flag, key, theirs, ours in diffs)
            + "); pass " + " ".join(f"{flag} {theirs}" for flag, _, theirs, _ in diffs)
            + (" (and a tokenizer of at most that many pieces)" if any(d[0] == "--vocab-size"
                                                                     for d in diffs) else ""))
