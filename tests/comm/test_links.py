"""The link-aware ledger (hybrid.perf.links, hybrid.comm): every collective's logical volume split
into intra-host and cross-host bytes from the ranks' hosts and the algorithm. The formulas are
checked against counts of (sender, receiver) pairs written out by hand; then four real gloo ranks
on two "nodes" of two (gpus_per_node=2) check the ledger of each collective against hand-computed
byte counts, with the per-group/op logical volume unchanged (ZeRO §7). The start-up report lists
the bytes per group and op that the dry run's formulas expect, inside hosts and across them."""

from __future__ import annotations

import pytest
import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.perf.links import cross_host_fraction, describe_group, nodes_of, ring_crossings, split_bytes
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology


def test_ring_crossings_count_neighbour_pairs_on_different_hosts():
    assert ring_crossings((0, 0, 0, 0)) == 0
    assert ring_crossings((0, 0, 1, 1)) == 2            # 1->2 and 3->0
    assert ring_crossings((0, 1, 2, 3)) == 4            # a DP group of one rank per host
    assert ring_crossings((0, 1, 0, 1)) == 4
    assert ring_crossings((5,)) == 0


def test_ring_fraction_is_crossing_pairs_over_ranks():
    assert cross_host_fraction("all_reduce", "ring", (0, 0, 1, 1)) == 2 / 4
    assert cross_host_fraction("all_gather", "ring", (0, 1, 2)) == 1.0
    # Megatron's 384-GPU baseline: TP 128 over 8 DGX-2 nodes of 16 -> 8 of 128 ring hops cross
    tp_group = nodes_of(list(range(128)), 16)
    assert cross_host_fraction("all_reduce", "ring", tp_group) == 8 / 128
    # the 400-GPU ZeRO layout: TP 16 inside a node, DP 25 strided across the 25 nodes
    topo = Topology(400, 16, 16)
    assert cross_host_fraction("reduce_scatter", "ring", nodes_of(topo.tp_group_of(0), 16)) == 0
    assert cross_host_fraction("reduce_scatter", "ring", nodes_of(topo.dp_group_of(0), 16)) == 1


def test_direct_fraction_is_off_host_peers_over_peers():
    # 4 ranks on hosts 0,0,1,1: each sends a quarter to each of 3 peers, 2 of them on the other host
    assert cross_host_fraction("reduce_scatter", "direct", (0, 0, 1, 1)) == pytest.approx(2 / 3)
    # 3 ranks on hosts 0,0,1: ranks 0 and 1 have 1 of 2 peers away, rank 2 has 2 of 2 -> (1+1+2)/6
    assert cross_host_fraction("all_gather", "direct", (0, 0, 1)) == pytest.approx(4 / 6)


def test_broadcast_chain_and_direct_and_shared_memory():
    # chain from index 0 over hosts 0,0,1,1: hops 0->0, 0->1, 1->1: one of three crosses
    assert cross_host_fraction("broadcast", "ring", (0, 0, 1, 1)) == pytest.approx(1 / 3)
    # from index 1: hops 1->2, 2->3, 3->0 on hosts 0->1, 1->1, 1->0: two of three
    assert cross_host_fraction("broadcast", "ring", (0, 0, 1, 1), 1) == pytest.approx(2 / 3)
    # one-to-all from index 0: peers on hosts 0, 1, 1 -> two of three
    assert cross_host_fraction("broadcast", "direct", (0, 0, 1, 1)) == pytest.approx(2 / 3)
    assert cross_host_fraction("all_gather", "shm", (0, 1)) == 0
    assert split_bytes(90.0, "all_gather", "direct", (0, 0, 1)) == pytest.approx((30.0, 60.0))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        cross_host_fraction("all_gather", "tree", (0, 1))


def test_nodes_and_start_up_lines():
    assert nodes_of([0, 2, 4, 6], 2) == (0, 1, 2, 3)
    assert nodes_of([0, 2], None) == (0, 0)
    assert "inside host 0: 0% of its bytes cross hosts" in describe_group("tp", [0, 1], 2)
    assert "over 2 hosts: 100% of its bytes cross hosts" in describe_group("dp", [0, 2], 2)


