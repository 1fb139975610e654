"""Megatron-core GPT / Llama checkpoints -> our canonical GPT state dict and :class:`GPTConfig`.

    megatron-core (global layout, models/gpt/megatron_files.py)       ours (canonical)
    embedding.word_embeddings.weight [V_padded, h]                      embedding.word.weight [V, h]
    embedding.position_embeddings.weight [P, h]                         embedding.position.weight
    decoder.layers.i.input_layernorm.{weight,bias}
      = decoder.layers.i.self_attention.linear_qkv.layer_norm_{weight,bias}   layers.i.ln1.*
    decoder.layers.i.self_attention.linear_qkv.{weight,bias}            layers.i.attn.qkv.*
    decoder.layers.i.self_attention.linear_proj.{weight,bias}           layers.i.attn.proj.*
    decoder.layers.i.pre_mlp_layernorm.{weight,bias}
      = decoder.layers.i.mlp.linear_fc1.layer_norm_{weight,bias}        layers.i.ln2.*
    decoder.layers.i.mlp.linear_fc1.{weight,bias} ([gate; up] SwiGLU)   layers.i.mlp.fc1.*
    decoder.layers.i.mlp.linear_fc2.{weight,bias}                       layers.i.mlp.fc2.*
    decoder.final_layernorm.{weight,bias}                               final_norm.*
    output_layer.weight (untied only; tied: the word embedding)         output_layer.weight

Megatron's fused QKV rows are grouped per query group, ``[q of the group's a/g heads, k, v]`` for
each of the g groups (per head ``[q k v]`` without GQA) - exactly our TP layout, which
:func:`models.gpt.sharding.from_tp_layout` turns into the canonical ``[q; k; v]``. Its rotary
embedding rotates the channel pairs (i, i + d/2) as ours does (``rotary_interleaved`` is refused).

The model config comes from the checkpoint's ``args`` (Megatron-LM's training arguments) where it
has them; ``overrides`` (the import tool's flags) fill in or replace fields. The vocab size is the
padded one Megatron trained with (its tokenizer's size is not stored) unless ``vocab_size`` is
given, which drops the padding rows. Features this GPT does not compute are refused by name.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from hybrid.checkpoint.format import CheckpointError
from models.gpt.config import GPTConfig
from models.gpt.megatron_files import read_megatron
from models.gpt.sharding import canonical_shapes, from_tp_layout

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "input_layernorm": "ln1", "self_attention.linear_qkv.layer_norm": "ln1",
    "self_attention.linear_qkv": "attn.qkv", "self_attention.linear_proj": "attn.proj",
    "pre_mlp_layernorm": "ln2", "mlp.linear_fc1.layer_norm": "ln2",
    "mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2",
}
_TOP_NAMES = {"embedding.word_embeddings.weight": "embedding.word.weight",
              "embedding.position_embeddings.weight": "embedding.position.weight",
              "decoder.final_layernorm.weight": "final_norm.weight",
              "decoder.final_layernorm.bias": "final_norm.bias",
              "output_layer.weight": "output_layer.weight"}
# Megatron args that change what the model computes, and the value this GPT supports
_UNSUPPORTED = {"qk_layernorm": False, "rotary_interleaved": False, "apply_layernorm_1p": False,
                "squared_relu": False, "multi_latent_attention": False, "num_experts": None,
                "mtp_num_layers": None, "add_qkv_bias": False}


class MegatronImportError(CheckpointError):
    """A Megatron checkpoint this GPT cannot represent; the message says what and why."""


def canonical_name(megatron_name: str) -> str | None:
    """Our canonical name of a Megatron parameter (None: not a parameter we know)."""
    if megatron_name in _TOP_NAMES:
        return _TOP_NAMES[megatron_name]
    parts = megatron_name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["decoder", "layers"]:
        return None
    module, _, kind = parts[3].rpartition(".")
    if kind.startswith("layer_norm_"):               # TE's fused norm: linear_qkv.layer_norm_weight
        module, kind = f"{module}.layer_norm", kind.removeprefix("layer_norm_")
    ours = _LAYER_NAMES.get(module)
    return None if ours is None else f"layers.{parts[2]}.{ours}.{kind}"


def config_from_args(args: argparse.Namespace | None, tensors: dict[str, torch.Tensor],
                     overrides: dict, *, approximate_gelu: bool = False) -> GPTConfig:
    """:class:`GPTConfig` from Megatron's ``args`` (None: from ``overrides`` and the tensors alone)."""
    fields = {} if args is None else _fields_from_args(args, approximate_gelu)
    if "vocab_size" not in fields:
        fields["vocab_size"] = tensors["embedding.word_embeddings.weight"].shape[0]
    fields.update(overrides)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in fields]
    if missing:
        raise MegatronImportError(f"the checkpoint stores no args; pass the model flags "
                                  f"{', '.join('--' + k.replace('_', '-') for k in missing)} (and "
                                  f"any other option its Megatron run used)")
    return GPTConfig(**fields)


