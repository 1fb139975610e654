"""The ``build_*`` steps that turn a :class:`TrainConfig` and its :class:`~hybrid.layout.RunLayout`
into the parts of a running job (torchtitan-style): the process groups, the data, the model (or this
rank's pipeline stage), its ZeRO engine, the starting train state, the loaders and the throughput
model. Each step takes what it needs from the steps before it as arguments;
:func:`pretrain.setup.build_trainer` calls them in order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from hybrid import comm
from hybrid.launch_env import LaunchEnv
from hybrid.layout import RunLayout
from hybrid.parallel_state import ParallelState
from hybrid.perf.flops import model_flops_per_iteration
from pretrain.config import TrainConfig
from pretrain.device_peaks import run_peak_tflops
from pretrain.hf_init import InitialWeights
from pretrain.lr_schedule import LRSchedule
from pretrain.metrics import ThroughputModel
from pretrain.recompute_method import apply_recompute_method
from pretrain.resume import TrainState, fresh_run_id
from pretrain.resume import load as load_checkpoint
from pretrain.resume_schedule import run_schedule

log = logging.getLogger(__name__)


def build_parallel_state(cfg: TrainConfig, layout: RunLayout,
                         env: LaunchEnv | None = None) -> ParallelState:
    """Join the launcher's job (``env``, default: this process's environment) or run as one
    process, and create the TP, CP, PP and DP groups of ``layout`` (``cfg.validate_for_world``)."""
    env = env if env is not None else LaunchEnv.from_environ()
    if env.world_size != layout.world_size:
        raise ValueError(f"the layout is for {layout.world_size} ranks but the job has "
                         f"{env.world_size}; resolve it with cfg.validate_for_world({env.world_size})")
    p = cfg.parallel
    return ParallelState.from_launch_env(
        env, tensor_parallel_size=layout.tensor_parallel,
        pipeline_parallel_size=layout.pipeline_parallel,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=p.expert_model_parallel_size, gpus_per_node=p.gpus_per_node,
        allow_tp_across_nodes=p.allow_tp_across_nodes, dp_transport=p.dp_transport,
        timeout=timedelta(minutes=p.distributed_timeout_minutes))


@dataclass
class DataBundle:
    train: object
    valid: object | None
    vocab_size: int
    eod: int


def build_data(cfg: TrainConfig, layout: RunLayout, state: ParallelState) -> DataBundle:
    """Datasets from --data-path/--split, or the embedded default corpus (built once, by rank 0),
    with the samples ``train_iters`` (and the evaluations) of ``layout``'s global batch need."""
    from hybrid.data import build_gpt_datasets, build_tokenizer, ensure_default_dataset
    d = cfg.data
    data_path, tokenizer_model = list(d.data_path), d.tokenizer_model
    megatron_tokenizer = d.tokenizer_type or d.vocab_file or d.merge_file
    if not data_path and megatron_tokenizer:
        raise ValueError("--tokenizer-type/--vocab-file/--merge-file need --data-path: the embedded "
                         "corpus is tokenized with its own tokenizer; pass the --data-path prefix "
                         "tools/preprocess_data.py wrote with this tokenizer")
    if not data_path:
        vocab = cfg.model.vocab_size or 4096
        error = None
        if state.rank == 0:
            try:
                ensure_default_dataset(d.data_cache_dir, vocab)
            except ValueError as err:   # e.g. a --vocab-size too small for its tokenizer
                error = err
        if comm.max_over(state.world, int(error is not None), state.device):   # and the barrier
            if error is not None:
                raise error
            raise SystemExit(2)   # rank 0 reports it, once; this rank leaves with its code
        prefix, default_tokenizer = ensure_default_dataset(d.data_cache_dir, vocab)
        data_path, tokenizer_model = [prefix], tokenizer_model or default_tokenizer
    if tokenizer_model is None and not megatron_tokenizer:
        raise ValueError("--data-path was given without --tokenizer-model or --tokenizer-type; pass "
                         "the tokenizer (.model or tokenizer.json, or Megatron's --tokenizer-type with "
                         "its files) the data was tokenized with")
    tokenizer = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                                model=tokenizer_model, vocab_size=cfg.model.vocab_size)
    t = cfg.training
    train_iters = cfg.train_iterations(layout)
    evals = train_iters // t.eval_interval + 1
    ramp = cfg.batch_schedule()
    trained = ramp.samples_after(train_iters) if ramp else train_iters * layout.global_batch
    counts = (trained, evals * t.eval_iters * layout.global_batch, 0)
    if state.rank == 0:   # build (and cache) the sample indices once
        build_gpt_datasets(data_path, d.split, cfg.model.seq_length, counts, t.seed,
                           vocab_size=tokenizer.vocab_size, cache_dir=d.data_cache_dir)
    comm.barrier(state.world)
    train, valid, _ = build_gpt_datasets(data_path, d.split, cfg.model.seq_length, counts, t.seed,
                                         vocab_size=tokenizer.vocab_size, cache_dir=d.data_cache_dir)
    if valid is None and t.eval_iters:   # every --eval-interval and at the end of training
        raise ValueError(
            f"--split {d.split} leaves the validation split of --data-path {' '.join(data_path)} "
            f"without documents, but evaluation is on (--eval-iters {t.eval_iters} every "
            f"--eval-interval {t.eval_interval}); give validation a share with enough documents "
            f"(e.g. --split 90,10,0), add documents, or pass --eval-iters 0")
    return DataBundle(train, valid, tokenizer.vocab_size, tokenizer.eod)


