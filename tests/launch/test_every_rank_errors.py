"""Bad input that every rank finds alike once the ranks have started (this command line against
the checkpoint they all load: a changed learning-rate schedule, other model dims) is printed by the
first rank of each host only, as config errors are; an error one rank finds alone (its own file,
its own host) is still printed by that rank."""

from __future__ import annotations

import pytest

from hybrid.checkpoint.format import CheckpointError
from hybrid.launch_env import LaunchEnv
from pretrain.arguments import parse_args
from pretrain.lr_schedule import LRSchedule
from pretrain.resume_schedule import resume_schedule
from pretrain.sections import TrainConfigError, found_by_every_rank
from tests.reliability_helpers import load_entry


def _error_lines(entry, monkeypatch, capsys, err, local_rank) -> tuple[int, list[str]]:
    def fail(cfg, env):
        raise err
    monkeypatch.setattr("pretrain.setup.run", fail)
    cfg, options = parse_args([])
    env = LaunchEnv(rank=local_rank, world_size=4, local_rank=local_rank, local_world_size=4)
    code = entry.train(cfg, options, env)
    return code, [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]


@pytest.mark.parametrize("err", [
    found_by_every_rank(TrainConfigError("the learning-rate schedule differs")),
    found_by_every_rank(CheckpointError("the checkpoint was written by a model with other dims"))])
def test_error_every_rank_finds_is_printed_once_per_host(err, monkeypatch, capsys):
    entry = load_entry()
    printed = [_error_lines(entry, monkeypatch, capsys, err, r) for r in range(4)]
    assert [code for code, _ in printed] == [2, 2, 2, 2]
    assert [len(lines) for _, lines in printed] == [1, 0, 0, 0]


def test_error_of_one_rank_is_printed_by_it(monkeypatch, capsys):
    entry = load_entry()
    code, lines = _error_lines(entry, monkeypatch, capsys,
                               FileNotFoundError("no such file: rank-local.bin"), 3)
    assert code == 2 and lines == ["error: no such file: rank-local.bin"]


def test_changed_schedule_on_resume_is_an_every_rank_error():
    cfg, _ = parse_args([])
    saved, mine = LRSchedule(1e-3, 1e-4, 1, 2), LRSchedule(1e-3, 1e-4, 1, 4)
    with pytest.raises(TrainConfigError) as err:
        resume_schedule(mine, saved.record(8), 8, cfg.optimizer)
    assert getattr(err.value, "every_rank", False)
