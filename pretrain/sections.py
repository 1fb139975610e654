"""The seven sections of the training configuration, each validating itself (docs/design.md §9).

The ``model`` section is :class:`models.gpt.GPTConfig` itself, with the trainer's defaults
(:data:`MODEL_DEFAULTS`); the other six are defined here. Every field name is the Megatron-LM command-line flag with dashes turned into underscores
(``tensor_model_parallel_size`` <-> ``--tensor-model-parallel-size``); the ``help`` metadata is the
flag's help text (pretrain.arguments generates the parser from these fields). Checks that
need several sections or the world size live in :class:`pretrain.config.TrainConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from hybrid.adamw_config import AdamWConfig
from hybrid.data.tokenizer_types import MEGATRON_TOKENIZER_TYPES
from hybrid.perf.hardware import Cluster
from hybrid.pipeline.config import SCHEDULES, default_schedule
from hybrid.precision_config import LossScaleConfig
from hybrid.topology import DEFAULT_TIMEOUT, DP_TRANSPORTS, Topology
from hybrid.zero_policy import DEFAULT_BUCKET_ELEMENTS, layout_refusal
from models.gpt.config import ConfigError, GPTConfig


class TrainConfigError(ValueError):
    """An invalid training configuration; the message says which flag to change and how."""


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(section, *names: str, allow_none: bool = False) -> None:
    for name in names:
        value = getattr(section, name)
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainConfigError(f"{flag_name(name)} must be a positive integer, got {value!r}")


def _non_negative(section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0):
            raise TrainConfigError(f"{flag_name(name)} must be a number >= 0, got {value!r}")


def _help(text: str, **kw):
    return field(metadata={"help": text}, **kw)


# The model section is models.gpt.GPTConfig itself (its fields, help texts and validation); the
# trainer only chooses other defaults: a tiny model, no dropout, the vocab size of the tokenizer.
MODEL_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                  "vocab_size": None, "hidden_dropout": 0.0, "attention_dropout": 0.0}


def build_model_config(values: dict) -> GPTConfig:
    """The ``model`` section: :data:`MODEL_DEFAULTS` overridden by ``values``, checked by
    GPTConfig's own validation (its errors become :class:`TrainConfigError`)."""
    try:
        return GPTConfig(**{**MODEL_DEFAULTS, **values})
    except ConfigError as err:
        raise TrainConfigError(str(err)) from None