def _fields_from_args(args: argparse.Namespace, approximate_gelu: bool) -> dict:
    a = vars(args)
    for name, supported in _UNSUPPORTED.items():
        if name == "add_qkv_bias" and a.get("add_bias_linear", True):
            continue                                   # biases everywhere: the QKV one included
        if a.get(name, supported) not in (supported, 0, False, None):
            raise MegatronImportError(f"the checkpoint's model uses {name}={a[name]!r}, which this "
                                      f"GPT does not compute")
    position = a.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise MegatronImportError(f"position_embedding_type {position!r}: only learned_absolute "
                                  f"and rope are supported")
    if a.get("rotary_percent", 1.0) != 1.0:
        raise MegatronImportError(f"rotary_percent {a['rotary_percent']}: only rotary embeddings "
                                  f"over the whole head (1.0) are supported")
    h, heads = a["hidden_size"], a["num_attention_heads"]
    if a.get("kv_channels") not in (None, h // heads):
        raise MegatronImportError(f"kv_channels {a['kv_channels']} differs from hidden_size / "
                                  f"num_attention_heads = {h // heads}")
    swiglu = bool(a.get("swiglu", False))
    if not swiglu and not a.get("openai_gelu", False) and not approximate_gelu:
        raise MegatronImportError(
            "the checkpoint's model computes the exact (erf) GELU (Megatron's default without "
            "--openai-gelu); this GPT computes GELU with the tanh approximation, which differs by up "
            "to about 5e-4 per activation. Pass --approximate-gelu to import it anyway")
    groups = a.get("num_query_groups") if a.get("group_query_attention") else None
    seq, positions = a.get("seq_length") or a.get("max_position_embeddings"), a.get("max_position_embeddings")
    if position == "rope" and seq and positions:   # no position table: any length up to seq runs
        positions = max(seq, positions)
    fields = dict(
        num_layers=a["num_layers"], hidden_size=h, num_attention_heads=heads,
        vocab_size=a.get("padded_vocab_size"), seq_length=seq,
        max_position_embeddings=positions, ffn_hidden_size=a.get("ffn_hidden_size"),
        make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by", 128),
        hidden_dropout=a.get("hidden_dropout", 0.1), attention_dropout=a.get("attention_dropout", 0.1),
        init_method_std=a.get("init_method_std", 0.02),
        norm_epsilon=a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)),
        position_embedding_type=position, rotary_base=float(a.get("rotary_base", 10000)),
        use_rope_scaling=bool(a.get("use_rope_scaling", False)),
        rope_scaling_factor=float(a.get("rope_scaling_factor", 8.0)),
        normalization=a.get("normalization", "LayerNorm"), swiglu=swiglu,
        group_query_attention=groups is not None and groups != heads,
        num_query_groups=groups if groups is not None and groups != heads else None,
        add_bias_linear=bool(a.get("add_bias_linear", True)),
        untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights", False)))
    return {k: v for k, v in fields.items() if v is not None}


def to_canonical(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's full tensors -> our canonical state dict for ``config`` (shapes checked, every
    parameter accounted for; vocab padding rows beyond ``config.vocab_size`` dropped)."""
    shapes, out, unknown = canonical_shapes(config), {}, []
    for name, t in tensors.items():
        ours = canonical_name(name)
        if ours is None or ours not in shapes:
            if not (ours == "output_layer.weight" and not config.untie_embeddings_and_output_weights):
                unknown.append(name)
            continue
        out[ours] = from_tp_layout(config, ours, t) if "qkv" in ours else t
    if unknown:
        raise MegatronImportError(f"the checkpoint holds parameters a GPT of this config does not "
                                  f"have: {', '.join(sorted(unknown)[:5])}; check the model options "
                                  f"(args or flags)")
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise MegatronImportError(f"the checkpoint lacks {', '.join(missing[:5])}, which a GPT of "
                                  f"this config has; check the model options (args or flags)")
    for name in ("embedding.word.weight", "output_layer.weight"):
        if name in out:
            out[name] = _trim_vocab(name, out[name], config.vocab_size)
    for name, shape in shapes.items():
        if tuple(out[name].shape) != shape:
            raise MegatronImportError(f"{name} has shape {list(out[name].shape)} in the checkpoint, "
                                      f"the model config implies {list(shape)}; the args or flags "
                                      f"do not describe this checkpoint")
    return {name: out[name].contiguous() for name in shapes}


def _trim_vocab(name: str, t: torch.Tensor, vocab: int) -> torch.Tensor:
    if t.shape[0] < vocab:
        raise MegatronImportError(f"{name} has {t.shape[0]} rows, fewer than the vocab size {vocab}")
    return t[:vocab]


def load_megatron(path: str | Path, overrides: dict | None = None, *,
                  approximate_gelu: bool = False) -> tuple[dict[str, torch.Tensor], GPTConfig, dict]:
    """``(canonical state dict, GPTConfig, info)`` of the Megatron checkpoint at ``path`` (its save
    directory or an iteration directory, torch_dist or legacy); ``info``: the source's description
    and iteration."""
    found = read_megatron(path)
    config = config_from_args(found.args, found.tensors, dict(overrides or {}),
                              approximate_gelu=approximate_gelu)
    state_dict = to_canonical(config, found.tensors)
    log.info("read %s: %d tensors", found.description, len(state_dict))
    return state_dict, config, {"source": found.description, "iteration": found.iteration}
