"""Conversion between our canonical GPT-2 state dict and Hugging Face's ``GPT2LMHeadModel``
(Llama: models/gpt/hf_llama.py; Mixtral and Qwen2-MoE: models/gpt/hf_moe.py, dispatched here).

Both are the GPT-2 architecture (Radford et al. 2019: pre-LayerNorm, learned positions, tied output
embedding, GELU with the tanh approximation - HF's ``gelu_new``, our ``F.gelu(approximate="tanh")``).
The differences are only in naming and storage:

    ours (models/gpt/sharding.py, canonical)     HF GPT2LMHeadModel
    embedding.word.weight   [V, h]               transformer.wte.weight  [V, h]
    embedding.position.weight [P, h]             transformer.wpe.weight  [P, h]
    layers.i.ln1 / ln2 .weight/.bias [h]         transformer.h.i.ln_1 / ln_2
    layers.i.attn.qkv.weight [3h, h] (nn.Linear) transformer.h.i.attn.c_attn.weight [h, 3h] (Conv1D)
    layers.i.attn.proj.weight [h, h]             transformer.h.i.attn.c_proj.weight [h, h] (Conv1D)
    layers.i.mlp.fc1.weight [f, h]               transformer.h.i.mlp.c_fc.weight [h, f]  (Conv1D)
    layers.i.mlp.fc2.weight [h, f]               transformer.h.i.mlp.c_proj.weight [f, h] (Conv1D)
    final_norm.weight/.bias                      transformer.ln_f
    (tied to the word embedding)                 lm_head.weight (tied; not stored)

HF's ``Conv1D`` stores ``[in, out]``, the transpose of ``nn.Linear``. Its fused ``c_attn`` columns are
``[q | k | v]`` with the heads contiguous inside each - exactly our canonical QKV rows; the per-head
``[q k v]`` interleave exists only in the TP layout and :mod:`models.gpt.sharding` adds/removes it
when a model is built at a TP degree. The canonical word embedding has the true vocab (no padding
rows), which is also HF's ``vocab_size``; padding is added again by ``shard_tensor`` at import.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hybrid.data.sentencepiece_convert import ConversionError
from hybrid.data.tokenizer import Tokenizer
from models.gpt.config import ConfigError, GPTConfig
from models.gpt import hf_llama, hf_moe
from models.gpt.sharding import canonical_shapes

log = logging.getLogger(__name__)

WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
INDEX_FILE = "model.safetensors.index.json"   # sharded checkpoints: {"weight_map": {key: file}}
TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_JSON_FILE = "tokenizer.json"
_TOP = {"embedding.word.weight": "wte.weight", "embedding.position.weight": "wpe.weight",
        "final_norm.weight": "ln_f.weight", "final_norm.bias": "ln_f.bias"}
_LAYER = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
          "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_CONV1D = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")
# GPT-2 activations HF computes with the tanh approximation of GELU (what our model uses)
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# buffers of older HF checkpoints (the causal mask), not parameters
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class HFConversionError(ValueError):
    """A Hugging Face directory or config this converter cannot represent; says what to change."""


def hf_name(name: str) -> str:
    """Canonical parameter name -> HF ``GPT2LMHeadModel`` state-dict key."""
    if name in _TOP:
        return "transformer." + _TOP[name]
    _, i, rest = name.split(".", 2)                       # "layers", "3", "attn.qkv.weight"
    module, param = rest.rsplit(".", 1)
    return f"transformer.h.{i}.{_LAYER[module]}.{param}"


def to_hf_state_dict(config: GPTConfig, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical state dict -> HF tensors (contiguous, Conv1D weights transposed, lm_head left tied)."""
    _check_gpt2(config)
    _check_names(config, canonical)
    out = {}
    for name, t in canonical.items():
        t = t.detach()
        out[hf_name(name)] = (t.t() if name.endswith(_CONV1D) else t).contiguous()
    return out


def from_hf_state_dict(config: GPTConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (``GPT2LMHeadModel`` keys, or ``GPT2Model`` keys without ``transformer.``) ->
    canonical state dict. An untied ``lm_head.weight`` that differs from ``wte`` is refused."""
    keys = {k.removeprefix("transformer."): k for k in hf
            if not k.endswith(_IGNORED_SUFFIXES) and k != "lm_head.weight"}
    out = {}
    for name, shape in canonical_shapes(config).items():
        key = hf_name(name).removeprefix("transformer.")
        if key not in keys:
            raise HFConversionError(f"HF weights lack {key!r} (needed for {name}); is this a GPT-2 "
                                    f"checkpoint with {config.num_layers} layers?")
        t = hf[keys.pop(key)]
        t = t.t() if name.endswith(_CONV1D) else t
        if tuple(t.shape) != shape:
            raise HFConversionError(f"HF tensor {key!r} has shape {list(t.shape)}, the config implies "
                                    f"{list(shape)}; config.json and the weights disagree")
        out[name] = t.contiguous()
    if keys:
        raise HFConversionError(f"HF weights hold tensors GPT-2 does not have: {sorted(keys)[:4]}; "
                                f"this is not a plain GPT2LMHeadModel")
    lm_head = hf.get("lm_head.weight")
    if lm_head is not None and not torch.equal(lm_head, out["embedding.word.weight"]):
        raise HFConversionError("lm_head.weight differs from transformer.wte.weight: the output layer "
                                "is untied, but this model ties it to the word embedding")
    return out


def hf_config(config: GPTConfig, *, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict:
    """``config.json`` of a ``GPT2LMHeadModel`` with the dims of ``config``."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": config.norm_epsilon,
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout, "initializer_range": config.init_method_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }


