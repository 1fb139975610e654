"""Named ``build_*`` steps that turn a :class:`TrainConfig` into a running job (torchtitan-style).

    state     = build_parallel_state(cfg)          # Topology -> TP and DP groups (docs/design.md §1, §2)
    data      = build_data(cfg, state)             # tokenizer, train/valid GPT datasets (Megatron)
    model     = build_model(cfg, state, vocab)     # TP GPT; meta device for ZeRO stage 3
    optimizer = build_optimizer(cfg, model, state) # ZeRO-DP stage 0-3 (AdamW, mixed precision)
    trainer   = Trainer(...); trainer.train()

:func:`run` is the whole program behind ``launch/pretrain_gpt.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from hybrid import comm
from hybrid.launch_env import LaunchEnv
from hybrid.parallel_state import ParallelState
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.links import describe_collectives, describe_group, nodes_of
from hybrid.processes import keep_freed_memory
from pretrain.config import TrainConfig
from pretrain.device_peaks import run_peak_tflops
from pretrain.exit import SetupSignals
from pretrain.liveness import Liveness
from pretrain.metrics import MetricsWriter, ThroughputModel
from pretrain.recompute_method import apply_recompute_method
from pretrain.resume import TrainState, fresh_run_id
from pretrain.resume import load as load_checkpoint
from pretrain.resume_schedule import run_schedule
from pretrain.traffic import expected_dp_collectives
from pretrain.trainer import Trainer

log = logging.getLogger(__name__)


def build_parallel_state(cfg: TrainConfig, env: LaunchEnv | None = None) -> ParallelState:
    """Join the launcher's job (``env``, default: this process's environment) or run as one
    process, and create the TP and DP groups the config asks for."""
    env = env if env is not None else LaunchEnv.from_environ()
    cfg.validate_for_world(env.world_size)
    p = cfg.parallel
    return ParallelState.from_launch_env(
        env, tensor_parallel_size=p.tensor_model_parallel_size,
        pipeline_parallel_size=p.pipeline_model_parallel_size, gpus_per_node=p.gpus_per_node,
        allow_tp_across_nodes=p.allow_tp_across_nodes, dp_transport=p.dp_transport,
        timeout=timedelta(minutes=p.distributed_timeout_minutes))


@dataclass
class DataBundle:
    train: object
    valid: object | None
    vocab_size: int
    eod: int


def build_data(cfg: TrainConfig, state: ParallelState) -> DataBundle:
    """Datasets from --data-path/--split, or the embedded default corpus (built once, by rank 0)."""
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
    global_batch = cfg.global_batch(state.world_size)
    train_iters = cfg.train_iterations(state.world_size)
    evals = train_iters // t.eval_interval + 1
    counts = (train_iters * global_batch, evals * t.eval_iters * global_batch, 0)
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


def build_model(cfg: TrainConfig, state: ParallelState, vocab_size: int):
    """The TP GPT and its RNG tracker; materialised in fp32 (ZeRO casts), on meta for stage 3.
    With PP > 1 the model is this rank's stage (:class:`StageChunks`); :func:`build_stage_model`
    returns the stage itself."""
    model, rng, _ = build_stage_model(cfg, state, vocab_size)
    return model, rng


def build_stage_model(cfg: TrainConfig, state: ParallelState, vocab_size: int):
    """(model, RNG tracker, :class:`~pretrain.pipeline_stage.PipelineStage` or None)."""
    from hybrid.tensor_parallel import RNGTracker
    from models.gpt.model import GPTModel
    rng = RNGTracker(cfg.training.seed, state.tp_rank, state.device)
    rng.seed_all()
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ValueError(f"--vocab-size {cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_size}; drop --vocab-size or raise it to at least {vocab_size}")
    gcfg = gpt_config(cfg, vocab_size)
    gcfg.validate_for_tp(state.tp_size)
    pcfg = cfg.pipeline_config(state.world_size)
    if pcfg is not None:
        from pretrain.pipeline_stage import build_stage
        stage = build_stage(pcfg, gcfg, state, sequence_parallel=cfg.parallel.sequence_parallel,
                            device=state.device, rng=rng, plan=recompute_plan(cfg, gcfg, state),
                            seed=cfg.training.seed)
        return stage.model, rng, stage
    meta = cfg.parallel.zero_stage == 3
    model = GPTModel(gcfg, state, sequence_parallel=cfg.parallel.sequence_parallel,
                     device="meta" if meta else state.device, dtype=torch.float32, rng=rng,
                     recompute=recompute_plan(cfg, gcfg, state))
    if not meta:
        model.init_weights(cfg.training.seed)
    return model, rng, None


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


def recompute_plan(cfg: TrainConfig, gcfg, state: ParallelState, device: str | None = None):
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
        device=device or state.device.type)
    plan = apply_recompute_method(plan, cfg, state.world_size)
    if state.rank == 0:
        log.info("activation recompute: %s", plan)
    return plan


# --init-from-hf: our model flag, the GPT-2 and the Llama config.json key, and our GPTConfig field
_HF_DIMS = (("--num-layers", "n_layer", "num_hidden_layers", "num_layers"),
            ("--hidden-size", "n_embd", "hidden_size", "hidden_size"),
            ("--num-attention-heads", "n_head", "num_attention_heads", "num_attention_heads"),
            ("--vocab-size", "vocab_size", "vocab_size", "vocab_size"),
            ("--ffn-hidden-size", "n_inner", "intermediate_size", "ffn_hidden_size"),
            ("--max-position-embeddings", "n_positions", "max_position_embeddings",
             "max_position_embeddings"),
            ("--num-query-groups", None, "num_key_value_heads", "query_groups"),
            ("--rotary-base", None, "rope_theta", "rotary_base"))
# the architecture options of a Llama directory: (GPTConfig field, the flags that select its value)
_HF_OPTIONS = (("position_embedding_type", lambda v: f"--position-embedding-type {v}"),
               ("normalization", lambda v: f"--normalization {v}"),
               ("swiglu", lambda v: "--swiglu" if v else "--no-swiglu"),
               ("add_bias_linear", lambda v: "--add-bias-linear" if v else "--disable-bias-linear"),
               ("untie_embeddings_and_output_weights",
                lambda v: "--untie-embeddings-and-output-weights" if v
                else "--no-untie-embeddings-and-output-weights"),
               ("use_rope_scaling", lambda v: "--use-rope-scaling" if v else "--no-use-rope-scaling"))


def check_hf_dims(path: str, model_config) -> None:
    """Refuse an HF GPT-2 or Llama directory whose dims or architecture differ from the model the
    flags describe, naming the flags that would match it."""
    from models.gpt.hf import CONFIG_FILE, is_hf_directory, read_hf_config
    from models.gpt.hf_llama import is_llama
    if not is_hf_directory(path):
        raise FileNotFoundError(f"--init-from-hf {path!r} is not a Hugging Face GPT-2 directory or "
                                f"Llama directory ({CONFIG_FILE} + model.safetensors); export one "
                                f"with tools/export_hf.py or pass the directory save_pretrained wrote")
    source = read_hf_config(path)
    llama = is_llama(source)
    differ = [(flag, llama_key if llama else key, field) for flag, key, llama_key, field in _HF_DIMS
              if (llama or key) and getattr(source, field) != getattr(model_config, field)]
    options = [(field, to_flag) for field, to_flag in _HF_OPTIONS
               if getattr(source, field) != getattr(model_config, field)]
    if not differ and not options:
        return
    fixes = [to_flag(getattr(source, field)) for field, to_flag in options] + [
        ("--group-query-attention " if flag == "--num-query-groups" else "")
        + f"{flag} {getattr(source, field)}" for flag, _, field in differ]
    raise ValueError(
        f"--init-from-hf {path}: the model has other dims or options ("
        + "; ".join([f"{key} {getattr(source, field)} there, {flag} {getattr(model_config, field)} "
                     f"here" for flag, key, field in differ]
                    + [f"{field} {getattr(source, field)} there, {getattr(model_config, field)} here"
                       for field, _ in options])
        + "); pass " + " ".join(fixes)
        + (" (and a tokenizer of at most that many pieces)" if any(d[0] == "--vocab-size"
                                                                 for d in differ) else ""))


def init_from_hf(cfg: TrainConfig, model):
    """--init-from-hf: overwrite ``model``'s weights in place (ZeRO stages 0-2, before the optimizer
    copies them), or return the stage-3 ``init_fn`` that fills each partition of the meta-built model."""
    from models.gpt.weights import init_from_pretrained, pretrained_init_fn
    path = cfg.checkpoint.init_from_hf
    if not path:
        return None
    check_hf_dims(path, model.config)
    log.info("initialising the model from the Hugging Face directory %s", path)
    if cfg.parallel.zero_stage == 3:
        return pretrained_init_fn(path, model)
    for chunk in getattr(model, "chunks", [model]):   # a pipeline stage: each of its chunks
        init_from_pretrained(chunk, path)
    return None


def build_optimizer(cfg: TrainConfig, model, state: ParallelState, init_fn=None):
    """The ZeRO engine of --zero-stage (stage 0 = plain data parallel), AdamW, mixed precision,
    optionally with the optimizer state offloaded to host memory or NVMe (hybrid.offload).
    ``init_fn(name)``: stage 3's source of initial values (default: the seeded init). With PP it
    counts m v backwards per step (micro-batches x model chunks of the stage)."""
    from hybrid.zero import AdamWConfig, LossScaleConfig, ZeroConfig
    from hybrid.zero.factory import build_zero_optimizer
    o = cfg.optimizer
    zcfg = ZeroConfig(stage=cfg.parallel.zero_stage, precision=o.precision,
                      bucket_size=cfg.parallel.zero_bucket_size, clip_grad=o.clip_grad,
                      gradient_accumulation_steps=_backwards_per_step(cfg, state),
                      **cfg.parallel.zero_config_options(),
                      loss_scale=LossScaleConfig(**o.loss_scale_options()))
    offload = cfg.parallel.offload_config()
    offload = offload if offload is not None and offload.enabled else None
    acfg = AdamWConfig(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                       weight_decay=o.weight_decay,   # --compile: the update in one compiled pass
                       kernel="compiled" if cfg.training.compile and offload is None else "fused")
    if zcfg.stage == 3:   # meta-built model: each rank initialises only its partitions
        return build_zero_optimizer(model, state, zcfg, acfg, offload, seed=cfg.training.seed,
                                    init_fn=init_fn)
    return build_zero_optimizer(model, state, zcfg, acfg, offload)


def _backwards_per_step(cfg: TrainConfig, state: ParallelState) -> int:
    pcfg = cfg.pipeline_config(state.world_size)
    if pcfg is None:
        return cfg.grad_accumulation_steps(state.world_size)
    return pcfg.num_micro_batches * pcfg.num_model_chunks


def make_loader_factory(data: DataBundle, cfg: TrainConfig, state: ParallelState):
    from hybrid.data.loader import build_pretraining_loader

    def make(split: str, consumed: int):
        dataset = data.train if split == "train" else data.valid
        if dataset is None:
            raise ValueError(f"no {split} data: give the split a share in --split (e.g. 969,30,1)")
        return build_pretraining_loader(dataset, consumed_samples=consumed,
                                        micro_batch_size=cfg.data.micro_batch_size,
                                        data_parallel_rank=state.dp_rank,
                                        data_parallel_size=state.dp_size, device="cpu",
                                        eod_mask_loss=data.eod if cfg.data.eod_mask_loss else None)
    return make


def build_trainer(cfg: TrainConfig, state: ParallelState, data: DataBundle | None = None,
                  make_loader=None) -> Trainer:
    """Everything but the loop; tests inject ``data`` (and a recording ``make_loader``)."""
    data = data if data is not None else build_data(cfg, state)
    if cfg.parallel.host_memory_budget is not None:   # before any model state is allocated
        from hybrid.offload.budget import return_freed_buffers_to_os
        return_freed_buffers_to_os()
    model, rng, stage = build_stage_model(cfg, state, data.vocab_size)
    compile_clock = build_compiled_layers(cfg, stage.chunks if stage is not None else [model])
    resume = resume_wanted(cfg)
    if resume and cfg.checkpoint.init_from_hf:
        log.info("resuming from %s: --init-from-hf is not used", cfg.checkpoint.load)
    optimizer = build_optimizer(cfg, model, state, None if resume else init_from_hf(cfg, model))
    if state.rank == 0 and state.dp_size > 1:   # the layout is checked: the engine is built
        log.info("%s", expected_dp_report(cfg, state, optimizer.num_local_params,
                                          gpt_config(cfg, data.vocab_size)))
    if stage is not None:
        from pretrain.pipeline_stage import attach_runner
        attach_runner(stage, optimizer, state, precision=cfg.optimizer.precision,
                      micro_batch=cfg.data.micro_batch_size, seq_length=cfg.model.seq_length,
                      hidden=cfg.model.hidden_size, sequence_parallel=cfg.parallel.sequence_parallel)
    train_state = (load_checkpoint(cfg.checkpoint.load, model, optimizer, state, cfg, rng=rng)
                   if resume else None)
    schedule = run_schedule(cfg, state.world_size, train_state)
    if train_state is None or cfg.checkpoint.finetune:   # iteration 0, a new run id
        train_state = TrainState(run_id=fresh_run_id(state))
    if stage is not None and stage.tied is not None:   # the last stage's copy = the loaded E
        stage.tied.sync_weight()
    m = cfg.model
    flops = model_flops_per_iteration(cfg.global_batch(state.world_size), m.seq_length, m.num_layers,
                                      m.hidden_size, model.config.padded_vocab_size(state.tp_size),
                                      heads=m.num_attention_heads, arch=m.perf_architecture())
    metrics = MetricsWriter(cfg.logging.tensorboard_dir, state.rank, run_name=cfg.logging.run_name,
                            run_id=train_state.run_id)   # a resume continues its run's curves
    metrics.log_config(cfg.to_dict())
    trainer = Trainer(cfg, state, model, optimizer,
                      schedule=schedule,
                      make_loader=make_loader or make_loader_factory(data, cfg, state),
                      metrics=metrics,
                      throughput=ThroughputModel(flops, state.world_size,
                                                 run_peak_tflops(cfg.logging.peak_tflops, state),
                                                 gemm_bound_s=build_roofline(
                                                     cfg, state, stage.chunks if stage else [model])),
                      rng=rng, train_state=train_state, pipeline=stage,
                      compile_clock=compile_clock)
    if resume and cfg.checkpoint.save == cfg.checkpoint.load and not cfg.checkpoint.finetune:
        trainer.last_saved_iteration = train_state.iteration   # no need to write it again
    return trainer


def build_roofline(cfg: TrainConfig, state: ParallelState, models: list) -> float | None:
    """This rank's GEMM-bound seconds per iteration (pretrain.roofline) for ``models`` (the
    model, or this pipeline stage's chunks), None with --no-roofline."""
    if not cfg.logging.roofline:
        return None
    from pretrain.roofline import gemm_bound_time, run_gemms
    gemms = run_gemms(cfg, state.tp_size, cfg.grad_accumulation_steps(state.world_size), models)
    return gemm_bound_time(gemms, cfg.optimizer.precision, state.device, cfg.data.data_cache_dir)


