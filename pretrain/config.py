"""Training configuration: dataclasses that validate themselves (docs/design.md §9).

One :class:`TrainConfig` groups the seven sections of :mod:`pretrain.sections` (the model
section is :class:`models.gpt.GPTConfig`, validated by its own checks only). Every field
name is the Megatron-LM flag with dashes turned into underscores (``tensor_model_parallel_size`` <->
``--tensor-model-parallel-size``), so a YAML/TOML preset, the command line and a checkpoint's stored
config all speak one vocabulary.

Each section checks its own values in ``__post_init__``; checks that need two sections or the world
size live in :meth:`TrainConfig.validate_for_world`, which resolves the run's
:class:`~hybrid.layout.RunLayout` (global batch = micro batch x DP x accumulation steps, Megatron-LM
§3 "data parallel") once; the set-up passes it down. Messages name the flag to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybrid.layout import LayoutError, RunLayout
from pretrain.sections import (SECTIONS, CheckpointSection, DataSection, LoggingSection,
                                      OptimizerSection, ParallelSection, TrainConfigError,
                                      TrainingSection, build_model_config)
from pretrain.config_values import coerce_section
from models.gpt.config import ConfigError, GPTConfig

__all__ = ["SECTIONS", "TrainConfig", "TrainConfigError"]

DEFAULT_TRAIN_ITERS = 100   # without --train-iters or --train-samples


@dataclass
class TrainConfig:
    model: GPTConfig = field(default_factory=lambda: build_model_config({}))
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        self.check_sections()

    # ---- cross-section checks ----------------------------------------------------------------
    def check_sections(self) -> None:
        """Checks between sections that need no world size: the model splits into the TP degree,
        and sequence parallelism shards the sequence into equal TP slices."""
        tp = self.parallel.tensor_model_parallel_size
        try:
            self.model.validate_for_tp(tp)
        except ConfigError as err:
            raise TrainConfigError(str(err)) from None
        self._check_pipeline_layers()
        self._check_experts()
        self._check_context_parallel()
        self._check_operations()
        self._check_schedule_units()
        self._check_offloaded_moments()
        self._check_fp8()
        if self.optimizer.optimizer == "muon" and self.parallel.tile_factor != 1:
            raise TrainConfigError("--optimizer muon with --tile-factor: Muon orthogonalises each "
                                   "hidden matrix whole, while tiling makes each row tile its own "
                                   "sharding unit; the two are not combined yet, drop one of them")
        if self.optimizer.optimizer == "muon" and self.parallel.offload_optimizer != "none":
            raise TrainConfigError(
                f"--optimizer muon keeps its state on the device (each matrix's owner gathers "
                f"and orthogonalises it there); --offload-optimizer "
                f"{self.parallel.offload_optimizer} is not supported with it: drop one of them")
        from pretrain.cuda_graphs import cuda_graph_problems
        problems = cuda_graph_problems(self)
        if problems:
            raise TrainConfigError("--enable-cuda-graph cannot capture this run: "
                                   + "; ".join(problems))

        seq = self.model.seq_length
        if self.parallel.sequence_parallel and seq % tp:
            raise TrainConfigError(
                f"--sequence-parallel shards the sequence over the TP ranks, but --seq-length {seq} "
                f"is not divisible by --tensor-model-parallel-size {tp}; use a sequence length that "
                f"is a multiple of {tp} or drop --sequence-parallel")

    def _check_experts(self) -> None:
        """Expert parallelism (issue 32): the experts split evenly over the EP ranks. EP composes
        with context parallelism (EP groups carved out of DP x CP; the router reduces its
        statistics and capacity over the CP group: docs/moe.md)."""
        from hybrid.topology import TopologyError, check_expert_split
        try:
            check_expert_split(self.model.num_experts, self.parallel.expert_model_parallel_size)
        except TopologyError as err:
            raise TrainConfigError(str(err)) from None

    def _check_context_parallel(self) -> None:
        """--context-parallel-size C (issue 31): every sequence cuts into 2C equal chunks (and,
        with --sequence-parallel, each rank's S/C tokens into TP slices); a2a scatters each TP
        rank's heads and query groups over the C ranks; no attention dropout (the CP attention
        has none)."""
        p, m = self.parallel, self.model
        cp, tp, seq = p.context_parallel_size, p.tensor_model_parallel_size, m.seq_length
        if cp == 1:
            return
        if seq % (2 * cp):
            from hybrid.context_parallel.layout import check_divisible   # its message, its rule
            try:
                check_divisible(seq, cp)
            except ValueError as err:
                raise TrainConfigError(str(err)) from None
        if p.sequence_parallel and (seq // cp) % tp:
            raise TrainConfigError(
                f"--sequence-parallel shards each CP rank's {seq // cp} tokens (--seq-length {seq} "
                f"/ --context-parallel-size {cp}) over --tensor-model-parallel-size {tp}, which does "
                f"not divide them; use a --seq-length that is a multiple of {2 * cp * tp}")
        if p.cp_comm_type == "a2a":
            for what, n, flag in (("attention heads", m.num_attention_heads, "--num-attention-heads"),
                                  ("query groups", m.query_groups, "--num-query-groups")):
                if (n // tp) % cp:
                    raise TrainConfigError(
                        f"--cp-comm-type a2a scatters each TP rank's {what} over the CP ranks, but "
                        f"{n // tp} {what} per TP rank ({flag} {n} / --tensor-model-parallel-size "
                        f"{tp}) is not divisible by --context-parallel-size {cp}; use --cp-comm-type "
                        f"p2p, or a CP size that divides {n // tp}")
        if m.attention_dropout > 0:
            raise TrainConfigError(
                f"--attention-dropout {m.attention_dropout} with --context-parallel-size {cp}: the "
                f"context-parallel attention has no dropout on its probabilities (each rank sees "
                f"only blocks of them); set --attention-dropout 0")

    def _check_offloaded_moments(self) -> None:
        """16-bit moments live on the device only: the offloaded AdamW has no 16-bit path."""
        o, p = self.optimizer, self.parallel
        if (o.exp_avg_dtype, o.exp_avg_sq_dtype) != ("fp32", "fp32") and (
                p.offload_optimizer != "none" or p.offload_nvme_path is not None):
            from hybrid.adamw_config import OFFLOAD_MOMENTS_REFUSAL
            raise TrainConfigError(OFFLOAD_MOMENTS_REFUSAL)

    def _check_operations(self) -> None:
        """Flags of long runs (issue 34) that need somewhere to write."""
        if self.logging.memory_snapshot_step is not None and not (self.logging.tensorboard_dir
                                                                  or self.checkpoint.save):
            raise TrainConfigError("--memory-snapshot-step writes its file to the run's TensorBoard "
                                   "directory or to --save; give --tensorboard-dir or --save")
        if self.checkpoint.async_save and not self.checkpoint.save:
            raise TrainConfigError("--async-save writes checkpoints in the background: give --save "
                                   "DIR (and --save-interval N)")

    def _check_fp8(self) -> None:
        """--fp8-format: every fp8 GEMM dimension a multiple of 16 (cuBLASLt's FP8 rule, which
        torch._scaled_mm enforces on GPUs; refused here on every device so a CPU rehearsal runs
        what a GPU will), a layer left in fp8, delayed scaling without a full recompute."""
        o, m = self.optimizer, self.model
        if o.fp8_format is None:
            return
        if self.parallel.tile_factor != 1:
            raise TrainConfigError("--fp8-format with --tile-factor: the tiled linears gather and "
                                   "multiply their weight tiles in the training dtype and have no "
                                   "FP8 path; drop one of them")
        tp = self.parallel.tensor_model_parallel_size
        f = m.ffn_hidden_size
        dims = {"--hidden-size": m.hidden_size,
                "the QKV projection's rows per TP rank": m.qkv_size // tp,
                "the attention output's inputs per TP rank (--hidden-size / TP)": m.hidden_size // tp,
                "--ffn-hidden-size per TP rank": f // tp,
                "tokens per micro-batch and CP rank (--micro-batch-size x --seq-length / "
                "--context-parallel-size)":
                    self.data.micro_batch_size * m.seq_length // self.parallel.context_parallel_size}
        for what, value in dims.items():
            if value % 16:
                raise TrainConfigError(f"--fp8-format: {what} is {value}, not a multiple of 16, "
                                       f"which FP8 GEMMs need (torch._scaled_mm on GPUs); choose "
                                       f"sizes that are multiples of 16 (x TP where split) or "
                                       f"drop --fp8-format")
        if o.first_last_layers_bf16 and (o.num_layers_at_start_in_bf16
                                         + o.num_layers_at_end_in_bf16 >= m.num_layers):
            raise TrainConfigError(f"--first-last-layers-bf16 keeps {o.num_layers_at_start_in_bf16}"
                                   f" + {o.num_layers_at_end_in_bf16} of the {m.num_layers} layers "
                                   f"in bf16, leaving none in FP8; lower "
                                   f"--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16")
        if o.fp8_recipe == "delayed" and self.training.compile:
            raise TrainConfigError(
                "--fp8-recipe delayed with --compile: delayed scaling updates its amax histories "
                "inside the compiled layers' forward and backward, which is not verified under "
                "torch.compile; use --fp8-recipe tensorwise (checked compiled against eager, "
                "docs/fp8.md) or drop --compile")
        if o.fp8_recipe == "delayed" and self.training.recompute not in ("none", "selective"):
            raise TrainConfigError(
                f"--fp8-recipe delayed with --recompute {self.training.recompute}: the recomputed "
                f"forward would cast with scales from a history its first forward has already "
                f"advanced, so backward would see other activations than the loss; use "
                f"--fp8-recipe tensorwise or rowwise (scales from the tensors themselves) or "
                f"--recompute selective")

    def _check_schedule_units(self) -> None:
        """Megatron's rule: an iteration-based run takes iteration-based schedule flags, a
        sample-based run (--train-samples) sample-based ones."""
        o = self.optimizer
        if self.training.train_samples is None:
            wrong = [f for f, v in (("--lr-decay-samples", o.lr_decay_samples),
                                    ("--lr-warmup-samples", o.lr_warmup_samples),
                                    ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples)) if v]
            if wrong:
                raise TrainConfigError(f"{' and '.join(wrong)} count samples: they go with "
                                       f"--train-samples; with --train-iters use their -iters "
                                       f"forms (--lr-decay-iters, --lr-warmup-iters, "
                                       f"--lr-wsd-decay-iters)")
            return
        wrong = [f for f, v in (("--lr-decay-iters", o.lr_decay_iters),
                                ("--lr-warmup-iters", o.lr_warmup_iters),
                                ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters)) if v]
        if wrong:
            raise TrainConfigError(f"{' and '.join(wrong)} count iterations, but the run is "
                                   f"sample-based (--train-samples); use their -samples forms "
                                   f"(--lr-decay-samples, --lr-warmup-samples, "
                                   f"--lr-wsd-decay-samples)")

    def train_iterations(self, layout: RunLayout) -> int:
        """Optimizer steps of the run: --train-iters, or --train-samples / the layout's global batch
        (Megatron's rounding down), or 100."""
        t = self.training
        if t.train_iters is not None:
            return t.train_iters
        if t.train_samples is None:
            return DEFAULT_TRAIN_ITERS
        ramp = self.batch_schedule()
        if ramp is not None:   # Megatron walks the schedule; the last step may pass the samples
            return ramp.iterations_for(t.train_samples)
        iters = t.train_samples // layout.global_batch
        if iters < 1:
            raise TrainConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                                   f"of {layout.global_batch} samples; raise it")
        return iters

    def _check_pipeline_layers(self) -> None:
        """The layers split into PP stages (x virtual stages of the given size)."""
        p, layers = self.parallel, self.model.num_layers
        pp, per_virtual = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
        if pp == 1:
            return
        if layers % pp:
            raise TrainConfigError(f"--num-layers {layers} does not split into "
                                   f"--pipeline-model-parallel-size {pp} stages of equal size; use a "
                                   f"multiple of {pp} layers or another pipeline size")
        if per_virtual is not None and (layers // pp) % per_virtual:
            raise TrainConfigError(f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not "
                                   f"divide the {layers // pp} layers of each of the {pp} stages; "
                                   f"choose a divisor of {layers // pp}")

    def layout(self, world_size: int) -> RunLayout:
        """The run's :class:`~hybrid.layout.RunLayout` on ``world_size`` ranks: the degrees, and
        global batch = micro batch x DP x m micro-batches per step (Megatron's rule; with pipeline
        parallelism m is the pipeline's micro-batches per step), v model chunks per stage."""
        from hybrid.pipeline.config import PipelineConfig, PipelineConfigError
        p = self.parallel
        try:
            chunks = PipelineConfig.chunks_per_stage(p.pipeline_model_parallel_size,
                                                     self.model.num_layers,
                                                     p.num_layers_per_virtual_pipeline_stage)
            return RunLayout.for_world(world_size, tensor_parallel=p.tensor_model_parallel_size,
                                       pipeline_parallel=p.pipeline_model_parallel_size,
                                       context_parallel=p.context_parallel_size,
                                       micro_batch_size=self.data.micro_batch_size,
                                       global_batch=self.nominal_global_batch(), model_chunks=chunks,
                                       seq_length=self.model.seq_length)
        except (LayoutError, PipelineConfigError) as err:
            raise TrainConfigError(str(err)) from None

    def batch_schedule(self):
        """The batch ramp (--step-batch-size-schedule / --rampup-batch-size) or None."""
        return self.data.batch_schedule(self.model.seq_length)

    def nominal_global_batch(self) -> int | None:
        """--global-batch-size, or a batch schedule's final batch: the layout's global batch, the
        unit the learning-rate schedule counts in (Megatron's ``global_batch_size``)."""
        ramp = self.batch_schedule()
        return ramp.nominal if ramp is not None else self.data.global_batch_size

    def _check_batch_schedule(self, layout: RunLayout) -> None:
        """Every batch of a ramp is whole micro-batches on each DP rank (x p, interleaved)."""
        from hybrid.batch_schedule import BatchScheduleError
        ramp = self.batch_schedule()
        if ramp is None:
            return
        interleaved = layout.pipeline_parallel > 1 and self.parallel.schedule == "interleaved"
        try:
            ramp.check_divisible(layout.micro_batch_size, layout.data_parallel,
                                 layout.pipeline_parallel if interleaved else 1)
        except BatchScheduleError as err:
            raise TrainConfigError(str(err)) from None

    def pipeline_config(self, layout: RunLayout):
        """The :class:`hybrid.pipeline.PipelineConfig` of this run on ``layout`` (PP > 1), else
        None; its checks (micro-batches per step m >= p and a multiple of p for interleaving, ...)
        as config errors."""
        from hybrid.pipeline.config import PipelineConfig, PipelineConfigError
        if layout.pipeline_parallel == 1:
            return None
        try:
            return PipelineConfig(layout.pipeline_parallel, layout.micro_batches, self.model.num_layers,
                                  self.parallel.schedule, layout.model_chunks)
        except PipelineConfigError as err:
            raise TrainConfigError(str(err)) from None

    def validate_for_world(self, world_size: int) -> RunLayout:
        """Checks that need the number of launched ranks; returns the run's layout."""
        p = self.parallel
        if p.world_size is not None and p.world_size != world_size:
            raise TrainConfigError(
                f"the config is laid out for --world-size {p.world_size} but {world_size} ranks were "
                f"launched; launch {p.world_size} ranks, or override --world-size {world_size} and "
                f"check --global-batch-size")
        layout = self.layout(world_size)
        self.check_sections()
        ep, dp_cp = p.expert_model_parallel_size, layout.data_parallel * p.context_parallel_size
        if dp_cp % ep:
            raise TrainConfigError(
                f"--expert-model-parallel-size {ep} does not divide the data-parallel x "
                f"context-parallel size {dp_cp} of {world_size} ranks (EP groups are carved out of "
                f"it); choose an EP degree that divides {dp_cp} or launch more ranks")
        self.pipeline_config(layout)
        self._check_batch_schedule(layout)
        self.train_iterations(layout)
        o = self.optimizer
        if o.lr_decay_iters is not None and o.lr_decay_iters < o.lr_warmup_iters:
            raise TrainConfigError(f"--lr-decay-iters {o.lr_decay_iters} is shorter than "
                                   f"--lr-warmup-iters {o.lr_warmup_iters}; raise the first or lower "
                                   f"the second")
        if o.lr_decay_samples is not None and o.lr_decay_samples < o.lr_warmup_samples:
            raise TrainConfigError(f"--lr-decay-samples {o.lr_decay_samples} is shorter than "
                                   f"--lr-warmup-samples {o.lr_warmup_samples}; raise the first or "
                                   f"lower the second")
        self._check_resolved_schedule(layout)
        return layout

    def _check_resolved_schedule(self, layout: RunLayout) -> None:
        """The schedule's lengths once defaults and --lr-warmup-fraction are resolved (the WSD
        decay within the decay after the warm-up, inverse-square-root's warm-up)."""
        from pretrain.lr_schedule import build_lr_schedule
        try:
            build_lr_schedule(self.optimizer, self.train_iterations(layout), layout.global_batch,
                              self.training.train_samples)
        except ValueError as err:
            raise TrainConfigError(str(err)) from None

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Build from nested ``{section: {field: value}}``; unknown keys raise with suggestions."""
        unknown = sorted(str(k) for k in set(d) - set(SECTIONS))
        if unknown:
            raise TrainConfigError(f"unknown config section(s) {unknown}; sections are "
                                   f"{sorted(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            values = coerce_section(name, section_cls, _section_values(name, d.get(name)))
            sections[name] = (build_model_config(values) if section_cls is GPTConfig
                              else section_cls(**values))
        return cls(**sections)

    def describe(self) -> str:
        """The resolved config, one 'section.key = value' per line (printed at start-up)."""
        lines = []
        for name, values in self.to_dict().items():
            for key, value in values.items():
                lines.append(f"  {name + '.' + key:<42} = {value!r}")
        return "\n".join(lines)


def _section_values(name: str, raw) -> dict:
    """The ``{key: value}`` of config section ``name`` (dashes in keys read as underscores); an empty
    section is ``{}``; anything but a mapping of known keys is refused."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TrainConfigError(f"config section '{name}' must be a mapping of key: value pairs, got "
                               f"{raw!r} ({type(raw).__name__}); write e.g. '{name}:' followed by "
                               f"indented 'key: value' lines")
    keys = [k for k in raw if not isinstance(k, str)]
    if keys:
        raise TrainConfigError(f"config section '{name}' has key(s) {keys} that are not names; keys "
                               f"are field names like {sorted(_known(name))[0]}")
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    bad = sorted(set(values) - _known(name))
    if bad:
        raise TrainConfigError(f"unknown key(s) {bad} in config section '{name}'; known keys: "
                               f"{sorted(_known(name))}")
    return values


def _known(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(SECTIONS[name])}
