"""The shaped multi-host test bed (tools/netns_cluster.py): namespaces of N "hosts" behind one
bridge, inter-host links limited by a token-bucket filter. Checks that the shaping really limits a
transfer (and leaves a host's loopback fast), that everything is removed even after a failure,
and (slow) that a TP x DP job runs across three hosts with the project's multi-node launcher.
Skips (saying why) where namespaces cannot be created."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import tiny_cli
from tools.netns_cluster import NetnsCluster, NetnsUnavailable


@contextlib.contextmanager
def _cluster(*args, **kwargs):
    """A :class:`NetnsCluster` that skips the test where namespaces cannot be made."""
    cluster = NetnsCluster(*args, **kwargs)
    try:
        cluster.__enter__()
    except NetnsUnavailable as err:
        pytest.skip(str(err))
    try:
        yield cluster
    finally:
        cluster.__exit__()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_shaping_limits_inter_host_bandwidth_and_not_loopback():
    rate = 40.0   # Mbit/s; 2 MB take ~0.4 s
    with _cluster(3, 1, rate_mbit=rate) as cluster:
        across = [cluster.measure_mbit(0, 1, 2 << 20), cluster.measure_mbit(2, 0, 2 << 20)]
        inside = cluster.measure_mbit(1, 1, 64 << 20)
    for measured in across:   # TCP over a tbf reaches 85-100% of the rate; a missing filter: GB/s
        assert 0.6 * rate < measured < 1.1 * rate, (across, rate)
    assert inside > 20 * rate, (inside, rate)
    assert not any(ns in _namespaces() for ns in cluster.ns + [cluster.switch])


def test_namespaces_are_removed_after_a_failure():
    with pytest.raises(RuntimeError, match="inside the cluster"):
        with _cluster(2, 1, rate_mbit=100) as cluster:
            assert cluster.switch in _namespaces()
            raise RuntimeError("a failure inside the cluster")
    assert not any(ns in _namespaces() for ns in cluster.ns + [cluster.switch])


def test_bad_cluster_shapes_are_refused():
    with pytest.raises(ValueError, match="at least 2 hosts"):
        NetnsCluster(1, 2)
    with pytest.raises(ValueError, match="rate_mbit must be positive"):
        NetnsCluster(2, 2, rate_mbit=0)


@pytest.mark.slow
def test_a_tp_dp_job_runs_across_three_shaped_hosts(tmp_path):
    corpus = build_corpus(tmp_path / "corpus")
    args = tiny_cli(corpus, tmp_path / "cache", iters=3,
                    extra=["--tensor-model-parallel-size", "2", "--global-batch-size", "6"])
    with _cluster(3, 2, rate_mbit=200) as cluster:
        codes = cluster.run_job(args, tmp_path, "j", timeout=300,
                                env=child_env(PYTHON=sys.executable))
    logs = [(tmp_path / f"j_host{h}.log").read_text() for h in range(3)]
    assert codes == [0, 0, 0], logs[0][-3000:]
    assert "6 ranks = 3 node(s) x 2 | TP 2" in "".join(logs)
