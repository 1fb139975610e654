"""GPT pretraining entry point for torchrun (Megatron-LM's pretrain_gpt.py, thin).

    torchrun --standalone --nproc-per-node 4 launch/pretrain_gpt.py --config tiny-cpu
    python launch/pretrain_gpt.py --config table5-zero-100B --dry-run      # 400-GPU layout, one CPU

Flags follow Megatron's names (``--help`` lists them); a ``--config`` YAML/TOML (or a preset name in
pretrain/presets/) gives the base values, flags override. Everything else lives in pretrain.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from hybrid.launch_env import LaunchEnv, LaunchEnvError  # noqa: E402
from pretrain.arguments import LaunchOptions, parse_args  # noqa: E402
from pretrain.config import TrainConfig  # noqa: E402
from pretrain.preflight import check_layout  # noqa: E402

# The modules above import no torch: a config or layout error ends a rank before torch is loaded.


def report_error(err: BaseException, env: LaunchEnv | None = None) -> int:
    """``error: <message>`` on one stderr line (the traceback only at DEBUG level); exit code 2.
    Under torchrun the line is also this rank's error file, which torchrun's failure report shows
    as the root cause instead of 'To enable traceback see ...'."""
    logging.getLogger("pretrain_gpt").debug("bad input", exc_info=err)
    line = "error: " + " ".join(str(err).split())
    print(line, file=sys.stderr, flush=True)
    if env is not None and env.error_file:
        when = str(int(time.time()))   # torch-elastic's error-file format; py_callstack is shown
        Path(env.error_file).write_text(json.dumps(
            {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": when}}}))
    return 2


def check_job(cfg: TrainConfig, env: LaunchEnv) -> None:
    """The checks that need the job's size but no process group (pretrain/preflight.py), with a
    host of the launcher's LOCAL_WORLD_SIZE ranks, as ParallelState.from_launch_env counts it."""
    if env.distributed:
        check_layout(cfg, env.world_size,
                     env.local_world_size or cfg.parallel.gpus_per_node or env.world_size)
    else:
        cfg.validate_for_world(1)


def main(argv: list[str] | None = None) -> int:
    try:
        env = LaunchEnv.from_environ()
    except LaunchEnvError as err:
        return report_error(err)
    try:
        cfg, options = parse_args(argv)
        if not options.dry_run:
            check_job(cfg, env)
    except ValueError as err:   # the same on every rank: the first rank of each host says it once
        return report_error(err, env) if env.local_rank == 0 else 2
    return train(cfg, options, env)


def train(cfg: TrainConfig, options: LaunchOptions, env: LaunchEnv) -> int:
    """The dry run, or the run of a checked config (errors found from here on may be one rank's:
    each rank that finds one says it)."""
    from hybrid.checkpoint.format import CheckpointError
    from pretrain.exit import Interrupted
    from pretrain.liveness import PeersLostError
    from pretrain.metrics import install_rank_logging
    # Bad input found at launch: config/topology/model dims (ValueError subclasses:
    # TrainConfigError, TopologyError, ConfigError), data (IndexedDatasetError, dataset ValueErrors)
    # and checkpoints, and paths that do not exist (a tokenizer model). Reported as one line, exit
    # code 2, no traceback (docs/design.md §9, §10).
    user_errors = (ValueError, CheckpointError, FileNotFoundError)
    install_rank_logging(env.rank)
    if options.dry_run:
        from pretrain.dry_run import dry_run_report, format_report
        try:
            print(format_report(dry_run_report(cfg, options.dry_run_rank)))
        except user_errors as err:   # the layout at its full GPU count (divisibility, batches)
            return report_error(err)
        return 0
    from pretrain.setup import run
    log = logging.getLogger("pretrain_gpt")
    try:
        trainer = run(cfg, env)
    except user_errors as err:   # found at launch: data, --load, --save, a peer's host
        if getattr(err, "every_rank", False) and env.local_rank != 0:
            return 2   # the flags against the checkpoint: the first rank of each host says it
        return report_error(err, env)
    except FloatingPointError as err:   # NaN/Inf loss with --on-nonfinite stop: every rank stops
        report_error(err, env)
        return 3
    except PeersLostError as err:   # a collective failed because other ranks are gone: name them
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # torchrun's teardown: leaving anyway, as 4
        report_error(err, env)
        return 4
    except Interrupted as stop:   # a signal before training, or a second Ctrl-C: one line
        print(("error: " if stop.code else "") + str(stop), file=sys.stderr, flush=True)
        return stop.code
    log.info("done: %d iterations, final lm loss %.4f", trainer.ts.iteration,
             trainer.losses[-1] if trainer.losses else float("nan"))
    if trainer.metrics.run_dir is not None:
        log.info("TensorBoard logs: %s  (view: tensorboard --logdir %s)", trainer.metrics.run_dir,
                 cfg.logging.tensorboard_dir)
    if cfg.checkpoint.save:
        log.info("checkpoint: %s (resume with --load %s)", cfg.checkpoint.save, cfg.checkpoint.save)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # Ctrl-C before the rank's own signal handling was installed
        print("stopped by SIGINT before training started: nothing to save", file=sys.stderr)
        sys.exit(0)
