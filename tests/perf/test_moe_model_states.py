"""Model-state bytes with experts (issue 32, hybrid.perf.model_states.moe_model_state_bytes):
dense parameters partitioned over DP, this EP rank's experts over expert-DP = DP / EP, against the
closed form written out per stage."""

import pytest

from hybrid.perf.model_states import model_state_bytes, moe_model_state_bytes

DENSE, EXPERT, DP, EP, MP = 6_000, 64_000, 8, 4, 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_split_equals_closed_form(stage):
    split = moe_model_state_bytes(DENSE, EXPERT, stage, DP, EP, mp=MP)
    d, e = DENSE / MP, EXPERT / EP / MP           # per TP rank; experts per EP rank
    edp = DP // EP
    # bf16 params and grads (2 + 2), K = 12 (fp32 master 4 + moments 8)
    per = {0: lambda n, g: 16 * n,
           1: lambda n, g: 4 * n + 12 * n / g,
           2: lambda n, g: 2 * n + 14 * n / g,
           3: lambda n, g: 16 * n / g}[stage]
    assert split.dense.total == pytest.approx(per(d, DP))
    assert split.expert.total == pytest.approx(per(e, edp))
    assert split.total.total == pytest.approx(per(d, DP) + per(e, edp))
    assert split.expert.master_fp32 == pytest.approx(4 * e / (edp if stage else 1))


def test_ep_one_and_no_experts_reduce_to_the_dense_formula():
    whole = model_state_bytes(DENSE + EXPERT, 2, DP, mp=MP)
    assert moe_model_state_bytes(DENSE, EXPERT, 2, DP, 1, mp=MP).total.total == pytest.approx(
        whole.total)
    assert moe_model_state_bytes(DENSE, 0, 2, DP, EP).total == model_state_bytes(DENSE, 2, DP)


def test_bad_expert_parallel_size_is_refused():
    with pytest.raises(ValueError, match="divisor of the data-parallel degree 8"):
        moe_model_state_bytes(DENSE, EXPERT, 1, DP, 3)
