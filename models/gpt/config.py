"""GPT model configuration (GPT-2 architecture as used by Megatron-LM and the ZeRO paper, §10 Table 5).

A :class:`GPTConfig` holds the model dimensions only (no parallel degrees, no batch sizes) and checks
itself on construction, with messages that say what to change (docs/design.md §9). Whether it
fits a tensor-parallel degree is a separate question, :meth:`GPTConfig.validate_for_tp`, because the
same model is trained at several TP degrees.

Parameter count of a dense GPT-2 layer (pre-LayerNorm, 4h MLP, biases everywhere):
    2 LayerNorms 4h + fused QKV 3h^2 + 3h + projection h^2 + h + MLP 8h^2 + 5h  =  12h^2 + 13h,
plus word embeddings V_padded * h, position embeddings P * h and the final LayerNorm 2h, which is
the paper's  Psi ~ 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))  (docs/design.md §Paper, FLOPs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """An invalid model configuration; the message says what to change."""


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50257
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # defaults to seq_length
    ffn_hidden_size: int | None = None          # defaults to 4 * hidden_size
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5

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
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} must be a positive integer, got {value!r}; set {flag}")

    def _check_shapes(self) -> None:
        h, a = self.hidden_size, self.num_attention_heads
        if h % a:
            raise ConfigError(
                f"hidden size {h} is not divisible by {a} attention heads; choose a head count "
                f"that divides {h} (e.g. {_nearest_divisor(h, a)}) or a hidden size that is a "
                f"multiple of {a}")
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"sequence length {self.seq_length} exceeds max position embeddings "
                f"{self.max_position_embeddings}; raise --max-position-embeddings to at least "
                f"{self.seq_length} or shorten --seq-length")

    def _check_numbers(self) -> None:
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {p}")
        if not self.init_method_std > 0:
            raise ConfigError(f"init_method_std must be positive, got {self.init_method_std}")
        if not self.layernorm_epsilon > 0:
            raise ConfigError(f"layernorm_epsilon must be positive, got {self.layernorm_epsilon}")

    def validate_for_tp(self, tp: int) -> None:
        """Raise :class:`ConfigError` unless the model can be split across ``tp`` ranks
        (whole attention heads and equal slices of h and of the MLP per rank)."""
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor-model-parallel size must be a positive integer, got {tp!r}")
        a, h, f = self.num_attention_heads, self.hidden_size, self.ffn_hidden_size
        if a % tp:
            raise ConfigError(
                f"{a} attention heads cannot be split across tensor-model-parallel size {tp}; use a "
                f"TP degree that divides {a} (e.g. {_nearest_divisor(a, tp)}) or a multiple of {tp} heads")
        if h % tp:
            raise ConfigError(
                f"hidden size {h} is not divisible by tensor-model-parallel size {tp}; use a TP degree "
                f"that divides {h} or a hidden size that is a multiple of {tp}")
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


def _nearest_divisor(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near`` (for suggestions in error messages)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), -d))
