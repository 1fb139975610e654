"""A config or layout error is found before any rank starts (pretrain/preflight.py): under
launch/torchrun.py it is one ``error:`` line, exit 2 (no torch imported, no rank, no rendezvous:
the two-host case names port 9, where nobody listens, so a rendezvous would fail differently); under plain torchrun the first rank of the host prints it once and torchrun's failure
report names it as the root cause (its traceback and exit code 1 are torchrun's own)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import ROOT

LAUNCHER = [sys.executable, "launch/torchrun.py"]
TWO_HOSTS = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:9", "--max-restarts", "0"]   # nobody listens on port 9
ONE_HOST = ["--standalone", "--nproc-per-node", "4"]


def _launch(launcher_flags: list[str], trainer_args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCHER, *launcher_flags, "launch/pretrain_gpt.py", *trainer_args],
                          capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=120)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    both = proc.stdout + proc.stderr
    assert proc.returncode == 2, both
    assert "Traceback" not in both and "torch.distributed" not in both, both
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, both
    assert proc.stderr.startswith("error: "), both
    return proc.stderr.strip()


def test_tp_group_spanning_two_hosts_is_refused_before_the_rendezvous():
    proc = _launch(TWO_HOSTS, ["--config", "tiny-cpu", "--tensor-model-parallel-size", "4"])
    line = _one_error_line(proc)
    for words in ("2 hosts x 2 ranks", "tensor-model-parallel size 4 is larger than a node",
                  "at most 2", "--allow-tp-across-nodes"):
        assert words in line, line


def test_json_config_is_read_like_yaml(tmp_path):
    from pretrain.arguments import parse_args
    values = {"model": {"num_layers": 3, "hidden_size": 96}, "optimizer": {"lr": 2e-3},
              "data": {"data_path": ["0.5", "a", "0.5", "b"]}}
    (tmp_path / "c.json").write_text(json.dumps(values))
    (tmp_path / "c.yaml").write_text(json.dumps(values))   # JSON is YAML
    from_json, _ = parse_args(["--config", str(tmp_path / "c.json")])
    from_yaml, _ = parse_args(["--config", str(tmp_path / "c.yaml")])
    assert from_json == from_yaml
    assert (from_json.model.num_layers, from_json.optimizer.lr) == (3, 2e-3)


def test_json_config_with_a_bad_value_is_one_line(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"optimizer": {"lr": "fast"}}))
    proc = _launch(ONE_HOST, ["--config", str(config)])
    line = _one_error_line(proc)
    assert "optimizer.lr must be a number" in line and "c.json.yaml" not in line, line


def test_negative_number_is_the_flags_value():
    proc = _launch(ONE_HOST, ["--config", "tiny-cpu", "--lr", "-1e-3"])
    assert _one_error_line(proc) == "error: --lr must be a number >= 0, got -0.001"
    from pretrain.arguments import parse_args
    cfg, _ = parse_args(["--lr", "1e-3", "--min-lr", "-0.0", "--seed", "7"])
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.training.seed) == (1e-3, 0.0, 7)


def test_a_good_command_passes_and_counts_come_from_the_launch_flags(monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("launch_torchrun", ROOT / "launch" / "torchrun.py")
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)
    monkeypatch.delenv("PET_NNODES", raising=False)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "8")
    trainer = ["launch/pretrain_gpt.py", "--config", "tiny-cpu"]
    assert wrapper.trainer_launch(["--standalone", *trainer]) == (trainer[1:], 1, 8)
    assert wrapper.trainer_launch(["--nnodes=2:2", "--nproc_per_node", "4", *trainer]) == (trainer[1:], 2, 4)
    assert wrapper.trainer_launch(["--nnodes", "1:4", "--nproc-per-node", "gpu", *trainer]) == (
        trainer[1:], None, None)
    assert wrapper.trainer_launch(["--standalone", "other.py", "--lr", "nan"]) is None
    assert wrapper.check_before_launch(["--standalone", "--nproc-per-node", "4", *trainer]) is None


def test_the_check_imports_no_torch():
    code = ("import sys; from pretrain.preflight import check_command; "
            "check_command(['--config', 'tiny-3d-cpu'], 1, 4); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=child_env(), timeout=60)


@pytest.mark.slow
def test_plain_torchrun_prints_the_error_once_and_names_it_as_root_cause():
    from tests.reliability_helpers import torchrun
    proc = subprocess.run(torchrun(2, ["--config", "tiny-cpu", "--lr", "-1e-3"]), capture_output=True,
                          text=True, cwd=ROOT, env=child_env(), timeout=300)
    line = "error: --lr must be a number >= 0, got -0.001"
    assert proc.returncode == 1, proc.stderr   # torchrun's own code for any failed rank
    assert [s for s in proc.stderr.splitlines() if s.startswith("error:")] == [line], proc.stderr
    root_cause = proc.stderr.split("Root Cause")[1]
    assert f"traceback : {line}" in root_cause, proc.stderr
