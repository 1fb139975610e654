"""The whole GPT trained 5 steps under context parallelism equals the single-device oracle (issue 31):
fp32, rtol 1e-5 on the losses, the gradient norms and the final parameters, with the gradients
reduced and ZeRO partitions built over DP x CP and each CP rank's loss its tokens' share.

Cases (world = TP x CP x DP): the default set runs CP 2 with the ring (p2p) on causal attention;
the slow set adds document-masked packed samples (tests/context_parallel/cp_training.py: a
document crossing chunk borders, one of length 1, a sample without EOD, a sample of EODs only),
TP 2, ZeRO 0 / 1 / 3, every comm type, DP 2 x CP 2 with accumulation, rotary positions and CP 4.
"""

import pytest

from hybrid.testing.multirank import run_on_ranks
from tests.context_parallel.cp_training import (assert_matches, cp_state, cp_train,
                                                local_parameters, packed_batches, reference_run)


def _cases(rank, world, cases):
    """Each case (tp, cp, stage, comm_type, documents, accum, rope) on this world of ranks."""
    done = []
    for tp, cp, stage, comm_type, documents, accum, rope in cases:
        state = cp_state(world, tp, cp)
        data = packed_batches(documents=documents)
        ref = reference_run(data, state.dp_size * accum, documents, rope)
        model, engine, losses, norms = cp_train(state, data, stage=stage, comm_type=comm_type,
                                                documents=documents, accum=accum, rope=rope)
        what = (f"TP {tp} CP {cp} DP {state.dp_size} ZeRO {stage} {comm_type} "
                f"{'documents' if documents else 'causal'} accum {accum}{' rope' if rope else ''}")
        # documents: the oracle runs each document alone, a different order of the same sums;
        # AdamW (lr / eps = 100) turns that rounding on near-zero gradients into ~1e-6 steps
        assert_matches(state, local_parameters(model, engine), losses, norms, ref, what, rope=rope,
                       atol=5e-6 if documents else 1e-6)
        done.append(what)
    return done


def test_cp2_ring_matches_single_device():
    """The default case: CP 2 ring attention, ZeRO 1, causal."""
    done = run_on_ranks(_cases, 2, args=([(1, 2, 1, "p2p", False, 1, False)],))
    assert len(done[0]) == 1


@pytest.mark.slow
def test_cp2_all_to_all_documents_zero3_matches_single_device():
    done = run_on_ranks(_cases, 2, args=([(1, 2, 3, "a2a", True, 1, False)],))
    assert len(done[0]) == 1


MATRIX_4 = [(tp, 2, stage, comm, docs, 1, False) for tp in (1, 2) for stage in (1, 3)
            for comm in ("p2p", "a2a", "allgather") for docs in (False, True)]


@pytest.mark.slow
def test_cp2_matrix_tp_zero_comm_masks_on_four_ranks():
    """CP 2 x TP 1 / 2 (TP 1: DP 2) x ZeRO 1 / 3 x p2p / a2a / allgather x causal / documents."""
    done = run_on_ranks(_cases, 4, args=(MATRIX_4,), timeout=1200)
    assert len(done[0]) == len(MATRIX_4)


@pytest.mark.slow
def test_cp2_with_accumulation_and_rotary():
    cases = [(1, 2, 1, "p2p", True, 2, True), (1, 2, 0, "a2a", True, 2, True),
             (2, 2, 1, "p2p", True, 1, True)]
    done = run_on_ranks(_cases, 4, args=(cases,), timeout=900)
    assert len(done[0]) == 3


@pytest.mark.slow
def test_cp4_matches_single_device():
    cases = [(1, 4, 1, comm, docs, 1, False) for comm in ("p2p", "a2a", "allgather")
             for docs in (False, True)]
    done = run_on_ranks(_cases, 4, args=(cases,), timeout=900)
    assert len(done[0]) == len(cases)