def test_dry_run_ledger_splits_without_process_groups():
    state = ParallelState.dry_run(Topology(400, 16, 16), rank=17)
    ledger = state.ledger
    ledger.record("all_gather", state.dp, 1000, torch.bfloat16)
    ledger.record("all_reduce", state.tp, 1000, torch.bfloat16)
    (dp_intra, dp_cross), (tp_intra, tp_cross) = (ledger.split_totals()[("dp", "all_gather")],
                                                  ledger.split_totals()[("tp", "all_reduce")])
    assert dp_intra == 0 and dp_cross == pytest.approx(2000 * 24 / 25)
    assert tp_cross == 0 and tp_intra == pytest.approx(2 * 2000 * 15 / 16)
    assert ledger.totals()[("dp", "all_gather")] == dp_cross       # the logical volume as before


def test_point_to_point_bytes_cross_only_to_a_peer_on_another_host():
    """A send/recv is split by the pair's hosts, not the group's ring: rank 17 of a 400-rank world
    (16 a node, node 1 = ranks 16-31) exchanges with DP peers on its node and on node 2."""
    state = ParallelState.dry_run(Topology(400, 4, 16), rank=17)   # DP group: 1, 5, 9, 13, 17, ...
    ledger = state.ledger
    me = state.dp.rank
    ledger.record("send", state.dp, 1000, torch.float32, peer=me + 1)   # rank 21: same node
    ledger.record("recv", state.dp, 1000, torch.float32, peer=me + 2)   # rank 25: same node
    ledger.record("send", state.dp, 1000, torch.float32, peer=me + 4)   # rank 33: node 2
    (send_intra, send_cross), (recv_intra, recv_cross) = (ledger.split_totals()[("dp", "send")],
                                                          ledger.split_totals()[("dp", "recv")])
    assert (send_intra, send_cross) == (4000, 4000) and (recv_intra, recv_cross) == (4000, 0)


