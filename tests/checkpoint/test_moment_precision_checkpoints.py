"""Checkpoints of runs with bf16 Adam moments (issue 33 part 5, docs/optimizer-precision.md).

A GPT run with bf16 moments is saved at DP 2 x ZeRO stage 1 after 2 of 4 iterations. It is loaded
at the same layout, at DP 2 x ZeRO 3, at TP 2 and at PP 2 (2 ranks, one spawn), and at DP 1 (one
process).
Each loaded run first writes its state again from its own layout: every master and moment tensor
of that checkpoint must equal the saved one bit for bit (the moments stay bf16: a reshard moves
them, it never rounds them). Then the runs continue: at the saved layout the losses equal the
uninterrupted run's exactly; at the others to rtol 1e-5 (the other layout sums in another order).

Across moment dtypes the load converts, with one logged note: the bf16 checkpoint loaded into an
fp32-moment run holds exactly the bf16 values; an fp32-moment checkpoint loaded into a bf16-moment
run holds its moments rounded to nearest even.
"""

import logging

import pytest
import torch

from hybrid.checkpoint.loader import CheckpointReader
from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

BF16 = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
FIXED = ["--lr-decay-iters", "4"]
SAVED = dict(tp=1, zero=1)
TWO_RANK_LAYOUTS = [dict(tp=1, zero=1), dict(tp=1, zero=3), dict(tp=2, zero=1),
                    dict(tp=1, zero=1, pp=2)]
KINDS = ("master", "exp_avg", "exp_avg_sq")


def _name(layout, moments="bf16", ranks=2) -> str:
    return f"{ranks}ranks-tp{layout['tp']}-pp{layout.get('pp', 1)}-zero{layout['zero']}-{moments}"


def _resume(ckpt, layout, moments, notes=None, source="saved", ranks=2):
    """Load iteration 2 of the run saved in ``source`` at ``layout``, write it again (to
    ``_name(...)``), train iterations 3-4."""
    extra = FIXED + (BF16 if moments == "bf16" else []) + [
        "--load", f"{ckpt}/{source}/iter_0000002", "--save",
        f"{ckpt}/{_name(layout, moments, ranks)}",
        "--pipeline-model-parallel-size", str(layout.get("pp", 1))]
    layout = {k: v for k, v in layout.items() if k != "pp"}
    handler = _Notes(notes) if notes is not None else None
    if handler:
        logging.getLogger("hybrid.zero.engine").addHandler(handler)
    try:
        trainer = make_trainer(tiny_args(iters=4, extra=extra, **layout))
    finally:
        if handler:
            logging.getLogger("hybrid.zero.engine").removeHandler(handler)
    trainer.save()
    trainer.train()
    return trainer.losses


class _Notes(logging.Handler):
    def __init__(self, out):
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record):
        self.out.append(record.getMessage())


def _two_ranks(rank, world_size, ckpt):
    logging.getLogger("hybrid.zero.engine").setLevel(logging.INFO)
    trainer = make_trainer(tiny_args(iters=4, extra=FIXED + BF16 + [
        "--save", f"{ckpt}/saved", "--save-interval", "2"], **SAVED))
    trainer.train()
    out = {"reference": trainer.losses}
    for layout in TWO_RANK_LAYOUTS:
        out[_name(layout)] = _resume(ckpt, layout, "bf16")
    return out


def _one_rank(rank, world_size, ckpt):
    logging.getLogger("hybrid.zero.engine").setLevel(logging.INFO)
    out = {}
    for moments in ("bf16", "fp32"):
        notes = []
        out[moments] = (_resume(ckpt, SAVED, moments, notes, ranks=1), notes)
    # an fp32-moment run of its own, loaded into a bf16-moment one
    make_trainer(tiny_args(iters=2, extra=FIXED + ["--save", f"{ckpt}/fp32saved"], **SAVED)).train()
    notes = []
    _resume(ckpt, dict(tp=1, zero=3), "bf16", notes, source="fp32saved", ranks=1)
    out["fp32 into bf16"] = notes
    return out


def _tensors(path):
    reader = CheckpointReader(path)
    return {(kind, name): reader.full_tensor(kind, name) for kind in KINDS
            for name in reader.names(kind)}


def _assert_same_state(saved, loaded, what, convert=None):
    assert saved.keys() == loaded.keys(), what
    for key, want in saved.items():
        got = loaded[key]
        rows = min(want.shape[0], got.shape[0])   # the vocab's padding rows differ with TP
        want, got = want[:rows], got[:rows]
        if key[0] != "master":
            want = convert(want) if convert else want
        assert got.dtype == want.dtype, (what, key, got.dtype, want.dtype)
        assert torch.equal(got, want), (what, key)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("bf16-moments"))
    return ckpt, run_on_ranks(_two_ranks, 2, args=(ckpt,), timeout=600)


@pytest.mark.slow
def test_bf16_moments_reshard_across_dp_zero_stage_and_tp(saved_run):
    ckpt, results = saved_run
    saved = _tensors(f"{ckpt}/saved/iter_0000002")
    assert {t.dtype for (kind, _), t in saved.items() if kind != "master"} == {torch.bfloat16}
    reference = results[0]["reference"]
    for layout in TWO_RANK_LAYOUTS:
        name = _name(layout)
        _assert_same_state(saved, _tensors(f"{ckpt}/{name}/iter_0000002"), name)
        for r in results:
            losses = r[name]
            if layout == SAVED:
                assert losses == reference[2:], (name, losses, reference)
            else:
                torch.testing.assert_close(losses, reference[2:], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_bf16_checkpoint_loads_at_dp1_and_into_fp32_moments(saved_run):
    ckpt, results = saved_run
    out = run_on_ranks(_one_rank, 1, args=(ckpt,), timeout=300)[0]
    saved = _tensors(f"{ckpt}/saved/iter_0000002")
    reference = results[0]["reference"]
    losses, notes = out["bf16"]
    _assert_same_state(saved, _tensors(f"{ckpt}/{_name(SAVED, ranks=1)}/iter_0000002"), "DP 1")
    torch.testing.assert_close(losses, reference[2:], rtol=1e-5, atol=0)
    assert not notes, notes
    losses, notes = out["fp32"]   # the same moments, widened exactly
    _assert_same_state(saved, _tensors(f"{ckpt}/{_name(SAVED, 'fp32', 1)}/iter_0000002"),
                       "into fp32 moments", convert=lambda t: t.float())
    assert len(notes) == 2 and all("converted on load (exact)" in n for n in notes), notes
    notes = out["fp32 into bf16"]   # fp32 moments rounded to nearest even, once
    _assert_same_state(_tensors(f"{ckpt}/fp32saved/iter_0000002"),
                       _tensors(f"{ckpt}/{_name(dict(tp=1, zero=3), 'bf16', 1)}/iter_0000002"),
                       "fp32 into bf16 moments", convert=lambda t: t.bfloat16())
    assert len(notes) == 2 and all("rounded to nearest even" in n for n in notes), notes