@dataclass
class ParallelSection:
    """Layout: TP inside a node, PP across nodes, DP across replicas (Megatron-LM §3; Narayanan et
    al. 2021 §2.2; ZeRO §7); ZeRO-DP stage."""

    tensor_model_parallel_size: int = _help("TP degree (ranks sharing each layer)", default=1)
    pipeline_model_parallel_size: int = _help("PP degree (pipeline stages, each a contiguous block "
                                              "of layers)", default=1)
    num_layers_per_virtual_pipeline_stage: int | None = _help(
        "layers per model chunk of the interleaved schedule (v = num_layers / (PP x this) chunks "
        "per stage; default: one chunk per stage)", default=None)
    pipeline_schedule: str | None = _help("1f1b | gpipe | interleaved (default: 1f1b, interleaved "
                                          "when --num-layers-per-virtual-pipeline-stage is set)",
                                          default=None)
    sequence_parallel: bool = _help("shard LayerNorm/dropout activations along the sequence",
                                    default=False)
    zero_stage: int = _help("ZeRO-DP stage: 0 baseline, 1 Pos, 2 Pos+g, 3 Pos+g+p", default=1)
    zero_bucket_size: int = _help("elements per gradient bucket (ZeRO-R CB)",
                                  default=DEFAULT_BUCKET_ELEMENTS)
    zero_hybrid_shard: bool = _help("ZeRO stages 1-3 partition inside each host and replicate across "
                                    "hosts (FSDP2 HSDP, MiCS): parameters gathered inside the host, "
                                    "gradient shards all-reduced across", default=False)
    zero_hpz: bool = _help("ZeRO stage 3 keeps a secondary 16-bit partition inside each host, so the "
                           "backward's parameter all-gather never crosses hosts (ZeRO++ hpZ)",
                           default=False)
    world_size: int | None = _help("GPUs the preset is meant for (checked at launch; used by --dry-run)",
                                   default=None)
    gpus_per_node: int = _help("GPUs per node (16 on a DGX-2)", default=Topology.gpus_per_node)
    allow_tp_across_nodes: bool = _help("accept TP groups larger than a node", default=False)
    offload_optimizer: str = _help("where fp32 master + Adam moments live: none | cpu (ZeRO-Offload) | "
                                   "nvme (ZeRO-Infinity)", default="none")
    offload_params: str = _help("ZeRO-3 16-bit parameter partitions: none (in memory) | nvme "
                                "(ZeRO-Infinity, beside the optimizer state; needs "
                                "--offload-optimizer nvme)", default="none")
    offload_nvme_path: str | None = _help("directory for --offload-optimizer nvme", default=None)
    host_memory_budget: str | None = _help("host memory for offloaded state, e.g. 8GiB", default=None)
    distributed_timeout_minutes: float = _help("a collective waiting longer than this for a lost rank "
                                               "fails (process-group timeout)",
                                               default=DEFAULT_TIMEOUT.total_seconds() / 60)
    dp_transport: str = _help("DP collectives of CPU ranks on one host: auto (shared memory where "
                              "every rank can map it, else gloo) | shm (shared memory or an error) | "
                              "gloo", default=DP_TRANSPORTS[0])
    zero_quantized_weights: bool = _help("ZeRO++ qwZ: stage 3 all-gathers parameters as block-wise "
                                         "int8 (256-element blocks, fp32 scales); masters stay exact",
                                         default=False)
    zero_quantized_gradients: bool = _help("ZeRO++ qgZ: stages 1-3 reduce-scatter gradients as "
                                           "block-wise int8, inside each host first, then across "
                                           "hosts, summing in fp32", default=False)

    def __post_init__(self) -> None:
        try:
            self.offload_config()
        except ValueError as err:
            raise TrainConfigError(str(err)) from None
        _positive(self, "tensor_model_parallel_size", "zero_bucket_size", "gpus_per_node",
                  "pipeline_model_parallel_size")
        _positive(self, "world_size", "num_layers_per_virtual_pipeline_stage", allow_none=True)
        if not self.distributed_timeout_minutes > 0:
            raise TrainConfigError(f"--distributed-timeout-minutes must be positive, got "
                                   f"{self.distributed_timeout_minutes}")
        if self.dp_transport not in DP_TRANSPORTS:
            raise TrainConfigError(f"--dp-transport must be auto, shm or gloo, got {self.dp_transport!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise TrainConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        self.zero_config_options()
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise TrainConfigError("--offload-optimizer needs --zero-stage 1, 2 or 3 (it offloads the "
                                   "partitioned optimizer state)")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise TrainConfigError("--offload-params nvme offloads the partitioned parameters of "
                                   "--zero-stage 3; use stage 3 or drop the flag")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise TrainConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1; "
                                   "drop the flag or raise the TP degree")
        self._check_pipeline()

    @property
    def schedule(self) -> str:
        """The pipeline schedule: --pipeline-schedule, else hybrid.pipeline's default (interleaved
        with virtual stages, else 1f1b)."""
        return self.pipeline_schedule or default_schedule(self.num_layers_per_virtual_pipeline_stage)

    def _check_pipeline(self) -> None:
        """The PP checks that need this section only (layers and micro-batches: TrainConfig)."""
        pp = self.pipeline_model_parallel_size
        if self.pipeline_schedule is not None and self.pipeline_schedule not in SCHEDULES:
            raise TrainConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got "
                                   f"{self.pipeline_schedule!r}")
        if pp == 1 and (self.num_layers_per_virtual_pipeline_stage is not None
                        or self.pipeline_schedule is not None):
            raise TrainConfigError("--num-layers-per-virtual-pipeline-stage and --pipeline-schedule "
                                   "need --pipeline-model-parallel-size > 1; raise it or drop them")
        virtual = self.num_layers_per_virtual_pipeline_stage is not None
        if virtual != (self.schedule == "interleaved"):
            raise TrainConfigError(
                "--pipeline-schedule interleaved and --num-layers-per-virtual-pipeline-stage go "
                "together: the interleaved schedule runs several model chunks per stage; set both, "
                "or neither for 1f1b / gpipe")
        refusal = layout_refusal(self.zero_stage, pp)   # the engine's rule and message
        if refusal is not None:
            raise TrainConfigError(refusal)

    def zero_config_options(self) -> dict:
        """The topology-aware fields of hybrid.zero.ZeroConfig (hybrid sharding, ZeRO++ hpZ, qwZ,
        qgZ), checked against the stage now (the hosts are only known at launch, where the engine
        checks them)."""
        options = {"hybrid_shard": self.zero_hybrid_shard, "hpz": self.zero_hpz,
                   "quantized_weights": self.zero_quantized_weights,
                   "quantized_gradients": self.zero_quantized_gradients}
        if any(options.values()):
            from hybrid.zero.config import ZeroConfig
            try:
                ZeroConfig(stage=self.zero_stage, **options)
            except ValueError as err:
                raise TrainConfigError(str(err)) from None
        return options

    def offload_config(self):
        """The hybrid.offload.OffloadConfig of these flags (None: no offload)."""
        if self.offload_optimizer == "none" and self.offload_nvme_path is None:
            return None
        from hybrid.offload.budget import OffloadConfig
        return OffloadConfig(mode=self.offload_optimizer, nvme_path=self.offload_nvme_path,
                             host_memory_budget=self.host_memory_budget, params=self.offload_params)


