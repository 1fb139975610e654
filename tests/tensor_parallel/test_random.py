"""RNGTracker on one process (Megatron-LM §3 random streams); the cross-rank properties - forked masks
differ across TP ranks, default masks agree - are checked in tests/tensor_parallel/test_layers.py."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.tensor_parallel import RNGTracker
from hybrid.tensor_parallel.random import TP_SEED_OFFSET


def _mask(n=256):
    return F.dropout(torch.ones(n), 0.5)


def test_fork_draws_the_seeded_tp_stream_and_leaves_the_default_stream_alone():
    tracker = RNGTracker(seed=3, tp_rank=1)
    tracker.seed_all()
    with tracker.fork():
        forked = _mask()
    after = _mask()
    torch.manual_seed(3)
    assert torch.equal(after, _mask()), "the default stream must continue as if fork never ran"
    torch.manual_seed(3 + TP_SEED_OFFSET + 1)
    assert torch.equal(forked, _mask()), "the TP stream is seeded seed + 2718 + tp_rank"


def test_states_round_trip_replays_both_streams():
    tracker = RNGTracker(seed=5, tp_rank=0)
    tracker.seed_all()
    _mask()
    states = tracker.get_states()
    with tracker.fork():
        first_tp = _mask()
    first_default = _mask()
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(_mask(), first_tp)
    assert torch.equal(_mask(), first_default)
    assert states.cuda is None   # CPU tracker captures no CUDA state


def test_seed_all_restarts_both_streams():
    tracker = RNGTracker(seed=9, tp_rank=2)
    tracker.seed_all()
    with tracker.fork():
        a = _mask()
    b = _mask()
    tracker.seed_all()
    with tracker.fork():
        assert torch.equal(_mask(), a)
    assert torch.equal(_mask(), b)


def test_misuse_raises_clear_errors():
    tracker = RNGTracker(0, 0)
    with tracker.fork():
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with tracker.fork():
                pass
        with pytest.raises(RuntimeError, match="get_states"):
            tracker.get_states()
    tracker.get_states()   # usable again after the fork
    with pytest.raises(ValueError, match="supports cpu and cuda"):
        RNGTracker(0, 0, "meta")
    with pytest.raises(ValueError, match="non-negative"):
        RNGTracker(-1, 0)
