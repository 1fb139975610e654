"""GPT pretraining entry point for torchrun (Megatron-LM's pretrain_gpt.py, thin).

    torchrun --standalone --nproc-per-node 4 launch/pretrain_gpt.py --config tiny-cpu
    python launch/pretrain_gpt.py --config table5-zero-100B --dry-run      # 400-GPU layout, one CPU

Flags follow Megatron's names (``--help`` lists them); a ``--config`` YAML/TOML (or a preset name in
pretrain/presets/) gives the base values, flags override. Everything else lives in pretrain.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from hybrid.checkpoint.format import CheckpointError  # noqa: E402
from hybrid.launch_env import LaunchEnv, LaunchEnvError  # noqa: E402
from pretrain.arguments import parse_args  # noqa: E402
from pretrain.exit import Interrupted  # noqa: E402
from pretrain.liveness import PeersLostError  # noqa: E402
from pretrain.metrics import install_rank_logging  # noqa: E402

# Bad input found before or at launch: config/topology/model dims (ValueError subclasses:
# TrainConfigError, TopologyError, ConfigError), data (IndexedDatasetError, dataset ValueErrors) and
# checkpoints, and paths that do not exist (a tokenizer model). Reported as one line, exit code 2,
# no traceback (docs/design.md §9, §10).
USER_ERRORS = (ValueError, CheckpointError, FileNotFoundError)


def report_error(err: BaseException) -> int:
    """``error: <message>`` on one stderr line (the traceback only at DEBUG level); exit code 2."""
    logging.getLogger("pretrain_gpt").debug("bad input", exc_info=err)
    print("error: " + " ".join(str(err).split()), file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        env = LaunchEnv.from_environ()
    except LaunchEnvError as err:
        return report_error(err)
    install_rank_logging(env.rank)
    try:
        cfg, options = parse_args(argv)
    except USER_ERRORS as err:
        return report_error(err)
    if options.dry_run:
        from pretrain.dry_run import dry_run_report, format_report
        try:
            print(format_report(dry_run_report(cfg, options.dry_run_rank)))
        except USER_ERRORS as err:   # the layout at its full GPU count (divisibility, batches)
            return report_error(err)
        return 0
    from pretrain.setup import run
    log = logging.getLogger("pretrain_gpt")
    try:
        trainer = run(cfg, env)
    except USER_ERRORS as err:   # found at launch: world size, data, --load, --save
        return report_error(err)
    except FloatingPointError as err:   # NaN/Inf loss with --on-nonfinite stop: every rank stops
        report_error(err)
        return 3
    except PeersLostError as err:   # a collective failed because other ranks are gone: name them
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # torchrun's teardown: leaving anyway, as 4
        report_error(err)
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
