"""The order of the steps that turn a :class:`TrainConfig` into a running job, in one place.

:func:`run` is the whole program behind ``launch/pretrain_gpt.py``: checks before training
(:mod:`pretrain.startup_checks`), the run's layout and process groups, the start-up report
(:mod:`pretrain.startup_report`), then :func:`build_trainer` and the loop. :func:`build_trainer`
calls the ``build_*`` steps of :mod:`pretrain.build` in order; each step takes what an earlier step
returned, so an order that would break (an engine before the weights it copies, a pipeline runner
before its engine, the tied copy synced before the checkpoint is loaded) cannot be written.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import torch

from hybrid import comm
from hybrid.launch_env import LaunchEnv
from hybrid.layout import RunLayout
from hybrid.parallel_state import ParallelState
from hybrid.processes import keep_freed_memory
from pretrain.build import (DataBundle, build_compiled_layers, build_data, build_model, build_optimizer,
                            build_parallel_state, build_pipeline_runner, build_throughput,
                            build_train_state, gpt_config, make_loader_factory,
                            prepare_host_memory)
from pretrain.config import TrainConfig
from pretrain.exit import SetupSignals
from pretrain.hf_init import initial_weights
from pretrain.liveness import Liveness
from pretrain.loggers import check_logger_backends, logger_options
from pretrain.metrics import MetricsWriter
from pretrain.restarts import plan_restart
from pretrain.startup_checks import (check_compile, check_output_dirs, check_save_dir, claim_save,
                                     resume_wanted)
from pretrain.startup_report import expected_dp_report, startup_report
from pretrain.trainer import Trainer

log = logging.getLogger(__name__)


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
        restart = plan_restart(cfg, env, env.rank)   # --max-restarts: a restart resumes from --save
        check_logger_backends(cfg)

        layout = cfg.validate_for_world(env.world_size)
        state = build_parallel_state(cfg, layout, env)
        check_compile(cfg, state)
        log.info("%s", startup_report(cfg, state, cfg.pipeline_config(layout)))
        timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
        with Liveness.start(env, timeout, hint=lambda: restart_hint(cfg)) as liveness:
            try:
                with claim_save(cfg, state):
                    trainer = build_trainer(cfg, layout, state,
                                            run_id=restart.run_id if restart else None)
                    if restart is not None:
                        trainer.restarts = restart
                        restart.started(trainer)
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


def build_trainer(cfg: TrainConfig, layout: RunLayout, state: ParallelState,
                  data: DataBundle | None = None, make_loader=None, run_id: str | None = None) -> Trainer:
    """Everything but the loop, step by step; tests inject ``data`` (and a recording
    ``make_loader``); ``run_id``: the id a fresh start keeps (an in-job restart's)."""
    data = data if data is not None else build_data(cfg, layout, state)
    prepare_host_memory(cfg)                                          # before any model state
    built = build_model(cfg, cfg.pipeline_config(layout), state, data.vocab_size)
    if make_loader is None:   # the loader checks the token ids on the host (issue 36)
        for chunk in built.chunks:
            chunk.leave_id_checks_to_loader()
    compile_clock = build_compiled_layers(cfg, built.chunks)
    resuming = resume_wanted(cfg)
    weights = initial_weights(cfg, built.model, resuming)             # --init-from-hf
    optimizer = build_optimizer(cfg, layout, state, weights)          # the engine takes them over
    if state.rank == 0 and state.dp_size > 1:
        log.info("%s", expected_dp_report(cfg, layout, state, optimizer.num_local_params,
                                          gpt_config(cfg, data.vocab_size)))
    pipeline = build_pipeline_runner(cfg, state, built, optimizer)   # PP: the schedule drives the engine
    from pretrain.cuda_graphs import capture_layers
    capture_layers(cfg, built.chunks, state, cfg.data.micro_batch_size)   # --enable-cuda-graph
    train_state, schedule = build_train_state(cfg, layout, built, optimizer, state,   # --load
                                              pipeline, resuming, run_id)
    metrics = MetricsWriter(cfg.logging.tensorboard_dir, state.rank, run_name=cfg.logging.run_name,
                            run_id=train_state.run_id,   # a resume continues its run's curves
                            **logger_options(cfg))
    metrics.log_config(cfg.to_dict())
    trainer = Trainer(cfg, layout, state, built.model, optimizer, schedule=schedule,
                      make_loader=make_loader or make_loader_factory(data, cfg, state),
                      metrics=metrics, throughput=build_throughput(cfg, layout, state, built),
                      rng=built.rng, train_state=train_state, pipeline=pipeline,
                      compile_clock=compile_clock)
    if resuming and cfg.checkpoint.save == cfg.checkpoint.load and not cfg.checkpoint.finetune:
        trainer.last_saved_iteration = train_state.iteration   # no need to write it again
    return trainer


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