def gpt_config(cfg: TrainConfig, vocab_size: int):
    """The model config of the run: ``cfg.model``, with the tokenizer's ``vocab_size`` when the
    config gives none."""
    if cfg.model.vocab_size is not None:
        return cfg.model
    return cfg.model.replace(vocab_size=vocab_size)


def prepare_host_memory(cfg: TrainConfig) -> None:
    """With --host-memory-budget, freed buffers go back to the OS (hybrid.offload.budget); to
    apply to the model states it must come before any of them is allocated."""
    if cfg.parallel.host_memory_budget is not None:
        from hybrid.offload.budget import return_freed_buffers_to_os
        return_freed_buffers_to_os()


@dataclass
class BuiltModel:
    """``model``: what the engine and checkpoints see (the GPT, or this stage's chunks as one
    :class:`~hybrid.pipeline.StageChunks`); ``rng``: its RNG tracker; ``stage``: the
    :class:`~pretrain.pipeline_stage.PipelineStage` with PP > 1, else None."""

    model: torch.nn.Module
    rng: object
    stage: object | None

    @property
    def chunks(self) -> list:
        """The models whose layers run: this stage's chunks, or the one model."""
        return self.stage.chunks if self.stage is not None else [self.model]


def build_model(cfg: TrainConfig, pipeline, state: ParallelState, vocab_size: int) -> BuiltModel:
    """The TP GPT and its RNG tracker, materialised in fp32 (ZeRO casts), on meta for stage 3; with
    ``pipeline`` (``cfg.pipeline_config(layout)``, None without PP) this rank's stage."""
    from hybrid.tensor_parallel import RNGTracker
    from models.gpt.model import GPTModel
    rng = RNGTracker(cfg.training.seed, state.tp_rank, state.device)
    rng.seed_all()
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ValueError(f"--vocab-size {cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_size}; drop --vocab-size or raise it to at least {vocab_size}")
    gcfg = gpt_config(cfg, vocab_size)
    gcfg.validate_for_tp(state.tp_size)
    if pipeline is not None:
        from pretrain.pipeline_stage import build_stage
        stage = build_stage(pipeline, gcfg, state, sequence_parallel=cfg.parallel.sequence_parallel,
                            device=state.device, rng=rng, plan=recompute_plan(cfg, gcfg, state, pipeline),
                            seed=cfg.training.seed)
        built = BuiltModel(stage.model, rng, stage)
        build_fp8(cfg, built.chunks, state)
        return built
    meta = cfg.parallel.zero_stage == 3
    model = GPTModel(gcfg, state, sequence_parallel=cfg.parallel.sequence_parallel,
                     device="meta" if meta else state.device, dtype=torch.float32, rng=rng,
                     recompute=recompute_plan(cfg, gcfg, state, pipeline))
    if not meta:
        model.init_weights(cfg.training.seed)
    built = BuiltModel(model, rng, None)
    build_fp8(cfg, built.chunks, state)
    return built


