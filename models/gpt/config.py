"""GPT model configuration: GPT-2 (as used by Megatron-LM and the ZeRO paper, §10 Table 5) and the
Llama-family options of Megatron-LM's GPT model (rotary positions, RMSNorm, SwiGLU, grouped-query
attention, no linear biases, an untied output layer).

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
With the options: QKV is h (h + 2 g d) for g query groups of head size d; SwiGLU's MLP has three
f x h matrices (gate, up, down); RMSNorm has a gain only (h); rotary positions have no parameters;
an untied output layer adds V_padded * h. Field names follow Megatron-LM's arguments, so each is the
flag of the same name (``add_bias_linear=False`` is ``--disable-bias-linear``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hybrid.perf.architecture import Architecture
from hybrid.perf.flops import active_param_count


class ConfigError(ValueError):
    """An invalid model configuration; the message says what to change."""


def _help(text: str, off_flag: str | None = None, **default):
    """A field whose ``help`` metadata is its command-line help (no ``default``: required);
    ``off_flag``: Megatron's name of the flag that turns a default-on option off."""
    metadata = {"help": text} if off_flag is None else {"help": text, "off_flag": off_flag}
    return field(metadata=metadata, **default)


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
    ffn_hidden_size: int | None = _help("MLP width (default: 4 h; SwiGLU: 8h/3 rounded down to 64)",
                                        default=None)
    make_vocab_size_divisible_by: int = _help("pad the vocab to a multiple of this x TP", default=128)
    hidden_dropout: float = _help("dropout after attention and MLP", default=0.1)
    attention_dropout: float = _help("dropout on attention probabilities", default=0.1)
    init_method_std: float = _help("std of the normal weight init", default=0.02)
    norm_epsilon: float = _help("epsilon of every LayerNorm / RMSNorm", default=1e-5)
    # ---- Llama-family options (Megatron-LM's names) ----
    position_embedding_type: str = _help("learned_absolute | rope", default="learned_absolute")
    rotary_base: float = _help("rotary embedding base (Llama-2 10000, Llama-3 500000)",
                               default=10000.0)
    use_rope_scaling: bool = _help("Llama-3.1 frequency scaling of the rotary embedding",
                                   default=False)
    rope_scaling_factor: float = _help("rope scaling factor (Llama-3.1: 8)", default=8.0)
    rope_low_freq_factor: float = _help("rope scaling low-frequency factor", default=1.0)
    rope_high_freq_factor: float = _help("rope scaling high-frequency factor", default=4.0)
    rope_original_max_position_embeddings: int = _help("context the rope scaling extends",
                                                       default=8192)
    normalization: str = _help("LayerNorm | RMSNorm", default="LayerNorm")
    swiglu: bool = _help("SwiGLU MLP (gate and up projections) instead of GELU", default=False)
    group_query_attention: bool = _help("grouped-query attention (needs --num-query-groups)",
                                        default=False)
    num_query_groups: int | None = _help("key/value groups with GQA; 1 = multi-query attention",
                                         default=None)
    add_bias_linear: bool = _help("biases in every linear layer", off_flag="--disable-bias-linear",
                                  default=True)
    untie_embeddings_and_output_weights: bool = _help("an output layer of its own, not the "
                                                      "word embedding", default=False)
    attention_softmax_in_fp32: bool = _help("run the attention core (q k^T, softmax, x v) in fp32 "
                                            "when the model is bf16 or fp16 (on CPU slower than "
                                            "the bf16 core)",
                                            default=False)
    add_qkv_bias: bool = _help("biases in the QKV projection even with --disable-bias-linear "
                               "(Qwen2)", default=False)
    # ---- mixture of experts (issue 32; Megatron-LM's names) ----
    num_experts: int | None = _help("experts per MoE layer (none: a dense model)", default=None)
    moe_router_topk: int = _help("experts each token is routed to (k)", default=2)
    moe_ffn_hidden_size: int | None = _help("width f of each routed expert's SwiGLU (default: "
                                            "--ffn-hidden-size)", default=None)
    moe_shared_expert_intermediate_size: int | None = _help(
        "width of the shared expert every token passes through (none: no shared expert)",
        default=None)
    moe_shared_expert_gate: bool = _help("Qwen2-MoE's sigmoid gate on the shared expert's output",
                                         default=False)
    moe_layer_freq: int | tuple[int, ...] = _help(
        "which layers are MoE: N = every N-th layer from layer 0, or one 0/1 per layer", default=1)
    moe_router_score_function: str = _help("softmax | sigmoid (DeepSeek-V3) router scores",
                                           default="softmax")
    moe_router_pre_softmax: bool = _help("softmax over all experts, then top-k (default: top-k "
                                         "logits, then softmax over the k, as Mixtral)",
                                         default=False)
    moe_router_topk_scaling_factor: float | None = _help(
        "multiply the routing probabilities of the chosen experts by this (DeepSeek: 2.5)",
        default=None)
    moe_router_load_balancing_type: str = _help(
        "aux_loss (Switch/GShard, per micro-batch) | seq_aux_loss (per sequence, DeepSeek) | none",
        default="aux_loss")
    moe_aux_loss_coeff: float = _help("weight of the load-balancing loss (0: off)", default=0.0)
    moe_z_loss_coeff: float | None = _help("weight of the router z-loss (mean logsumexp^2; none: "
                                           "off)", default=None)
    moe_router_enable_expert_bias: bool = _help(
        "DeepSeek-V3's aux-loss-free balancing: a per-expert bias on the selection scores, moved "
        "each step toward the mean load (needs sigmoid scores)", default=False)
    moe_router_bias_update_rate: float = _help("step of the expert-bias update per optimizer step",
                                               default=1e-3)
    moe_expert_capacity_factor: float | None = _help(
        "expert capacity = ceil(factor x tokens x k / experts) per micro-batch; overflow tokens "
        "are dropped (none: dropless)", default=None)
    moe_token_dispatcher_type: str = _help("alltoall | allgather token dispatch with expert "
                                           "parallelism", default="alltoall")

    def __post_init__(self) -> None:
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", self._default_ffn_hidden_size())
        self._check_positive()
        self._check_shapes()
        self._check_numbers()
        self._check_options()
        self._normalise_moe()
        self._check_moe()

    def _default_ffn_hidden_size(self) -> int:
        """4h; with SwiGLU 2/3 of that rounded down to a multiple of 64 (Megatron's rule: three
        matrices of about the parameters of the two 4h ones)."""
        if self.swiglu:
            return max(64, int(4 * self.hidden_size * 2 / 3) // 64 * 64)
        return 4 * self.hidden_size

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
        for name in ("hidden_dropout", "attention_dropout", "init_method_std", "norm_epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}; set {_flag(name)}")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {p}; set {_flag(name)}")
        if not self.init_method_std > 0:
            raise ConfigError(f"init_method_std must be positive, got {self.init_method_std}; set "
                              f"--init-method-std")
        if not self.norm_epsilon > 0:
            raise ConfigError(f"norm_epsilon must be positive, got {self.norm_epsilon}; set "
                              f"--norm-epsilon (e.g. 1e-5)")

    def _check_options(self) -> None:
        _check_choice("position_embedding_type", self.position_embedding_type,
                      ("learned_absolute", "rope"))
        _check_choice("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        for name in ("use_rope_scaling", "swiglu", "group_query_attention", "add_bias_linear",
                     "untie_embeddings_and_output_weights", "attention_softmax_in_fp32",
                     "add_qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_rotary()
        self._check_query_groups()

    def _check_rotary(self) -> None:
        if self.position_embedding_type == "rope":
            if self.head_dim % 2:
                raise ConfigError(
                    f"rotary embeddings rotate pairs of channels, but the head size "
                    f"{self.head_dim} (hidden {self.hidden_size} / {self.num_attention_heads} heads) "
                    f"is odd; choose an even head size")
            if not self.rotary_base > 1:
                raise ConfigError(f"rotary_base must be greater than 1, got {self.rotary_base}; "
                                  f"set --rotary-base (10000 for Llama-2, 500000 for Llama-3)")
        elif self.use_rope_scaling:
            raise ConfigError("rope scaling applies to rotary embeddings only; add "
                              "--position-embedding-type rope or drop --use-rope-scaling")
        if not self.use_rope_scaling:
            return
        if not self.rope_scaling_factor >= 1:
            raise ConfigError(f"rope_scaling_factor must be at least 1, got {self.rope_scaling_factor}")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(
                f"rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor} (Llama-3: 1 and 4)")
        original = self.rope_original_max_position_embeddings
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ConfigError(f"rope_original_max_position_embeddings must be a positive integer, "
                              f"got {original!r} (Llama-3: 8192)")

    def _check_query_groups(self) -> None:
        a, g = self.num_attention_heads, self.num_query_groups
        if not self.group_query_attention:
            if g is not None:
                raise ConfigError(f"num_query_groups={g} needs grouped-query attention; add "
                                  f"--group-query-attention or drop --num-query-groups")
            return
        if g is None:
            raise ConfigError("grouped-query attention needs --num-query-groups (1 = multi-query "
                              f"attention, {a} = every head its own keys and values)")
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ConfigError(f"num_query_groups must be a positive integer, got {g!r}")
        if a % g:
            raise ConfigError(
                f"{a} attention heads cannot be shared evenly by {g} query groups; use a number "
                f"of query groups that divides {a} (e.g. {_nearest_divisor(a, g)})")

    def _normalise_moe(self) -> None:
        """A layer pattern read from YAML/JSON or the command line is a list: one value is the
        frequency N, several are the 0/1 pattern (kept as a tuple: the config is frozen)."""
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            freq = freq[0] if len(freq) == 1 else tuple(freq)
            object.__setattr__(self, "moe_layer_freq", freq)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)

    def _check_moe(self) -> None:
        """The MoE fields: one error per problem, naming the flag to change."""
        e = self.num_experts
        if e is None:
            return
        for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}; set {_flag(name)}")
        if self.moe_router_topk > e:
            raise ConfigError(f"moe_router_topk {self.moe_router_topk} exceeds the {e} experts: a "
                              f"token cannot go to more experts than exist; set --moe-router-topk "
                              f"to at most {e}")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int)
                                   or shared < 1):
            raise ConfigError(f"moe_shared_expert_intermediate_size must be a positive integer, got "
                              f"{shared!r}; set --moe-shared-expert-intermediate-size")
        if self.moe_shared_expert_gate and shared is None:
            raise ConfigError("--moe-shared-expert-gate gates the shared expert, but there is none; "
                              "add --moe-shared-expert-intermediate-size or drop the gate")
        if not self.swiglu:
            raise ConfigError("the experts are SwiGLU MLPs (Mixtral, DeepSeek, Qwen2-MoE); add "
                              "--swiglu to use --num-experts")
        self._check_moe_layer_freq()
        _check_choice("moe_router_score_function", self.moe_router_score_function,
                      ("softmax", "sigmoid"))
        _check_choice("moe_router_load_balancing_type", self.moe_router_load_balancing_type,
                      ("aux_loss", "seq_aux_loss", "none"))
        _check_choice("moe_token_dispatcher_type", self.moe_token_dispatcher_type,
                      ("alltoall", "allgather"))
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ConfigError("--moe-router-pre-softmax orders softmax and top-k, which only the "
                              "softmax score function has; drop it or use "
                              "--moe-router-score-function softmax")
        self._check_moe_numbers()

    def _check_moe_layer_freq(self) -> None:
        freq, layers = self.moe_layer_freq, self.num_layers
        if isinstance(freq, tuple):
            if len(freq) != layers or any(v not in (0, 1) or isinstance(v, float) for v in freq):
                raise ConfigError(f"moe_layer_freq as a pattern needs one 0 (dense) or 1 (MoE) per "
                                  f"layer, {layers} values, got {list(freq)}; or give one number N "
                                  f"(every N-th layer)")
            if not any(freq):
                raise ConfigError("moe_layer_freq marks no layer as MoE; put a 1 in the pattern or "
                                  "drop --num-experts for a dense model")
        elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"moe_layer_freq must be a positive integer N (every N-th layer is "
                              f"MoE) or a 0/1 pattern per layer, got {freq!r}; set --moe-layer-freq")

    def _check_moe_numbers(self) -> None:
        for name in ("moe_aux_loss_coeff", "moe_router_bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}; set "
                                  f"{_flag(name)}")
        for name in ("moe_z_loss_coeff", "moe_expert_capacity_factor",
                     "moe_router_topk_scaling_factor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ConfigError(f"{name} must be a positive number or unset, got {value!r}; set "
                                  f"{_flag(name)} > 0 or leave it out")
        if self.moe_router_enable_expert_bias:
            if self.moe_router_score_function != "sigmoid":
                raise ConfigError("--moe-router-enable-expert-bias is DeepSeek-V3's aux-loss-free "
                                  "balancing, defined on sigmoid scores; add "
                                  "--moe-router-score-function sigmoid")
            if not self.moe_router_bias_update_rate > 0:
                raise ConfigError("--moe-router-enable-expert-bias needs a positive "
                                  "--moe-router-bias-update-rate (DeepSeek-V3: 1e-3)")

    def is_moe_layer(self, index: int) -> bool:
        """Whether transformer layer ``index`` (0-based) is a MoE layer."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[index]) if isinstance(freq, tuple) else index % freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

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
        g = self.query_groups
        if g % tp:
            raise ConfigError(
                f"{g} query groups cannot be split across tensor-model-parallel size {tp} (each rank "
                f"holds whole groups of keys and values); use a TP degree that divides {g} (e.g. "
                f"{_nearest_divisor(g, tp)}) or set --num-query-groups to a multiple of {tp}")
        if f % tp:
            raise ConfigError(
                f"ffn hidden size {f} is not divisible by tensor-model-parallel size {tp}; use a TP "
                f"degree that divides {f} or set --ffn-hidden-size to a multiple of {tp}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            width = getattr(self, name) if self.num_experts is not None else None
            if width is not None and width % tp:
                raise ConfigError(
                    f"{name.replace('_', ' ')} {width} is not divisible by tensor-model-parallel "
                    f"size {tp} (experts are split like the dense MLP); set {_flag(name)} to a "
                    f"multiple of {tp}")

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

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups`` with grouped-query attention, else one per head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Output features of the fused QKV projection: h queries + 2 g d keys and values."""
        return self.hidden_size + 2 * self.query_groups * self.head_dim

    @property
    def norm_parameters(self) -> int:
        """One norm's parameters: LayerNorm gain and bias 2h, RMSNorm gain h."""
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden_size

    def _layer_split(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of one layer: the QKV / MLP-in / MLP-out /
        projection matrices and the column-parallel biases are sharded; the two norms and the two
        row-parallel biases are replicated."""
        h, f, bias = self.hidden_size, self.ffn_hidden_size, self.add_bias_linear
        mlp_in = 2 * f if self.swiglu else f          # SwiGLU: gate and up
        sharded = h * self.qkv_size + h * h + h * mlp_in + f * h
        if bias:
            sharded += self.qkv_size + mlp_in
        elif self.add_qkv_bias:
            sharded += self.qkv_size
        replicated = 2 * self.norm_parameters + (2 * h if bias else 0)
        return sharded, replicated

    def layer_parameters(self) -> int:
        """Parameters of one dense transformer layer (4h^2 + 2hf + 9h + f = 12h^2 + 13h for GPT-2)."""
        return sum(self._layer_split())

    def _moe_layer_split(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of one MoE layer: the dense layer without its MLP,
        plus E routed SwiGLU experts 3 h f_moe and the shared expert 3 h f_s (sharded), the
        router E h and the shared-expert gate h (replicated). No biases in the MoE block."""
        sharded, replicated = self._layer_split()
        h, f, bias = self.hidden_size, self.ffn_hidden_size, self.add_bias_linear
        sharded -= 3 * h * f + (2 * f if bias else 0)           # the dense SwiGLU MLP
        replicated -= h if bias else 0                            # its row-parallel bias
        shared = self.moe_shared_expert_intermediate_size or 0
        sharded += self.num_experts * 3 * h * self.moe_ffn_hidden_size + 3 * h * shared
        replicated += self.num_experts * h + (h if self.moe_shared_expert_gate else 0)
        return sharded, replicated

    def _layers_split(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of all layers, MoE layers counted with every expert."""
        moe = self.num_moe_layers
        dense, dense_rep = self._layer_split()
        out = [(self.num_layers - moe) * dense, (self.num_layers - moe) * dense_rep]
        if moe:
            sharded, replicated = self._moe_layer_split()
            out = [out[0] + moe * sharded, out[1] + moe * replicated]
        return out[0], out[1]

    def _embedding_parameters(self, vocab_rows: int) -> int:
        """Word embedding (+ untied output layer) of ``vocab_rows`` rows and learned positions."""
        h = self.hidden_size
        tables = 2 if self.untie_embeddings_and_output_weights else 1
        positions = self.max_position_embeddings if self.position_embedding_type == "learned_absolute" else 0
        return tables * vocab_rows * h + positions * h

    def num_parameters(self, tp: int = 1) -> int:
        """Exact parameter count of the whole model with the vocab padded for ``tp`` (a tied output
        layer counted once); with MoE layers every expert counted (the total)."""
        return (self._embedding_parameters(self.padded_vocab_size(tp))
                + sum(self._layers_split()) + self.norm_parameters)

    def num_active_parameters(self, tp: int = 1) -> int:
        """Parameters one token uses: :meth:`num_parameters` less the E - k routed experts it
        skips in every MoE layer (the total for a dense model)."""
        return active_param_count(self.num_layers, self.hidden_size, self.padded_vocab_size(tp),
                                  self.max_position_embeddings, heads=self.num_attention_heads,
                                  arch=self.perf_architecture())

    # ---- mixture of experts ----------------------------------------------------------------
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Per layer whether it is a MoE layer: ``moe_layer_freq`` N makes layers 0, N, 2N, ... MoE;
        a sequence gives one 0/1 per layer; a dense model has none."""
        return tuple(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One routed expert's width: ``moe_ffn_hidden_size``, else ``ffn_hidden_size``."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def num_parameters_per_rank(self, tp: int = 1) -> int:
        """Exact parameter count held by one of ``tp`` tensor-parallel ranks: the sharded matrices,
        column-parallel biases and vocab tables divided by ``tp``; norms, row-parallel biases and
        position embeddings replicated."""
        self.validate_for_tp(tp)
        sharded, replicated = self._layers_split()
        embeddings = self._embedding_parameters(self.padded_vocab_size(tp) // tp)
        return embeddings + sharded // tp + replicated + self.norm_parameters

    def perf_architecture(self) -> Architecture:
        """The options as the perf models (hybrid.perf: parameters, FLOPs, activations) take them."""
        return Architecture(ffn_hidden=self.ffn_hidden_size,
                            query_groups=self.num_query_groups if self.group_query_attention else None,
                            swiglu=self.swiglu, bias=self.add_bias_linear,
                            rmsnorm=self.normalization == "RMSNorm",
                            untied=self.untie_embeddings_and_output_weights,
                            learned_positions=self.position_embedding_type == "learned_absolute",
                            qkv_bias=self.add_qkv_bias, **self._perf_moe())

    def _perf_moe(self) -> dict:
        if self.num_experts is None:
            return {}
        return dict(num_experts=self.num_experts, moe_topk=self.moe_router_topk,
                    moe_ffn_hidden=self.expert_ffn_hidden_size,
                    shared_expert_ffn=self.moe_shared_expert_intermediate_size,
                    shared_expert_gate=self.moe_shared_expert_gate,
                    moe_pattern=tuple(int(m) for m in self.moe_layer_pattern()))

    def replace(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again); derived defaults are recomputed unless
        given explicitly."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if ({"hidden_size", "swiglu"} & set(changes)
                and self.ffn_hidden_size == self._default_ffn_hidden_size()):
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
        if "layernorm_epsilon" in d and "norm_epsilon" not in d:   # checkpoints before the rename
            d = {("norm_epsilon" if k == "layernorm_epsilon" else k): v for k, v in d.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown GPT config fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}; set {_flag(name)}")


def _nearest_divisor(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near`` (for suggestions in error messages)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), -d))
