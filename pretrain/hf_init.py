"""``--init-from-hf``: the run starts from the weights of a Hugging Face GPT-2 or Llama directory.

:func:`initial_weights` is the step between building the model and building its ZeRO engine: the
engine is built from the :class:`InitialWeights` it returns, so the weights are in place before the
engine copies them (stages 0-2: the model's tensors, overwritten here) or partitions them (stage 3:
the meta-built model's partitions are filled by ``init_fn``). Resuming from ``--load`` skips it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pretrain.config import TrainConfig

log = logging.getLogger(__name__)

# our model flag, the GPT-2 and the Llama config.json key, and our GPTConfig field
_HF_DIMS = (("--num-layers", "n_layer", "num_hidden_layers", "num_layers"),
            ("--hidden-size", "n_embd", "hidden_size", "hidden_size"),
            ("--num-attention-heads", "n_head", "num_attention_heads", "num_attention_heads"),
            ("--vocab-size", "vocab_size", "vocab_size", "vocab_size"),
            ("--ffn-hidden-size", "n_inner", "intermediate_size", "ffn_hidden_size"),
            ("--max-position-embeddings", "n_positions", "max_position_embeddings",
             "max_position_embeddings"),
            ("--num-query-groups", None, "num_key_value_heads", "query_groups"),
            ("--rotary-base", None, "rope_theta", "rotary_base"))
# the architecture options of a Llama directory: (GPTConfig field, the flags that select its value)
_HF_OPTIONS = (("position_embedding_type", lambda v: f"--position-embedding-type {v}"),
               ("normalization", lambda v: f"--normalization {v}"),
               ("swiglu", lambda v: "--swiglu" if v else "--no-swiglu"),
               ("add_bias_linear", lambda v: "--add-bias-linear" if v else "--disable-bias-linear"),
               ("untie_embeddings_and_output_weights",
                lambda v: "--untie-embeddings-and-output-weights" if v
                else "--no-untie-embeddings-and-output-weights"),
               ("use_rope_scaling", lambda v: "--use-rope-scaling" if v else "--no-use-rope-scaling"),
               # Mixtral / Qwen2-MoE directories (models/gpt/hf_moe.py)
               ("add_qkv_bias", lambda v: "--add-qkv-bias" if v else "--no-add-qkv-bias"),
               ("num_experts", lambda v: f"--num-experts {v}"),
               ("moe_router_topk", lambda v: f"--moe-router-topk {v}"),
               ("expert_ffn_hidden_size", lambda v: f"--moe-ffn-hidden-size {v}"),
               ("moe_shared_expert_intermediate_size",
                lambda v: f"--moe-shared-expert-intermediate-size {v}"),
               ("moe_shared_expert_gate",
                lambda v: "--moe-shared-expert-gate" if v else "--no-moe-shared-expert-gate"),
               ("moe_router_pre_softmax",
                lambda v: "--moe-router-pre-softmax" if v else "--no-moe-router-pre-softmax"),
               ("moe_layer_pattern", lambda v: "--moe-layer-freq " + str([int(m) for m in v])))


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


def _option(config, field: str):
    """An option's value (methods such as ``moe_layer_pattern`` called); MoE options of a dense
    model are None."""
    if field.startswith(("moe_", "expert_")) and config.num_experts is None:
        return None
    value = getattr(config, field)
    return value() if callable(value) else value


def check_hf_dims(path: str, model_config) -> None:
    """Refuse an HF GPT-2 or Llama directory whose dims or architecture differ from the model the
    flags describe, naming the flags that would match it."""
    from models.gpt.hf import CONFIG_FILE, is_hf_directory, read_hf_config
    from models.gpt.hf_llama import is_llama
    if not is_hf_directory(path):
        raise FileNotFoundError(f"--init-from-hf {path!r} is not a Hugging Face GPT-2 directory or "
                                f"Llama, Mixtral or Qwen2-MoE directory ({CONFIG_FILE} + "
                                f"model.safetensors); export one "
                                f"with tools/export_hf.py or pass the directory save_pretrained wrote")
    source = read_hf_config(path)
    llama = is_llama(source)
    differ = [(flag, llama_key if llama else key, field) for flag, key, llama_key, field in _HF_DIMS
              if (llama or key) and getattr(source, field) != getattr(model_config, field)]
    options = [(field, to_flag) for field, to_flag in _HF_OPTIONS
               if _option(source, field) != _option(model_config, field)]
    if not differ and not options:
        return
    fixes = [to_flag(_option(source, field)) for field, to_flag in options] + [
        ("--group-query-attention " if flag == "--num-query-groups" else "")
        + f"{flag} {getattr(source, field)}" for flag, _, field in differ]
    raise ValueError(
        f"--init-from-hf {path}: the model has other dims or options ("
        + "; ".join([f"{key} {getattr(source, field)} there, {flag} {getattr(model_config, field)} "
                     f"here" for flag, key, field in differ]
                    + [f"{field} {_option(source, field)} there, {_option(model_config, field)} here"
                       for field, _ in options])
        + "); pass " + " ".join(fixes)
        + (" (and a tokenizer of at most that many pieces)" if any(d[0] == "--vocab-size"
                                                                 for d in differ) else ""))
