"""Hugging Face ``LlamaForCausalLM`` <-> our canonical GPT layout (docs/design.md §8), both ways.

    ours (models/gpt/sharding.py, canonical)        HF LlamaForCausalLM
    embedding.word.weight [V, h]                    model.embed_tokens.weight
    layers.i.ln1.weight [h]                         model.layers.i.input_layernorm.weight
    layers.i.attn.qkv.weight [h + 2 g d, h]         self_attn.q_proj / k_proj / v_proj .weight, stacked
    layers.i.attn.proj.weight [h, h]                self_attn.o_proj.weight
    layers.i.ln2.weight [h]                         model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.fc1.weight [2f, h]                 mlp.gate_proj / up_proj .weight, stacked
    layers.i.mlp.fc2.weight [h, f]                  mlp.down_proj.weight
    final_norm.weight [h]                           model.norm.weight
    output_layer.weight [V, h] (untied)             lm_head.weight (tie_word_embeddings=false)

(biases likewise, with ``attention_bias`` / ``mlp_bias``). Rotary layout: Meta's original checkpoints
rotate interleaved channel pairs (2i, 2i+1) and HF's conversion permutes the q/k rows of each head
into the "rotate half" pairs (i, i + d/2). Our rotary (models/gpt/rotary.py) uses the rotate-half
pairs too, so HF's q_proj/k_proj rows are ours unchanged; :func:`permute_for_rotate_half` is the
permutation for weights in Meta's interleaved layout.
"""

from __future__ import annotations

import torch

from models.gpt.config import GPTConfig

_LAYER = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
          "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias",
          "mlp.fc2.weight": "mlp.down_proj.weight", "mlp.fc2.bias": "mlp.down_proj.bias"}
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


class HFLlamaError(ValueError):
    """A model that cannot be written as, or read from, a LlamaForCausalLM."""


def is_llama(config: GPTConfig) -> bool:
    """Whether ``config`` is a Llama architecture (rotary, RMSNorm, SwiGLU)."""
    return (config.position_embedding_type == "rope" and config.normalization == "RMSNorm"
            and config.swiglu)


def check_exportable(config: GPTConfig) -> None:
    """Refuse mixtures that are neither GPT-2 nor Llama (no HF class computes them)."""
    if not is_llama(config):
        raise HFLlamaError(
            f"a LlamaForCausalLM needs rotary positions, RMSNorm and SwiGLU; this model has "
            f"position_embedding_type={config.position_embedding_type}, normalization="
            f"{config.normalization}, swiglu={config.swiglu} (GPT-2 export needs learned "
            f"positions, LayerNorm, GELU and tied weights)")


def to_hf_llama_state_dict(config: GPTConfig, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    check_exportable(config)
    kv = config.query_groups * config.head_dim
    out = {"model.embed_tokens.weight": canonical["embedding.word.weight"],
           "model.norm.weight": canonical["final_norm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = canonical["output_layer.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if config.add_bias_linear else ("weight",):
            for name, part in zip(_QKV, canonical[f"{ours}attn.qkv.{kind}"].split(
                    [config.hidden_size, kv, kv])):
                out[f"{theirs}self_attn.{name}.{kind}"] = part
            for name, part in zip(_GATE_UP, canonical[f"{ours}mlp.fc1.{kind}"].chunk(2)):
                out[f"{theirs}mlp.{name}.{kind}"] = part
        for key, hf_key in _LAYER.items():
            if f"{ours}{key}" in canonical:
                out[f"{theirs}{hf_key}"] = canonical[f"{ours}{key}"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_llama_state_dict(config: GPTConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = dict(hf)
    out = {"embedding.word.weight": hf.pop("model.embed_tokens.weight"),
           "final_norm.weight": hf.pop("model.norm.weight")}
    lm_head = hf.pop("lm_head.weight", None)
    if config.untie_embeddings_and_output_weights:
        if lm_head is None:
            raise HFLlamaError("config.json says tie_word_embeddings=false but lm_head.weight is missing")
        out["output_layer.weight"] = lm_head
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if config.add_bias_linear else ("weight",):
            out[f"{ours}attn.qkv.{kind}"] = torch.cat(
                [hf.pop(f"{theirs}self_attn.{n}.{kind}") for n in _QKV])
            out[f"{ours}mlp.fc1.{kind}"] = torch.cat([hf.pop(f"{theirs}mlp.{n}.{kind}") for n in _GATE_UP])
        for key, hf_key in _LAYER.items():
            if key.endswith(".bias") and not config.add_bias_linear:
                continue
            out[f"{ours}{key}"] = hf.pop(f"{theirs}{hf_key}")
    left = sorted(k for k in hf if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise HFLlamaError(f"HF weights hold tensors a Llama of this config does not have: {left[:4]}")
    return out


def hf_llama_config(config: GPTConfig, *, bos_token_id: int | None = None,
                    eos_token_id: int | None = None) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` computing what ``config`` computes."""
    check_exportable(config)
    scaling = None
    if config.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                   "low_freq_factor": config.rope_low_freq_factor,
                   "high_freq_factor": config.rope_high_freq_factor,
                   "original_max_position_embeddings": config.rope_original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.query_groups, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings, "hidden_act": "silu",
        "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rotary_base,
        "rope_scaling": scaling, "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear, "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_method_std, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }


def gpt_config_from_hf_llama(cfg: dict, *, make_vocab_size_divisible_by: int = 128) -> GPTConfig:
    """Our :class:`GPTConfig` from an HF Llama ``config.json`` (refusing variants we do not model)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFLlamaError(f"hidden_act {cfg.get('hidden_act')!r} is not silu (SwiGLU)")
    heads, h = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("head_dim", h // heads) != h // heads:
        raise HFLlamaError(f"head_dim {cfg['head_dim']} differs from hidden_size / heads = {h // heads}")
    if cfg.get("attention_bias", False) != cfg.get("mlp_bias", False):
        raise HFLlamaError("attention_bias and mlp_bias differ; this model has biases everywhere or nowhere")
    # transformers 4: rope_theta + rope_scaling; transformers 5: rope_parameters holding both
    scaling = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFLlamaError(f"rope scaling type {kind!r} is not supported (only llama3)")
    scaling = scaling if kind == "llama3" else {}
    groups = cfg.get("num_key_value_heads", heads)
    rope = {}
    if scaling:
        rope = dict(use_rope_scaling=True, rope_scaling_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    gqa = dict(group_query_attention=True, num_query_groups=groups) if groups != heads else {}
    positions = cfg.get("max_position_embeddings", 2048)
    return GPTConfig(num_layers=cfg["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
                     vocab_size=cfg["vocab_size"], seq_length=positions,
                     max_position_embeddings=positions, ffn_hidden_size=cfg["intermediate_size"],
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by, hidden_dropout=0.0,
                     attention_dropout=float(cfg.get("attention_dropout", 0.0)),
                     init_method_std=float(cfg.get("initializer_range", 0.02)),
                     norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
                     position_embedding_type="rope", rotary_base=theta,
                     normalization="RMSNorm", swiglu=True,
                     add_bias_linear=bool(cfg.get("attention_bias", False)),
                     untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
                     **gqa, **rope)


def permute_for_rotate_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows of Meta's interleaved rotary layout (pairs 2i, 2i+1 per head) -> rotate-half pairs
    (i, i + d/2), what HF Llama and this model use: [heads * d, ...] -> same shape."""
    rest = weight.shape[1:]
    d = weight.size(0) // heads
    return weight.view(heads, d // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)