def build_fp8(cfg: TrainConfig, models: list, state: ParallelState) -> None:
    """--fp8-format: the transformer layers' linears of ``models`` run their GEMMs in FP8
    (models/gpt/fp8.py, docs/fp8.md)."""
    options = cfg.optimizer.fp8_options()
    if options is None:
        return
    from hybrid.tensor_parallel.fp8_scaling import Fp8Recipe
    from models.gpt.fp8 import enable_fp8
    o = cfg.optimizer
    count = enable_fp8(models, Fp8Recipe(**options), first_last_bf16=o.first_last_layers_bf16,
                       num_at_start=o.num_layers_at_start_in_bf16,
                       num_at_end=o.num_layers_at_end_in_bf16, device=state.device)
    if state.rank == 0:
        log.info("FP8 training: %d linears of the transformer layers in %s, recipe %s", count,
                 options["format"], options["recipe"])


def recompute_plan(cfg: TrainConfig, gcfg, state: ParallelState, pipeline=None,
                   device: str | None = None):
    """--recompute as a hybrid.recompute plan (None: keep every activation). ``auto`` asks the
    planner for the cheapest per-layer plan whose activations fit --memory-budget on one rank."""
    if cfg.training.recompute == "none":
        return None
    from hybrid.recompute import plan_from_cli
    plan = plan_from_cli(
        cfg.training.recompute, gcfg, micro_batch=cfg.data.micro_batch_size, tp=state.tp_size,
        sequence_parallel=cfg.parallel.sequence_parallel and state.tp_size > 1,
        memory_budget=cfg.training.memory_budget_bytes,
        bytes_per_element=4 if cfg.optimizer.precision == "fp32" else 2,
        device=device or state.device.type, cp=getattr(state, "cp_size", 1),
        cp_comm_type=getattr(cfg.parallel, "cp_comm_type", "p2p"))
    plan = apply_recompute_method(plan, cfg, pipeline)
    if state.rank == 0:
        log.info("activation recompute: %s", plan)
    return plan


def build_compiled_layers(cfg: TrainConfig, models: list):
    """--compile: regional torch.compile of every transformer layer of ``models`` (the model, or
    this pipeline stage's chunks; models/gpt/compile.py), its inductor cache in
    <--data-cache-dir>/inductor; returns the compile clock (None without the flag). Compilation
    itself happens in the first step."""
    if not cfg.training.compile:
        return None
    from models.gpt.compile import compile_layers
    cache = Path(cfg.data.data_cache_dir) / "inductor"
    clock = compile_layers(*models, cache_dir=cache)
    log.info("torch.compile: %d transformer layers compile at their first use (inductor, %s), "
             "cache %s", sum(len(m.layers) for m in models), models[0].state.device.type, cache)
    return clock


def build_optimizer(cfg: TrainConfig, layout: RunLayout, state: ParallelState, weights: InitialWeights):
    """The ZeRO engine of --zero-stage (stage 0 = plain data parallel) over ``weights.model``, AdamW,
    mixed precision, optionally with the optimizer state offloaded to host memory or NVMe
    (hybrid.offload). It counts ``layout.backwards_per_step`` backwards per step (with PP m v: the
    micro-batches x model chunks of the stage); stage 3 fills its partitions from
    ``weights.init_fn`` (default: the seeded init)."""
    from hybrid.zero import AdamWConfig, LossScaleConfig, ZeroConfig
    from hybrid.zero.factory import build_zero_optimizer
    o = cfg.optimizer
    zcfg = ZeroConfig(stage=cfg.parallel.zero_stage, precision=o.precision, muon=o.muon_config(),
                      bucket_size=cfg.parallel.zero_bucket_size, clip_grad=o.clip_grad,
                      gradient_accumulation_steps=layout.backwards_per_step,
                      **cfg.parallel.zero_config_options(),
                      loss_scale=LossScaleConfig(**o.loss_scale_options()))
    offload = cfg.parallel.offload_config()
    offload = offload if offload is not None and offload.enabled else None
    acfg = AdamWConfig(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                       weight_decay=o.weight_decay,   # --compile: the update in one compiled pass
                       kernel="compiled" if cfg.training.compile and offload is None
                       and o.optimizer == "adamw" else "fused",   # Muon: per-span kernels
                       **o.adamw_moment_dtypes())
    if zcfg.stage == 3:   # meta-built model: each rank initialises only its partitions
        return build_zero_optimizer(weights.model, state, zcfg, acfg, offload, seed=cfg.training.seed,
                                    init_fn=weights.init_fn)
    return build_zero_optimizer(weights.model, state, zcfg, acfg, offload)


