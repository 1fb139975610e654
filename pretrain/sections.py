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
from hybrid.muon_config import MuonConfig
from hybrid.data.tokenizer_types import MEGATRON_TOKENIZER_TYPES
from hybrid.perf.hardware import (DGX2_HOST_OFFLOAD_BANDWIDTH, DGX2_NVME_OFFLOAD_BANDWIDTH,
                                  Cluster)
from hybrid.pipeline.config import SCHEDULES, default_schedule
from hybrid.precision_config import LossScaleConfig
from hybrid.topology import DEFAULT_TIMEOUT, DP_TRANSPORTS, Topology
from hybrid.zero_policy import DEFAULT_BUCKET_ELEMENTS, layout_refusal
from models.gpt.config import ConfigError, GPTConfig


class TrainConfigError(ValueError):
    """An invalid training configuration; the message says which flag to change and how."""


def found_by_every_rank(err: Exception) -> Exception:
    """Mark ``err`` as bad input every rank finds alike (this command line against the checkpoint
    they all read): the entry point prints it once per host, as it does config errors, instead of
    once per rank."""
    err.every_rank = True
    return err


FP8_FORMATS = ("e4m3", "hybrid")                    # hybrid.tensor_parallel.fp8_scaling's
FP8_RECIPES = ("tensorwise", "delayed", "rowwise")  # (this layer imports no torch)
QUANTIZED_WEIGHTS_FORMATS = ("int8", "fp8")          # hybrid.zero.quantize's
CP_COMM_TYPES = ("p2p", "a2a", "allgather")         # hybrid.context_parallel.attention's


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
    context_parallel_size: int = _help("CP degree: ranks splitting every sequence, each holding 2 "
                                       "load-balanced chunks; gradients and ZeRO partitions span "
                                       "DP x CP", default=1)
    cp_comm_type: str = _help("attention communication under CP: p2p (ring of K/V blocks) | a2a "
                              "(all-to-all of heads, Ulysses) | allgather (all K/V gathered)",
                              default="p2p")
    num_layers_per_virtual_pipeline_stage: int | None = _help(
        "layers per model chunk of the interleaved schedule (v = num_layers / (PP x this) chunks "
        "per stage; default: one chunk per stage)", default=None)
    pipeline_schedule: str | None = _help("1f1b | gpipe | interleaved (default: 1f1b, interleaved "
                                          "when --num-layers-per-virtual-pipeline-stage is set)",
                                          default=None)
    sequence_parallel: bool = _help("shard LayerNorm/dropout activations along the sequence",
                                    default=False)
    expert_model_parallel_size: int = _help("EP degree: the experts of each MoE layer split over "
                                            "this many DP ranks (carved out of DP; expert-DP = "
                                            "DP / EP)", default=1)
    expert_tensor_parallel_size: int | None = _help(
        "TP degree of the experts; only the dense TP degree is supported (default: the same)",
        default=None)
    zero_stage: int = _help("ZeRO-DP stage: 0 baseline, 1 Pos, 2 Pos+g, 3 Pos+g+p", default=1)
    zero_bucket_size: int = _help("elements per gradient bucket (ZeRO-R CB)",
                                  default=DEFAULT_BUCKET_ELEMENTS)
    zero_hybrid_shard: bool = _help("ZeRO stages 1-3 partition inside each host and replicate across "
                                    "hosts (FSDP2 HSDP, MiCS): parameters gathered inside the host, "
                                    "gradient shards all-reduced across", default=False)
    zero_hpz: bool = _help("ZeRO stage 3 keeps a secondary 16-bit partition inside each host, so the "
                           "backward's parameter all-gather never crosses hosts (ZeRO++ hpZ)",
                           default=False)
    tile_factor: int = _help("ZeRO stage 3 memory-centric tiling (ZeRO-Infinity): each column- and "
                             "row-parallel linear weight split into this many row tiles, each "
                             "gathered, used and released on its own (1 = whole weights)",
                             default=1)
    max_working_memory: str | None = _help("ZeRO stage 3: largest parameter memory one layer may "
                                           "gather at once, e.g. 2GiB; a layer over it is refused "
                                           "with the --tile-factor that fits (default: no bound)",
                                           default=None)
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
    host_offload_bandwidth: float = _help("GB/s per GPU between host memory and the GPU (declared; "
                                          "--dry-run compares it with what offloaded state needs, "
                                          "ZeRO-Infinity §4; default: a DGX-2's)",
                                          default=DGX2_HOST_OFFLOAD_BANDWIDTH / 1e9)
    nvme_offload_bandwidth: float = _help("GB/s per GPU between NVMe and the GPU (declared; used as "
                                          "--host-offload-bandwidth; default: a DGX-2's)",
                                          default=DGX2_NVME_OFFLOAD_BANDWIDTH / 1e9)
    offload_target_efficiency: float = _help("efficiency --dry-run asks offloaded state's bandwidth "
                                             "for (ZeRO-Infinity §4: ait bw / (ait bw + peak))",
                                             default=0.9)
    distributed_timeout_minutes: float = _help("a collective waiting longer than this for a lost rank "
                                               "fails (process-group timeout)",
                                               default=DEFAULT_TIMEOUT.total_seconds() / 60)
    dp_transport: str = _help("DP collectives of CPU ranks on one host: auto (shared memory where "
                              "every rank can map it, else gloo) | shm (shared memory or an error) | "
                              "gloo", default=DP_TRANSPORTS[0])
    zero_quantized_weights: bool = _help("ZeRO++ qwZ: stage 3 all-gathers parameters as block-wise "
                                         "int8 (256-element blocks, fp32 scales); masters stay exact",
                                         default=False)
    zero_quantized_weights_format: str = _help("--zero-quantized-weights' format: int8 (ZeRO++'s) "
                                               "| fp8 (E4M3 with the same 256-element blocks and "
                                               "fp32 scales)", default="int8")
    zero_quantized_gradients: bool = _help("ZeRO++ qgZ: stages 1-3 reduce-scatter gradients as "
                                           "block-wise int8, inside each host first, then across "
                                           "hosts, summing in fp32", default=False)

    def __post_init__(self) -> None:
        try:
            self.offload_config()
        except ValueError as err:
            raise TrainConfigError(str(err)) from None
        _positive(self, "tensor_model_parallel_size", "zero_bucket_size", "gpus_per_node",
                  "pipeline_model_parallel_size", "context_parallel_size")
        _positive(self, "world_size", "num_layers_per_virtual_pipeline_stage", allow_none=True)
        _positive(self, "expert_model_parallel_size")
        ett, tp = self.expert_tensor_parallel_size, self.tensor_model_parallel_size
        if ett is not None and ett != tp:
            raise TrainConfigError(
                f"--expert-tensor-parallel-size {ett} differs from --tensor-model-parallel-size {tp}:"
                f" here the experts are split over the same TP ranks as the dense layers (the tokens"
                f" they receive are replicated on that TP group), so only {tp} is supported; drop the"
                f" flag or set it to {tp}")
        if not self.distributed_timeout_minutes > 0:
            raise TrainConfigError(f"--distributed-timeout-minutes must be positive, got "
                                   f"{self.distributed_timeout_minutes}")
        for name in ("host_offload_bandwidth", "nvme_offload_bandwidth"):
            if not getattr(self, name) > 0:
                raise TrainConfigError(f"--{name.replace('_', '-')} must be a positive GB/s per GPU, "
                                       f"got {getattr(self, name)!r}")
        if not 0 < self.offload_target_efficiency < 1:
            raise TrainConfigError(f"--offload-target-efficiency must lie strictly between 0 and 1, "
                                   f"got {self.offload_target_efficiency!r}")
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
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        """The CP checks that need this section only (sequence, heads, dropout: TrainConfig)."""
        if self.cp_comm_type not in CP_COMM_TYPES:
            extra = (" (Megatron's a2a+p2p, hierarchical CP, is not here: use a2a inside a node or "
                     "p2p)" if self.cp_comm_type == "a2a+p2p" else "")
            raise TrainConfigError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got "
                                   f"{self.cp_comm_type!r}{extra}")
        if self.context_parallel_size == 1:
            return
        hosts = [flag for flag, on in (("--zero-hybrid-shard", self.zero_hybrid_shard),
                                       ("--zero-hpz", self.zero_hpz),
                                       ("--zero-quantized-gradients", self.zero_quantized_gradients))
                 if on]
        if hosts:
            raise TrainConfigError(
                f"{' and '.join(hosts)} with --context-parallel-size "
                f"{self.context_parallel_size}: these split the DP group by host, while under CP "
                f"the ZeRO partitions span DP x CP; the host split of DP x CP is not built yet, "
                f"drop {'them' if len(hosts) > 1 else 'it'} or use --context-parallel-size 1")

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
        qgZ) and memory-centric tiling (tile factor, working-memory bound), checked against the
        stage now (the hosts are only known at launch, where the engine
        checks them)."""
        if self.zero_quantized_weights_format not in QUANTIZED_WEIGHTS_FORMATS:
            raise TrainConfigError(f"--zero-quantized-weights-format must be int8 or fp8, got "
                                   f"{self.zero_quantized_weights_format!r}")
        if self.zero_quantized_weights_format != "int8" and not self.zero_quantized_weights:
            raise TrainConfigError(f"--zero-quantized-weights-format "
                                   f"{self.zero_quantized_weights_format} is the format of "
                                   f"--zero-quantized-weights' all-gathers: add that flag")
        options = {"hybrid_shard": self.zero_hybrid_shard, "hpz": self.zero_hpz,
                   "quantized_weights": self.zero_quantized_weights,
                   "quantized_gradients": self.zero_quantized_gradients}
        if self.tile_factor != 1:
            options["tile_factor"] = self.tile_factor
        if self.max_working_memory is not None:
            from hybrid.offload.budget import parse_bytes
            try:
                options["max_working_memory"] = parse_bytes(self.max_working_memory)
            except ValueError as err:
                raise TrainConfigError(f"--max-working-memory: {err}") from None
        if self.zero_quantized_weights_format != "int8":
            options["quantized_weights_format"] = self.zero_quantized_weights_format
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
    optimizer: str = _help("adamw | muon (Muon for the transformer layers' weight matrices, each "
                           "expert's separately, AdamW for embeddings, output layer, norms and biases; Megatron's 'adam' is "
                           "adamw)", default="adamw")
    muon_momentum: float = _help("Muon: SGD momentum mu", default=MuonConfig.momentum)
    muon_use_nesterov: bool = _help("Muon: Nesterov momentum (Megatron's default: off)",
                                    default=MuonConfig.nesterov)
    muon_num_ns_steps: int = _help("Muon: Newton-Schulz iterations", default=MuonConfig.ns_steps)
    muon_scale_mode: str = _help("Muon: update scale: spectral (sqrt(max(m, n))) | unit_rms_norm "
                                 "(sqrt(m / n)) | shape_scaling (sqrt(max(1, m / n)))",
                                 default=MuonConfig.scale_mode)
    muon_extra_scale_factor: float = _help("Muon: extra update factor (0.2 with spectral: "
                                           "Moonlight's AdamW-RMS match; Megatron's default 1.0)",
                                           default=MuonConfig.extra_scale_factor)
    muon_tp_mode: str = _help("Muon: a TP-sharded matrix is gathered whole on every TP rank of "
                              "its owner (duplicated; the only mode)", default=MuonConfig.tp_mode)
    muon_ns_dtype: str = _help("Muon: Newton-Schulz dtype (and of Muon's communication): bf16 | "
                               "fp32", default=MuonConfig.ns_dtype)
    override_opt_param_scheduler: bool = _help(
        "on resume, take the learning-rate schedule (lr, min lr, warm-up, decay length and style) "
        "from these flags, not from the checkpoint", default=False)
    use_checkpoint_opt_param_scheduler: bool = _help(
        "on resume, take the learning-rate schedule from the checkpoint, not from these flags",
        default=False)
    # Megatron's precision-aware optimizer (issue 33 part 4, docs/optimizer-precision.md)
    use_precision_aware_optimizer: bool = _help(
        "let --exp-avg-dtype / --exp-avg-sq-dtype / --main-params-dtype take 16-bit values",
        default=False)
    exp_avg_dtype: str = _help("storage dtype of Adam's first moment: fp32 | bf16 (the step "
                               "computes in fp32)", default="fp32")
    exp_avg_sq_dtype: str = _help("storage dtype of Adam's second moment: fp32 | bf16 (the step "
                                  "computes in fp32)", default="fp32")
    main_params_dtype: str = _help("dtype of the master weights: fp32 (fp16 is refused: it needs "
                                   "stochastic rounding, not implemented)", default="fp32")

    # ---- FP8 training (docs/fp8.md; Megatron-LM's Transformer-Engine flags) ----
    fp8_format: str | None = _help("FP8 GEMMs in every linear of the transformer layers: e4m3 "
                                   "(E4M3 everywhere) | hybrid (E4M3 forward, E5M2 gradients); "
                                   "needs --bf16", default=None)
    fp8_recipe: str = _help("FP8 scales: delayed (from an amax history) | tensorwise (each "
                            "tensor's current amax) | rowwise (per row / column, powers of two: "
                            "torchao's)", default="delayed")
    fp8_margin: int = _help("FP8 scales are divided by 2^margin", default=0)
    fp8_amax_history_len: int = _help("delayed FP8 scaling: amaxes kept per tensor", default=1)
    fp8_amax_compute_algo: str = _help("delayed FP8 scaling: the amax used, max (of the history) | "
                                       "most_recent", default="most_recent")
    first_last_layers_bf16: bool = _help("under FP8, keep the first and last transformer layers "
                                         "in bf16", default=False)
    num_layers_at_start_in_bf16: int = _help("with --first-last-layers-bf16: leading layers in "
                                             "bf16", default=1)
    num_layers_at_end_in_bf16: int = _help("with --first-last-layers-bf16: trailing layers in "
                                           "bf16", default=1)

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
        self._check_optimizer_dtypes()
        self._check_optimizer()

        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise TrainConfigError(f"{flag_name(name)} must be in [0, 1), "
                                       f"got {getattr(self, name)}")
        if self.on_nonfinite not in ("skip", "stop"):
            raise TrainConfigError(f"--on-nonfinite must be skip or stop, got {self.on_nonfinite!r}")
        if self.bf16 and self.fp16:
            raise TrainConfigError("--bf16 and --fp16 are exclusive; pick one")
        self._check_fp8()
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

    def _check_optimizer_dtypes(self) -> None:
        """Megatron's precision-aware optimizer flags: bf16 moments are implemented, fp32 master
        weights only (docs/optimizer-precision.md says why)."""
        from hybrid.adamw_config import MOMENT_DTYPES
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(self, name)
            if value not in MOMENT_DTYPES:
                raise TrainConfigError(
                    f"{flag_name(name)} {value!r} is not implemented: Adam's moments are stored in "
                    f"fp32 or bf16 here (Megatron's fp16 / fp8 moment storage needs per-tensor "
                    f"scaling this optimizer does not have); use fp32 or bf16")
        if self.main_params_dtype == "fp16":
            raise TrainConfigError(
                "--main-params-dtype fp16 is refused: fp16 master weights only train when each "
                "update is rounded stochastically into them (a round-to-nearest fp16 master loses "
                "every update smaller than half an ulp of the weight), and stochastic rounding is "
                "not implemented here; use --main-params-dtype fp32 (the default)")
        if self.main_params_dtype != "fp32":
            raise TrainConfigError(f"--main-params-dtype must be fp32 (or Megatron's fp16, refused "
                                   f"here), got {self.main_params_dtype!r}")
        low = [flag_name(n) for n in ("exp_avg_dtype", "exp_avg_sq_dtype")
               if getattr(self, n) != "fp32"]
        if low and not self.use_precision_aware_optimizer:
            raise TrainConfigError(
                f"{' and '.join(low)} bf16: 16-bit moments belong to Megatron's precision-aware "
                f"optimizer (without --use-precision-aware-optimizer Megatron keeps fp32 "
                f"moments); add --use-precision-aware-optimizer")

    def _check_fp8(self) -> None:
        """--fp8-format and its options (the model's shapes: TrainConfig.check_sections)."""
        if self.fp8_format is None:
            if self.first_last_layers_bf16:
                raise TrainConfigError("--first-last-layers-bf16 keeps layers out of FP8 training; "
                                       "it needs --fp8-format e4m3 or hybrid (or drop it)")
            return
        if self.fp8_format not in FP8_FORMATS:
            raise TrainConfigError(f"--fp8-format must be e4m3 or hybrid, got {self.fp8_format!r}")
        if self.fp16:
            raise TrainConfigError(
                "--fp8-format with --fp16: fp16's dynamic loss scaler finds overflows as Inf in the "
                "gradients, but every FP8 cast saturates at the format's largest value, so an "
                "overflow would be clipped silently and the scale never backs off; use --bf16 "
                "(FP8 training keeps bf16 around its GEMMs, as Transformer Engine does)")
        if not self.bf16:
            raise TrainConfigError("--fp8-format runs the GEMMs in FP8 with bf16 outputs, "
                                   "parameters and activations: add --bf16")
        if self.fp8_recipe not in FP8_RECIPES:
            raise TrainConfigError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got "
                                   f"{self.fp8_recipe!r}")
        if self.fp8_amax_compute_algo not in ("max", "most_recent"):
            raise TrainConfigError(f"--fp8-amax-compute-algo must be max or most_recent, got "
                                   f"{self.fp8_amax_compute_algo!r}")
        _positive(self, "fp8_amax_history_len")
        _non_negative(self, "fp8_margin", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
        for name in ("fp8_margin", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if not isinstance(getattr(self, name), int):
                raise TrainConfigError(f"{flag_name(name)} must be an integer, got "
                                       f"{getattr(self, name)!r}")

    def fp8_options(self) -> dict | None:
        """The recipe of hybrid.tensor_parallel.fp8_scaling.Fp8Recipe (None without FP8)."""
        if self.fp8_format is None:
            return None
        return {"format": self.fp8_format, "recipe": self.fp8_recipe, "margin": self.fp8_margin,
                "amax_history_len": self.fp8_amax_history_len,
                "amax_compute_algo": self.fp8_amax_compute_algo}

    def _check_optimizer(self) -> None:
        if self.optimizer == "adam":   # Megatron's name for its (decoupled) AdamW
            self.optimizer = "adamw"
        if self.optimizer not in ("adamw", "muon"):
            raise TrainConfigError(f"--optimizer must be adamw or muon (adam: adamw), got "
                                   f"{self.optimizer!r}")
        try:
            self.muon_config()
        except ValueError as err:
            raise TrainConfigError(str(err)) from None

    def muon_config(self) -> MuonConfig | None:
        """The Muon hyper-parameters of --optimizer muon (None under AdamW); checked even then."""
        config = MuonConfig(momentum=self.muon_momentum, nesterov=self.muon_use_nesterov,
                            ns_steps=self.muon_num_ns_steps, scale_mode=self.muon_scale_mode,
                            extra_scale_factor=self.muon_extra_scale_factor,
                            ns_dtype=self.muon_ns_dtype, tp_mode=self.muon_tp_mode)
        return config if self.optimizer == "muon" else None


    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def adamw_moment_dtypes(self) -> dict:
        """AdamWConfig's moment storage fields of these flags."""
        return {"exp_avg_dtype": self.exp_avg_dtype, "exp_avg_sq_dtype": self.exp_avg_sq_dtype}

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
    step_batch_size_schedule: str | None = _help(
        "global batch by tokens consumed, 'THRESHOLD:BATCH ...' with K/M/B/T suffixes, e.g. "
        "'0:16 2.4B:320 12B:1536' (hybrid/batch_schedule.py)", default=None)
    rampup_batch_size: list[int] | None = _help(
        "START INCREMENT SAMPLES: grow the batch linearly from START to --global-batch-size over "
        "SAMPLES samples", default=None)
    data_path: list[str] = _help("'prefix' or 'w1 prefix1 w2 prefix2 ...' (empty: embedded corpus)",
                                 default_factory=list)
    split: str = _help("train,valid,test proportions", default="969,30,1")
    eod_mask_loss: bool = _help("no loss where the input token is end-of-document", default=False)
    reset_position_ids: bool = _help("positions restart at 0 after each end-of-document token "
                                     "(learned and rotary positions)", default=False)
    reset_attention_mask: bool = _help("no attention across documents: a token attends only to "
                                       "earlier tokens of its own document (an EOD ends its "
                                       "document)", default=False)
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
        self._check_batch_ramp()
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

    def _check_batch_ramp(self) -> None:
        ramp, steps = self.rampup_batch_size, self.step_batch_size_schedule
        if ramp is not None and steps is not None:
            raise TrainConfigError("give one of --rampup-batch-size and --step-batch-size-schedule")
        if ramp is not None:
            if len(ramp) != 3:
                raise TrainConfigError(f"--rampup-batch-size takes three numbers, START INCREMENT "
                                       f"SAMPLES, got {' '.join(map(str, ramp))}")
            if self.global_batch_size is None:
                raise TrainConfigError("--rampup-batch-size ramps up to --global-batch-size; set it")

    def batch_schedule(self, seq_length: int):
        """The :class:`~hybrid.batch_schedule.BatchSchedule` of a batch ramp, else None."""
        from hybrid.batch_schedule import BatchSchedule, BatchScheduleError
        try:
            if self.step_batch_size_schedule is not None:
                return BatchSchedule.parse(self.step_batch_size_schedule, seq_length,
                                           self.global_batch_size)
            if self.rampup_batch_size is not None:
                return BatchSchedule.rampup(*self.rampup_batch_size, final=self.global_batch_size)
        except BatchScheduleError as err:
            raise TrainConfigError(str(err)) from None
        return None

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
    async_save: bool = _help("write checkpoints in the background: the loop stops only to copy "
                             "the state to host memory (one save in flight; docs/checkpoints.md)",
                             default=False)
    max_restarts: int = _help("restart the ranks up to N times after a failure (launch/torchrun.py "
                              "passes it to torchrun); a restarted job resumes from the latest "
                              "checkpoint in --save by itself (docs/launching.md)", default=0)

    def __post_init__(self) -> None:
        _positive(self, "save_interval", "keep_last_checkpoints", allow_none=True)
        _non_negative(self, "max_restarts")
        if self.finetune and not self.load:
            raise TrainConfigError("--finetune loads the weights of --load; give --load DIR")


@dataclass
class LoggingSection:
    """Console, TensorBoard, W&B and JSON-lines metrics (Megatron's scalar names), stragglers."""

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
    memory_snapshot_step: int | None = _help("after iteration K, write a memory snapshot to the run "
                                             "directory: the CUDA allocator's history on GPUs, the "
                                             "memory report by category on CPU", default=None)

    wandb_project: str | None = _help("Weights & Biases project: log every scalar to W&B too "
                                      "(needs --wandb-exp-name; WANDB_MODE=offline writes the "
                                      "run locally, without network)", default=None)
    wandb_exp_name: str | None = _help("name of this run in the W&B project", default=None)
    wandb_save_dir: str | None = _help("directory of the W&B run files (default: <--save>/wandb, "
                                       "else ./wandb)", default=None)
    jsonl_log: str | None = _help("also append every scalar to this JSON-lines file, one line "
                                  "per log call: {\"step\": N, \"metrics\": {name: value}}",
                                  default=None)
    log_straggler: bool = _help("every --log-interval, gather each rank's step time split into "
                                "compute, communication wait and data wait; log min/median/max "
                                "per category and name the slowest ranks above "
                                "--straggler-threshold x the median", default=False)
    straggler_threshold: float = _help("a rank is a straggler when its step time exceeds this "
                                       "multiple of the median rank's", default=1.2)
    straggler_minmax_count: int = _help("how many of the slowest (and fastest) ranks a straggler "
                                        "line names", default=1)

    def __post_init__(self) -> None:
        _positive(self, "log_interval", "straggler_minmax_count")
        _positive(self, "memory_snapshot_step", allow_none=True)
        if not (isinstance(self.straggler_threshold, (int, float)) and self.straggler_threshold > 1):
            raise TrainConfigError(f"--straggler-threshold must be a number above 1 (a multiple of "
                                   f"the median step time), got {self.straggler_threshold!r}")
        if self.wandb_project and not self.wandb_exp_name:
            raise TrainConfigError("--wandb-project needs --wandb-exp-name (the run's name in the "
                                   "project, as Megatron-LM requires); pass one")
        if self.wandb_exp_name and not self.wandb_project:
            raise TrainConfigError("--wandb-exp-name is given without --wandb-project; pass the "
                                   "project to log to W&B, or drop the name")

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
