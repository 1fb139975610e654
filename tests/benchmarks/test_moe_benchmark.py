"""benchmarks/moe.py (issue 32's MoE step against peers; docs/moe.md, "Benchmark").

* fast: the expert module handed to DeepSpeed-MoE computes the same SwiGLU as ours (our stacked
  experts, gate/up rows interleaved, against the peer's [gate; up] Linear), so the peer does the
  same work per route;
* slow: the benchmark's worker on 2 gloo ranks, 3 steps, with ours at EP 2 and megatron-core's
  MoE layer on CPU (its CUDA-only calls redirected by ``_megatron_on_cpu``; megatron-core from the
  test-only environment of tests/checkpoint/megatron_env.py): both step, hold the same expert
  parameters per rank and return the input's shape. DeepSpeed is not in the test environment; the
  benchmark itself runs it from benchmarks/.venv-deepspeed.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import moe as bench
from hybrid.moe.experts import GroupedSwiGLUExperts
from hybrid.parallel_state import ParallelState


def test_the_peer_expert_is_our_swiglu():
    torch.manual_seed(0)
    ours = GroupedSwiGLUExperts(1, bench.HIDDEN, bench.FFN, ParallelState.single_process().tp)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(std=0.02)
    peer = bench.SwiGLUExpert()
    fc1 = ours.fc1.weight[0].view(bench.FFN, 2, bench.HIDDEN)            # rows gate 0, up 0, ...
    with torch.no_grad():
        peer.fc1.weight.copy_(torch.cat([fc1[:, 0], fc1[:, 1]]))          # rows [gate; up]
        peer.fc2.weight.copy_(ours.fc2.weight[0])
    x = torch.randn(37, bench.HIDDEN)
    torch.testing.assert_close(peer(x), ours(x, [37]))
    assert sum(p.numel() for p in peer.parameters()) == sum(p.numel() for p in ours.parameters())


@pytest.mark.slow
def test_ours_and_megatron_core_step_at_ep2():
    from hybrid.testing.multirank import run_on_ranks
    from tests.checkpoint import megatron_env
    megatron_env.put_on_path()
    names = ["ours EP=2 alltoall", "megatron-core EP=2"]
    per_rank = run_on_ranks(bench._worker, 2, args=(names, 3), timeout=600)
    for times, failed, shape in per_rank:
        assert not failed, failed
        assert all(len(times[n]) == 1 and times[n][0][1] > 0 for n in names)   # (wall, cpu)
        assert shape["ours EP=2 alltoall"]["expert_params_per_rank"] == 4 * 3 * 256 * 512
        assert shape["megatron-core EP=2"]["expert_params_per_rank"] == 4 * 3 * 256 * 512
        assert {tuple(shape[n]["output_shape"]) for n in names} == {(bench.SEQ, bench.MICRO,
                                                                      bench.HIDDEN)}