def build_pipeline_runner(cfg: TrainConfig, state: ParallelState, built: BuiltModel, optimizer):
    """With PP: this rank's stage with the runner of its schedule over ``optimizer`` (the runner
    tells the engine every backward); None without PP."""
    if built.stage is None:
        return None
    from pretrain.pipeline_stage import attach_runner
    return attach_runner(built.stage, optimizer, state, precision=cfg.optimizer.precision,
                         micro_batch=cfg.data.micro_batch_size, seq_length=cfg.model.seq_length,
                         hidden=cfg.model.hidden_size, sequence_parallel=cfg.parallel.sequence_parallel)


def build_train_state(cfg: TrainConfig, layout: RunLayout, built: BuiltModel, optimizer,
                      state: ParallelState, pipeline, resuming: bool,
                      run_id: str | None = None) -> tuple[TrainState, LRSchedule]:
    """Where training starts, and its learning-rate schedule: the --load checkpoint's weights,
    optimizer state and counters (``resuming``; its stored schedule against this command line's,
    pretrain.resume_schedule), or a fresh run (also with --finetune: the loaded weights from
    iteration 0; ``run_id``: the id a fresh run keeps after an in-job restart); then the last
    stage's copy of the tied embedding takes the first stage's (loaded or initial) weights. ``pipeline``: the stage with its runner (PP > 1)."""
    train_state = (load_checkpoint(cfg.checkpoint.load, built.model, optimizer, state, cfg,
                                   rng=built.rng) if resuming else None)
    schedule = run_schedule(cfg, layout, train_state)
    if train_state is None or cfg.checkpoint.finetune:   # iteration 0, a new run id
        train_state = TrainState(run_id=fresh_run_id(state, run_id))
    if pipeline is not None and pipeline.tied is not None:
        pipeline.tied.sync_weight()
    return train_state, schedule


def make_loader_factory(data: DataBundle, cfg: TrainConfig, state: ParallelState):
    from hybrid.data.loader import build_pretraining_loader

    def make(split: str, consumed: int):
        dataset = data.train if split == "train" else data.valid
        if dataset is None:
            raise ValueError(f"no {split} data: give the split a share in --split (e.g. 969,30,1)")
        return build_pretraining_loader(dataset, consumed_samples=consumed,
                                        micro_batch_size=cfg.data.micro_batch_size,
                                        data_parallel_rank=state.dp_rank,
                                        data_parallel_size=state.dp_size,
                                        # pinned in the loader's thread, copied without a wait
                                        device=state.device,
                                        eod_mask_loss=data.eod if cfg.data.eod_mask_loss else None,
                                        vocab_size=data.vocab_size,   # checked on the host
                                        eod=data.eod,   # documents: --reset-position-ids ...
                                        reset_position_ids=cfg.data.reset_position_ids,
                                        reset_attention_mask=cfg.data.reset_attention_mask)
    return make


def build_throughput(cfg: TrainConfig, layout: RunLayout, state: ParallelState,
                     built: BuiltModel) -> ThroughputModel:
    """Model FLOPs of a global batch of ``layout`` (Megatron's formula) over the job's ranks at
    --peak-tflops, and this rank's GEMM-bound seconds per iteration (:func:`build_roofline`)."""
    m = cfg.model
    flops = model_flops_per_iteration(layout.global_batch, m.seq_length, m.num_layers, m.hidden_size,
                                      built.model.config.padded_vocab_size(state.tp_size),
                                      heads=m.num_attention_heads, arch=m.perf_architecture())
    return ThroughputModel(flops, state.world_size, run_peak_tflops(cfg.logging.peak_tflops, state),
                           gemm_bound_s=build_roofline(cfg, layout, state, built.chunks))


def build_roofline(cfg: TrainConfig, layout: RunLayout, state: ParallelState,
                   models: list) -> float | None:
    """This rank's GEMM-bound seconds per iteration (pretrain.roofline) for ``models`` (the
    model, or this pipeline stage's chunks), None with --no-roofline."""
    if not cfg.logging.roofline:
        return None
    from pretrain.roofline import gemm_bound_time, run_gemms
    gemms = run_gemms(cfg, state.tp_size, layout.micro_batches, models)
    return gemm_bound_time(gemms, cfg.optimizer.precision, state.device, cfg.data.data_cache_dir)
