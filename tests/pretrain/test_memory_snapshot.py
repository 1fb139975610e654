"""``--memory-snapshot-step K`` on CPU (pretrain/memory_snapshot.py, issue 34 part 6): after
iteration K each rank writes its memory report by category to the run directory and logs it. The
oracle is the engine itself: the Adam moments of a one-rank fp32 ZeRO-1 run are 8 bytes x its
parameter count, and the file's categories equal the engine's own report at that point.
(The CUDA path - the allocator's history - runs in tests/gpu when a GPU is there.)"""

from __future__ import annotations

import json
import logging

import pytest

from hybrid.testing.corpus import build_corpus
from tests.reliability_helpers import tiny_cli


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("memsnap_corpus"))


def test_cpu_memory_report_at_step_k_is_written_and_logged(corpus, tmp_path, caplog):
    from pretrain.arguments import parse_args
    from pretrain.setup import run
    cfg, _ = parse_args(tiny_cli(corpus, tmp_path / "cache", iters=3,
                                 extra=["--memory-snapshot-step", "2", "--no-roofline",
                                        "--tensorboard-dir", str(tmp_path / "tb")]))
    with caplog.at_level(logging.INFO, logger="pretrain.memory_snapshot"):
        trainer = run(cfg)
    files = list((tmp_path / "tb").rglob("memory-report-*.json"))
    assert [f.name for f in files] == ["memory-report-iter2-rank0.json"]
    assert files[0].parent == trainer.metrics.run_dir
    report = json.loads(files[0].read_text())
    assert report["iteration"] == 2
    engine = trainer.optimizer.memory_report()
    assert report["measured"] == {k: int(v) for k, v in engine.measured.items()}
    assert report["measured"]["adam_moments"] == 8 * trainer.optimizer.num_local_params   # fp32 m, v
    assert report["host"]["mem-rss-bytes"] > 0
    assert any("memory after iteration 2 (rank 0): param16" in r.getMessage() for r in caplog.records)


def test_memory_snapshot_needs_somewhere_to_write():
    from pretrain.arguments import parse_args
    from pretrain.config import TrainConfigError
    with pytest.raises(TrainConfigError, match="--tensorboard-dir or --save"):
        parse_args(["--memory-snapshot-step", "3"])
