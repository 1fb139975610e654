"""Megatron-LM's command-line flags and what each one does here: the catalogue behind the parser
and the generated docs/megatron-flags.md (``python -m pretrain.megatron_flags > docs/megatron-flags.md``).

Users arrive with Megatron scripts, so a Megatron flag name means what Megatron means by it. Every
flag of the catalogue is one of

    native    a config field of the same name (``--train-samples`` <-> ``training.train_samples``)
    mapped    sets our equivalent (``--use-distributed-optimizer`` -> ``--zero-stage 1``)
    no-op     accepted with one info line saying why nothing changes (``--use-flash-attn``: SDPA
              picks flash kernels itself); some only for some values (``--context-parallel-size 1``)
    refused   the feature does not exist here: an error with Megatron's meaning and our nearest
              equivalent, never a spelling match

A flag in neither the catalogue nor the config is unknown: the suggestions are typos (one or two
edits away) or exact prefixes of known flags, never a flag that merely looks alike.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Callable

from pretrain.sections import TrainConfigError

log = logging.getLogger(__name__)

NATIVE, MAPPED, NOOP, REFUSED = "native", "mapped", "no-op", "refused"
SWITCH = "switch"   # a flag without a value


class Given:
    """The nested ``{section: {key: value}}`` a run is built from (config file, then our flags),
    which the mapped flags read and extend; a mapped flag never overrides a value given explicitly
    to something else: that is a contradiction, and an error."""

    def __init__(self, nested: dict):
        self.nested = nested
        self.flag = ""   # the catalogue flag being applied, named in contradictions
        self.changes: list[str] = []   # 'section.key = value' it set (logged: the resolved values)

    def has(self, key: str) -> bool:
        section, name = key.split(".")
        return isinstance(self.nested.get(section), dict) and name in self.nested[section]

    def get(self, key: str, default=None):
        section, name = key.split(".")
        return self.nested.get(section, {}).get(name, default) if self.has(key) else default

    def set(self, key: str, value) -> None:
        if self.has(key) and self.get(key) != value:
            raise TrainConfigError(f"{self.flag} sets {_flag_of(key)} {value}, but {_flag_of(key)} "
                                   f"{self.get(key)} was given too; drop one of them")
        self.replace(key, value)

    def replace(self, key: str, value) -> None:
        """Set ``key`` whatever was given (a flag that refines another's value)."""
        self.changes.append(f"{key} = {value!r}")
        section, name = key.split(".")
        if not isinstance(self.nested.get(section), dict):
            self.nested[section] = {}
        self.nested[section][name] = value


def _flag_of(key: str) -> str:
    return "--" + key.split(".")[1].replace("_", "-")


@dataclass(frozen=True)
class MegatronFlag:
    name: str            # Megatron's spelling
    kind: str            # native | mapped | no-op | refused
    meaning: str         # what Megatron means by it
    here: str            # native: the field; mapped: what it sets; no-op: why; refused: nearest
    value: object = SWITCH          # SWITCH, int, float or str; "*" for refused flags
    apply: Callable[[object, Given], None] | None = None       # mapped: set our fields
    noop_when: Callable[[object, Given], bool] | None = None   # no-op for some values only
    check: Callable[[object, object], None] | None = None      # mapped: check the built config


# ---- mapped flags ------------------------------------------------------------------------------
def _distributed_optimizer(value, given: Given) -> None:
    """Megatron's distributed optimizer shards the optimizer state over DP: ZeRO stage 1, unless a
    stage (1, 2 or 3) is given."""
    if given.get("parallel.zero_stage") == 0:
        raise TrainConfigError("--use-distributed-optimizer shards the optimizer state over the "
                               "data-parallel ranks (ZeRO stage 1 or more), but --zero-stage 0 was "
                               "given; drop one of them")
    if not given.has("parallel.zero_stage"):
        given.set("parallel.zero_stage", 1)


def _recompute_granularity(value, given: Given) -> None:
    if value not in ("full", "selective"):
        raise TrainConfigError(f"--recompute-granularity must be full or selective, got {value!r}")
    if value == "full" and not given.has("training.recompute_method"):
        raise TrainConfigError("--recompute-granularity full needs --recompute-method uniform or "
                               "block and --recompute-num-layers N (Megatron's rule); e.g. "
                               "--recompute-method uniform --recompute-num-layers 1 recomputes "
                               "every layer")
    given.set("training.recompute", value)


def _distribute_saved_activations(value, given: Given) -> None:
    if given.get("training.recompute") != "full":
        raise TrainConfigError("--distribute-saved-activations partitions the checkpointed layer "
                               "inputs over the TP ranks of a full recompute; add "
                               "--recompute-granularity full (or use --recompute full-pa)")
    given.replace("training.recompute", "full-pa")


def _virtual_pipeline(value, given: Given) -> None:
    from pretrain.sections import MODEL_DEFAULTS
    layers = given.get("model.num_layers", MODEL_DEFAULTS["num_layers"])
    pp = given.get("parallel.pipeline_model_parallel_size", 1)
    if value < 1 or layers % (pp * value):
        raise TrainConfigError(f"--virtual-pipeline-model-parallel-size {value}: --num-layers "
                               f"{layers} does not split into {pp} stages x {value} chunks")
    given.set("parallel.num_layers_per_virtual_pipeline_stage", layers // (pp * value))


def _mock_data(value, given: Given) -> None:
    if given.get("data.data_path"):
        raise TrainConfigError("--mock-data trains on a built-in corpus instead of --data-path; "
                               "drop one of them")


def _kv_channels(value, cfg) -> None:
    if value != cfg.model.head_dim:
        raise TrainConfigError(
            f"--kv-channels {value}: the head size here is always --hidden-size / "
            f"--num-attention-heads = {cfg.model.head_dim}; a projection to another head size is "
            f"not supported; drop --kv-channels or choose the hidden size and heads to match")


def _setter(key: str, value=None):
    """A mapped flag that sets ``key`` to ``value`` (a switch) or to the flag's own value."""
    def apply(flag_value, given: Given, _key=key):
        given.set(_key, flag_value if value is None else value)
    return apply


def _bf16_given(value, given: Given) -> bool:
    return bool(given.get("optimizer.bf16"))


def _equals(expected):
    return lambda value, given: value == expected


def _native(name: str, field: str, meaning: str, value=SWITCH) -> MegatronFlag:
    return MegatronFlag(name, NATIVE, meaning, f"`{field}`", value)


def _refused(name: str, meaning: str, nearest: str) -> MegatronFlag:
    return MegatronFlag(name, REFUSED, meaning, nearest, "*")


def _noop(name: str, meaning: str, why: str, value=SWITCH, when=None) -> MegatronFlag:
    return MegatronFlag(name, NOOP, meaning, why, value, noop_when=when)


_FP8 = ("parameters stay bf16 here; ZeRO stage 3 can all-gather them as FP8 blocks: --zero-stage "
        "3 --zero-quantized-weights --zero-quantized-weights-format fp8")
_FUSION = "a kernel-fusion switch: it changes speed, not results; our kernels are chosen per device"

CATALOGUE: tuple[MegatronFlag, ...] = (
    # ---- model ----
    _native("--num-layers", "model.num_layers", "transformer layers", int),
    _native("--hidden-size", "model.hidden_size", "hidden size", int),
    _native("--ffn-hidden-size", "model.ffn_hidden_size", "MLP width", int),
    _native("--num-attention-heads", "model.num_attention_heads", "attention heads", int),
    _native("--group-query-attention", "model.group_query_attention", "grouped-query attention"),
    _native("--num-query-groups", "model.num_query_groups", "key/value groups", int),
    MegatronFlag("--kv-channels", MAPPED, "head size of the attention projections (default: "
                 "hidden size / heads)", "checked: must equal --hidden-size / "
                 "--num-attention-heads (`model.head_dim`)", int, check=_kv_channels),
    _native("--seq-length", "model.seq_length", "tokens per sample", int),
    _native("--max-position-embeddings", "model.max_position_embeddings", "position table size",
            int),
    _native("--position-embedding-type", "model.position_embedding_type",
            "learned_absolute | rope | ...", str),
    MegatronFlag("--use-rotary-position-embeddings", MAPPED, "rotary positions (deprecated "
                 "spelling)", "`model.position_embedding_type = rope`",
                 apply=_setter("model.position_embedding_type", "rope")),
    _native("--rotary-base", "model.rotary_base", "rotary embedding base", float),
    _noop("--rotary-percent", "share of each head's channels that are rotated",
          "1.0 is what rope does here; other values (partial rotary) are refused", float,
          when=_equals(1.0)),
    _refused("--rotary-seq-len-interpolation-factor", "linear position interpolation of rope",
             "use --use-rope-scaling (Llama-3.1 frequency scaling)"),
    _native("--use-rope-scaling", "model.use_rope_scaling", "Llama-3.x rope scaling"),
    _native("--rope-scaling-factor", "model.rope_scaling_factor", "rope scaling factor", float),
    _native("--normalization", "model.normalization", "LayerNorm | RMSNorm", str),
    _native("--norm-epsilon", "model.norm_epsilon", "epsilon of every norm", float),
    MegatronFlag("--layernorm-epsilon", MAPPED, "epsilon of every norm (older spelling)",
                 "`model.norm_epsilon`", float, apply=_setter("model.norm_epsilon")),
    _refused("--apply-layernorm-1p", "norm weights stored zero-centred (gamma = 1 + w), so weight "
             "decay pulls gamma towards 1", "the norms here store gamma itself (--normalization "
             "LayerNorm or RMSNorm); drop the flag"),
    _native("--swiglu", "model.swiglu", "SwiGLU MLP"),
    _refused("--squared-relu", "squared-ReLU MLP activation", "use GELU (default) or --swiglu"),
    _refused("--openai-gelu", "OpenAI's tanh GELU", "drop it: the exact GELU is used"),
    _native("--disable-bias-linear", "model.add_bias_linear", "no biases in linear layers"),
    _native("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights",
            "an output layer of its own"),
    _native("--init-method-std", "model.init_method_std", "std of the normal weight init", float),
    _native("--hidden-dropout", "model.hidden_dropout", "dropout after attention and MLP", float),
    _native("--attention-dropout", "model.attention_dropout", "dropout on attention probabilities",
            float),
    _native("--vocab-size", "model.vocab_size", "vocabulary size", int),
    _native("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by",
            "vocabulary padding multiple", int),
    _native("--attention-softmax-in-fp32", "model.attention_softmax_in_fp32",
            "softmax in fp32 under 16-bit training"),
    _refused("--qk-layernorm", "LayerNorm on queries and keys", "drop it (not implemented)"),
    _noop("--use-mcore-models", "use Megatron-core models (deprecated, ignored by Megatron)",
          "there is one GPT implementation here"),
    _noop("--attention-backend", "attention kernel: auto | flash | fused | unfused | local",
          "attention picks its kernel per device (SDPA's flash/memory-efficient kernels on CUDA, "
          "batched matmuls on CPU)", str),
    _noop("--use-flash-attn", "FlashAttention kernels", "SDPA picks flash kernels on CUDA itself"),
    _noop("--no-masked-softmax-fusion", "unfused scale-mask-softmax", _FUSION),
    _noop("--no-bias-gelu-fusion", "unfused bias + GELU", _FUSION),
    _noop("--no-bias-swiglu-fusion", "unfused bias + SwiGLU", _FUSION),
    _noop("--no-bias-dropout-fusion", "unfused bias + dropout + add", _FUSION),
    _noop("--no-rope-fusion", "unfused rotary embedding", _FUSION),
    _noop("--no-persist-layer-norm", "no persistent LayerNorm kernel", _FUSION),
    _noop("--no-gradient-accumulation-fusion", "no fused weight-gradient accumulation", _FUSION),
    _noop("--cross-entropy-loss-fusion", "fused cross-entropy", "the vocab-parallel cross entropy "
          "is computed blockwise in one pass already"),
    # ---- mixture of experts (issue 32; docs/moe.md) ----
    _native("--num-experts", "model.num_experts", "experts per MoE layer", int),
    _native("--moe-router-topk", "model.moe_router_topk", "experts per token", int),
    _native("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size", "width of each routed expert",
            int),
    _native("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_intermediate_size",
            "width of the shared expert", int),
    _native("--moe-shared-expert-gate", "model.moe_shared_expert_gate",
            "sigmoid gate on the shared expert (Qwen2-MoE)"),
    _native("--moe-layer-freq", "model.moe_layer_freq",
            "MoE every N-th layer, or a 0/1 pattern per layer (here: N, or the pattern as "
            "space-separated 0/1 values instead of Megatron's Python list expression)", int),
    _native("--moe-router-score-function", "model.moe_router_score_function",
            "softmax | sigmoid router scores", str),
    _native("--moe-router-pre-softmax", "model.moe_router_pre_softmax",
            "softmax over all experts before top-k"),
    _native("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor",
            "scale of the chosen experts' probabilities", float),
    _native("--moe-router-load-balancing-type", "model.moe_router_load_balancing_type",
            "aux_loss | seq_aux_loss | none (sinkhorn is refused by the config check)", str),
    _native("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", "MoE load-balancing loss weight",
            float),
    _native("--moe-z-loss-coeff", "model.moe_z_loss_coeff", "router z-loss weight", float),
    _native("--moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias",
            "aux-loss-free balancing by a per-expert bias (DeepSeek-V3)"),
    _native("--moe-router-bias-update-rate", "model.moe_router_bias_update_rate",
            "expert-bias step per optimizer step", float),
    _native("--moe-expert-capacity-factor", "model.moe_expert_capacity_factor",
            "expert capacity factor (token dropping); dropless when unset", float),
    _native("--moe-token-dispatcher-type", "model.moe_token_dispatcher_type",
            "alltoall | allgather token dispatch", str),
    _noop("--moe-grouped-gemm", "grouped GEMM for experts",
          "the experts always run as grouped GEMMs here (a padded batched product where the "
          "device has no grouped GEMM)"),
    _noop("--moe-token-drop-policy", "which tokens an over-capacity expert drops: probs | position",
          "probs (the lowest routing probabilities are dropped) is the rule here; position is "
          "refused", str, when=_equals("probs")),
    _refused("--moe-pad-expert-input-to-capacity", "pad every expert's input to its capacity",
             "drop it: experts run on their actual token counts (grouped GEMM)"),
    _native("--expert-model-parallel-size", "parallel.expert_model_parallel_size",
            "expert parallelism: experts split over EP ranks carved out of DP", int),
    _native("--expert-tensor-parallel-size", "parallel.expert_tensor_parallel_size",
            "TP degree of the experts (here only the dense TP degree)", int),
    # ---- FP8 / context parallelism ----
    _native("--fp8-format", "optimizer.fp8_format", "FP8 training (e4m3 | hybrid)", str),
    _native("--fp8-recipe", "optimizer.fp8_recipe", "FP8 scaling recipe (tensorwise | delayed; "
            "here also torchao's rowwise; mxfp8 and blockwise are not here)", str),
    _native("--fp8-margin", "optimizer.fp8_margin", "FP8 scaling margin", int),
    _native("--fp8-amax-history-len", "optimizer.fp8_amax_history_len", "FP8 amax history", int),
    _native("--fp8-amax-compute-algo", "optimizer.fp8_amax_compute_algo", "FP8 amax algorithm",
            str),
    _native("--first-last-layers-bf16", "optimizer.first_last_layers_bf16",
            "first and last layers in bf16 under FP8"),
    _native("--num-layers-at-start-in-bf16", "optimizer.num_layers_at_start_in_bf16",
            "leading bf16 layers", int),
    _native("--num-layers-at-end-in-bf16", "optimizer.num_layers_at_end_in_bf16",
            "trailing bf16 layers", int),
    _refused("--fp8-param-gather", "keep the compute parameters in FP8 and all-gather them in FP8",
             _FP8),
    _noop("--context-parallel-size", "split the sequence over GPUs inside attention (ring "
          "attention)", "1 means no context parallelism; larger values are refused: shard long "
          "sequences' activations with --sequence-parallel (TP > 1) or --recompute", int,
          when=_equals(1)),
    # ---- parallelism ----
    _native("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size", "TP degree",
            int),
    _native("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size",
            "PP degree", int),
    _native("--num-layers-per-virtual-pipeline-stage",
            "parallel.num_layers_per_virtual_pipeline_stage", "interleaved schedule chunk size",
            int),
    MegatronFlag("--virtual-pipeline-model-parallel-size", MAPPED, "model chunks per pipeline "
                 "stage (interleaved schedule)", "`parallel.num_layers_per_virtual_pipeline_stage"
                 " = num_layers / (PP x this)`", int, apply=_virtual_pipeline),
    _native("--sequence-parallel", "parallel.sequence_parallel", "sequence-parallel "
            "LayerNorm/dropout (here it needs TP > 1; Megatron switches it off at TP 1)"),
    MegatronFlag("--use-distributed-optimizer", MAPPED, "shard the optimizer state over the "
                 "data-parallel ranks", "`parallel.zero_stage = 1` (ZeRO stage 1) unless "
                 "--zero-stage 1, 2 or 3 is given", apply=_distributed_optimizer),
    _noop("--overlap-grad-reduce", "overlap the gradient reduction with backward",
          "always on: gradient buckets are reduced while backward runs (stage 3: per-unit "
          "reduce-scatter)"),
    _noop("--overlap-param-gather", "overlap the parameter all-gather with the next forward",
          "stage 3 prefetches the next unit's parameters during forward and backward; stages 1-2 "
          "all-gather the updated parameters at the end of the step, buckets pipelined"),
    _native("--distributed-timeout-minutes", "parallel.distributed_timeout_minutes",
            "process-group timeout", float),
    _noop("--distributed-backend", "nccl | gloo", "picked by the device: NCCL on CUDA, gloo on "
          "CPU", str),
    # ---- precision ----
    _native("--bf16", "optimizer.bf16", "bf16 mixed precision"),
    _native("--fp16", "optimizer.fp16", "fp16 mixed precision"),
    _native("--loss-scale", "optimizer.loss_scale", "static fp16 loss scale", float),
    _native("--initial-loss-scale", "optimizer.initial_loss_scale", "dynamic scale start", float),
    _native("--min-loss-scale", "optimizer.min_loss_scale", "dynamic scale floor", float),
    _native("--loss-scale-window", "optimizer.loss_scale_window", "clean steps before growing",
            int),
    _native("--hysteresis", "optimizer.hysteresis", "overflows before shrinking", int),
    _noop("--grad-reduce-in-bf16", "reduce gradients in bf16", "with --bf16 gradients are "
          "reduced in bf16 here anyway; refused without --bf16", when=_bf16_given),
    _native("--use-precision-aware-optimizer", "optimizer.use_precision_aware_optimizer",
            "let the optimizer keep its state in lower precision (the dtypes below)"),
    _native("--exp-avg-dtype", "optimizer.exp_avg_dtype", "storage dtype of Adam's first moment "
            "(fp32 | bf16 here; Megatron's fp16 / fp8 refused)", str),
    _native("--exp-avg-sq-dtype", "optimizer.exp_avg_sq_dtype", "storage dtype of Adam's second "
            "moment (fp32 | bf16 here; Megatron's fp16 / fp8 refused)", str),
    _native("--main-params-dtype", "optimizer.main_params_dtype", "dtype of the master weights "
            "(fp32; Megatron's fp16 is refused: it needs stochastic rounding)", str),
    _noop("--no-check-for-nan-in-loss-and-grad", "do not check loss and gradients for NaN",
          "the checks are always on here; --on-nonfinite skip|stop picks what a NaN does"),
    # ---- optimizer and schedule ----
    _native("--optimizer", "optimizer.optimizer", "adam | sgd | muon (here: adamw | muon; adam "
            "is adamw, sgd is refused)", str),
    _native("--muon-momentum", "optimizer.muon_momentum", "Muon's momentum", float),
    _native("--muon-num-ns-steps", "optimizer.muon_num_ns_steps", "Newton-Schulz iterations", int),
    _native("--muon-use-nesterov", "optimizer.muon_use_nesterov", "Nesterov momentum in Muon "
            "(Megatron: off by default; here on, --no-muon-use-nesterov turns it off)"),
    _native("--muon-scale-mode", "optimizer.muon_scale_mode", "spectral | unit_rms_norm | "
            "shape_scaling update scale", str),
    _native("--muon-extra-scale-factor", "optimizer.muon_extra_scale_factor", "extra update "
            "factor (Megatron: 1.0 by default; here 0.2, Moonlight's AdamW-RMS match)", float),
    _native("--muon-tp-mode", "optimizer.muon_tp_mode", "blockwise | duplicated | distributed: "
            "how a TP-sharded matrix is orthogonalised (here only duplicated: gathered whole)",
            str),
    _noop("--muon-no-split-qkv", "orthogonalise the fused QKV matrix as one matrix",
          "that is what Muon does here always (Megatron's default splits Q, K and V)"),
    _refused("--muon-fp32-matmul-prec", "fp32 matmul precision of the Newton-Schulz iteration",
             "--muon-ns-dtype bf16 | fp32 picks the iteration's dtype"),
    _native("--lr", "optimizer.lr", "peak learning rate", float),
    _native("--min-lr", "optimizer.min_lr", "final learning rate", float),
    _native("--lr-decay-style", "optimizer.lr_decay_style", "constant | linear | cosine | "
            "inverse-square-root | WSD (warmup-stable-decay)", str),
    _native("--lr-wsd-decay-style", "optimizer.lr_wsd_decay_style", "WSD's decay shape: "
            "exponential | linear | cosine | minus_sqrt", str),
    _native("--lr-wsd-decay-iters", "optimizer.lr_wsd_decay_iters", "WSD's decay length in "
            "iterations, the last ones of the decay length", int),
    _native("--lr-wsd-decay-samples", "optimizer.lr_wsd_decay_samples", "WSD's decay length in "
            "samples", int),
    _native("--lr-decay-iters", "optimizer.lr_decay_iters", "decay length in iterations", int),
    _native("--lr-decay-samples", "optimizer.lr_decay_samples", "decay length in samples", int),
    _native("--lr-warmup-iters", "optimizer.lr_warmup_iters", "warm-up iterations", int),
    _native("--lr-warmup-samples", "optimizer.lr_warmup_samples", "warm-up samples", int),
    _native("--lr-warmup-fraction", "optimizer.lr_warmup_fraction", "warm-up as a fraction of "
            "the decay length", float),
    _noop("--lr-warmup-init", "learning rate the warm-up starts from", "0.0 is the warm-up's "
          "start here; other values are refused", float, when=_equals(0.0)),
    _refused("--decoupled-lr", "a separate learning rate for the embedding and output layer",
             "one --lr applies to every parameter"),
    _refused("--decoupled-min-lr", "a separate minimum learning rate for the embedding and "
             "output layer", "one --min-lr applies to every parameter"),
    _native("--override-opt-param-scheduler", "optimizer.override_opt_param_scheduler",
            "on resume, take the schedule from the flags"),
    MegatronFlag("--override-opt_param-scheduler", MAPPED, "on resume, take the schedule from "
                 "the flags", "`optimizer.override_opt_param_scheduler = true`",
                 apply=_setter("optimizer.override_opt_param_scheduler", True)),
    _native("--use-checkpoint-opt-param-scheduler", "optimizer.use_checkpoint_opt_param_scheduler",
            "on resume, take the schedule from the checkpoint"),
    MegatronFlag("--use-checkpoint-opt_param-scheduler", MAPPED, "on resume, take the schedule "
                 "from the checkpoint", "`optimizer.use_checkpoint_opt_param_scheduler = true`",
                 apply=_setter("optimizer.use_checkpoint_opt_param_scheduler", True)),
    _native("--weight-decay", "optimizer.weight_decay", "AdamW weight decay", float),
    _native("--adam-beta1", "optimizer.adam_beta1", "Adam beta1", float),
    _native("--adam-beta2", "optimizer.adam_beta2", "Adam beta2", float),
    _native("--adam-eps", "optimizer.adam_eps", "Adam epsilon", float),
    _native("--clip-grad", "optimizer.clip_grad", "global gradient-norm clip", float),
    # ---- batches, length, recompute ----
    _native("--micro-batch-size", "data.micro_batch_size", "samples per rank per micro-step", int),
    _native("--global-batch-size", "data.global_batch_size", "samples per optimizer step", int),
    _native("--rampup-batch-size", "data.rampup_batch_size", "grow the global batch linearly "
            "from START by INCREMENT over SAMPLES samples (deprecated in Megatron, which now "
            "ignores it; here it is the step schedule it describes)", int),
    _native("--step-batch-size-schedule", "data.step_batch_size_schedule", "step-wise "
            "global-batch schedule over the consumed tokens", str),
    _native("--train-iters", "training.train_iters", "optimizer steps", int),
    _native("--train-samples", "training.train_samples", "samples to train on", int),
    _native("--exit-interval", "training.exit_interval", "save and exit after an iteration that "
            "is a multiple of N", int),
    _native("--exit-duration-in-mins", "training.exit_duration_in_mins", "save and exit after "
            "N minutes", float),
    _native("--enable-cuda-graph", "training.enable_cuda_graph", "capture and replay CUDA graphs "
            "of the step (Megatron's local implementation)"),
    _native("--cuda-graph-scope", "training.cuda_graph_scope", "what the CUDA graphs capture: "
            "full (each transformer layer), attn, full_iteration", str),
    _native("--cuda-graph-warmup-steps", "training.cuda_graph_warmup_steps", "eager runs before "
            "a CUDA graph is captured", int),
    _noop("--exit-signal-handler", "save and exit on SIGTERM", "always on: SIGTERM/SIGINT save a "
          "checkpoint and stop every rank together"),
    _native("--seed", "training.seed", "random seed", int),
    _native("--eval-interval", "training.eval_interval", "validate every N iterations", int),
    _native("--eval-iters", "training.eval_iters", "validation batches", int),
    _refused("--skip-train", "evaluate only", "use tools/evaluate.py on a checkpoint"),
    MegatronFlag("--recompute-activations", MAPPED, "selective activation recompute",
                 "`training.recompute = selective`",
                 apply=_setter("training.recompute", "selective")),
    MegatronFlag("--recompute-granularity", MAPPED, "full | selective activation recompute",
                 "`training.recompute = full | selective` (full needs --recompute-method)", str,
                 apply=_recompute_granularity),
    _native("--recompute-method", "training.recompute_method", "uniform (every layer, N per "
            "checkpoint) | block (first N layers of each stage)", str),
    _native("--recompute-num-layers", "training.recompute_num_layers", "the N of "
            "--recompute-method", int),
    MegatronFlag("--distribute-saved-activations", MAPPED, "partition the checkpointed inputs "
                 "of a full recompute over the TP ranks", "`training.recompute = full-pa` "
                 "(ZeRO-R Pa)", apply=_distribute_saved_activations),
    _refused("--checkpoint-activations", "activation checkpointing (removed from Megatron)",
             "use --recompute-activations or --recompute-granularity"),
    _noop("--empty-unused-memory-level", "call torch.cuda.empty_cache() every iteration",
          "the caching allocator keeps its blocks here (emptying it only slows steps down)", int),
    _noop("--manual-gc", "disable Python's automatic garbage collector and collect every N steps",
          "Python's collector runs as usual; the training numerics are the same"),
    _noop("--manual-gc-interval", "steps between manual collections", "see --manual-gc", int),
    _noop("--calculate-per-token-loss", "average the loss over the global batch's tokens instead "
          "of per micro-batch", "without --eod-mask-loss every micro-batch has the same number of "
          "loss tokens, so both averages are equal; refused with --eod-mask-loss",
          when=lambda value, given: not given.get("data.eod_mask_loss")),
    # ---- data ----
    _native("--data-path", "data.data_path", "weighted dataset prefixes", str),
    _native("--split", "data.split", "train,valid,test proportions", str),
    _native("--tokenizer-model", "data.tokenizer_model", "tokenizer model file", str),
    _native("--tokenizer-type", "data.tokenizer_type", "tokenizer class", str),
    _native("--vocab-file", "data.vocab_file", "GPT-2 BPE vocab.json", str),
    _native("--merge-file", "data.merge_file", "GPT-2 BPE merges.txt", str),
    _noop("--tiktoken-pattern", "split pattern of Megatron's tiktoken tokenizer",
          "only Megatron's TikTokenizer reads it", str),
    _native("--eod-mask-loss", "data.eod_mask_loss", "no loss on end-of-document tokens"),
    _refused("--reset-position-ids", "restart positions at every document",
             "positions run over the whole sample here; use --eod-mask-loss"),
    _refused("--reset-attention-mask", "no attention across documents",
             "attention is causal over the whole sample here; use --eod-mask-loss"),
    MegatronFlag("--data-cache-path", MAPPED, "where dataset indices are cached",
                 "`data.data_cache_dir`", str, apply=_setter("data.data_cache_dir")),
    MegatronFlag("--mock-data", MAPPED, "train on synthetic tokens, no dataset needed",
                 "no `data.data_path`: the embedded default corpus (real text, built on first use)",
                 apply=_mock_data),
    _noop("--no-create-attention-mask-in-dataloader", "the data loader builds no attention mask",
          "the loader never builds one here: attention is causal by construction"),
    _noop("--no-mmap-bin-files", "read .bin files without memory mapping", "the .bin files are "
          "memory-mapped read-only; the results are the same"),
    _noop("--num-workers", "data-loader worker processes", "the loader prefetches in a thread", int),
    _noop("--dataloader-type", "single | cyclic", "single is what the loader does; other values "
          "are refused", str, when=_equals("single")),
    _refused("--train-data-path", "separate train/valid/test datasets", "use --data-path with "
             "--split"),
    # ---- checkpoints ----
    _native("--save", "checkpoint.save", "checkpoint directory", str),
    _native("--load", "checkpoint.load", "directory to resume from", str),
    _native("--save-interval", "checkpoint.save_interval", "save every N iterations", int),
    _native("--no-load-optim", "checkpoint.load_optim", "load weights into a fresh optimizer (and "
            "a fresh learning-rate schedule from the loaded iteration)"),
    _native("--no-load-rng", "checkpoint.load_rng", "do not restore the random streams"),
    _native("--finetune", "checkpoint.finetune", "load weights only, start at iteration 0"),
    _refused("--no-save-optim", "checkpoints without the optimizer state", "checkpoints always "
             "hold it (resume is exact); tools/export_hf.py writes the weights alone"),
    _refused("--no-save-rng", "checkpoints without random states", "checkpoints always hold them"),
    _noop("--ckpt-format", "torch | torch_dist | ...", "one format here: safetensors pieces that "
          "any TP/PP/DP layout and ZeRO stage can load (as torch_dist)", str),
    _noop("--use-dist-ckpt", "distributed checkpoint format (deprecated)", "see --ckpt-format"),
    _native("--async-save", "checkpoint.async_save", "write checkpoints in the background"),
    # ---- logging ----
    _native("--log-interval", "logging.log_interval", "console line every N iterations", int),
    _native("--tensorboard-dir", "logging.tensorboard_dir", "TensorBoard directory", str),
    _noop("--tensorboard-log-interval", "TensorBoard scalars every N iterations", "TensorBoard "
          "scalars are written every --log-interval", int),
    _noop("--log-throughput", "log TFLOP/s per GPU", "always logged (throughput, mfu, "
          "tokens-per-second)"),
    _noop("--log-timers-to-tensorboard", "timers in TensorBoard", "iteration-time, eval-time and "
          "checkpoint-save-time are always logged"),
    _noop("--log-memory-to-tensorboard", "memory in TensorBoard", "mem-* scalars are always "
          "logged"),
    _noop("--log-validation-ppl-to-tensorboard", "validation perplexity in TensorBoard",
          "always logged (lm loss validation ppl)"),
    _noop("--timing-log-level", "detail of the timers", "one level of timing here", int),
    _refused("--log-params-norm", "log the parameter norm", "grad-norm is logged; the parameter "
             "norm is not computed"),
    _native("--wandb-project", "logging.wandb_project", "Weights & Biases project", str),
    _native("--wandb-exp-name", "logging.wandb_exp_name", "W&B run name", str),
    _native("--wandb-save-dir", "logging.wandb_save_dir", "W&B run files directory", str),
    _native("--log-straggler", "logging.log_straggler", "per-rank step times, slowest ranks named"),
    _native("--straggler-minmax-count", "logging.straggler_minmax_count",
            "slowest/fastest ranks reported", int),
    _noop("--disable-straggler-on-startup", "start the straggler detector paused", "the "
          "detector measures from the first interval when --log-straggler is given"),
    _noop("--straggler-ctrlr-port", "port to switch the detector on and off at run time",
          "no controller: --log-straggler decides for the whole run", int),
    _noop("--profile", "profile some steps (nsys or torch.profiler)", "no trace is written here: "
          "run under nsys profile, or see benchmarks/ for step breakdowns"),
    _noop("--use-pytorch-profiler", "torch.profiler instead of nsys", "see --profile"),
    _noop("--profile-step-start", "first profiled step", "see --profile", int),
    _noop("--profile-step-end", "last profiled step", "see --profile", int),
)

BY_NAME: dict[str, MegatronFlag] = {f.name: f for f in CATALOGUE}


# ---- the parser side ---------------------------------------------------------------------------
def dest_of(flag: MegatronFlag) -> str:
    return "megatron:" + flag.name


def add_to_parser(parser) -> None:
    """The mapped, no-op and refused flags (native ones are config fields, added with them); their
    help says what each does here."""
    group = parser.add_argument_group("Megatron-LM flags mapped, accepted as no-ops, or refused "
                                      "(docs/megatron-flags.md)")
    for f in CATALOGUE:
        if f.kind == NATIVE:
            continue
        kw = dict(dest=dest_of(f), default=None, help=f"{f.kind}: {f.here}")
        if f.value == SWITCH:
            group.add_argument(f.name, action="store_true", **kw)
        elif f.value == "*":
            group.add_argument(f.name, nargs="*", metavar="VALUE", **kw)
        else:
            group.add_argument(f.name, type=f.value, metavar=f.value.__name__.upper(), **kw)


def apply_flags(values: dict, nested: dict) -> list:
    """Handle the catalogue flags the command line gave (``values``: argparse dest -> value) on
    ``nested`` (the config file overridden by our flags); return the checks to run on the built
    config. Refused flags are one error naming all of them."""
    given, refused, checks = Given(nested), [], []
    for f in CATALOGUE:
        value = values.get(dest_of(f))
        if f.kind == NATIVE or value is None or value is False:
            continue
        if f.kind == REFUSED or (f.noop_when is not None and not f.noop_when(value, given)):
            shown = f.name if value is True or value == [] else f"{f.name} {_shown(value)}"
            refused.append(f"{shown} is not supported here (Megatron: {f.meaning}); {f.here}")
        elif f.kind == NOOP:
            log.info("%s: accepted, nothing to change (%s)", f.name, f.here)
        else:
            given.flag, given.changes = f.name, []
            if f.apply is not None:
                f.apply(value, given)
            if f.check is not None:
                checks.append(lambda cfg, _f=f, _v=value: _f.check(_v, cfg))
            log.info("%s: %s", f.name, ", ".join(given.changes) or f.here)
    if refused:
        raise TrainConfigError("; ".join(refused))
    return checks


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def suggest(flag: str, known: list[str]) -> str | None:
    """A known flag the unknown ``flag`` is a typo of (one edit, two for long names) or an exact
    prefix of, else None: a flag that only looks alike may mean something else entirely."""
    prefixed = sorted(k for k in known if k.startswith(flag) and len(flag) >= 6)
    if len(prefixed) == 1:
        return prefixed[0]
    budget = 2 if len(flag) >= 16 else 1
    close = sorted((d, k) for k in known if (d := _edits(flag, k, budget)) <= budget)
    return close[0][1] if close else None


def _edits(a: str, b: str, limit: int) -> int:
    """Damerau-Levenshtein distance of ``a`` and ``b`` (adjacent swaps count one), capped at
    ``limit + 1``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    prev2, prev = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if (prev2 is not None and i > 1 and j > 1 and a[i - 1] == b[j - 2]
                    and a[i - 2] == b[j - 1]):
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return min(prev[-1], limit + 1)


# ---- defaults that differ from Megatron's ------------------------------------------------------
# our field -> (Megatron's default, why ours differs); the docs table shows both values
DIFFERENT_DEFAULTS: dict[str, tuple[object, str]] = {
    "model.hidden_dropout": (0.1, "large pretraining runs (Llama's example) train without "
                             "dropout; Megatron's GPT-3 example does not set it, so pass "
                             "--hidden-dropout 0.1 --attention-dropout 0.1 for its behaviour"),
    "model.attention_dropout": (0.1, "as --hidden-dropout"),
    "model.num_layers": (None, "Megatron requires the model dims; ours default to a tiny CPU "
                         "model so a bare command runs"),
    "model.hidden_size": (None, "as --num-layers"),
    "model.num_attention_heads": (None, "as --num-layers"),
    "model.seq_length": (None, "as --num-layers"),
    "optimizer.lr": (None, "Megatron requires it"),
    "optimizer.min_lr": (0.0, "a tenth of the peak, GPT-3's choice (both example scripts set "
                         "--min-lr)"),
    "optimizer.adam_beta2": (0.999, "0.95 is GPT-3's and Llama's value (both example scripts "
                             "set it)"),
    "optimizer.lr_decay_style": ("linear", "cosine, as GPT-3 and Llama (both example scripts "
                                 "set it)"),
    "optimizer.initial_loss_scale": (2.0 ** 32, "2^32 overflows in the first steps, each one "
                                     "skipped; 2^16 skips fewer"),
    "data.micro_batch_size": (None, "Megatron requires it; 4 keeps a bare CPU run small"),
    "training.eval_iters": (100, "a small validation for CPU-sized runs"),
    "training.eval_interval": (None, "Megatron validates only when it is given; a small run "
                               "here validates every 50 iterations"),
    "logging.log_interval": (100, "a small run still prints progress"),
    "parallel.zero_stage": (0, "not a Megatron flag: Megatron's optimizer is unsharded unless "
                            "--use-distributed-optimizer (= ZeRO stage 1), which its example "
                            "scripts turn on; this framework is built around ZeRO"),
}


def default_of(key: str):
    """Our default of ``section.field`` (the trainer's model defaults for the model section)."""
    from pretrain.sections import MODEL_DEFAULTS, SECTIONS
    section, name = key.split(".")
    if section == "model" and name in MODEL_DEFAULTS:
        return MODEL_DEFAULTS[name]
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


# ---- the generated docs page -------------------------------------------------------------------
DOC_INTRO = """# Megatron-LM flags

This page is generated from `pretrain/megatron_flags.py`
(`python -m pretrain.megatron_flags > docs/megatron-flags.md`); `tests/pretrain/test_megatron_flags.py`
fails when the two differ. A Megatron-LM script runs here with its flags: a flag name means what
Megatron-LM means by it. Each flag is

- **native**: a config field of the same name (the flag sets it; `--help` shows it with its default),
- **mapped**: it sets our equivalent (the start-up log and `--dry-run` say what it set),
- **no-op**: accepted with one info line saying why nothing changes (some only for some values),
- **refused**: the feature does not exist here; the error gives Megatron's meaning and the nearest
  equivalent.

A flag that is neither here nor a config field is unknown; the error suggests only a flag it is a
typo or an exact prefix of, never one that merely looks alike (`--vocab-file` is not `--vocab-size`).

Megatron's GPT-3 175B example (`examples/gpt3/train_gpt3_175b_distributed.sh`) at its full size,
checked on one CPU with `--dry-run` at its 1536 GPUs (TP 8 x PP 16 x DP 12; `--vocab-size` stands for
the GPT-2 vocab and merge files, which a dry run does not read):

```bash
python launch/pretrain_gpt.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
    --seq-length 2048 --max-position-embeddings 2048 --attention-backend auto \\
    --micro-batch-size 1 --global-batch-size 1536 --train-iters 500000 --weight-decay 0.1 \\
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 \\
    --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000 \\
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --split 949,50,1 \\
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \\
    --vocab-size 50257 --world-size 1536 --gpus-per-node 8 --dry-run
```

Where a flag's behaviour differs in a detail, it is said here:

- `--step-batch-size-schedule` may be given with a `--global-batch-size` equal to its last batch
  (Megatron refuses the pair, though its GPT-3 175B example passes both); every batch of the
  schedule must be whole micro-batches on each DP rank from the start (Megatron checks the current
  one). `--rampup-batch-size`, which Megatron now ignores, ramps linearly as its help describes.
- The warm-up is one iteration ahead of Megatron's: the first step trains at `lr / warmup` where
  Megatron's trains at 0, and the peak is reached one step earlier; the decay is the same.
- `--sequence-parallel` at `--tensor-model-parallel-size 1` is an error here (Megatron switches it
  off with a warning).
- With `--bf16`, gradients are reduced over data parallelism in bf16 (Megatron reduces them in fp32
  unless `--grad-reduce-in-bf16`).
- `--train-samples` and `--lr-*-samples` are converted to iterations of the constant global batch,
  which gives Megatron's learning rate at every iteration.
- On resume a checkpoint's schedule is compared with the flags' (lr, min lr, warm-up and decay
  lengths in samples, decay style, WSD's decay length and shape) as Megatron's scheduler does;
  `--override-opt_param-scheduler` or `--use-checkpoint-opt_param-scheduler` picks one when they
  differ.
- `--lr-decay-style WSD`: its decay (`--lr-wsd-decay-iters` / `--lr-wsd-decay-samples`) must fit
  between the warm-up's end and `--lr-decay-iters` (Megatron does not check, and an overlap makes
  the lr drop when the warm-up ends); a WSD length with another decay style is an error (Megatron
  ignores it).
- `--lr-decay-style inverse-square-root` needs a warm-up (Megatron's formula
  `lr * sqrt(warm-up / step)` then takes a warm-up of one sample, which makes the lr depend on the
  global batch size); like Megatron's, it falls to `--min-lr` after `--lr-decay-iters`.
- `--exit-interval N` stops after an iteration that is a multiple of N, saving a checkpoint first
  when `--save` is given (Megatron's rule).
"""


def catalogue_table() -> str:
    rows = ["| flag | here | Megatron-LM's meaning | what it does here |", "| --- | --- | --- | --- |"]
    for f in sorted(CATALOGUE, key=lambda f: f.name):
        here = f.here.replace("|", "\\|")
        rows.append(f"| `{f.name}` | {f.kind} | {f.meaning.replace('|', chr(92) + '|')} | {here} |")
    return "\n".join(rows)


def defaults_table() -> str:
    rows = ["| field (flag) | ours | Megatron-LM's | why |", "| --- | --- | --- | --- |"]
    for key, (theirs, why) in DIFFERENT_DEFAULTS.items():
        rows.append(f"| `{key}` (`{_flag_of(key)}`) | `{default_of(key)!r}` | `{theirs!r}` | {why} |")
    return "\n".join(rows)


def markdown() -> str:
    return (DOC_INTRO + "\n## Flags\n\n" + catalogue_table()
            + "\n\n## Defaults that differ from Megatron-LM's\n\n"
            "`--help` prints every default. These differ from Megatron-LM's, each for the reason "
            "given; setting the flag gives Megatron's behaviour.\n\n" + defaults_table() + "\n")


if __name__ == "__main__":
    sys.stdout.write(markdown())