@dataclass
class OptimizerSection:
    """AdamW, its learning-rate schedule, clipping and mixed-precision loss scaling."""

    lr: float = _help("peak learning rate", default=3e-4)
    min_lr: float = _help("final learning rate of the decay", default=3e-5)
    lr_warmup_iters: int = _help("linear warm-up iterations", default=0)
    lr_warmup_samples: int = _help("linear warm-up in samples (with --train-samples)", default=0)
    lr_warmup_fraction: float | None = _help("warm-up as a fraction of the decay length (instead of "
                                             "--lr-warmup-iters / --lr-warmup-samples)", default=None)
    lr_decay_iters: int | None = _help("decay length (default: train iters)", default=None)
    lr_decay_samples: int | None = _help("decay length in samples (with --train-samples; default: "
                                         "train samples)", default=None)
    lr_decay_style: str = _help("cosine | linear | constant | inverse-square-root (lr * "
                                "sqrt(warm-up / iteration), needs a warm-up) | WSD "
                                "(warmup-stable-decay: lr until the last --lr-wsd-decay-iters "
                                "of the decay)", default="cosine")
    lr_wsd_decay_style: str = _help("WSD's decay shape: exponential | linear | cosine | minus_sqrt",
                                    default="exponential")
    lr_wsd_decay_iters: int | None = _help("WSD: iterations of the decay, the last ones of "
                                           "--lr-decay-iters", default=None)
    lr_wsd_decay_samples: int | None = _help("WSD: samples of the decay, the last ones of "
                                             "--lr-decay-samples (with --train-samples)",
                                             default=None)
    weight_decay: float = _help("AdamW decoupled weight decay (not on norms/biases)",
                                default=AdamWConfig.weight_decay)
    adam_beta1: float = _help("Adam beta1", default=AdamWConfig.betas[0])
    adam_beta2: float = _help("Adam beta2", default=0.95)
    adam_eps: float = _help("Adam epsilon", default=AdamWConfig.eps)
    clip_grad: float = _help("max global grad norm (0 = off)", default=1.0)
    bf16: bool = _help("bf16 params/grads with fp32 master weights", default=False)
    fp16: bool = _help("fp16 params/grads with fp32 master weights and dynamic loss scaling",
                       default=False)
    loss_scale: float | None = _help("fp16: a static loss scale (steps whose gradients overflow are "
                                     "skipped); none: dynamic loss scaling", default=None)
    initial_loss_scale: float = _help("fp16: starting loss scale",
                                      default=LossScaleConfig.initial_scale)
    min_loss_scale: float = _help("fp16: lowest loss scale", default=LossScaleConfig.min_scale)
    loss_scale_window: int = _help("fp16: clean steps before the scale grows",
                                   default=LossScaleConfig.growth_interval)
    hysteresis: int = _help("fp16: overflows tolerated before the scale shrinks",
                            default=LossScaleConfig.hysteresis)
    on_nonfinite: str = _help("bf16/fp32: a NaN/Inf loss or gradient skips the step or stops "
                              "the run, before any update (fp16: the loss scaler skips)",
                              default="skip")
    override_opt_param_scheduler: bool = _help(
        "on resume, take the learning-rate schedule (lr, min lr, warm-up, decay length and style) "
        "from these flags, not from the checkpoint", default=False)
    use_checkpoint_opt_param_scheduler: bool = _help(
        "on resume, take the learning-rate schedule from the checkpoint, not from these flags",
        default=False)

    def __post_init__(self) -> None:
        _non_negative(self, "lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "weight_decay",
                      "clip_grad", "adam_eps")
        _positive(self, "lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters",
                  "lr_wsd_decay_samples", allow_none=True)
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            raise TrainConfigError(f"--lr-warmup-fraction must be in [0, 1], got "
                                   f"{self.lr_warmup_fraction}")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise TrainConfigError("give one of --lr-warmup-fraction, --lr-warmup-iters and "
                                   "--lr-warmup-samples")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise TrainConfigError("--override-opt_param-scheduler (the flags' schedule) and "
                                   "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude "
                                   "each other; pick one")
        if self.loss_scale is not None and not (self.fp16 and self.loss_scale > 0):
            raise TrainConfigError(f"--loss-scale {self.loss_scale} is fp16's static loss scale: it "
                                   f"needs --fp16 and a positive value (bf16 and fp32 need none)")
        _positive(self, "loss_scale_window", "hysteresis")
        if self.min_lr > self.lr:
            raise TrainConfigError(f"--min-lr {self.min_lr} is above --lr {self.lr}; lower --min-lr")
        self._check_decay_style()
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise TrainConfigError(f"{flag_name(name)} must be in [0, 1), "
                                       f"got {getattr(self, name)}")
        if self.on_nonfinite not in ("skip", "stop"):
            raise TrainConfigError(f"--on-nonfinite must be skip or stop, got {self.on_nonfinite!r}")
        if self.bf16 and self.fp16:
            raise TrainConfigError("--bf16 and --fp16 are exclusive; pick one")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise TrainConfigError(f"need 0 < --min-loss-scale <= --initial-loss-scale, got "
                                   f"{self.min_loss_scale} and {self.initial_loss_scale}")

    def _check_decay_style(self) -> None:
        """Megatron's styles; WSD needs its decay length, which no other style takes."""
        from pretrain.lr_schedule import STYLES, WSD_STYLES
        if self.lr_decay_style not in STYLES:
            raise TrainConfigError(f"--lr-decay-style must be cosine, linear or constant, or "
                                   f"inverse-square-root or WSD; got {self.lr_decay_style!r}")
        if self.lr_wsd_decay_style not in WSD_STYLES:
            raise TrainConfigError(f"--lr-wsd-decay-style must be one of {', '.join(WSD_STYLES)}, "
                                   f"got {self.lr_wsd_decay_style!r}")
        wsd_lengths = [f for f in ("lr_wsd_decay_iters", "lr_wsd_decay_samples")
                       if getattr(self, f) is not None]
        if self.lr_decay_style == "WSD" and not wsd_lengths:
            raise TrainConfigError("--lr-decay-style WSD needs the length of its decay: give "
                                   "--lr-wsd-decay-iters (or --lr-wsd-decay-samples with "
                                   "--train-samples)")
        if self.lr_decay_style != "WSD" and wsd_lengths:
            raise TrainConfigError(f"{flag_name(wsd_lengths[0])} is the decay length of "
                                   f"--lr-decay-style WSD, not of {self.lr_decay_style}; drop it "
                                   f"or use --lr-decay-style WSD")
        if len(wsd_lengths) == 2:
            raise TrainConfigError("give one of --lr-wsd-decay-iters and --lr-wsd-decay-samples")

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def loss_scale_options(self) -> dict:
        """fp16's scaler (hybrid.zero.LossScaleConfig's fields): dynamic, or pinned at --loss-scale
        (Megatron's static scale: it never grows or backs off; an overflowed step is skipped)."""
        if self.loss_scale is not None:
            return {"initial_scale": self.loss_scale, "min_scale": self.loss_scale,
                    "growth_interval": 2 ** 62, "hysteresis": 1}
        return {"initial_scale": self.initial_loss_scale, "min_scale": self.min_loss_scale,
                "growth_interval": self.loss_scale_window, "hysteresis": self.hysteresis}


