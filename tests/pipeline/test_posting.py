"""The runner's batched (NCCL) posting (hybrid.pipeline.runner) under rendezvous semantics, for every
schedule, without communication.

Rendezvous: a batch of sends and receives completes only when every message in it is matched by the
peer's posted counterpart, and a rank's batches complete in the order it posted them (NCCL: one
stream per pair of ranks). A rank computes an action once the batch holding that action's input has
completed, and posts the action's send only after computing it. The model runs every stage until
no stage can move; the step must finish.

Batches are a stage's :func:`~hybrid.pipeline.runner.exchange_groups`: after a group, its sends and
the next group's receives are one batch. One group per action (the pattern before)
deadlocks the interleaved schedule's steady state, which m = p never reaches.
"""

from __future__ import annotations

import pytest

from hybrid.pipeline import PipelineConfig, build_schedule
from hybrid.pipeline.runner import exchange_groups

MIRROR = {"send": "recv", "recv": "send"}


def _messages(config, stage, action):
    """(received, sent) message keys of an action; None at the ends of the virtual pipeline."""
    p, v = config.num_stages, config.num_model_chunks
    k = action.chunk * p + stage
    step = 1 if action.kind == "F" else -1
    received = (action.kind, action.micro_batch, k) if 0 <= k - step < p * v else None
    sent = (action.kind, action.micro_batch, k + step) if 0 <= k + step < p * v else None
    return received, sent


def _batches(config, stage, groups):
    """The batches a stage posts, in order, each with the index of the group that may compute once
    it completes (-1: none), and the group after which it is posted (-1: before the first)."""
    actions = build_schedule(config)[stage]

    def ops(kind, group):
        picked = [_messages(config, stage, actions[i])[0 if kind == "recv" else 1] for i in group]
        return [(kind, key) for key in picked if key]
    batches = [(ops("recv", groups[0]), 0, -1)]
    for g, group in enumerate(groups):
        following = groups[g + 1] if g + 1 < len(groups) else []
        batches.append((ops("send", group) + ops("recv", following),
                        g + 1 if following else -1, g))
    return batches


def _stuck(config, grouping):
    """Stages that cannot finish under rendezvous (their next group's index), or {} when the step
    completes. ``grouping(actions)``: the exchange groups of a stage."""
    p = config.num_stages
    schedule = build_schedule(config)
    groups = [grouping(schedule[s]) for s in range(p)]
    batches = [_batches(config, s, groups[s]) for s in range(p)]
    posted, issued, done, computed = set(), [0] * p, [0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            # post every batch whose group has been computed (the first one at once)
            while issued[s] < len(batches[s]) and batches[s][issued[s]][2] < computed[s]:
                posted.update(batches[s][issued[s]][0])
                issued[s] += 1
                moved = True
            # complete batches in order
            while done[s] < issued[s] and all((MIRROR[o], key) in posted
                                              for o, key in batches[s][done[s]][0]):
                done[s] += 1
                moved = True
            # compute groups whose inputs' batch has completed
            ready = {batches[s][b][1] for b in range(done[s])}
            while computed[s] < len(groups[s]) and computed[s] in ready:
                computed[s] += 1
                moved = True
    return {s: computed[s] for s in range(p) if computed[s] < len(groups[s]) or done[s] < len(batches[s])}


def _one_group_per_action(actions):
    return [[i] for i in range(len(actions))]


SCHEDULES = [("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 2, 2),
             ("interleaved", 4, 2), ("interleaved", 2, 3), ("interleaved", 8, 2)]


@pytest.mark.parametrize("schedule,p,v", SCHEDULES)
@pytest.mark.parametrize("m_over_p", [1, 2, 4])
def test_batched_exchange_groups_complete_every_schedule(schedule, p, v, m_over_p):
    config = PipelineConfig(p, p * m_over_p, p * v * 2, schedule, v)
    assert _stuck(config, exchange_groups) == {}


@pytest.mark.parametrize("m_over_p", [2, 4])
def test_one_batch_per_action_deadlocks_the_interleaved_steady_state(m_over_p):
    """The model can fail: the per-action batching (the NCCL pattern before exchange_groups) hangs
    at m > p, as the real two-rank run did."""
    config = PipelineConfig(2, 2 * m_over_p, 8, "interleaved", 2)
    assert _stuck(config, _one_group_per_action) != {}
    assert _stuck(PipelineConfig(2, 2, 8, "interleaved", 2), _one_group_per_action) == {}


def test_exchange_groups_pair_a_forward_with_the_next_backward_only_in_the_steady_state():
    actions = build_schedule(PipelineConfig(2, 4, 4, "1f1b", 1))[0]   # F F B F B F B B
    assert "".join(a.kind for a in actions) == "FFBFBFBB"
    assert exchange_groups(actions) == [[0], [1], [2], [3, 4], [5, 6], [7]]
