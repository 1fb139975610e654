"""Context parallelism composed with fp16 dynamic loss scaling and with ``--compile`` (issue 31,
item 5), through the real trainer on 2 ranks (tests/training_helpers.py's tiny model and config).

* **fp16**: CP 2 on 2 ranks against CP 1 on 1 rank (both DP 1) of the same config: the dynamic
  loss scaler takes the same decisions on every iteration (skip flag and loss scale, read from the
  trainer's per-iteration device values), on both CP ranks. The oracle keeps DP 1: the engines
  divide the reduced gradient by DP only in the step (``grad_divisor``), so at DP 2 the fp16
  gradient is twice as large and overflows one halving of the scale earlier, whatever the CP size.
  The scale starts high enough to overflow by itself (fp16 gradients past 65504: iterations 1-3;
  it grows again after 2 clean steps), and iteration 5, at the scale iteration 4 stepped with,
  gets an Inf gradient on rank 0 only (CP rank 0 at CP 2): the step is skipped on both CP ranks.
  The losses agree to rtol 1e-4 (up to 7e-6 relative measured: the CP core merges the partial
  softmaxes of the key chunks in another order, and the CP ranks' loss shares add in another
  order).
* **--compile**: CP 2 ring (p2p) attention, causal and with ``--reset-position-ids
  --reset-attention-mask`` over packed documents: the compiled run's losses equal the eager CP 2
  run's and the CP 1 oracle's to rtol 1e-5 in fp32 (``ParallelAttention.layout_core`` runs eagerly
  between the compiled regions, models/gpt/compile.py; about 1e-7 relative measured).
"""

import numpy as np
import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import SEQ, VOCAB, IndexedSamples, tiny_args

EOD = VOCAB - 1


class PackedSamples(IndexedSamples):
    """IndexedSamples with end-of-document tokens: 1 to 3 per sample at places that vary with i (a
    document crossing the CP chunk border at SEQ / 4, one of length 1 when two are adjacent)."""

    def __getitem__(self, i: int) -> np.ndarray:
        sample = super().__getitem__(i)
        sample[sample == EOD] = EOD - 1
        sample[[1 + i % 7, 2 + (3 * i) % 11, 3 + (5 * i) % (SEQ - 3)]] = EOD
        return sample


def _trainer(args: list[str]):
    """The trainer with the default data path (the loader builds the document tensors from EOD)."""
    from hybrid.launch_env import LaunchEnv
    from pretrain.arguments import parse_args
    from pretrain.build import DataBundle, build_parallel_state
    from pretrain.setup import build_trainer
    torch.set_num_threads(1)
    cfg, _ = parse_args(args)
    layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
    state = build_parallel_state(cfg, layout)
    data = DataBundle(PackedSamples(4096), PackedSamples(512), VOCAB, eod=EOD)
    return build_trainer(cfg, layout, state, data=data)


class _Inf(torch.autograd.Function):
    """Identity forward, an Inf gradient behind it (an fp16 overflow on this rank only)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


FP16 = ["--initial-loss-scale", str(2.0 ** 20), "--hysteresis", "1", "--loss-scale-window", "2",
        "--lr-decay-iters", "8"]


def _fp16_run(cp: int):
    trainer = _trainer(tiny_args(zero=1, precision="fp16", iters=8,
                                 extra=FP16 + ["--context-parallel-size", str(cp)]))
    rows, settle = [], trainer._settle

    def recorded(stats):   # [mean loss, rank loss, loss non-finite, skipped, norm, scale, bubble]
        rows.extend(p.values.tolist() for p in trainer._pending)
        settle(stats)
    loss_fn = trainer._micro_batch_loss

    def poisoned(batch):
        value = loss_fn(batch)
        if trainer.ts.iteration == 4 and trainer.state.rank == 0:
            value = value + 0.0 * _Inf.apply(value)
        return value
    trainer._settle, trainer._micro_batch_loss = recorded, poisoned
    trainer.train()
    return {"losses": trainer.losses, "skipped": [bool(r[3]) for r in rows],
            "scale": [r[5] for r in rows], "total_skipped": trainer.ts.skipped_iterations}


def _fp16_ranks(rank, world_size):
    return _fp16_run(world_size)   # CP = the world: DP 1


@pytest.mark.slow
def test_cp2_fp16_loss_scaling_matches_cp1():
    (ref,) = run_on_ranks(_fp16_ranks, 1, timeout=1500)
    results = run_on_ranks(_fp16_ranks, 2, timeout=1500)
    assert len(ref["skipped"]) == 8 and ref["skipped"][4], ref        # the poisoned step skips
    assert not ref["skipped"][3] and ref["scale"][3] == ref["scale"][4], ref   # ... only it
    assert ref["skipped"][0], f"the initial scale never overflowed by itself: {ref}"
    assert any(b > a for a, b in zip(ref["scale"], ref["scale"][1:])), f"never grew: {ref}"
    for rank, got in enumerate(results):
        what = f"CP 2 rank {rank}"
        assert got["skipped"] == ref["skipped"], (what, got, ref)
        assert got["scale"] == ref["scale"], (what, got, ref)
        assert got["total_skipped"] == sum(ref["skipped"]), what
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-4, atol=0, msg=lambda m: f"{what}: {m}")


def _compile_runs(rank, world_size, cache_parent):
    torch._inductor.config.compile_threads = 1
    out = {}
    for docs in (False, True):
        extra = ["--reset-position-ids", "--reset-attention-mask"] if docs else []
        for name, cp, compiled in (("cp1", 1, False), ("cp2", 2, False), ("cp2-compiled", 2, True)):
            args = tiny_args(iters=4, extra=["--lr-decay-iters", "4", "--context-parallel-size",
                                             str(cp), "--cp-comm-type", "p2p",
                                             "--data-cache-dir", cache_parent] + extra
                             + (["--compile"] if compiled else []))
            trainer = _trainer(args)
            trainer.train()
            if compiled:
                assert trainer.compile_clock.compiles > 0
            out[(docs, name)] = trainer.losses
    return out


@pytest.mark.slow
def test_cp2_compile_matches_eager_and_cp1(tmp_path):
    results = run_on_ranks(_compile_runs, 2, args=(str(tmp_path),), timeout=1800)
    for rank, r in enumerate(results):
        for docs in (False, True):
            eager, oracle = torch.tensor(r[(docs, "cp2")]), torch.tensor(r[(docs, "cp1")])
            compiled = torch.tensor(r[(docs, "cp2-compiled")])
            what = f"rank {rank} {'documents' if docs else 'causal'}"
            torch.testing.assert_close(eager, oracle, rtol=1e-5, atol=0,
                                       msg=lambda m: f"{what} eager CP 2 vs CP 1: {m}")
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0,
                                       msg=lambda m: f"{what} compiled CP 2 vs eager: {m}")
            torch.testing.assert_close(compiled, oracle, rtol=1e-5, atol=0,
                                       msg=lambda m: f"{what} compiled CP 2 vs CP 1: {m}")
        # the same samples: the document masks and reset positions change every loss
        causal, documents = r[(False, "cp2")], r[(True, "cp2")]
        assert all(abs(a - b) > 1e-4 for a, b in zip(causal, documents)), (causal, documents)