@dataclass
class DataSection:
    """Batch sizes and the GPT corpus (Megatron's weighted --data-path and --split)."""

    micro_batch_size: int = _help("samples per rank per forward/backward", default=4)
    global_batch_size: int | None = _help("samples per optimizer step (default: micro x DP)",
                                          default=None)
    data_path: list[str] = _help("'prefix' or 'w1 prefix1 w2 prefix2 ...' (empty: embedded corpus)",
                                 default_factory=list)
    split: str = _help("train,valid,test proportions", default="969,30,1")
    eod_mask_loss: bool = _help("no loss where the input token is end-of-document", default=False)
    tokenizer_model: str | None = _help("sentencepiece .model or tokenizer.json (default: the embedded corpus's)",
                                        default=None)
    tokenizer_type: str | None = _help("Megatron's tokenizer name: GPT2BPETokenizer (--vocab-file, "
                                       "--merge-file), HuggingFaceTokenizer, SentencePieceTokenizer "
                                       "(--tokenizer-model), NullTokenizer (--vocab-size)",
                                       default=None)
    vocab_file: str | None = _help("GPT-2's vocab.json (GPT2BPETokenizer)", default=None)
    merge_file: str | None = _help("GPT-2's merges.txt (GPT2BPETokenizer)", default=None)
    data_cache_dir: str = _help("where the embedded corpus and sample indices are cached",
                                default="data-cache")

    def __post_init__(self) -> None:
        _positive(self, "micro_batch_size")
        _positive(self, "global_batch_size", allow_none=True)
        if isinstance(self.data_path, str):
            self.data_path = self.data_path.split()
        self.weighted_data_paths()  # validates
        if self.tokenizer_type is not None and self.tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
            raise TrainConfigError(f"--tokenizer-type {self.tokenizer_type!r} is not supported; "
                                   f"choose one of {', '.join(MEGATRON_TOKENIZER_TYPES)}")
        parts = self.split.split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise TrainConfigError(f"--split {self.split!r} must be comma-separated numbers like "
                                   f"'969,30,1'") from None
        if len(weights) > 3 or any(w < 0 for w in weights) or weights[0] <= 0:
            raise TrainConfigError(f"--split {self.split!r} needs up to 3 non-negative weights with a "
                                   f"positive training share, e.g. '969,30,1'")

    def weighted_data_paths(self) -> list[tuple[float, str]]:
        """``[(weight, prefix), ...]``; a single bare prefix gets weight 1."""
        items = self.data_path
        if len(items) == 1:
            return [(1.0, items[0])]
        if len(items) % 2:
            raise TrainConfigError(f"--data-path {' '.join(items)!r} must be one prefix or pairs "
                                   f"'weight prefix ...'")
        pairs = []
        for w, prefix in zip(items[0::2], items[1::2]):
            try:
                pairs.append((float(w), prefix))
            except ValueError:
                raise TrainConfigError(f"--data-path weight {w!r} is not a number; write "
                                       f"'0.7 prefixA 0.3 prefixB'") from None
        return pairs