def resume_wanted(cfg: TrainConfig) -> bool:
    """--load given; ``--load`` = ``--save`` with no checkpoint yet is a fresh start (so the same
    command serves the first launch and every restart, e.g. under ``torchrun --max-restarts``)."""
    from hybrid.checkpoint.format import LATEST_FILE
    c = cfg.checkpoint
    if not c.load:
        return False
    fresh = (c.save is not None and Path(c.load).resolve() == Path(c.save).resolve()
             and not (Path(c.load) / LATEST_FILE).is_file())
    if fresh:
        log.info("no checkpoint in %s yet: starting from iteration 0", c.load)
    return not fresh


def check_save_dir(cfg: TrainConfig) -> None:
    """Fail at launch, not after hours of training, when --save cannot be written."""
    from hybrid.checkpoint.format import CheckpointError
    if not cfg.checkpoint.save:
        return
    save = Path(cfg.checkpoint.save)
    problem = writable_dir_problem(save)
    if problem:
        raise CheckpointError(f"cannot write checkpoints to --save {str(save)!r} ({problem}); "
                              f"choose a writable directory")


def check_output_dirs(cfg: TrainConfig) -> None:
    """Fail at launch when a directory the run writes to (besides --save) cannot be a writable
    directory: the TensorBoard events, the sample-index cache and the NVMe offload files (each is
    created, as the run would; every rank probes with its own file, so ranks do not race)."""
    dirs = {"--tensorboard-dir": cfg.logging.tensorboard_dir, "--data-cache-dir": cfg.data.data_cache_dir,
            "--offload-nvme-path": cfg.parallel.offload_nvme_path}
    for flag, path in dirs.items():
        problem = None if path is None else writable_dir_problem(Path(path))
        if problem:
            raise ValueError(f"{flag} {path!r} is not a writable directory ({problem}); choose a "
                             f"directory this job can create and write")


