"""Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` <-> our canonical MoE layout
(issue 32, item 5), both ways, on canonical state dicts (TP/EP-independent: sharding them over TP and
EP is the checkpoint layer's job, so any degree that divides the model converts).

Attention, norms, embeddings and the output layer are named as in ``LlamaForCausalLM``
(models/gpt/hf_llama.py); Qwen2-MoE adds q/k/v biases (``add_qkv_bias``). A MoE layer ``i``:

    ours (canonical, contract 2)          Mixtral (model.layers.i.)          Qwen2-MoE (model.layers.i.)
    mlp.router.weight [E, h]              block_sparse_moe.gate.weight       mlp.gate.weight
    mlp.experts.fc1.weight [E, 2f, h]     block_sparse_moe.experts.j.w1 |    mlp.experts.j.gate_proj |
      (per expert rows [gate; up])          w3 .weight (gate | up) [f, h]      up_proj .weight [f, h]
    mlp.experts.fc2.weight [E, h, f]      block_sparse_moe.experts.j.w2      mlp.experts.j.down_proj
    mlp.shared_expert.fc1.weight [2fs, h]     -                              mlp.shared_expert.gate_proj | up_proj
    mlp.shared_expert.fc2.weight [h, fs]      -                              mlp.shared_expert.down_proj
    mlp.shared_expert_gate.weight [1, h]      -                              mlp.shared_expert_gate.weight

That is the layout of the released checkpoints, which transformers 4 and 5 both read (transformers 5
fuses the experts in memory, ``mlp.experts.gate_up_proj`` [E, 2f, h] = our fc1 and
``mlp.experts.down_proj`` [E, h, f] = our fc2, and saves the released layout again; import accepts
both). Dense layers of a Qwen2-MoE (``mlp_only_layers``, ``decoder_sparse_step``) are Llama MLPs.

Routers. Mixtral takes the softmax over all E experts, keeps the top k and renormalises them, which
equals the softmax over the top-k logits: ``moe_router_pre_softmax=False``. Qwen2-MoE keeps the top
k of the softmax unnormalised (``norm_topk_prob=false``: ``moe_router_pre_softmax=True``) or
renormalised (``norm_topk_prob=true``: ``False``). Options no HF class computes (sigmoid scores,
a top-k scaling factor, DeepSeek-V3's expert bias, linear biases) are refused with the reason.
"""

from __future__ import annotations

import logging

import torch

from models.gpt.config import ConfigError, GPTConfig

log = logging.getLogger(__name__)

MIXTRAL, QWEN2_MOE = "mixtral", "qwen2_moe"
MODEL_TYPES = (MIXTRAL, QWEN2_MOE)
ARCHITECTURES = {MIXTRAL: "MixtralForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM"}
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")
# the released names of one expert's matrices: (gate, up, down)
_EXPERT = {MIXTRAL: ("w1", "w3", "w2"), QWEN2_MOE: ("gate_proj", "up_proj", "down_proj")}
_MLP = {MIXTRAL: "block_sparse_moe", QWEN2_MOE: "mlp"}


class HFMoEError(ValueError):
    """A model that cannot be written as, or read from, a Mixtral / Qwen2-MoE checkpoint."""


