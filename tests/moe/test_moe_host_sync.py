"""Host reads of a MoE training step (issue 36's "nothing in a step waits on the host", issue 32's
layer): tests/host_sync.py counts every read to Python and every value-sized operation inside
:meth:`Trainer.train_step` of a MoE GPT (2 layers, both MoE, 2 micro-batches per step at DP 2).

Oracle, per MoE layer and micro-batch, forward only (backward reads nothing; docs/moe.md, "Host
synchronisation"):

    EP 1, dropless (grouped GEMM)        0
    EP 1, capacity                       1  int: the number of routes kept (the rows' count)
    EP 2, alltoall (dropless, capacity)  1  tolist: the all-to-all's split sizes, sent and received
    EP 2, allgather (dropless, capacity) 1  int: the routes to this rank's experts (rows' count)
    + fp16 (padded batched product)      1  tolist: the counts (the padding is the largest count)

and nothing else: the router's loads, the capacity rule, the grouped GEMM's offsets and the
balancing losses stay on the device. EP 2 alltoall dropless runs by default (in the ranks of
tests/pretrain/test_host_sync.py's default test); every path in the slow test here.
"""

from __future__ import annotations

from collections import Counter

import pytest

from hybrid.testing.multirank import run_on_ranks
from tests.host_sync import HostReads
from tests.pretrain.test_host_sync import _trainer
from tests.training_helpers import tiny_args

LAYERS, MICRO_BATCHES = 2, 2     # tiny_args: 2 layers, global batch 8 = 2 x micro-batch 2 x DP 2
MOE = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
CASES = {  # name: (EP, dispatcher, capacity, precision, {(read, file): per layer and micro-batch})
    "ep1-dropless": (1, "alltoall", False, "fp32", {}),
    "ep1-capacity": (1, "alltoall", True, "fp32", {("__int__", "dispatch.py"): 1}),
    "ep2-alltoall-dropless": (2, "alltoall", False, "fp32", {("tolist", "dispatch.py"): 1}),
    "ep2-alltoall-capacity": (2, "alltoall", True, "fp32", {("tolist", "dispatch.py"): 1}),
    "ep2-allgather-dropless": (2, "allgather", False, "fp32", {("__int__", "dispatch.py"): 1}),
    "ep2-allgather-capacity": (2, "allgather", True, "fp32", {("__int__", "dispatch.py"): 1}),
    "ep2-alltoall-bf16": (2, "alltoall", False, "bf16", {("tolist", "dispatch.py"): 1}),
    "ep2-alltoall-fp16": (2, "alltoall", False, "fp16", {("tolist", "dispatch.py"): 1,
                                                          ("tolist", "experts.py"): 1}),
}


def reads(rank, world, names, iters):
    out = {}
    for name in names:
        ep, dispatcher, capacity, precision, _ = CASES[name]
        extra = MOE + ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type",
                       dispatcher, "--log-interval", str(iters)]
        if capacity:
            extra += ["--moe-expert-capacity-factor", "1.5"]
        trainer = _trainer(tiny_args(iters=iters, zero=1, precision=precision, extra=extra))
        reads, steps = HostReads(), []

        def counted(loader, lr, _step=trainer.train_step):
            with reads:
                result = _step(loader, lr)
            steps.append(Counter((n, where.rsplit("/", 1)[-1].split(":")[0])
                                 for n, where in reads.take()))
            return result
        trainer.train_step = counted
        trainer.train()
        out[name] = (steps, [x == x for x in trainer.losses])
    return out


def check(results, names, iters):
    for per_rank in results:
        for name in names:
            steps, finite = per_rank[name]
            expected = Counter({k: v * LAYERS * MICRO_BATCHES for k, v in CASES[name][4].items()})
            assert len(steps) == iters and all(finite), name
            assert steps == [expected] * iters, (name, steps)


@pytest.mark.slow
def test_moe_step_reads_every_path():
    """Every path of the table; the default case (EP 2 alltoall dropless) runs in the ranks of
    tests/pretrain/test_host_sync.py's default test."""
    names = list(CASES)
    check(run_on_ranks(reads, 2, args=(names, 2), timeout=900), names, 2)
