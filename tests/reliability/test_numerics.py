"""NaN/Inf never reaches the weights or a checkpoint (docs/design.md §10), on 2 gloo ranks
(DP 2, ZeRO stage 2 - and stages 0 and 3 for the skip -, 2 micro-batches per step), with the NaN
injected into ONE rank's loss:

* fp16: the dynamic loss scaler skips the step; bf16/fp32 with ``--on-nonfinite skip``: the step is
  skipped on every rank before any update. Oracle: the parameters after the poisoned iteration are
  bit-identical to those before it, the run continues with finite losses and weights, and the skip
  is counted (``skipped-iterations``, the TensorBoard scalar);
* a NaN gradient under a finite loss (bf16/fp32, stages 2 and 3): the engine finds it in the global
  norm and skips the step before the update, counted the same way;
* ``--on-nonfinite stop``: every rank raises FloatingPointError before the update (no hang), for a
  non-finite loss and for a non-finite gradient;
* a save with non-finite weights is refused on every rank and the previous checkpoint is untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid.checkpoint.format import CheckpointError
from hybrid.testing.multirank import run_on_ranks
from tests.reliability_helpers import tree_hashes
from tests.training_helpers import make_trainer, tiny_args

FIXED = ["--lr-decay-iters", "4"]


class _NaNGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite), NaN in every gradient behind it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _poison(trainer, iteration: int, micro: int, rank: int, where: str = "loss") -> list[dict]:
    """NaN loss (``where="loss"``) or NaN gradients under a finite loss (``"grad"``) on ``rank``'s
    micro-batch ``micro`` of ``iteration``; returns parameter snapshots taken at the start of every
    iteration (and the end)."""
    loss_fn, step_fn = trainer._micro_batch_loss, trainer.train_step
    calls, snaps = {"n": 0}, []

    def loss(batch):
        value = loss_fn(batch)
        k, calls["n"] = calls["n"], calls["n"] + 1
        hit = trainer.ts.iteration + 1 == iteration and k == micro and trainer.state.rank == rank
        if not hit:
            return value
        return value * float("nan") if where == "loss" else _NaNGradient.apply(value)

    def step(loader, lr):
        calls["n"] = 0
        snaps.append(_params(trainer))
        return step_fn(loader, lr)

    trainer._micro_batch_loss, trainer.train_step = loss, step
    return snaps


def _params(trainer) -> dict[str, torch.Tensor]:
    gathered = getattr(trainer.optimizer, "gathered_state_dict", None)   # stage 3: collective
    if gathered is not None:
        return {n: t.clone() for n, t in gathered().items()}
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def _finite(params: dict) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in params.values())


def _skip_case(precision: str, micro: int, tb_dir: str, zero: int = 2, where: str = "loss") -> dict:
    scaler = ["--initial-loss-scale", "1024", "--hysteresis", "1"] if precision == "fp16" else []
    tb_dir = f"{tb_dir}/{precision}{micro}z{zero}{where}"
    tb = ["--tensorboard-dir", tb_dir, "--log-interval", "1"]
    t = make_trainer(tiny_args(zero=zero, precision=precision, iters=3,
                               extra=FIXED + scaler + tb + ["--on-nonfinite", "skip"]))
    snaps = _poison(t, iteration=2, micro=micro, rank=1, where=where)
    t.train()
    t.metrics.close()
    final = _params(t)
    return {"tb_skipped": _tensorboard_scalar(str(t.metrics.run_dir), "skipped-iterations")
            if t.state.rank == 0 else None, "untouched": _same(snaps[1], snaps[2]), "trained_after": not _same(snaps[2], final),
            "finite": _finite(final), "skipped": t.ts.skipped_iterations,
            "losses_after": [t.losses[0], t.losses[2]], "poisoned_loss": t.losses[1],
            "consumed": t.ts.consumed_train_samples,
            "scale": getattr(t.optimizer.scaler, "scale", 1.0)}


def _tensorboard_scalar(directory: str, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(directory)
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def _stop_case(where: str = "loss") -> dict:
    t = make_trainer(tiny_args(zero=2, iters=3, extra=FIXED + ["--on-nonfinite", "stop"]))
    snaps = _poison(t, iteration=2, micro=1, rank=1, where=where)
    try:
        t.train()
    except FloatingPointError as err:
        return {"raised": str(err), "untouched": _same(snaps[1], _params(t))}
    return {"raised": None}


def _save_case(save_dir: str) -> dict:
    t = make_trainer(tiny_args(zero=2, iters=2, extra=FIXED + ["--save", save_dir]))
    t.train()                                           # writes iter_0000002
    torch.distributed.barrier()
    before = tree_hashes(save_dir)
    if t.state.rank == 0:
        with torch.no_grad():
            next(iter(t.model.parameters()))[0] = float("inf")
    t.ts.iteration = 3
    try:
        t.save()
        error = None
    except CheckpointError as err:
        error = str(err)
    torch.distributed.barrier()
    return {"error": error, "unchanged": tree_hashes(save_dir) == before}


def _all_cases(rank: int, world: int, save_dir: str) -> dict:
    out = {f"{p}-micro{m}": _skip_case(p, m, f"{save_dir}-tb") for p, m in
           (("fp32", 1), ("bf16", 0), ("bf16", 1), ("fp16", 1))}
    # stage 0 (all-reduce buckets) and stage 3 (per-unit reduce-scatters in flight) drop the
    # poisoned step's gradients too, and nothing non-finite lands in the next step
    out["fp32-micro1-zero0"] = _skip_case("fp32", 1, f"{save_dir}-tb", zero=0)
    out["bf16-micro0-zero3"] = _skip_case("bf16", 0, f"{save_dir}-tb", zero=3)
    # a finite loss with NaN gradients: only the engine's global norm can see it
    out["fp32-micro1-grad"] = _skip_case("fp32", 1, f"{save_dir}-tb", where="grad")
    out["bf16-micro0-zero3-grad"] = _skip_case("bf16", 0, f"{save_dir}-tb", zero=3, where="grad")
    out["stop"] = _stop_case()
    out["stop-grad"] = _stop_case("grad")
    out["save"] = _save_case(save_dir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_all_cases, 2, args=(str(tmp_path_factory.mktemp("nan_ckpt")),),
                        timeout=400)


@pytest.mark.parametrize("case", ["fp32-micro1", "bf16-micro0", "bf16-micro1", "fp16-micro1",
                                  "fp32-micro1-zero0", "bf16-micro0-zero3", "fp32-micro1-grad",
                                  "bf16-micro0-zero3-grad"])
def test_nonfinite_loss_or_gradient_skips_the_step_on_every_rank(results, case):
    for r in results:
        c = r[case]
        assert c["untouched"], "the poisoned iteration changed the weights"
        assert c["trained_after"] and c["finite"]
        assert c["skipped"] == 1
        assert all(math.isfinite(x) for x in c["losses_after"])
        assert c["consumed"] == 3 * 8                 # the skipped step's samples are consumed
    assert results[0][case]["tb_skipped"] == [0.0, 1.0, 1.0]   # TensorBoard counts the skip
    if case.startswith("fp16"):
        assert results[0][case]["scale"] == 512     # the scaler backed off (1024 / 2)
    if case.endswith("-grad"):                      # the loss was finite: the gradient was caught
        assert all(math.isfinite(r[case]["poisoned_loss"]) for r in results)


@pytest.mark.parametrize("case, what", [("stop", "non-finite loss"),
                                        ("stop-grad", "non-finite gradient (global norm nan)")])
def test_nonfinite_with_stop_raises_on_every_rank(results, case, what):
    for r in results:
        assert r[case]["raised"] and what in r[case]["raised"]
        assert "--on-nonfinite stop" in r[case]["raised"]
        assert r[case]["untouched"]


def test_save_with_nonfinite_weights_is_refused_everywhere(results):
    for r in results:
        assert r["save"]["error"] and r["save"]["unchanged"]
    assert "refusing to save iteration 3: non-finite values in" in results[0]["save"]["error"]
    assert "failed on rank 0" in results[1]["save"]["error"]     # the other rank says who failed
