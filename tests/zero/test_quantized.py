"""ZeRO++ qwZ / qgZ (hybrid/zero/quantize.py, hybrid/zero/quantized_collectives.py).

* the block quantizer: every element within half its block's scale, Inf/NaN kept visible;
* the collectives on 4 gloo ranks laid out as 2 hosts x 2: the hierarchical reduce-scatter equals
  a local simulation of the same two hops (the routing is right) and the exact sum within the
  quantization bound; the quantized all-gather is the per-shard round trip; the ledger records
  the int8 bytes sent, split into intra- and cross-host ones, against formulas;
* the engines (stage 3 with either or both options, stages 1 and 2 with qgZ, TP 2 x DP 2): losses
  close to the exact run's, the ledger's bytes per step against formulas, masters exact;
* invalid use: one error line each.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.quantize import BLOCK, dequantize, pack, packed_numel, quantize, unpack
from hybrid.zero.quantized_collectives import hierarchical_reduce_scatter, quantized_all_gather
from models.gpt.model import GPTModel
from models.gpt.sharding import canonical_init, shard_tensor
from tests.zero.test_stage3 import ADAMW, CONFIG, SEED, build, data, train_step

WORLD, PER_HOST, STEPS = 4, 2, 4
# int8 blocks perturb each weight (qwZ) or gradient (qgZ) by at most 1/254 of its block's largest
# magnitude: the first forward's loss moves by ~3e-4. Adam then amplifies: its first updates are
# about lr x sign(gradient) per element, so an element whose small gradient changes sign moves by
# 2 lr = 2e-3 instead of 0, and three updates later the per-rank loss (2 samples of 8 tokens) is
# seen to differ by up to 7e-3. The bound, 0.02 (0.5% of the loss), still fails a wrong block
# scale or a chunk routed to the wrong rank by orders of magnitude.
LOSS_GAP = 0.02


# ---- the quantizer --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4096])
def test_round_trip_error_is_within_half_a_block_scale(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(3, numel, generator=g) * torch.rand(3, numel, generator=g).pow(4) * 50).to(dtype)
    x[1, : min(numel, BLOCK)] = 0.0                             # an all-zero block: exact zeros
    q, scales = quantize(x)
    assert q.dtype == torch.int8 and q.shape == (3, numel) and scales.shape == (3, -(-numel // BLOCK))
    back = dequantize(q, scales)
    per_element = scales.repeat_interleave(BLOCK, dim=1)[:, :numel]
    error = (x.float() - back).abs()
    assert torch.all(error <= per_element / 2 * (1 + 1e-6))
    assert torch.equal(back[1, : min(numel, BLOCK)], torch.zeros(min(numel, BLOCK)))
    assert torch.all(q.abs() <= 127) and (q.abs() == 127).any()   # the block maximum maps to 127
    packed = pack(x)                                            # one row: payload | scale bytes
    assert packed.dtype == torch.int8 and packed.shape == (3, numel + 4 * -(-numel // BLOCK))
    assert packed.shape[1] == packed_numel(numel)
    assert torch.equal(unpack(packed, numel), back)


def test_a_non_finite_value_turns_its_block_to_nan_and_no_other():
    x = torch.randn(2, 3 * BLOCK)
    x[0, 5], x[1, BLOCK + 7] = float("inf"), float("nan")
    back = unpack(pack(x), 3 * BLOCK)
    assert back[0, :BLOCK].isnan().all() and back[0, BLOCK:].isfinite().all()
    assert back[1, BLOCK:2 * BLOCK].isnan().all()
    assert back[1, :BLOCK].isfinite().all() and back[1, 2 * BLOCK:].isfinite().all()


def test_dp_host_groups_follow_the_hosts():
    # qgZ's DP rank order is host-major: DP rank = host x m + position (its two all-to-alls)
    assert Topology(4, 1, gpus_per_node=2).dp_host_groups() == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # TP 2 inside hosts of 4: DP groups {0,2,4,6} and {1,3,5,7}, two of each on a host
    assert Topology(8, 2, gpus_per_node=4).dp_host_groups() == (
        [[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
    assert Topology(4, 1, gpus_per_node=4).dp_host_groups() == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert ParallelState.dry_run(Topology(12, 1, gpus_per_node=4, pipeline_parallel_size=2),
                                 rank=0).dp_intra_host_group is None
    state = ParallelState.dry_run(Topology(400, 16, gpus_per_node=16), rank=17)
    assert state.dp_intra_host_group.ranks == [17]             # one DP rank per DGX-2 node
    assert state.dp_inter_host_group.ranks == list(range(1, 400, 16))


# ---- the collectives on 2 hosts x 2 ranks ---------------------------------------------------
def _simulate_hierarchical(inputs: list[torch.Tensor], hosts: int, per_host: int, rank: int):
    """What rank ``rank`` must hold after the two quantized hops, computed locally from every
    rank's input (the module docstring's scheme, written out independently)."""
    n = hosts * per_host
    c = inputs[0].numel() // n
    host, position = divmod(rank, per_host)
    total = torch.zeros(c)
    for k in range(hosts):   # host k: its ranks' rows for `position`, each quantized, summed
        rows = [inputs[k * per_host + j].view(hosts, per_host, c)[:, position].reshape(1, -1)
                for j in range(per_host)]
        host_sum = sum(unpack(pack(r), hosts * c) for r in rows)[0]       # [hosts c]
        total += unpack(pack(host_sum.view(hosts, c)), c)[host]         # row `host` to us
    return total


def _collectives(rank: int, world: int) -> dict:
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=PER_HOST), dp_transport="gloo")
    intra, inter = state.dp_intra_host_group, state.dp_inter_host_group
    c = 3 * BLOCK + 40                       # chunk of each rank: a short last block
    inputs = [torch.randn(world * c, generator=torch.Generator().manual_seed(r)) * (r + 1)
              for r in range(world)]
    out = torch.empty(c)
    mark = state.ledger.position
    hierarchical_reduce_scatter(out, inputs[rank].clone(), intra, inter, async_op=True).wait()
    records = [(r.group, r.op, r.dtype, r.bytes_per_rank, r.cross_host_bytes)
               for r in state.ledger.since(mark)]
    in_place = inputs[rank].clone()          # stage 1's use: the output is a slice of the input
    hierarchical_reduce_scatter(in_place[rank * c:(rank + 1) * c], in_place, intra, inter)
    shard = inputs[rank][:c].to(torch.bfloat16)
    gathered = torch.empty(world * c, dtype=torch.bfloat16)
    mark = state.ledger.position
    quantized_all_gather(gathered, shard, state.dp)
    gather_records = [(r.op, r.dtype, r.bytes_per_rank, r.cross_host_bytes)
                      for r in state.ledger.since(mark)]
    tensors = {"out": out, "in_place": in_place[rank * c:(rank + 1) * c],
               "simulated": _simulate_hierarchical(inputs, world // PER_HOST, PER_HOST, rank),
               "exact": sum(inputs)[rank * c:(rank + 1) * c], "gathered": gathered.float(),
               "shards": torch.stack([x[:c].to(torch.bfloat16).float() for x in inputs])}
    # numpy: torch tensors would cross the result queue as shared memory of a finished process
    return {**{k: v.numpy() for k, v in tensors.items()}, "records": records,
            "gather_records": gather_records, "bound_scale": max(x.abs().max().item() for x in inputs),
            "intra": intra.ranks, "inter": inter.ranks}


@functools.lru_cache(maxsize=None)
def collective_results() -> list[dict]:
    return [{k: torch.from_numpy(v) if hasattr(v, "dtype") and not isinstance(v, torch.dtype) else v
             for k, v in r.items()} for r in run_on_ranks(_collectives, WORLD, timeout=300)]


def test_hierarchical_reduce_scatter_matches_its_two_hops_and_the_exact_sum():
    for rank, r in enumerate(collective_results()):
        assert r["intra"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["inter"] == [rank % 2, rank % 2 + 2]
        torch.testing.assert_close(r["out"], r["simulated"], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(r["in_place"], r["out"], rtol=0, atol=0)
        # hop 1 errs by <= A/254 per input (A: largest magnitude), hop 2 by <= 1/254 of a host
        # sum of 2 inputs, for each of the 2 hosts: (4 + 2 x 2) A / 254 in all
        error = (r["out"] - r["exact"]).abs().max()
        assert 0 < error <= 8 * r["bound_scale"] / 254


def test_hierarchical_reduce_scatter_ledger_is_the_int8_bytes_sent():
    c = 3 * BLOCK + 40
    for r in collective_results():
        (g1, op1, dt1, bytes1, cross1), (g2, op2, dt2, bytes2, cross2) = r["records"]
        assert (g1, op1, dt1) == ("dp_intra_host", "all_to_all", torch.int8)
        assert (g2, op2, dt2) == ("dp_inter_host", "all_to_all", torch.int8)
        # hop 1: one row of 2 chunks (both hosts' chunks of my position) to my host's other rank
        assert bytes1 == packed_numel(2 * c) and cross1 == 0
        # hop 2: one chunk to the other host; fp32 flat would send 3 chunks, 2 of them across
        assert bytes2 == packed_numel(c) == c + 4 * 4 and cross2 == bytes2
        assert 2 * c * 4 / cross2 == pytest.approx(7.84, abs=0.01)   # cross-host: 7.8x fewer


def test_quantized_all_gather_is_the_round_trip_of_every_shard():
    c = 3 * BLOCK + 40
    for r in collective_results():
        expected = torch.cat([unpack(pack(s.to(torch.bfloat16).view(1, -1)), c)[0]
                              .to(torch.bfloat16).float() for s in r["shards"]])
        assert torch.equal(r["gathered"], expected)
        [(op, dtype, nbytes, cross)] = r["gather_records"]
        assert (op, dtype) == ("all_gather", torch.int8)
        assert nbytes == 3 * packed_numel(c) and cross == 2 * packed_numel(c)   # 2 of 3 peers away
        assert 3 * c * 2 / nbytes == pytest.approx(1.97, abs=0.01)              # vs bf16


# ---- the engines ----------------------------------------------------------------------------
def _materialised(state: ParallelState, zero: ZeroConfig):
    model = GPTModel(CONFIG, state, dtype=zero.param_dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_tensor(CONFIG, name, canonical_init(CONFIG, name, SEED), state.tp_rank,
                                 state.tp_size))
    return model, build_zero_optimizer(model, state, zero, AdamWConfig(**ADAMW))


def _run(state: ParallelState, zero: ZeroConfig) -> dict:
    model, opt = build(state, zero) if zero.stage == 3 else _materialised(state, zero)
    tokens, labels = data()
    losses, norms, per_step = [], [], []
    for i in range(STEPS):
        mark = state.ledger.position
        loss, norm = train_step(model, opt, state, tokens[i], labels[i], 1)
        losses.append(loss)
        norms.append(norm)
        opt.zero_grad()
        per_step.append([(r.group, r.op, r.numel, r.dtype, r.bytes_per_rank, r.cross_host_bytes)
                         for r in state.ledger.since(mark)])
    out = {"losses": losses, "norms": norms, "records": per_step[-1]}
    if zero.stage == 3:
        out["chunks"] = sorted({u.chunk for u in opt.all_units})
        out["masters"] = {k: v.float().numpy() for k, v in opt.gathered_state_dict().items()}
    return out


ENGINE_CASES = {  # name -> (tp, stage, precision, qwZ, qgZ)
    "s3": (1, 3, "fp32", False, False), "s3_qwz": (1, 3, "fp32", True, False),
    "s3_qgz": (1, 3, "fp32", False, True), "s3_both": (1, 3, "fp32", True, True),
    "s3_zeropp": (1, 3, "fp32", True, True),   # with hpZ: ZeRO++'s three options together
    "s3_qwzfp8": (1, 3, "fp32", True, False),   # --zero-quantized-weights-format fp8 (E4M3)
    "s2": (1, 2, "bf16", False, False), "s2_qgz": (1, 2, "bf16", False, True),
    "s1": (1, 1, "fp32", False, False), "s1_qgz": (1, 1, "fp32", False, True),
    "tp2_s3": (2, 3, "bf16", False, False), "tp2_s3_both": (2, 3, "bf16", True, True),
    # one host of 4, DP collectives through shared memory: qgZ is one hop inside the host
    "host1_s3": ("one host", 3, "bf16", False, False),
    "host1_s3_both": ("one host", 3, "bf16", True, True),
    # fp16 with a loss scale that overflows: the first steps must be skipped with or without qgZ
    "fp16_s3": (1, 3, "fp16", False, False), "fp16_s3_both": (1, 3, "fp16", True, True),
}


def _engines(rank: int, world: int) -> dict:
    states = {tp: ParallelState.initialize(Topology(world, tp, gpus_per_node=PER_HOST),
                                           dp_transport="gloo") for tp in (1, 2)}
    states["one host"] = ParallelState.initialize(Topology(world, 1, gpus_per_node=world),
                                                  dp_transport="auto")
    out = {}
    for name, (tp, stage, precision, qwz, qgz) in ENGINE_CASES.items():
        # read by fp16 only: overflows at 2^40 (and maybe 2^20), trains from 2^0 on
        scale = LossScaleConfig(initial_scale=2.0 ** 40, hysteresis=1, backoff_factor=2.0 ** -20)
        zero = ZeroConfig(stage=stage, precision=precision, quantized_weights=qwz,
                          quantized_gradients=qgz, bucket_size=3000, loss_scale=scale,
                          hpz=name.endswith("zeropp"),
                          quantized_weights_format="fp8" if name.endswith("fp8") else "int8")
        out[name] = _run(states[tp], zero)
    return out


@functools.lru_cache(maxsize=None)
def engine_results() -> list[dict]:
    return run_on_ranks(_engines, WORLD, timeout=600)


@pytest.mark.parametrize("option", ["s3_qwz", "s3_qwzfp8", "s3_qgz", "s3_both", "s2_qgz", "s1_qgz", "tp2_s3_both",
                                    "host1_s3_both"])
def test_quantized_losses_stay_close_to_the_exact_run(option):
    exact = option.rsplit("_", 1)[0]
    for r in engine_results():
        gaps = [abs(a - b) for a, b in zip(r[option]["losses"], r[exact]["losses"])]
        assert max(gaps) <= LOSS_GAP, (option, gaps)
        assert max(gaps) > 0, f"{option} changed nothing: is the option wired?"
        if "qwz" in option or "both" in option:
            assert gaps[0] > 0     # the very first forward already uses the quantized weights
        else:
            assert gaps[0] == 0    # qgZ: the first forward is exact, the update is not


def _cross(records, dtype=None, op=None) -> float:
    return sum(r[5] for r in records if (dtype is None or r[3] == dtype) and (op is None or r[1] == op))


def test_hpz_qwz_and_qgz_together_keep_only_the_forward_gather_across_hosts():
    """ZeRO++'s three options: hpZ moves the backward's (int8) all-gather inside the host, so of
    s3_both's cross-host bytes exactly half of the int8 gathers' go away; the persistent unit's
    exact gather and qgZ's all-to-alls are unchanged. Losses stay near the exact run's."""
    for r in engine_results():
        both, zeropp = r["s3_both"]["records"], r["s3_zeropp"]["records"]
        int8_gathers = _cross(both, torch.int8, "all_gather")
        assert int8_gathers > 0
        assert _cross(zeropp, torch.int8, "all_gather") == pytest.approx(int8_gathers / 2)
        assert _cross(zeropp) == pytest.approx(_cross(both) - int8_gathers / 2)
        assert _cross(zeropp) < _cross(r["s3"]["records"]) / 5   # fp32 here: about 8x fewer
        gaps = [abs(a - b) for a, b in zip(r["s3_zeropp"]["losses"], r["s3"]["losses"])]
        assert 0 < max(gaps) <= LOSS_GAP


def test_on_one_host_qgz_is_one_hop_and_nothing_crosses():
    for r in engine_results():
        records = r["host1_s3_both"]["records"]
        assert _by(records, "dp_inter_host", "all_to_all") == []     # a group of one: no message
        intra = _by(records, "dp_intra_host", "all_to_all")
        assert intra and all(rec[3] == torch.int8 and rec[5] == 0 for rec in intra)
        gathers = _by(records, "dp", "all_gather")
        assert gathers and all(rec[3] == torch.int8 and rec[5] == 0 for rec in gathers)


def test_fp16_overflow_is_still_seen_through_quantized_gradients():
    """An Inf in a gradient turns its int8 block to NaN (quantize.py), so the loss scaler skips
    exactly the steps it skips without quantization, then both train."""
    import math
    for r in engine_results():
        overflowed = [not math.isfinite(n) for n in r["fp16_s3"]["norms"]]
        assert overflowed == [not math.isfinite(n) for n in r["fp16_s3_both"]["norms"]]
        assert overflowed[0] and not overflowed[-1]
        assert abs(r["fp16_s3"]["losses"][-1] - r["fp16_s3_both"]["losses"][-1]) <= LOSS_GAP


def _by(records, group, op):
    return [rec for rec in records if rec[0] == group and rec[1] == op]


def test_stage3_qwz_ledger_per_step_against_the_formula():
    for r in engine_results():
        exact = _by(r["s3"]["records"], "dp", "all_gather")
        quant = _by(r["s3_qwz"]["records"], "dp", "all_gather")
        assert len(quant) == len(exact) > 0   # the same gathers (forward and backward), int8
        for (_, _, numel, dtype, nbytes, cross), (_, _, qnumel, qdtype, qbytes, qcross) in zip(exact, quant):
            chunk = numel // WORLD
            assert dtype == torch.float32 and qdtype == torch.int8
            assert nbytes == 3 * chunk * 4 and qbytes == 3 * packed_numel(chunk)
            assert cross == 2 * chunk * 4 and qcross == 2 * packed_numel(chunk)
        ratio = sum(x[4] for x in exact) / sum(x[4] for x in quant)
        assert 3.9 < ratio < 4.0             # fp32 -> int8 + one fp32 scale per 256
        # the gradient reduce-scatter is untouched by qwZ
        assert _by(r["s3"]["records"], "dp", "reduce_scatter") == \
            _by(r["s3_qwz"]["records"], "dp", "reduce_scatter")


def test_qgz_ledger_per_step_against_the_formula():
    for exact_name, quant_name, item in (("s3", "s3_qgz", 4), ("s2", "s2_qgz", 2), ("s1", "s1_qgz", 4)):
        for r in engine_results():
            exact = _by(r[exact_name]["records"], "dp", "reduce_scatter")
            intra = _by(r[quant_name]["records"], "dp_intra_host", "all_to_all")
            inter = _by(r[quant_name]["records"], "dp_inter_host", "all_to_all")
            assert _by(r[quant_name]["records"], "dp", "reduce_scatter") == []
            assert len(exact) == len(intra) == len(inter) > 0
            for (_, _, numel, _, nbytes, cross), a, b in zip(exact, intra, inter):
                chunk = numel // WORLD
                assert nbytes == 3 * chunk * item and cross == 2 * chunk * item
                assert a[4] == packed_numel(2 * chunk) and a[5] == 0        # inside the host
                assert b[4] == b[5] == packed_numel(chunk)                  # all of it across
            cross_ratio = sum(x[5] for x in exact) / sum(x[5] for x in inter)
            # 2 ranks a host pre-sum: 2x, and int8 + scales vs fp32 (3.94x) or bf16 (1.97x)
            assert cross_ratio == pytest.approx(2 * item / (1 + 4 / BLOCK), rel=0.02)


def test_quantized_runs_keep_exact_masters():
    """The masters that checkpoints save are fp32 and were updated from the (dequantized) gradients;
    they are whole fp32 values, not int8 grid points: gathered through the exact path."""
    for r in engine_results():
        for name, value in r["s3_both"]["masters"].items():
            assert value.dtype.name == "float32"
        diffs = [abs(r["s3_both"]["masters"][k] - r["s3"]["masters"][k]).max()
                 for k in r["s3"]["masters"]]
        assert 0 < max(diffs) < 1e-2


# qwZ and qgZ quantize a unit's DP chunk (or gradient rows) in 256-element blocks that mix TP-sharded
# and TP-replicated parameters (layer norms, row-parallel biases, position embeddings). A block's
# scale is its largest magnitude, which differs between TP ranks where the block holds sharded
# values, so the replicated values come back rounded differently on each TP rank and the replicas
# drift apart (about 1e-5 after 4 steps; the exact run keeps them bit-equal). A checkpoint keeps TP
# rank 0's copy, so TP rank 1 changes on resume (tests/zero/test_quantized_training.py, TP 2).
@pytest.mark.parametrize("case", ["tp2_s3", "tp2_s3_both"])
def test_tp_replicated_parameters_stay_equal_on_every_tp_rank(case):
    """TP-replicated parameters (LayerNorm, row-parallel biases, position embeddings) share
    quantization blocks with TP-sharded ones; the block scales are the TP group's maximum, so the
    replicated values round alike and stay bit-equal on every TP rank (they drifted by up to 3.6e-4
    in 3 steps with per-rank scales)."""
    from models.gpt.sharding import partition_dim
    results = engine_results()
    for dp_rank in range(WORLD // 2):          # TP 2: ranks 2 d and 2 d + 1 hold the same DP rank
        first, second = (results[2 * dp_rank + t][case]["masters"] for t in range(2))
        replicated = [k for k in first if partition_dim(k) == -1]
        assert replicated
        for name in replicated:
            assert (first[name] == second[name]).all(), (case, dp_rank, name)


# ---- invalid use ----------------------------------------------------------------------------
def test_options_refuse_the_stages_they_do_not_apply_to():
    with pytest.raises(ValueError, match="--zero-quantized-weights .*stage 3"):
        ZeroConfig(stage=2, quantized_weights=True)
    with pytest.raises(ValueError, match="--zero-quantized-gradients .*stages 1-3"):
        ZeroConfig(stage=0, quantized_gradients=True)
    ZeroConfig(stage=1, quantized_gradients=True)
    ZeroConfig(stage=3, quantized_weights=True, quantized_gradients=True, precision="fp16")


def test_qgz_refuses_a_dp_group_spread_unevenly_over_hosts():
    state = ParallelState.single_process()
    state.dp_intra_host_group = None
    from hybrid.zero.quantized_collectives import gradient_reduce_scatter
    with pytest.raises(ValueError, match="same number of DP ranks on every host"):
        gradient_reduce_scatter(state, quantized=True)
    assert gradient_reduce_scatter(state, quantized=False) is None   # the engines keep their own


def test_a_nan_block_stays_non_finite_when_the_scales_are_agreed_over_tp():
    """The TP maximum of the scales (tp_agreed_scales) may drop a NaN, as fmax does; a NaN scale is
    made Inf first, so the block still dequantizes to NaN and an overflow is seen."""
    x = torch.randn(1, 600)
    x[0, 300] = float("nan")
    other_rank = torch.full((1, 3), 0.01)

    def fmax_over_tp(scales):
        scales.copy_(torch.fmax(scales, other_rank))
    out = unpack(pack(x, fmax_over_tp), 600)
    assert out[0, 256:512].isnan().all() and out[0, :256].isfinite().all()


def test_fp8_blocks_keep_a_relative_error_of_one_sixteenth():
    """--zero-quantized-weights-format fp8: E4M3 payload, same blocks and bytes as int8; every
    element within max(|x| / 16, scale / 1024) (E4M3's half step, or its smallest subnormal)."""
    from hybrid.zero.quantize import BLOCK, pack, packed_numel, quantize, unpack
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 700, generator=gen) * torch.logspace(-4, 0, 700)     # small beside large
    x[1, 5] = 0.0
    packed = pack(x, fmt="fp8")
    assert packed.dtype == torch.int8 and packed.shape == (3, packed_numel(700))
    back = unpack(packed, 700, fmt="fp8")
    q, scales = quantize(x, fmt="fp8")
    assert q.dtype == torch.float8_e4m3fn
    per_element = scales.repeat_interleave(BLOCK, dim=1)[:, :700]
    bound = torch.maximum(x.abs() / 16, per_element / 1024)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    int8_error = (unpack(pack(x), 700) - x).abs()
    small = x.abs() < 1e-3
    assert (back - x)[small].abs().max() < int8_error[small].max()      # small values kept
    x[2, 10] = float("inf")
    assert torch.isnan(unpack(pack(x, fmt="fp8"), 700, fmt="fp8")[2, :BLOCK]).all()


def test_fp8_gather_format_is_wired_and_sends_the_same_bytes():
    """--zero-quantized-weights-format fp8: other rounding than int8 (other losses), the same
    packed bytes per gather in the ledger."""
    for r in engine_results():
        assert r["s3_qwzfp8"]["losses"] != r["s3_qwz"]["losses"]
        fp8 = _by(r["s3_qwzfp8"]["records"], "dp", "all_gather")
        int8 = _by(r["s3_qwz"]["records"], "dp", "all_gather")
        assert [rec[2:4] for rec in fp8] == [rec[2:4] for rec in int8]
