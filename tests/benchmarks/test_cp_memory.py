"""Issue 31, memory: at a fixed activation budget the longest trainable sequence grows about
linearly with the CP degree, measured with the activation meter at CP 1, 2 and 4 (ring attention on
gloo CPU ranks through the GPT model's TokenLayout), and the memory model predicts every
measurement within 10% (benchmarks/cp_memory.py; a smaller budget than its default)."""

from __future__ import annotations

import pytest

from benchmarks import cp_memory


def test_longest_sequence_grows_with_cp_degree_in_the_model():
    budget = cp_memory.model_bytes(1024, 1)
    longest = {cp: cp_memory.longest_seq(budget, cp) for cp in cp_memory.CP_DEGREES}
    assert longest[1] == 1024
    for cp in (2, 4):
        assert 0.9 * cp <= longest[cp] / longest[1] <= 1.25 * cp, longest


@pytest.mark.slow
def test_measured_activations_match_the_model_at_cp_1_2_4():
    result = cp_memory.run(base_seq=512)
    rows = result["rows"]
    assert {r["cp"] for r in rows} == {1, 2, 4}
    for r in rows:
        assert abs(r["error"]) <= 0.10, r
        assert r["measured"] <= result["budget"] * 1.10, r
    longest = {r["cp"]: r["seq"] for r in rows if r["longest"]}
    for cp in (2, 4):
        assert 0.9 * cp <= longest[cp] / longest[1] <= 1.25 * cp, longest


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["a2a", "allgather"])
def test_a2a_and_allgather_activations_match_the_model(comm_type):
    """a2a keeps what the ring keeps (a/C heads of all S tokens); the all-gather baseline also the
    gathered K and V of the whole sequence."""
    got = cp_memory.measure_all([1024], 2, comm_type)[0]["kept"]
    assert got == pytest.approx(cp_memory.model_bytes(1024, 2, comm_type), rel=0.10)