def writable_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be used as an output directory, or None; tries it for real."""
    if path.exists() and not path.is_dir():
        return "it is a file"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def claim_save(cfg: TrainConfig, state: ParallelState):
    """Collective: the job's lock on --save, held until the block ends (refuses a directory another
    job holds, or another run's checkpoints unless resuming or --overwrite)."""
    from hybrid.checkpoint.lock import claim_save_dir
    if not cfg.checkpoint.save:
        return contextlib.nullcontext()
    lock = claim_save_dir(cfg.checkpoint.save, resuming=resume_wanted(cfg),
                          overwrite=cfg.checkpoint.overwrite, world=state.world, device=state.device)
    return lock if lock is not None else contextlib.nullcontext()


def run(cfg: TrainConfig, env: LaunchEnv | None = None) -> Trainer:
    """The whole pretraining program in the launcher's job ``env`` (default: this process's
    environment); returns the finished trainer. A collective that fails because other ranks are
    gone raises :class:`~pretrain.liveness.PeersLostError` naming them (and their host)
    instead of gloo's address and port."""
    env = env if env is not None else LaunchEnv.from_environ()
    keep_freed_memory()   # steps reuse their temporaries' pages instead of faulting them in
    with SetupSignals() as signals:   # a stop signal before training: nothing to save, stop now
        check_save_dir(cfg)
        check_output_dirs(cfg)
        state = build_parallel_state(cfg, env)
        if cfg.training.compile:   # no C++ compiler / Triton: say so before building anything
            from models.gpt.compile import check_compile_support
            check_compile_support(state.device)
        log.info("%s\n%s\nresolved config:\n%s", state.topology.describe(),
                 link_report(state, cfg), cfg.describe())
        timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
        with Liveness.start(env, timeout, hint=lambda: restart_hint(cfg)) as liveness:
            try:
                with claim_save(cfg, state):
                    trainer = build_trainer(cfg, state)
                    signals.training_started()
                    try:
                        trainer.train()
                    finally:
                        trainer.metrics.close()
                liveness.close()   # done: a store that goes with the first rank to leave is no loss
                leave_job(state)
            except Exception as err:
                liveness.check(err, restart_hint(cfg))
                raise
    return trainer