CUDA_GRAPH_SCOPES = ("full", "attn", "full_iteration")   # Megatron's --cuda-graph-scope values


@dataclass
class TrainingSection:
    """How long to train, seeding, evaluation cadence and activation recompute (ZeRO-R §6.1)."""

    train_iters: int | None = _help("optimizer steps to run (default: 100, or --train-samples / "
                                    "global batch)", default=None)
    train_samples: int | None = _help("samples to train on, instead of --train-iters (iterations = "
                                      "train samples / global batch)", default=None)
    seed: int = _help("seed of weights, dropout and data order", default=1234)
    exit_duration_in_mins: float | None = _help("save and stop after this many minutes", default=None)
    exit_interval: int | None = _help("save (with --save) and stop after the iteration that is a "
                                      "multiple of N", default=None)
    eval_interval: int = _help("validate every N iterations", default=50)
    eval_iters: int = _help("validation batches per evaluation (0 = none)", default=4)
    recompute: str = _help("activation recompute: none | selective | full | full-pa (ZeRO-R Pa) | "
                           "full-pa-cpu (Pa+cpu) | auto (per-layer plan for --memory-budget)",
                           default="none")
    recompute_method: str | None = _help(
        "with a full recompute: uniform (every layer, --recompute-num-layers layers per checkpoint) "
        "| block (only the first --recompute-num-layers layers of each model chunk)", default=None)
    recompute_num_layers: int | None = _help("layers per checkpoint (uniform) or recomputed layers "
                                             "per model chunk (block)", default=None)
    memory_budget: str | None = _help("activation bytes per rank that --recompute auto plans for, "
                                      "e.g. 2GiB or 500000000", default=None)
    compile: bool = _help("torch.compile each transformer layer (regional; inductor's C++ back end "
                          "on CPU, Triton on CUDA) and the AdamW update (one pass; not with "
                          "optimizer offload), cached in <--data-cache-dir>/inductor",
                          default=False)
    enable_cuda_graph: bool = _help("capture CUDA graphs of the training step (scope: "
                                    "--cuda-graph-scope) and replay them; CUDA only",
                                    default=False)
    cuda_graph_scope: str = _help("with --enable-cuda-graph: full (each transformer layer's "
                                  "forward and backward) | attn | full_iteration (refused, with "
                                  "the reason)", default="full")
    cuda_graph_warmup_steps: int = _help("eager runs of each layer before its capture",
                                         default=3)

    def _check_recompute_method(self) -> None:
        """Megatron's --recompute-method / --recompute-num-layers apply to full recompute only."""
        from hybrid.recompute.plan import FULL_MODES
        method, layers = self.recompute_method, self.recompute_num_layers
        if method is None and layers is None:
            return
        if method not in ("uniform", "block"):
            raise TrainConfigError(f"--recompute-method must be uniform or block, got {method!r}")
        if self.recompute not in FULL_MODES:
            raise TrainConfigError(f"--recompute-method applies to a full recompute (--recompute "
                                   f"{' | '.join(FULL_MODES)}), not --recompute {self.recompute}")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise TrainConfigError(f"--recompute-method {method} needs --recompute-num-layers N "
                                   f"(a positive integer), got {layers!r}")

    @property
    def memory_budget_bytes(self) -> int | None:
        from hybrid.offload.budget import parse_bytes
        if self.memory_budget is None:
            return None
        try:
            return parse_bytes(self.memory_budget)
        except ValueError as err:
            raise TrainConfigError(f"--memory-budget: {err}") from None

    def __post_init__(self) -> None:
        from hybrid.recompute.plan import MODES
        if self.recompute not in (*MODES, "auto"):
            raise TrainConfigError(f"--recompute must be one of {', '.join(MODES)}, auto; got "
                                   f"{self.recompute!r}")
        if (self.recompute == "auto") != (self.memory_budget is not None):
            raise TrainConfigError("--recompute auto needs --memory-budget <bytes per rank> (e.g. "
                                   "2GiB), and --memory-budget applies only to --recompute auto")
        if self.memory_budget is not None:
            self.memory_budget_bytes  # noqa: B018  (validates the size now, not at build time)
        self._check_recompute_method()
        if self.cuda_graph_scope not in CUDA_GRAPH_SCOPES:
            raise TrainConfigError(f"--cuda-graph-scope must be one of {', '.join(CUDA_GRAPH_SCOPES)}, "
                                   f"got {self.cuda_graph_scope!r}")
        _positive(self, "cuda_graph_warmup_steps")
        _positive(self, "eval_interval")
        _positive(self, "train_iters", "train_samples", "exit_interval", allow_none=True)
        if self.train_iters is not None and self.train_samples is not None:
            raise TrainConfigError("give --train-iters or --train-samples, not both")
        _non_negative(self, "seed", "eval_iters")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise TrainConfigError(f"--exit-duration-in-mins must be positive, got "
                                   f"{self.exit_duration_in_mins}")