def hf_model_type(config: GPTConfig) -> str:
    """The HF class that computes ``config``: Qwen2-MoE with a (gated) shared expert or QKV biases,
    else Mixtral; refuses MoE options neither computes."""
    if config.num_experts is None:
        raise HFMoEError("this is a dense model; it exports as GPT-2 or Llama, not as a MoE model")
    problems = []
    if not (config.position_embedding_type == "rope" and config.normalization == "RMSNorm"
            and config.swiglu):
        problems.append("rotary positions, RMSNorm and SwiGLU are needed (Mixtral / Qwen2-MoE "
                        "layers are Llama layers)")
    if config.add_bias_linear:
        problems.append("linear biases (--disable-bias-linear; Qwen2-MoE has QKV biases only: "
                        "--add-qkv-bias)")
    if config.use_rope_scaling:
        problems.append("rope scaling (neither model scales its rotary frequencies)")
    if config.moe_router_score_function != "softmax":
        problems.append(f"{config.moe_router_score_function} router scores (both use softmax)")
    if config.moe_router_topk_scaling_factor not in (None, 1.0):
        problems.append("a top-k scaling factor (--moe-router-topk-scaling-factor)")
    if config.moe_router_enable_expert_bias:
        problems.append("the expert bias of aux-loss-free balancing (it changes which experts "
                        "are chosen, and no HF class adds it)")
    shared = config.moe_shared_expert_intermediate_size
    if shared and not config.moe_shared_expert_gate:
        problems.append("a shared expert without the sigmoid gate (Qwen2-MoE always gates it: "
                        "add --moe-shared-expert-gate)")
    qwen = bool(shared) or config.add_qkv_bias
    if qwen and not shared:
        problems.append("QKV biases without a shared expert (Qwen2-MoE has one, Mixtral has no "
                        "biases)")
    if not qwen:
        if not all(config.moe_layer_pattern()):
            problems.append("dense layers between MoE layers (Mixtral's layers are all MoE)")
        if config.moe_router_pre_softmax:
            problems.append("softmax before the top-k without renormalisation (Mixtral "
                            "renormalises the k: --moe-router-pre-softmax off)")
    if problems:
        raise HFMoEError("this MoE model is neither a MixtralForCausalLM nor a Qwen2MoeForCausalLM: "
                         + "; ".join(problems))
    if config.moe_expert_capacity_factor is not None:
        log.warning("the model was trained with capacity factor %s (dropped tokens); transformers "
                    "computes it dropless", config.moe_expert_capacity_factor)
    return QWEN2_MOE if qwen else MIXTRAL