def link_report(state: ParallelState, cfg: TrainConfig | None = None) -> str:
    """This rank's TP and DP groups (and PP group): the hosts they span and the share of their
    bytes that cross hosts (start-up report; the ledger measures it per step, hybrid.perf.links),
    then the pipeline layout."""
    per_node = state.ledger.ranks_per_node
    groups = [state.tp, state.dp]
    if state.dp_intra_host_group is not None and state.dp_inter_host_group.size > 1:
        groups += [state.dp_intra_host_group, state.dp_inter_host_group]   # hybrid shard, hpZ
    lines = [describe_group(g.kind, g.ranks, per_node) for g in groups]
    pcfg = cfg.pipeline_config(state.world_size) if cfg is not None else None
    if pcfg is not None:
        hosts = nodes_of(state.pp.ranks, per_node)
        crossings = sum(a != b for a, b in zip(hosts, hosts[1:]))
        lines += [f"pp group {state.pp.ranks}: {crossings} of its {state.pp_size - 1} stage "
                  f"boundaries cross hosts (point-to-point activations and gradients)",
                  pipeline_report(pcfg, state.pp_rank)]
    return "\n".join(lines)


def expected_dp_report(cfg: TrainConfig, state: ParallelState, psi: int, model_cfg=None) -> str:
    """Start-up report: the DP bytes per rank per step ZeRO's formulas expect for this rank's
    ``psi`` parameters, per group and op, inside hosts and across them (pretrain.traffic,
    the dry run's formulas, as NCCL rings); the trainer logs the measured bytes of every group
    after the first logged step."""
    param_bytes = 4 if cfg.optimizer.precision == "fp32" else 2
    ops = expected_dp_collectives(cfg.parallel, state, float(psi), param_bytes,
                                  state.ledger.ranks_per_node,
                                  micro_batches=cfg.grad_accumulation_steps(state.world_size),
                                  model=model_cfg)
    return "\n".join(["DP bytes per rank per step, expected (ZeRO's formulas over NCCL rings):",
                      *describe_collectives(ops)])