@dataclass
class CheckpointSection:
    """Where and how often layout-independent checkpoints are written (docs/design.md §8)."""

    save: str | None = _help("directory to save checkpoints to", default=None)
    load: str | None = _help("directory to resume from (its `latest`)", default=None)
    save_interval: int | None = _help("save every N iterations (default: only at the end)", default=None)
    keep_last_checkpoints: int | None = _help("keep the newest K checkpoints, delete older ones "
                                              "(default: keep all)", default=None)
    load_optim: bool = _help("load the optimizer state (Adam moments, step count, loss scale) "
                             "with --load; --no-load-optim starts a fresh optimizer on the loaded "
                             "weights", default=True)
    load_rng: bool = _help("restore the random-number streams with --load; --no-load-rng reseeds "
                           "them from --seed and the iteration", default=True)
    finetune: bool = _help("load only the weights of --load: start at iteration 0 with a fresh "
                           "optimizer and data order", default=False)
    overwrite: bool = _help("start a new run in a --save that holds another run's checkpoints; "
                            "they are deleted once this run saves its first", default=False)
    init_from_hf: str | None = _help("start from the weights of this Hugging Face GPT-2 or Llama "
                                     "directory (config.json + model.safetensors, e.g. "
                                     "tools/export_hf.py or save_pretrained output; same model dims "
                                     "and options); not used when resuming from --load",
                                     default=None)

    def __post_init__(self) -> None:
        _positive(self, "save_interval", "keep_last_checkpoints", allow_none=True)
        if self.finetune and not self.load:
            raise TrainConfigError("--finetune loads the weights of --load; give --load DIR")


