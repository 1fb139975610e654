"""Metric loggers behind one small interface (issue 34, part 3): TensorBoard, Weights & Biases and a
JSON-lines file.

    log(metrics, step)    every scalar of a log call, at one step
    log_config(config)    the resolved ``{section: {field: value}}`` config, once
    close()               flush and release the backend

:class:`pretrain.metrics.MetricsWriter` holds the chosen backends on the writer rank and hands each
call to every one of them, so every scalar reaches every backend. A backend is opened before the
first step, and one that cannot start (W&B not installed, a directory that cannot be written) is one
:class:`LoggerStartError` naming the flag and the fix, raised before training begins.

W&B follows Megatron-LM's flags (``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``);
without network, ``WANDB_MODE=offline`` writes the run under the save directory
(``wandb/offline-run-*``), and ``wandb sync`` uploads it later. The JSON-lines file
(``--jsonl-log``) is this framework's own: one line per log call,
``{"step": N, "metrics": {name: value}}`` (non-finite values as null), then one line
``{"config": {...}}`` first; it needs nothing installed and a script reads it with ``json.loads``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class LoggerStartError(ValueError):
    """A logger backend cannot start; the message names the flag and the fix."""


class Logger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_config(self, config: dict) -> None: ...

    def close(self) -> None: ...


def finite_scalars(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics a backend records: finite numbers as floats (NaN/Inf and None left out, as
    TensorBoard would show them as gaps anyway)."""
    out = {}
    for name, value in metrics.items():
        if value is not None and math.isfinite(float(value)):
            out[name] = float(value)
    return out


def flat_hparams(config: dict) -> dict[str, float | str]:
    """``{section: {field: value}}`` as ``{'section.field': value}`` in the types the HParams tab
    takes: numbers stay numbers (booleans 0/1), lists become comma-separated text, None 'none'."""
    flat = {}
    for section, fields in config.items():
        for name, value in fields.items():
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            flat[f"{section}.{name}"] = "none" if value is None else value
    return flat


class TensorBoardLogger:
    """Scalars into a TensorBoard run directory; the config as YAML text and HParams."""

    def __init__(self, run_dir: Path, hparams_metrics: tuple[str, ...]):
        try:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is optional
        except ImportError as err:
            raise LoggerStartError(f"--tensorboard-dir needs the tensorboard package ({err}); "
                                   f"install it with: pip install tensorboard") from None
        self.run_dir = run_dir
        self._hparams_metrics = hparams_metrics
        self.writer = SummaryWriter(log_dir=str(run_dir), max_queue=100)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in finite_scalars(metrics).items():
            self.writer.add_scalar(name, value, step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_text(tag, "```\n" + text + "\n```", step)

    def log_config(self, config: dict) -> None:
        import yaml
        from torch.utils.tensorboard.summary import hparams

        self.log_text("config", yaml.safe_dump(config, sort_keys=False).rstrip())
        # the summaries add_hparams writes, but into this run (add_hparams opens a sub-run)
        for summary in hparams(flat_hparams(config), dict.fromkeys(self._hparams_metrics, 0.0)):
            self.writer.file_writer.add_summary(summary)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One W&B run (``wandb.init`` with the project, name and directory of Megatron's flags)."""

    def __init__(self, project: str, name: str, save_dir: str | Path, run_id: str | None = None):
        try:
            import wandb
        except ImportError:
            raise LoggerStartError("--wandb-project needs the wandb package, which is not "
                                   "installed; install it with: pip install wandb (or drop "
                                   "--wandb-project)") from None
        save_dir = Path(save_dir)
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LoggerStartError(f"--wandb-save-dir {str(save_dir)!r} cannot be created "
                                   f"({err.strerror or err}); choose a writable directory") from None
        try:
            # our run id (20261123T231500Z-1a2b3c4d) is a valid W&B id: a resumed run
            # continues its W&B run as it continues its TensorBoard curves
            self.run = wandb.init(project=project, name=name, dir=str(save_dir), id=run_id,
                                  resume="allow" if run_id else None)
        except Exception as err:   # wandb's own errors (no login online, a bad mode) are many
            raise LoggerStartError(f"W&B run {project}/{name} did not start ({err}); log in with "
                                   f"'wandb login', or run without network with "
                                   f"WANDB_MODE=offline") from None
        self.directory = Path(self.run.dir).parent     # <save_dir>/wandb/(offline-)run-*/
        log.info("W&B run %s/%s in %s", project, name, self.directory)

    def log(self, metrics: dict[str, float], step: int) -> None:
        scalars = finite_scalars(metrics)
        if scalars:
            self.run.log(scalars, step=step)

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def flush(self) -> None:
        pass   # wandb's service writes as it receives

    def close(self) -> None:
        self.run.finish()


class JsonlLogger:
    """Appends one JSON object per log call to a file (created with its directory)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise LoggerStartError(f"--jsonl-log {str(path)!r} cannot be opened for writing "
                                   f"({err.strerror or err}); choose a writable path") from None
        self.path = path

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {name: (float(v) if v is not None and math.isfinite(float(v)) else None)
                  for name, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "metrics": values}) + "\n")

    def log_config(self, config: dict) -> None:
        self._file.write(json.dumps({"config": config}, default=str) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a ``--jsonl-log`` file (tests, plots)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def logger_options(cfg) -> dict:
    """The W&B and JSON-lines keyword arguments of :class:`pretrain.metrics.MetricsWriter` from a
    TrainConfig; the W&B directory defaults to ``<--save>/wandb`` (Megatron-LM's), else ``wandb``."""
    c = cfg.logging
    save_dir = c.wandb_save_dir or (str(Path(cfg.checkpoint.save) / "wandb") if cfg.checkpoint.save
                                    else "wandb")
    return dict(wandb_project=c.wandb_project, wandb_exp_name=c.wandb_exp_name,
                wandb_save_dir=save_dir, jsonl_log=c.jsonl_log)


def check_logger_backends(cfg) -> None:
    """Every rank, at launch: the chosen backends' packages are importable (the writer rank opens
    them later; an uninstalled one must not surface after the model is built)."""
    import importlib.util
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise LoggerStartError("--wandb-project needs the wandb package, which is not installed; "
                               "install it with: pip install wandb (or drop --wandb-project)")
    if cfg.logging.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise LoggerStartError("--tensorboard-dir needs the tensorboard package, which is not "
                               "installed; install it with: pip install tensorboard")