def pipeline_report(pcfg, stage: int) -> str:
    """The PP layout in one line: schedule, stages, chunks, micro-batches, this stage's layers and
    the bubble the schedule implies (hybrid.pipeline.schedules)."""
    from hybrid.pipeline import bubble_formula
    layers = ", ".join("[%d, %d)" % pcfg.layer_range(stage, c) for c in range(pcfg.num_model_chunks))
    return (f"pipeline: {pcfg.schedule}, PP {pcfg.num_stages} stages x {pcfg.num_model_chunks} "
            f"model chunk(s) of {pcfg.layers_per_chunk} layers, m {pcfg.num_micro_batches} "
            f"micro-batches per step; stage {stage} holds layers {layers}; bubble "
            f"(p-1)/(v m+p-1) = {bubble_formula(pcfg):.3f}")


def restart_hint(cfg: TrainConfig) -> str:
    """What a relaunch does, for the lost-peer message: resume from the latest checkpoint (with
    ``--load`` = ``--save``, as the launch scripts' restarts use it) or start again."""
    from hybrid.checkpoint import read_latest
    c = cfg.checkpoint
    latest = read_latest(Path(c.save)) if c.save else None
    if latest is None:
        again = f"--load {c.load}" if c.load else "iteration 0"
        return f"restart the job; no checkpoint was written yet, so it starts again from {again}"
    where = Path(c.save) / latest
    if c.load and Path(c.load).resolve() == Path(c.save).resolve():
        return f"restart the job to resume from {where}"
    return f"restart with --load {c.save} to resume from {where}"


def leave_job(state: ParallelState) -> None:
    """Wait for every rank, then tear the process groups down: a rank exiting while a peer still
    talks to it aborted in gloo's destructors ('terminate called without an active exception')."""
    if torch.distributed.is_initialized():
        comm.barrier(state.world)
        torch.distributed.destroy_process_group()