@dataclass
class LoggingSection:
    """Console and TensorBoard metrics (Megatron's scalar names)."""

    log_interval: int = _help("console/TensorBoard line every N iterations", default=10)
    tensorboard_dir: str | None = _help("TensorBoard directory; each run writes to its own run "
                                        "directory in it (none: no TensorBoard)", default=None)
    run_name: str | None = _help("name of this run's directory under --tensorboard-dir (default: "
                                 "the run's UTC start time and id, e.g. 20261123-231500-1a2b3c4d, "
                                 "which a resumed run keeps); a name that exists is appended to",
                                 default=None)
    peak_tflops: float | None = _help("per-device peak TFLOP/s for MFU (default: the detected "
                                      "GPU's dense bf16/fp16 peak, pretrain.device_peaks)",
                                      default=None)
    roofline: bool = _help("measure this machine's GEMM rate at the run's shapes (once, cached in "
                           "--data-cache-dir) and log each step as a fraction of its GEMM-bound "
                           "time (perf/gemm-bound-fraction)", default=True)

    def __post_init__(self) -> None:
        _positive(self, "log_interval")
        if self.run_name is not None and not isinstance(self.run_name, str):
            raise TrainConfigError(f"--run-name must be text, got {self.run_name!r}; quote it")
        if self.run_name and (Path(self.run_name).is_absolute() or ".." in Path(self.run_name).parts):
            raise TrainConfigError(f"--run-name {self.run_name!r} must be a name inside "
                                   f"--tensorboard-dir, not a path out of it; pass a plain name")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise TrainConfigError(f"--peak-tflops must be positive, got {self.peak_tflops}")


SECTIONS: dict[str, type] = {
    "model": GPTConfig, "parallel": ParallelSection, "optimizer": OptimizerSection,
    "data": DataSection, "training": TrainingSection, "checkpoint": CheckpointSection,
    "logging": LoggingSection,
}
