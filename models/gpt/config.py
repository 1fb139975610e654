"""GPT model configuration (GPT-2 architecture as used by Megatron-LM and the ZeRO paper, §10 Table 5).

A :class:`GPTConfig` holds the model dimensions only (no parallel degrees, no batch sizes) and checks
itself on construction, with messages that say what to change (docs/design.md §9). Whether it
fits a tensor-parallel degree is a separate question, :meth:`GPTConfig.validate_for_tp`, because the
same model is trained at several TP degrees.

It is also the ``model`` section of the trainer's configuration: each field is a Megatron-LM flag
(``num_layers`` <-> ``--num-layers``) whose help text is the field's ``help`` metadata, so the
command line, a YAML/TOML preset and a checkpoint's stored config all build this one class and pass
through this one validation.

Parameter count of a dense GPT-2 layer (pre-LayerNorm, 4h MLP, biases everywhere):
    2 LayerNorms 4h + fused QKV 3h^2 + 3h + projection h^2 + h + MLP 8h^2 + 5h  =  12h^2 + 13h,
plus word embeddings V_padded * h, position embeddings P * h and the final LayerNorm 2h, which is
the paper's  Psi ~ 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))  (docs/design.md §Paper, FLOPs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """An invalid model configuration; the message says what to change."""


def _help(text: str, **default):
    """A field whose ``help`` metadata is its command-line help (no ``default``: required)."""
    return field(metadata={"help": text}, **default)


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int = _help("transformer layers")
    hidden_size: int = _help("hidden size h")
    num_attention_heads: int = _help("attention heads a")
    # None: not known yet; the trainer fills in its tokenizer's size before building a model
    vocab_size: int | None = _help("vocab size (default: the tokenizer's)", default=50257)
    seq_length: int = _help("tokens per sample s", default=1024)
    max_position_embeddings: int | None = _help("learned positions (default: seq length)",
                                                default=None)
    ffn_hidden_size: int | None = _help("MLP width (default: 4 h)", default=None)
    make_vocab_size_divisible_by: int = _help("pad the vocab to a multiple of this x TP", default=128)
    hidden_dropout: float = _help("dropout after attention and MLP", default=0.1)
    attention_dropout: float = _help("dropout on attention probabilities", default=0.1)
    init_method_std: float = _help("std of the normal weight init", default=0.02)
    layernorm_epsilon: float = _help("epsilon of every LayerNorm", default=1e-5)

    def __post_init__(self) -> None:
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        self._check_positive()
        self._check_shapes()
        self._check_numbers()

    # ---- validation ------------------------------------------------------------------------
    def _check_positive(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "max_position_embeddings", "ffn_hidden_size", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if value is None and name == "vocab_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}; "
                                  f"set {_flag(name)}")

    def _check_shapes(self) -> None:
        h, a = self.hidden_size, self.num_attention_heads
        if h % a:
            raise ConfigError(
                f"hidden size {h} is not divisible by {a} attention heads; set "
                f"--num-attention-heads to a divisor of {h} (e.g. {_nearest_divisor(h, a)}) or "
                f"--hidden-size to a multiple of {a}")
        s, p = self.seq_length, self.max_position_embeddings
        if s > p:
            raise ConfigError(
                f"sequence length {s} exceeds max position embeddings {p}; raise "
                f"--max-position-embeddings {p} to at least {s} or shorten --seq-length {s}")

    def _check_numbers(self) -> None:
        for name in ("hidden_dropout", "attention_dropout", "init_method_std", "layernorm_epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}; set {_flag(name)}")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {p}; set {_flag(name)}")
        for name in ("init_method_std", "layernorm_epsilon"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}; "
                                  f"set {_flag(name)}")

    def validate_for_tp(self, tp: int) -> None:
        """Raise :class:`ConfigError` unless the model can be split across ``tp`` ranks
        (whole attention heads and equal slices of h and of the MLP per rank)."""
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor-model-parallel size must be a positive integer, got {tp!r}")
        a, h, f = self.num_attention_heads, self.hidden_size, self.ffn_hidden_size
        if h % tp:
            raise ConfigError(
                f"hidden size {h} is not divisible by tensor-model-parallel size {tp} (--hidden-size "
                f"{h}, --tensor-model-parallel-size {tp}); use a TP degree that divides {h} or a "
                f"hidden size that is a multiple of {tp}")
        if a % tp:
            raise ConfigError(
                f"{a} attention heads cannot be split across tensor-model-parallel size {tp}: "
                f"--num-attention-heads {a} is not divisible by --tensor-model-parallel-size {tp}; "
                f"use a TP degree that divides {a} (e.g. {_nearest_divisor(a, tp)}) or a multiple "
                f"of {tp} heads")
        if f % tp:
            raise ConfigError(
                f"ffn hidden size {f} is not divisible by tensor-model-parallel size {tp}; use a TP "
                f"degree that divides {f} or set --ffn-hidden-size to a multiple of {tp}")

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocab rounded up to a multiple of ``make_vocab_size_divisible_by * tp`` (Megatron's rule):
        every TP rank holds an equal slice of the embedding, and slices stay GEMM-friendly."""
        if self.vocab_size is None:
            raise ConfigError("the vocab size is not set; pass --vocab-size or a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer: 4h^2 + 2hf + 9h + f (= 12h^2 + 13h at f = 4h)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return 4 * h * h + 2 * h * f + 9 * h + f

    def num_parameters(self, tp: int = 1) -> int:
        """Exact parameter count of the whole model with the vocab padded for ``tp`` (tied output
        layer counted once)."""
        h = self.hidden_size
        embeddings = (self.padded_vocab_size(tp) + self.max_position_embeddings) * h
        return embeddings + self.num_layers * self.layer_parameters() + 2 * h

    def num_parameters_per_rank(self, tp: int = 1) -> int:
        """Exact parameter count held by one of ``tp`` tensor-parallel ranks: the sharded matrices,
        QKV/MLP-in biases and word embedding divided by ``tp``; LayerNorms, row-parallel biases
        and position embeddings replicated."""
        self.validate_for_tp(tp)
        h, f = self.hidden_size, self.ffn_hidden_size
        sharded = self.layer_parameters() - 4 * h - 2 * h   # minus 2 LayerNorms and 2 row biases
        layer = sharded // tp + 6 * h
        embeddings = self.padded_vocab_size(tp) * h // tp + self.max_position_embeddings * h
        return embeddings + self.num_layers * layer + 2 * h

    def replace(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again); derived defaults are recomputed unless
        given explicitly."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "hidden_size" in changes and self.ffn_hidden_size == 4 * self.hidden_size:
            fields["ffn_hidden_size"] = None
        if "seq_length" in changes and self.max_position_embeddings == self.seq_length:
            fields["max_position_embeddings"] = None
        fields.update(changes)
        return GPTConfig(**fields)

    def to_dict(self) -> dict:
        """Plain dict for checkpoints (so a resumed run rebuilds its model)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown GPT config fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _nearest_divisor(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near`` (for suggestions in error messages)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), -d))
