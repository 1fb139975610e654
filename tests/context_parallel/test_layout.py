"""The load-balanced CP layout: every rank holds two chunks, the split round-trips, and the causal
work (query, key) pairs per rank is the same on every rank."""

import pytest
import torch

from hybrid.context_parallel.layout import (check_divisible, local_positions, merge_sequence,
                                            split_sequence)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_and_merge_round_trip(cp):
    x = torch.arange(3 * 16).view(3, 16)
    parts = [split_sequence(x, 1, r, cp) for r in range(cp)]
    assert torch.equal(merge_sequence(parts, 1), x)
    for r, part in enumerate(parts):   # the positions name exactly the tokens the rank holds
        assert torch.equal(part[0], local_positions(16, r, cp))


def test_chunks_of_rank_one_of_four():
    assert local_positions(16, 1, 4).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_balanced(cp):
    s = 8 * cp
    pairs = [int((local_positions(s, r, cp) + 1).sum()) for r in range(cp)]  # keys each query sees
    assert len(set(pairs)) == 1 and sum(pairs) == s * (s + 1) // 2


def test_indivisible_length_is_one_clear_error():
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size = 8"):
        check_divisible(20, 4)
