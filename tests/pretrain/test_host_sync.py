"""Nothing in a training step waits on the host (issue 36 item 2), proved on CPU ranks by counting
every tensor read to Python (tests/host_sync.py: ``item``, ``tolist``, ``bool``/``int``/``float``,
``numpy``, ``cpu``, ``to("cpu")``) made inside :meth:`Trainer.train_step`.

Oracle: zero reads in every step - non-log steps and the log step alike - for ZeRO stages 0-3 at
DP 2, TP 2, PP 2 (1F1B, the tied embedding) and fp16 dynamic loss scaling (plus an overflowed,
skipped step: the skip decision is made on the device); at the log interval the settle makes the
documented reads only: ONE ``tolist`` of the interval's stacked values, and with fp16 one more of
the loss scaler's state. The bookkeeping they feed still matches the host values (the losses are
finite and the skip is counted).
"""

from __future__ import annotations

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.host_sync import HostReads
from tests.training_helpers import DataBundle, IndexedSamples, VOCAB, tiny_args

CASES = {  # name: (tiny_args keywords, extra flags)
    "zero0": (dict(zero=0), []),
    "zero1": (dict(zero=1), []),
    "zero2": (dict(zero=2), []),
    "zero3": (dict(zero=3), []),
    "tp2-zero1": (dict(tp=2, zero=1), []),
    "pp2": (dict(zero=1), ["--pipeline-model-parallel-size", "2", "--lr-decay-iters", "4"]),
    "fp16-zero2": (dict(zero=2, precision="fp16"), ["--initial-loss-scale", "1024",
                                                    "--hysteresis", "1"]),
    "bf16-zero2": (dict(zero=2, precision="bf16"), []),
}


def _trainer(args):
    """The trainer with the default data path (the host-checking loader), on the tiny corpus."""
    from hybrid.launch_env import LaunchEnv
    from pretrain.arguments import parse_args
    from pretrain.build import build_parallel_state
    from pretrain.setup import build_trainer
    torch.set_num_threads(1)
    cfg, _ = parse_args(args)
    layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
    state = build_parallel_state(cfg, layout)
    data = DataBundle(IndexedSamples(4096), IndexedSamples(512), VOCAB, eod=-1)
    return build_trainer(cfg, layout, state, data=data)


def _count(rank, world, names):
    out = {}
    for name in names:
        kwargs, extra = CASES[name]
        trainer = _trainer(tiny_args(iters=4, extra=extra + ["--log-interval", "2"], **kwargs))
        reads = HostReads()
        steps, settles = [], []
        step, settle = trainer.train_step, trainer._settle

        def counted_step(loader, lr, _step=step):
            with reads:
                out_ = _step(loader, lr)
            steps.append(reads.take())
            return out_

        def counted_settle(stats, _settle=settle):
            with reads:
                _settle(stats)
            settles.append(reads.take())

        if name.startswith("fp16"):   # overflow at iteration 3 on one rank: an Inf gradient
            loss_fn = trainer._micro_batch_loss

            def poisoned(batch, _fn=loss_fn):
                value = _fn(batch)
                if trainer.ts.iteration == 2 and trainer.state.rank == 0:
                    value = value + 0.0 * _Inf.apply(value)
                return value
            trainer._micro_batch_loss = poisoned
        trainer.train_step, trainer._settle = counted_step, counted_settle
        trainer.train()
        out[name] = {"steps": steps, "settles": [s for s in settles if s],
                     "losses": trainer.losses, "skipped": trainer.ts.skipped_iterations}
    return out


class _Inf(torch.autograd.Function):
    """Identity forward, an Inf gradient behind it (an fp16 overflow)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def _check(results, name):
    for r in results:
        c = r[name]
        assert len(c["steps"]) == 4
        sites = sorted({f"{n} {where}" for calls in c["steps"] for n, where in calls})
        assert all(calls == [] for calls in c["steps"]), "\n".join(sites)
        expected = ["tolist"] + (["tolist"] if name.startswith("fp16") else [])
        assert [[n for n, _ in calls] for calls in c["settles"]] == [expected, expected], c["settles"]
        if name.startswith("fp16"):
            assert c["skipped"] == 1
            assert [x == x for x in c["losses"]] == [True, True, True, True]
        else:
            assert c["skipped"] == 0 and all(x == x for x in c["losses"])


def _default_cases(rank, world):
    from tests.moe.test_moe_host_sync import reads
    return _count(rank, world, ["fp16-zero2"]), reads(rank, world, ["ep2-alltoall-dropless"], 1)


def test_no_host_reads_in_a_step_fp16_overflow():
    """The default set's case: ZeRO stage 2 at DP 2, fp16 with an overflowed (skipped) step; in
    the same ranks, a MoE step at EP 2 (tests/moe/test_moe_host_sync.py: its one documented read
    per MoE layer and micro-batch)."""
    from tests.moe.test_moe_host_sync import check
    results = run_on_ranks(_default_cases, 2, timeout=300)
    _check([dense for dense, _ in results], "fp16-zero2")
    check([moe for _, moe in results], ["ep2-alltoall-dropless"], 1)


@pytest.fixture(scope="module")
def every_layout():
    names = ["zero0", "zero1", "zero2", "zero3", "tp2-zero1", "pp2", "bf16-zero2"]
    return run_on_ranks(_count, 2, args=(names,), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "tp2-zero1", "pp2",
                                  "bf16-zero2"])
def test_no_host_reads_in_a_step_every_layout(every_layout, name):
    _check(every_layout, name)
