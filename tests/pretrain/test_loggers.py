"""The logger backends (issue 34, part 3; pretrain/loggers.py): a short real run with TensorBoard,
W&B (offline, WANDB_MODE=offline) and a JSON-lines file; every scalar TensorBoard gets is in the W&B
run's history, read back with wandb's own reader of the offline run (``wandb leet inspect``), and in
the JSON lines, at the same step with the same value. A backend that cannot start is one clear error.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.loggers import LoggerStartError, WandbLogger, check_logger_backends, read_jsonl
from tests.training_helpers import make_trainer, tiny_args

wandb = pytest.importorskip("wandb")


def _tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def _wandb_history(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every history row of the offline run, as wandb's CLI reads its .wandb transaction log."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    history = {}
    for line in out.splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") == "history":
            item = record["history"]["item"]
            step = int(item["_step"])
            history.update({(k, step): v for k, v in item.items() if not k.startswith("_")})
    return history


def test_every_scalar_reaches_tensorboard_wandb_and_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    jsonl = tmp_path / "metrics.jsonl"
    trainer = make_trainer(tiny_args(iters=3, extra=[
        "--log-interval", "1", "--no-roofline", "--tensorboard-dir", str(tmp_path / "tb"),
        "--wandb-project", "hybrid-tests", "--wandb-exp-name", "loggers",
        "--wandb-save-dir", str(tmp_path / "wb"), "--jsonl-log", str(jsonl)]))
    wandb_dir = trainer.metrics.backends[1].directory
    trainer.train()
    trainer.metrics.close()
    assert wandb_dir.name.startswith("offline-run-") and wandb_dir.parent == tmp_path / "wb" / "wandb"

    tensorboard = _tensorboard_scalars(trainer.metrics.run_dir)
    assert {("lm loss", s) for s in (1, 2, 3)} <= tensorboard.keys()
    history = _wandb_history(wandb_dir)
    lines = read_jsonl(jsonl)
    assert set(lines[0]) == {"config"} and lines[0]["config"]["logging"]["wandb_project"] == "hybrid-tests"
    jsonl_scalars = {(k, rec["step"]): v for rec in lines[1:] for k, v in rec["metrics"].items()}
    for key, value in tensorboard.items():   # TensorBoard keeps float32
        assert history.get(key) == pytest.approx(value, rel=1e-6), key
        assert jsonl_scalars.get(key) == pytest.approx(value, rel=1e-6), key
    assert history.keys() == tensorboard.keys()   # and nothing W&B has that TensorBoard lacks


def test_wandb_not_installed_is_one_clear_error(monkeypatch, tmp_path):
    cfg, _ = parse_args(tiny_args(extra=["--wandb-project", "p", "--wandb-exp-name", "e"]))
    monkeypatch.setitem(sys.modules, "wandb", None)      # import wandb -> ImportError
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(LoggerStartError, match="pip install wandb"):
        check_logger_backends(cfg)
    with pytest.raises(LoggerStartError, match="pip install wandb"):
        WandbLogger("p", "e", tmp_path)


def test_wandb_flags_are_checked_together():
    with pytest.raises(TrainConfigError, match="--wandb-exp-name"):
        parse_args(tiny_args(extra=["--wandb-project", "p"]))
    with pytest.raises(TrainConfigError, match="--wandb-project"):
        parse_args(tiny_args(extra=["--wandb-exp-name", "e"]))


def test_unwritable_jsonl_log_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(LoggerStartError, match="--jsonl-log"):
        make_trainer(tiny_args(extra=["--jsonl-log", str(tmp_path / "file" / "m.jsonl")]))