def gpt_config_from_hf(cfg: dict, *, make_vocab_size_divisible_by: int = 128) -> GPTConfig:
    """Our :class:`GPTConfig` from an HF GPT-2 ``config.json`` (refusing variants we do not model)."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise HFConversionError(f"model_type {cfg.get('model_type')!r} is not gpt2, llama, mixtral "
                                f"or qwen2_moe; only those checkpoints convert")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise HFConversionError(f"activation_function {act!r} is not the tanh GELU (gelu_new) our "
                                f"model computes; logits would differ")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if cfg.get(flag, False):
            raise HFConversionError(f"config sets {flag}=true, which our GPT-2 does not implement")
    if not cfg.get("scale_attn_weights", True) or not cfg.get("tie_word_embeddings", True):
        raise HFConversionError("config needs scale_attn_weights=true and tie_word_embeddings=true")
    positions = int(cfg.get("n_positions", cfg.get("n_ctx", 1024)))
    try:
        return GPTConfig(num_layers=int(cfg["n_layer"]), hidden_size=int(cfg["n_embd"]),
                         num_attention_heads=int(cfg["n_head"]), vocab_size=int(cfg["vocab_size"]),
                         seq_length=positions, max_position_embeddings=positions,
                         ffn_hidden_size=cfg.get("n_inner") or None,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                         hidden_dropout=float(cfg.get("resid_pdrop", 0.1)),
                         attention_dropout=float(cfg.get("attn_pdrop", 0.1)),
                         init_method_std=float(cfg.get("initializer_range", 0.02)),
                         norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)))
    except KeyError as missing:
        raise HFConversionError(f"config.json lacks {missing}; it is not a GPT-2 config") from None
    except ConfigError as err:
        raise HFConversionError(f"config.json describes an invalid model: {err}") from None


def save_hf_directory(out_dir: str | Path, config: GPTConfig, canonical: dict[str, torch.Tensor], *,
                      tokenizer_model: str | Path | None = None,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Write a ``GPT2LMHeadModel`` directory: config.json, model.safetensors, and (given a
    tokenizer file, :class:`hybrid.data.tokenizer.Tokenizer`) tokenizer files. Written to ``<out>.tmp`` and renamed, so a crash never
    leaves a half directory under the final name."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bos = eos = None
    if tokenizer_model is not None:
        bos, eos = write_tokenizer_files(tmp, tokenizer_model)
    moe = config.num_experts is not None
    llama = hf_llama.is_llama(config) and not moe
    _check_names(config, canonical)
    if moe:
        tensors, write_config = hf_moe.to_hf_moe_state_dict(config, canonical), hf_moe.hf_moe_config
    elif llama:
        tensors, write_config = hf_llama.to_hf_llama_state_dict(config, canonical), hf_llama.hf_llama_config
    else:
        tensors, write_config = to_hf_state_dict(config, canonical), hf_config
    save_file({k: v.to(dtype) for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE),
              metadata={"format": "pt"})
    meta = write_config(config, bos_token_id=bos, eos_token_id=eos)
    meta["torch_dtype"] = meta["dtype"] = str(dtype).removeprefix("torch.")  # transformers 4 / 5 key
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("wrote Hugging Face %s directory %s", meta["architectures"][0], out)
    return out


def write_tokenizer_files(out_dir: Path, tokenizer_model: str | Path) -> tuple[int | None, int | None]:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` loads as a
    fast tokenizer without sentencepiece (no BOS/EOS added, no prefix space: our encoding exactly).
    A sentencepiece model is converted (hybrid/data/sentencepiece_convert.py) and also copied as
    ``tokenizer.model``; one the converter cannot reproduce ships as ``tokenizer.model`` alone,
    loaded as a ``LlamaTokenizer``. Returns (bos id, eos id)."""
    tok = Tokenizer(tokenizer_model)
    if tok.kind == "sentencepiece":
        shutil.copyfile(tok.model_path, out_dir / TOKENIZER_FILE)
    try:
        if tok.kind == "tokenizer.json":
            shutil.copyfile(tok.model_path, out_dir / TOKENIZER_JSON_FILE)
        else:
            tok.to_tokenizer_json().save(str(out_dir / TOKENIZER_JSON_FILE))
        tokenizer_class = "PreTrainedTokenizerFast"
    except ConversionError as err:
        log.warning("no %s written (AutoTokenizer will need sentencepiece): %s",
                    TOKENIZER_JSON_FILE, err)
        tokenizer_class = "LlamaTokenizer"
    special = tok.special_tokens()
    token = {name: pair[0] if pair else None for name, pair in special.items()}
    meta = {"tokenizer_class": tokenizer_class, "add_bos_token": False, "add_eos_token": False,
            "add_prefix_space": False, "legacy": False, "clean_up_tokenization_spaces": False,
            "bos_token": token["bos"], "eos_token": token["eos"], "unk_token": token["unk"],
            "pad_token": token["eos"]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return tuple(special[name][1] if special[name] else None for name in ("bos", "eos"))


def is_hf_directory(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and ((path / WEIGHTS_FILE).is_file()
                                               or (path / INDEX_FILE).is_file())


def read_hf_config(path: str | Path, *, make_vocab_size_divisible_by: int = 128) -> GPTConfig:
    """The :class:`GPTConfig` of an HF GPT-2, Llama, Mixtral or Qwen2-MoE directory's config.json
    (no weights read)."""
    file = Path(path) / CONFIG_FILE
    meta = _read_json(file)
    convert = {"llama": hf_llama.gpt_config_from_hf_llama,
               **dict.fromkeys(hf_moe.MODEL_TYPES, hf_moe.gpt_config_from_hf_moe)}.get(
        meta.get("model_type"), gpt_config_from_hf)
    try:
        return convert(meta, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    except (KeyError, TypeError) as err:
        raise HFConversionError(f"{file} is not a GPT-2 or Llama config (missing or wrong {err}); "
                                f"pass a directory written by save_pretrained or "
                                f"tools/export_hf.py") from None


def load_hf_directory(path: str | Path, *, make_vocab_size_divisible_by: int = 128
                      ) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """``(canonical fp32 state dict, GPTConfig)`` of an HF GPT-2 directory (model.safetensors, or
    shards listed in model.safetensors.index.json). Pickled ``.bin`` weights are refused."""
    path = Path(path)
    if not is_hf_directory(path):
        raise HFConversionError(f"{path} is not a Hugging Face model directory with {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE} (for .bin checkpoints: re-save them with "
                                f"save_pretrained(safe_serialization=True))")
    config = read_hf_config(path, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    moe = config.num_experts is not None
    llama = hf_llama.is_llama(config) and not moe
    if (path / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        files = sorted(set(_read_json(path / INDEX_FILE)["weight_map"].values()))
    hf = {k: v.float() for f in files for k, v in _load_tensors(path / f).items()}
    if moe:
        return hf_moe.from_hf_moe_state_dict(config, hf), config
    if llama:
        return hf_llama.from_hf_llama_state_dict(config, hf), config
    return from_hf_state_dict(config, hf), config


def _check_gpt2(config: GPTConfig) -> None:
    """A GPT2LMHeadModel computes learned positions, LayerNorm, GELU, biases, tied output only."""
    if (config.position_embedding_type, config.normalization, config.swiglu,
            config.group_query_attention, config.add_bias_linear,
            config.untie_embeddings_and_output_weights) != ("learned_absolute", "LayerNorm", False,
                                                            False, True, False):
        raise HFConversionError(
            "this model uses options a GPT2LMHeadModel does not compute (rope / RMSNorm / SwiGLU / "
            "GQA / no biases / untied output); Llama-style models (rope, RMSNorm, SwiGLU) export "
            "as LlamaForCausalLM")


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFConversionError(f"{file} is not valid JSON ({err}); restore it or export the "
                                f"model again") from None


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:   # a damaged or foreign file
        raise HFConversionError(f"{file} is not a readable safetensors file ({err}); restore it "
                                f"or export the model again") from None


def _check_names(config: GPTConfig, canonical: dict[str, torch.Tensor]) -> None:
    expected = canonical_shapes(config)
    missing, extra = sorted(set(expected) - set(canonical)), sorted(set(canonical) - set(expected))
    if missing or extra:
        raise HFConversionError(f"state dict does not match the config: missing {missing[:4]}, "
                                f"unexpected {extra[:4]}")
    for name, shape in expected.items():
        if tuple(canonical[name].shape) != shape:
            raise HFConversionError(f"{name} has shape {list(canonical[name].shape)}, the config "
                                    f"implies {list(shape)} (padded vocab? export canonical tensors)")