# ---- state dicts ----------------------------------------------------------------------------
def to_hf_moe_state_dict(config: GPTConfig, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors -> the released Mixtral / Qwen2-MoE checkpoint keys (per-expert matrices)."""
    kind = hf_model_type(config)
    out = {"model.embed_tokens.weight": canonical["embedding.word.weight"],
           "model.norm.weight": canonical["final_norm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = canonical["output_layer.weight"]
    gate_name, up_name, down_name = _EXPERT[kind]
    for i, moe in enumerate(config.moe_layer_pattern()):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out.update(_attention_to_hf(config, canonical, ours, theirs))
        if not moe:                                       # a Qwen2-MoE dense layer: a Llama MLP
            for name, part in zip(_GATE_UP, canonical[f"{ours}mlp.fc1.weight"].chunk(2)):
                out[f"{theirs}mlp.{name}.weight"] = part
            out[f"{theirs}mlp.down_proj.weight"] = canonical[f"{ours}mlp.fc2.weight"]
            continue
        mlp = f"{theirs}{_MLP[kind]}."
        out[f"{mlp}gate.weight"] = canonical[f"{ours}mlp.router.weight"]
        fc1, fc2 = canonical[f"{ours}mlp.experts.fc1.weight"], canonical[f"{ours}mlp.experts.fc2.weight"]
        for j in range(config.num_experts):
            gate, up = fc1[j].chunk(2)                    # [2f, h] -> [f, h], [f, h]
            out[f"{mlp}experts.{j}.{gate_name}.weight"] = gate
            out[f"{mlp}experts.{j}.{up_name}.weight"] = up
            out[f"{mlp}experts.{j}.{down_name}.weight"] = fc2[j]
        if kind == QWEN2_MOE:
            for name, part in zip(_GATE_UP, canonical[f"{ours}mlp.shared_expert.fc1.weight"].chunk(2)):
                out[f"{mlp}shared_expert.{name}.weight"] = part
            out[f"{mlp}shared_expert.down_proj.weight"] = canonical[f"{ours}mlp.shared_expert.fc2.weight"]
            out[f"{mlp}shared_expert_gate.weight"] = canonical[f"{ours}mlp.shared_expert_gate.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf_moe_state_dict(config: GPTConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral / Qwen2-MoE tensors (released per-expert keys, or transformers 5's fused
    ``experts.gate_up_proj`` / ``down_proj``) -> canonical tensors; leftovers are refused."""
    kind = hf_model_type(config)
    hf = dict(hf)
    out = {"embedding.word.weight": _pop(hf, "model.embed_tokens.weight"),
           "final_norm.weight": _pop(hf, "model.norm.weight")}
    lm_head = hf.pop("lm_head.weight", None)
    if config.untie_embeddings_and_output_weights:
        if lm_head is None:
            raise HFMoEError("config.json says tie_word_embeddings=false but lm_head.weight is missing")
        out["output_layer.weight"] = lm_head
    gate_name, up_name, down_name = _EXPERT[kind]
    for i, moe in enumerate(config.moe_layer_pattern()):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out.update(_attention_from_hf(config, hf, ours, theirs))
        if not moe:
            out[f"{ours}mlp.fc1.weight"] = torch.cat([_pop(hf, f"{theirs}mlp.{n}.weight") for n in _GATE_UP])
            out[f"{ours}mlp.fc2.weight"] = _pop(hf, f"{theirs}mlp.down_proj.weight")
            continue
        mlp = next((f"{theirs}{m}." for m in (_MLP[kind], "mlp") if f"{theirs}{m}.gate.weight" in hf),
                   f"{theirs}{_MLP[kind]}.")
        out[f"{ours}mlp.router.weight"] = _pop(hf, f"{mlp}gate.weight")
        if f"{mlp}experts.gate_up_proj" in hf:            # transformers 5, in memory
            out[f"{ours}mlp.experts.fc1.weight"] = hf.pop(f"{mlp}experts.gate_up_proj")
            out[f"{ours}mlp.experts.fc2.weight"] = _pop(hf, f"{mlp}experts.down_proj")
        else:
            experts = range(config.num_experts)
            out[f"{ours}mlp.experts.fc1.weight"] = torch.stack([torch.cat(
                [_pop(hf, f"{mlp}experts.{j}.{n}.weight") for n in (gate_name, up_name)])
                for j in experts])
            out[f"{ours}mlp.experts.fc2.weight"] = torch.stack(
                [_pop(hf, f"{mlp}experts.{j}.{down_name}.weight") for j in experts])
        if kind == QWEN2_MOE:
            out[f"{ours}mlp.shared_expert.fc1.weight"] = torch.cat(
                [_pop(hf, f"{mlp}shared_expert.{n}.weight") for n in _GATE_UP])
            out[f"{ours}mlp.shared_expert.fc2.weight"] = _pop(hf, f"{mlp}shared_expert.down_proj.weight")
            out[f"{ours}mlp.shared_expert_gate.weight"] = _pop(hf, f"{mlp}shared_expert_gate.weight")
    left = sorted(k for k in hf if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise HFMoEError(f"HF weights hold tensors a {ARCHITECTURES[kind]} of this config does not "
                         f"have: {left[:4]}; config.json and the weights disagree")
    return out


def _attention_to_hf(config: GPTConfig, canonical: dict, ours: str, theirs: str) -> dict:
    kv = config.query_groups * config.head_dim
    out = {f"{theirs}input_layernorm.weight": canonical[f"{ours}ln1.weight"],
           f"{theirs}post_attention_layernorm.weight": canonical[f"{ours}ln2.weight"],
           f"{theirs}self_attn.o_proj.weight": canonical[f"{ours}attn.proj.weight"]}
    for kind in ("weight", "bias") if config.add_qkv_bias else ("weight",):
        for name, part in zip(_QKV, canonical[f"{ours}attn.qkv.{kind}"].split(
                [config.hidden_size, kv, kv])):
            out[f"{theirs}self_attn.{name}.{kind}"] = part
    return out


def _attention_from_hf(config: GPTConfig, hf: dict, ours: str, theirs: str) -> dict:
    out = {f"{ours}ln1.weight": _pop(hf, f"{theirs}input_layernorm.weight"),
           f"{ours}ln2.weight": _pop(hf, f"{theirs}post_attention_layernorm.weight"),
           f"{ours}attn.proj.weight": _pop(hf, f"{theirs}self_attn.o_proj.weight")}
    for kind in ("weight", "bias") if config.add_qkv_bias else ("weight",):
        out[f"{ours}attn.qkv.{kind}"] = torch.cat([_pop(hf, f"{theirs}self_attn.{n}.{kind}")
                                                   for n in _QKV])
    return out


def _pop(hf: dict, key: str) -> torch.Tensor:
    try:
        return hf.pop(key)
    except KeyError:
        raise HFMoEError(f"HF weights lack {key!r}; config.json and the weights disagree (layers, "
                         f"experts or dense layers)") from None


# ---- config.json ----------------------------------------------------------------------------
def hf_moe_config(config: GPTConfig, *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> dict:
    """``config.json`` of the Mixtral / Qwen2-MoE model computing what ``config`` computes."""
    kind = hf_model_type(config)
    meta = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.query_groups, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings, "hidden_act": "silu",
        "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_method_std, "use_cache": True,
        "num_experts_per_tok": config.moe_router_topk,
        "router_aux_loss_coef": config.moe_aux_loss_coeff, "output_router_logits": False,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }
    if kind == MIXTRAL:
        meta.update(num_local_experts=config.num_experts, intermediate_size=config.expert_ffn_hidden_size,
                    sliding_window=None, router_jitter_noise=0.0)
        return meta
    pattern = config.moe_layer_pattern()
    meta.update(num_experts=config.num_experts, intermediate_size=config.ffn_hidden_size,
                moe_intermediate_size=config.expert_ffn_hidden_size,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
                qkv_bias=config.add_qkv_bias, use_sliding_window=False, sliding_window=None,
                max_window_layers=config.num_layers)
    return meta


def gpt_config_from_hf_moe(cfg: dict, *, make_vocab_size_divisible_by: int = 128) -> GPTConfig:
    """Our :class:`GPTConfig` from a Mixtral or Qwen2-MoE ``config.json`` (refusing variants we do
    not model: sliding-window attention, rope scaling, other activations)."""
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise HFMoEError(f"model_type {kind!r} is not one of {MODEL_TYPES}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFMoEError(f"hidden_act {cfg.get('hidden_act')!r} is not silu (SwiGLU experts)")
    heads, h = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("head_dim") not in (None, h // heads):
        raise HFMoEError(f"head_dim {cfg['head_dim']} differs from hidden_size / heads = {h // heads}")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0 if kind == QWEN2_MOE else 1e6)))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFMoEError(f"rope scaling {rope} is not supported for MoE models")
    positions = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window") if kind == MIXTRAL or cfg.get("use_sliding_window") else None
    if window is not None and window < positions:
        raise HFMoEError(f"sliding-window attention (window {window} < {positions} positions) is "
                         f"not implemented here")
    layers, groups = cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads
    common = dict(num_layers=layers, hidden_size=h, num_attention_heads=heads,
                  vocab_size=cfg["vocab_size"], seq_length=positions,
                  max_position_embeddings=positions,
                  make_vocab_size_divisible_by=make_vocab_size_divisible_by, hidden_dropout=0.0,
                  attention_dropout=float(cfg.get("attention_dropout", 0.0)),
                  init_method_std=float(cfg.get("initializer_range", 0.02)),
                  norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), position_embedding_type="rope",
                  rotary_base=theta, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
                  moe_router_topk=int(cfg.get("num_experts_per_tok", 2)),
                  moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
                  **(dict(group_query_attention=True, num_query_groups=groups) if groups != heads else {}))
    try:
        if kind == MIXTRAL:
            return GPTConfig(**common, ffn_hidden_size=cfg["intermediate_size"],
                             num_experts=int(cfg.get("num_local_experts", 8)),
                             moe_router_pre_softmax=False)
        shared = cfg.get("shared_expert_intermediate_size")
        if not shared:
            raise HFMoEError("shared_expert_intermediate_size is 0 or missing; a Qwen2-MoE has a "
                             "shared expert")
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
        return GPTConfig(**common, ffn_hidden_size=cfg["intermediate_size"],
                         add_qkv_bias=bool(cfg.get("qkv_bias", True)),
                         num_experts=int(cfg["num_experts"]),
                         moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                         moe_shared_expert_intermediate_size=int(shared), moe_shared_expert_gate=True,
                         moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
                         moe_layer_freq=1 if all(pattern) else pattern)
    except ConfigError as err:
        raise HFMoEError(f"config.json describes a model this framework cannot build: {err}") from None