def _two_nodes(rank, world_size):
    """Each collective once on every group of TP 1 and of TP 2, on 2 nodes x 2 ranks; returns the
    ledgers' split and totals per TP degree."""
    out = {}
    for tp in (1, 2):
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=2),
                                         dp_transport="gloo")
        n = 8 * world_size
        for group in (state.world, state.tp, state.dp):
            if group.size > 1:
                comm.all_reduce(torch.ones(n), group)
                comm.all_gather_into(torch.empty(n), torch.ones(n // group.size), group)
                comm.reduce_scatter_into(torch.empty(n // group.size), torch.ones(n), group)
                comm.broadcast(torch.ones(n), group, src_index=1)
        out[tp] = state.ledger.split_totals(), state.ledger.totals()
    return out


def test_ledger_split_on_two_nodes_of_two_ranks():
    b = 32 * 4                       # 32 fp32 elements: 128 bytes per collective tensor
    ledgers = run_on_ranks(_two_nodes, 4)[0]
    # TP 1: DP = world = [0,1,2,3] on hosts 0,0,1,1. Ring all-reduce: 2 (3/4) b per rank, 2 of 4
    # hops cross. gloo all-gather / reduce-scatter send b/4 to each of 3 peers, 2 of them away
    # (2/3 of (3/4) b). gloo broadcast from index 1: b to ranks 0, 2, 3; 2 of 3 away.
    split, totals = ledgers[1]
    for group in ("dp", "world"):
        assert split[(group, "all_reduce")] == pytest.approx((1.5 * b / 2, 1.5 * b / 2))
        assert split[(group, "all_gather")] == pytest.approx((0.75 * b / 3, 0.75 * b * 2 / 3))
        assert split[(group, "reduce_scatter")] == pytest.approx((0.75 * b / 3, 0.75 * b * 2 / 3))
        assert split[(group, "broadcast")] == pytest.approx((b / 3, b * 2 / 3))
        assert totals[(group, "all_gather")] == pytest.approx(0.75 * b)   # unchanged volume
    # TP 2: TP [0,1] inside host 0 (nothing crosses), DP [0,2] over both hosts (everything does)
    split, totals = ledgers[2]
    for op, volume in (("all_reduce", b), ("all_gather", b / 2), ("reduce_scatter", b / 2),
                       ("broadcast", b)):
        assert split[("tp", op)] == pytest.approx((volume, 0.0))
        assert split[("dp", op)] == pytest.approx((0.0, volume))
        assert totals[("dp", op)] == pytest.approx(volume)


def test_dry_runs_split_the_400_gpu_traffic_by_link():
    """table5-zero-100B: DP 25 with one rank per DGX-2 node (every DP byte on InfiniBand), TP 16
    inside a node (none); table5-megatron-100B: TP 128 over 8 nodes, 8 of 128 ring hops cross."""
    from hybrid.perf.throughput import tp_ring_bytes_per_microbatch
    from pretrain.arguments import parse_args
    from pretrain.dry_run import dry_run_report, format_report
    zero = dry_run_report(parse_args(["--config", "table5-zero-100B"])[0])
    assert zero["dp_cross_host_bytes_per_step"] == zero["dp_bytes_per_step"] > 0
    assert zero["tp_cross_host_bytes_per_step"] == 0
    # ZeRO-R Pa + full recompute: 6 all-reduces a layer + Pa's all-gather, micro 32, seq 1024, h 8192
    tp_bytes = tp_ring_bytes_per_microbatch(125, 8192, 1024, 32, 16, full_recompute=True,
                                            partition_activations=True, activation_bytes=2)[0]
    assert zero["tp_bytes_per_step"] == pytest.approx(tp_bytes)
    megatron = dry_run_report(parse_args(["--config", "table5-megatron-100B"])[0])
    assert megatron["tp_cross_host_bytes_per_step"] == pytest.approx(
        megatron["tp_bytes_per_step"] * 8 / 128)
    assert "(3.13 GB across nodes)" in format_report(megatron)


@pytest.mark.parametrize("options", [[], ["--zero-hybrid-shard"]])
def test_start_up_report_gives_each_dp_group_and_op_its_bytes(options):
    """4 ranks as 2 hosts of 2, ZeRO stage 2 in bf16, ψ parameters, Ψ_b = 2ψ bytes: the start-up
    report lists per group and op the bytes the formulas expect per step, inside hosts and across
    (NCCL rings over hosts 0,0,1,1 cross at 2 of 4 hops). Plain: reduce-scatter and all-gather
    Ψ_b 3/4 each over DP; hybrid sharding: both inside the host, Ψ_b 1/2, then the all-reduce of
    the host's half Ψ_b/2, 2 (1/2) of it, all across hosts. The dry run lists the same lines."""
    from pretrain.arguments import parse_args
    from pretrain.dry_run import dry_run_report, format_report
    from pretrain.startup_report import expected_dp_report
    from tests.training_helpers import tiny_args
    cfg = parse_args(tiny_args(zero=2, precision="bf16",
                               extra=["--gpus-per-node", "2", "--world-size", "4", *options]))[0]
    state = ParallelState.dry_run(Topology(4, 1, gpus_per_node=2), rank=1)
    psi = 1000
    psi_b = 2 * psi
    if options:
        rows = [("dp_intra_host", "all_gather", psi_b / 2, 0),
                ("dp_intra_host", "reduce_scatter", psi_b / 2, 0),
                ("dp_inter_host", "all_reduce", psi_b / 2, psi_b / 2)]
    else:
        rows = [("dp", op, 0.75 * psi_b, 0.375 * psi_b) for op in ("all_gather", "reduce_scatter")]
    lines = [f"{g} {op}: {total:,.0f} B per step, {total - cross:,.0f} B inside hosts, "
             f"{cross:,.0f} B across hosts" for g, op, total, cross in rows]
    text = expected_dp_report(cfg, cfg.layout(4), state, psi)
    assert text.splitlines() == ["DP bytes per rank per step, expected (ZeRO's formulas over NCCL "
                                 "rings):", *lines]
    report = dry_run_report(cfg, rank=1)
    assert expected_dp_report(cfg, cfg.layout(4), state, report["params_per_rank"]).splitlines()[1:] == [
        line.strip() for line in format_report(report).splitlines() if line.startswith("  dp")]


def _engine_bytes_with_accumulation(rank, world_size, accum):
    from hybrid.zero import ZeroConfig, build_zero_optimizer
    from tests.zero.test_stages import GPTTask, train
    task = GPTTask()
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    rows = {}
    for stage in (0, 1, 2, 3):
        model = task.model(state)
        engine = build_zero_optimizer(model, state, ZeroConfig(
            stage=stage, bucket_size=2048, gradient_accumulation_steps=accum), task.adamw,
            **({"seed": 11} if stage == 3 else {}))
        train(task, state, engine, model, task.data(steps=1), accum)
        report = engine.comm_report()
        rows[stage] = (report.by_group_op, engine.num_local_params, engine.param_bytes)
    return rows


@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.slow), 2])   # CI budget
def test_expected_dp_bytes_count_the_micro_batches_of_stages_2_and_3(accum):
    """The expected per-step DP bytes (dry run, start-up report) against the ledger of real engines
    with gradient accumulation: stage 2 reduce-scatters in every backward, stage 3 also gathers in
    every forward and backward, stages 0-1 communicate once."""
    from hybrid.perf.links import zero_dp_collectives
    rows = run_on_ranks(_engine_bytes_with_accumulation, 2, args=(accum,))[0]
    for stage, (measured, psi, param_bytes) in rows.items():
        expected = zero_dp_collectives(psi * param_bytes, stage, [0, 1], 2, micro_batches=accum)
        assert {(g, op): pytest.approx(v, rel=0.02) for g, op, v, _ in expected} == {
            k: v for k, v in measured.items() if k[0].startswith("dp")}, (stage, accum)


def _stage3_untied_bytes(rank, world_size):
    import dataclasses
    from hybrid.zero import ZeroConfig, build_zero_optimizer
    from tests.zero.test_stages import GPTTask, train
    task = GPTTask()
    task.config = dataclasses.replace(task.config, untie_embeddings_and_output_weights=True)
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    model = task.model(state)
    engine = build_zero_optimizer(model, state, ZeroConfig(stage=3, bucket_size=2048), task.adamw,
                                  seed=11)
    train(task, state, engine, model, task.data(steps=1), 1)
    return engine.comm_report().by_group_op, engine.num_local_params, engine.param_bytes, task.config


def test_stage3_expected_gathers_leave_out_the_untied_embeddings_backward():
    """An untied word embedding is gathered in forward only (its backward reads no weight), so
    ZeRO-3 gathers less than 2Ψ per step: the start-up report and the dry run (pretrain.traffic
    with the model config) expect exactly what the ledger measures; 2Ψ would overstate it."""
    from hybrid.perf.links import zero_dp_collectives
    from pretrain.traffic import forward_only_parameters
    measured, psi, param_bytes, config = run_on_ranks(_stage3_untied_bytes, 2)[0]
    once = forward_only_parameters(config, 1)
    assert once == (config.padded_vocab_size(1) + config.max_position_embeddings) * config.hidden_size
    gathered = measured[("dp", "all_gather")]
    corrected = zero_dp_collectives(psi * param_bytes, 3, [0, 1], 2,
                                    backward_gather_bytes=(psi - once) * param_bytes)
    plain = zero_dp_collectives(psi * param_bytes, 3, [0, 1], 2)
    assert dict(((g, op), v) for g, op, v, _ in corrected)[("dp", "all_gather")] == \
        pytest.approx(gathered, rel=0.02)
    assert dict(((g, op), v) for g, op, v, _ in plain)[("dp", "all_gather")] > gathered * 1.03
