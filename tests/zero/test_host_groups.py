"""Topology-aware ZeRO (hybrid.zero.host_groups): hybrid sharding (FSDP2 HSDP, MiCS) for stages 1-3
and ZeRO++ hpZ for stage 3, on 4 gloo ranks laid out as 2 hosts x 2 (``gpus_per_node=2``).

Both are exact algorithms: fp32 losses and final parameters equal plain ZeRO's (rtol 1e-5), with
TP and sequence parallelism too. The ledger's cross-host bytes per step match the formulas of
hybrid.zero.host_groups (n DP ranks, h per host, k hosts, Ψ_b the padded 16-bit unit bytes):
plain stage 3 3Ψ_b(n-h)/n, hpZ 2Ψ_b(n-h)/n, hybrid sharding 2Ψ_b(k-1)/n; stages 1-2 2Ψ_b(n-h)/n
plainly and 2Ψ_b(k-1)/n hybrid. A checkpoint saved with an option loads without it and the other
way round, with TP 1 and TP 2, and the next step's loss is the one the saving run computes.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.checkpoint.state import load_state, save_state
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology, TopologyError
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.model import GPTModel
from models.gpt.sharding import canonical_init, shard_tensor
from tests.zero.test_stage3 import ADAMW, CONFIG, SEED, data, train_step

WORLD, PER_HOST, STEPS = 4, 2, 3   # STEPS: the checkpoint case's; parity runs TRAIN_STEPS
TRAIN_STEPS = 2
VARIANTS3 = {"plain": {}, "hpz": {"hpz": True}, "hsdp": {"hybrid_shard": True}}


def build(state: ParallelState, stage: int, sequence_parallel: bool = False, **options):
    """GPT + ZeRO engine of ``stage`` from the canonical init (meta-built for stage 3)."""
    zcfg = ZeroConfig(stage=stage, **options)
    if stage == 3:
        model = GPTModel(CONFIG, state, device="meta", sequence_parallel=sequence_parallel)

        def init_fn(name: str) -> torch.Tensor:
            return shard_tensor(CONFIG, name, canonical_init(CONFIG, name, SEED), state.tp_rank,
                                state.tp_size)
        return model, build_zero_optimizer(model, state, zcfg, AdamWConfig(**ADAMW), init_fn=init_fn)
    model = GPTModel(CONFIG, state, sequence_parallel=sequence_parallel)
    model.init_weights(SEED)
    return model, build_zero_optimizer(model, state, zcfg, AdamWConfig(**ADAMW))


def params_of(model, opt) -> dict:
    full = opt.gathered_state_dict() if hasattr(opt, "gathered_state_dict") else {
        n: p.detach().clone() for n, p in model.named_parameters()}
    return {k: v.float().numpy() for k, v in full.items()}


def dp_records(opt) -> list:
    return [r for r in opt._last_step_records if r.group.startswith("dp")]


def unit_bytes(opt) -> float:
    """Ψ_b: padded 16-bit bytes of what the engine partitions (stage 3 units / stage 1-2 buckets)."""
    if hasattr(opt, "all_units"):
        return sum(u.padded for u in opt.all_units) * opt.param_bytes
    return opt.layout.numel * opt.param_bytes


def run_variant(state: ParallelState, stage: int, sp: bool = False, accum: int = 1,
                **options) -> dict:
    model, opt = build(state, stage, sequence_parallel=sp, gradient_accumulation_steps=accum,
                       **options)
    tokens, labels = data(steps=TRAIN_STEPS)
    losses = []
    for i in range(TRAIN_STEPS):
        losses.append(train_step(model, opt, state, tokens[i], labels[i], accum)[0])
        opt.zero_grad()
    records = dp_records(opt)
    report = opt.memory_report()
    return {"losses": losses, "params": params_of(model, opt), "psi_b": unit_bytes(opt),
            "cross": sum(r.cross_host_bytes for r in records),
            "total": sum(r.bytes_per_rank for r in records),
            "groups": sorted({(r.group, r.op) for r in records}),
            "measured": report.measured, "formula": report.formula,
            "overhead": opt.expected_overhead_bytes() if stage == 3 else {}}


def checkpoint_case(state: ParallelState, directory: str, save_options: dict, load_options: dict,
                    stage: int = 3):
    """Train 2 steps with ``save_options``, save; a fresh engine with ``load_options`` loads it.
    Returns the third step's loss of both."""
    tokens, labels = data(steps=STEPS)
    model, opt = build(state, stage, **save_options)
    for i in range(2):
        train_step(model, opt, state, tokens[i], labels[i], 1)
        opt.zero_grad()
    save_state(directory, 2, opt, model.checkpoint_layout(), state, extra={}, metadata={},
               keep_last=1)
    saver = train_step(model, opt, state, tokens[2], labels[2], 1)[0]
    model2, opt2 = build(state, stage, **load_options)
    load_state(directory, opt2, model2.checkpoint_layout(), state)
    loader = train_step(model2, opt2, state, tokens[2], labels[2], 1)[0]
    return saver, loader


def hosts_state(world: int, tp: int = 1) -> ParallelState:
    # gloo, not shared memory: on this one machine the whole DP group could map it, on real hosts not
    return ParallelState.initialize(Topology(world, tp, gpus_per_node=PER_HOST), dp_transport="gloo")


def _rank_core(rank: int, world: int) -> dict:
    hosts = hosts_state(world)
    out = {"groups": (hosts.dp_intra_host_group.ranks, hosts.dp_inter_host_group.ranks)}
    for name, options in VARIANTS3.items():
        out[("stage3", name)] = run_variant(hosts, 3, **options)
    return out


def _rank_more(rank: int, world: int, tmp: str) -> dict:
    hosts, out = hosts_state(world), {}
    for stage in (1, 2):
        out[(f"stage{stage}", "plain")] = run_variant(hosts, stage)
        out[(f"stage{stage}", "hsdp")] = run_variant(hosts, stage, hybrid_shard=True)
    for name, options in VARIANTS3.items():   # hpZ: later micro-batches gather inside the host
        out[("accum2", name)] = run_variant(hosts, 3, accum=2, **options)
    tp2 = hosts_state(world, tp=2)
    for name, options in VARIANTS3.items():
        out[("tp2sp", name)] = run_variant(tp2, 3, sp=True, **options)
    out["ckpt"] = {
        "hsdp->plain": checkpoint_case(hosts, f"{tmp}/a", {"hybrid_shard": True}, {}),
        "plain->hsdp": checkpoint_case(hosts, f"{tmp}/b", {}, {"hybrid_shard": True}),
        "hpz->plain": checkpoint_case(hosts, f"{tmp}/c", {"hpz": True}, {}),
        "plain->hpz": checkpoint_case(hosts, f"{tmp}/d", {}, {"hpz": True}),
        "stage2 hsdp->plain": checkpoint_case(hosts, f"{tmp}/e", {"hybrid_shard": True}, {}, 2),
        "stage1 plain->hsdp": checkpoint_case(hosts, f"{tmp}/f", {}, {"hybrid_shard": True}, 1),
        # TP 2 inside each host, DP 2 across: every rank's TP shard through each option and back
        "tp2 hpz->plain": checkpoint_case(tp2, f"{tmp}/g", {"hpz": True}, {}),
        "tp2 plain->hpz": checkpoint_case(tp2, f"{tmp}/h", {}, {"hpz": True}),
        "tp2 hsdp->plain": checkpoint_case(tp2, f"{tmp}/i", {"hybrid_shard": True}, {}),
        "tp2 plain->hsdp": checkpoint_case(tp2, f"{tmp}/j", {}, {"hybrid_shard": True})}
    return out


@pytest.fixture(scope="module")
def core():
    """Stage 3 plain / hpZ / hybrid sharding on 2 hosts x 2 (the default suite's multi-rank run)."""
    return run_on_ranks(_rank_core, WORLD, timeout=600)


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    """Stages 1-2, TP 2 + sequence parallel, checkpoints (slow suite)."""
    return run_on_ranks(_rank_more, WORLD, args=(str(tmp_path_factory.mktemp("hostgroups")),),
                        timeout=900)


def _same(a: dict, b: dict, what) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-7), what
    for k in b["params"]:
        torch.testing.assert_close(torch.from_numpy(a["params"][k]),
                                   torch.from_numpy(b["params"][k]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {k}: {m}")


# ---- pure: the host split of the topology ------------------------------------------------------
def test_topology_lists_host_groups():
    intra, inter = Topology(8, 1, gpus_per_node=2).dp_host_groups()
    assert intra == [[0, 1], [2, 3], [4, 5], [6, 7]] and inter == [[0, 2, 4, 6], [1, 3, 5, 7]]
    intra, inter = Topology(8, 2, gpus_per_node=4).dp_host_groups()   # DP [0,2,4,6], [1,3,5,7]
    assert intra == [[0, 2], [4, 6], [1, 3], [5, 7]] and inter == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_dry_run_of_400_ranks_has_host_groups():
    topology = Topology(400, 4, gpus_per_node=16)
    state = ParallelState.dry_run(topology, rank=37)   # node 2, TP rank 1, DP rank 9
    assert state.dp_intra_host_group.ranks == [33, 37, 41, 45]
    inter = state.dp_inter_host_group.ranks
    assert len(inter) == 25 and inter == [37 % 16 + 16 * node for node in range(25)]
    assert topology.dp_ranks_per_host == 4
    intra, inter_all = topology.dp_host_groups()
    assert len(intra) == 100 and len(inter_all) == 16
    assert sorted(r for g in intra for r in g) == list(range(400))


def test_unequal_hosts_are_refused():
    topology = Topology(12, 1, gpus_per_node=4, pipeline_parallel_size=2)   # stage = 1.5 hosts
    with pytest.raises(TopologyError, match="same number on every host"):
        topology.dp_host_groups()
    state = ParallelState.dry_run(topology)
    assert state.dp_intra_host_group is None
    with pytest.raises(ValueError, match="--zero-hpz splits every DP group by host"):
        state.require_host_groups("--zero-hpz")


def test_dry_run_of_the_options():
    """8 ranks as 2 hosts of 4, TP 2: DP n = 4, h = 2, k = 2; NCCL rings (a DP ring crosses at k of
    its n hops): plain stage 3 3Ψ(n-1)/n k/n, hpZ 2Ψ(n-1)/n k/n, hybrid sharding 2(Ψ/h)(k-1)/k."""
    from pretrain.arguments import parse_args
    from pretrain.dry_run import dry_run_report, format_report
    base = ["--config", "tiny-cpu", "--world-size", "8", "--gpus-per-node", "4", "--zero-stage", "3",
            "--bf16", "--dry-run"]
    plain, hpz, hsdp = (dry_run_report(parse_args(base + extra)[0]) for extra in
                        ([], ["--zero-hpz"], ["--zero-hybrid-shard"]))
    psi_b, n, h, k = 2 * plain["params_per_rank"], 4, 2, 2
    assert plain["dp_cross_host_bytes_per_step"] == pytest.approx(3 * psi_b * (n - 1) / n * k / n)
    assert hpz["dp_cross_host_bytes_per_step"] == pytest.approx(2 * psi_b * (n - 1) / n * k / n)
    assert hsdp["dp_cross_host_bytes_per_step"] == pytest.approx(2 * psi_b / h * (k - 1) / k)
    assert hpz["dp_bytes_per_step"] == pytest.approx(2 * psi_b * (n - 1) / n + psi_b * (h - 1) / h)
    secondary = hpz["model_states_per_rank"]["params_16bit_secondary"]
    assert secondary == pytest.approx(psi_b / h)                                   # 2Ψ/h in bf16
    assert hpz["model_states_per_rank"]["total"] == pytest.approx(
        plain["model_states_per_rank"]["total"] + secondary)
    assert hsdp["model_states_per_rank"]["total"] == pytest.approx(
        plain["model_states_per_rank"]["total"] * n / h)                           # /h, not /n
    assert "hpZ secondary params" in format_report(hpz)


@pytest.mark.parametrize("stage, extra", [
    (3, ["--zero-quantized-weights"]), (3, ["--zero-quantized-gradients"]),
    (3, ["--zero-quantized-weights", "--zero-quantized-gradients", "--zero-hpz"]),
    (2, ["--zero-quantized-gradients"])])
def test_dry_run_of_the_quantized_options(stage, extra):
    """The layout above with qwZ / qgZ: q = 1 + 4/256 bytes per element (int8 and an fp32 scale a
    block of 256). qwZ: the all-gathers from the primary partition carry ψq instead of Ψ_b = 2ψ
    (hpZ's secondary one stays bf16); qgZ: the reduce-scatter becomes an all-to-all inside the host,
    ψq(h-1)/h, and one across hosts on the host's partial sum, ψq(k-1)/(k h), all of it crossing.
    Stage 3 also equals hybrid.perf.zeropp's model of the same options."""
    from hybrid.perf.zeropp import ZeroOptions, dp_traffic
    from pretrain.arguments import parse_args
    from pretrain.dry_run import dry_run_report, format_report
    base = ["--config", "tiny-cpu", "--world-size", "8", "--gpus-per-node", "4", "--zero-stage",
            str(stage), "--bf16", "--dry-run"]
    plain, quant = (dry_run_report(parse_args(base + e)[0]) for e in ([], extra))
    psi = plain["params_per_rank"]
    psi_b, q, n, h, k = 2 * psi, 1 + 4 / 256, 4, 2, 2
    qwz, qgz, hpz = ("--zero-quantized-weights" in extra, "--zero-quantized-gradients" in extra,
                     "--zero-hpz" in extra)
    ring = (n - 1) / n                      # a ring's volume per rank; k of its n hops cross
    gather = psi * q if qwz else psi_b
    gathers = [(gather * ring, gather * ring * k / n)]
    if stage == 3:
        gathers.append((psi_b * (h - 1) / h, 0.0) if hpz else gathers[0])
    reduce = ([(psi * q * (h - 1) / h, 0.0), (psi * q * (k - 1) / (k * h),) * 2] if qgz
              else [(psi_b * ring, psi_b * ring * k / n)])
    total, cross = (sum(c[i] for c in gathers + reduce) for i in (0, 1))
    assert quant["dp_bytes_per_step"] == pytest.approx(total)
    assert quant["dp_cross_host_bytes_per_step"] == pytest.approx(cross)
    if stage == 3:
        model = dp_traffic(psi, n, h, ZeroOptions(hpz=hpz, quantized_weights=qwz,
                                                  quantized_gradients=qgz))
        assert quant["dp_bytes_per_step"] == pytest.approx(model.intra_node + model.cross_node)
        assert quant["dp_cross_host_bytes_per_step"] == pytest.approx(model.cross_node)
    # int8 gathers cross with q/2 of bf16's bytes; qgZ's reduce-scatter with q/(2 h (n-1)/n) of
    # them (only the host's partial sum leaves it): every option takes bytes off the links
    assert quant["dp_cross_host_bytes_per_step"] < plain["dp_cross_host_bytes_per_step"]
    if qwz:
        assert quant["dp_cross_host_bytes_per_step"] < 0.7 * plain["dp_cross_host_bytes_per_step"]
    text = format_report(quant)
    assert all(name in text for name, on in (("qwZ", qwz), ("qgZ", qgz)) if on)


# ---- option errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(stage=0, hybrid_shard=True), "stage 0 partitions nothing"),
    (dict(stage=2, hpz=True), "ZeRO stage 2 does not partition parameters"),
    (dict(stage=3, hpz=True, hybrid_shard=True), "choose one")])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def test_single_host_is_refused():
    state = ParallelState.dry_run(Topology(4, 1, gpus_per_node=4))
    from hybrid.zero.host_groups import partition_groups
    with pytest.raises(ValueError, match="all on one host.*drop the flag"):
        partition_groups(state, ZeroConfig(stage=1, hybrid_shard=True))


def test_trainer_flags_are_checked():
    from pretrain.config import TrainConfigError
    from pretrain.sections import ParallelSection
    with pytest.raises(TrainConfigError, match="use --zero-stage 3"):
        ParallelSection(zero_stage=1, zero_hpz=True)
    assert ParallelSection(zero_stage=3, zero_hpz=True).zero_config_options()["hpz"]


# ---- multi-rank: groups, parity, ledger, memory, checkpoints ------------------------------------
def test_parallel_state_groups(core):
    for rank, out in enumerate(core):
        intra, inter = out["groups"]
        assert intra == [2 * (rank // 2), 2 * (rank // 2) + 1] and inter == [rank % 2, rank % 2 + 2]


def test_stage3_options_equal_plain(core):
    for rank, out in enumerate(core):
        for name in ("hpz", "hsdp"):
            _same(out[("stage3", name)], out[("stage3", "plain")], (rank, name))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2sp", "accum2"])
def test_stage3_options_equal_plain_with_tp_sp_and_accumulation(more, layout):
    for rank, out in enumerate(more):
        for name in ("hpz", "hsdp"):
            _same(out[(layout, name)], out[(layout, "plain")], (rank, layout, name))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_hybrid_shard_stage_1_2_equals_plain(more, stage):
    for rank, out in enumerate(more):
        _same(out[(f"stage{stage}", "hsdp")], out[(f"stage{stage}", "plain")], (rank, stage))


def test_stage3_cross_host_bytes_match_formulas(core):
    n, h, k = WORLD, PER_HOST, WORLD // PER_HOST
    for rank, out in enumerate(core):
        plain, hpz, hsdp = (out[("stage3", v)] for v in ("plain", "hpz", "hsdp"))
        assert plain["total"] == pytest.approx(3 * plain["psi_b"] * (n - 1) / n)
        assert plain["cross"] == pytest.approx(3 * plain["psi_b"] * (n - h) / n)
        assert hpz["cross"] == pytest.approx(2 * hpz["psi_b"] * (n - h) / n)
        assert hpz["total"] == pytest.approx(2 * hpz["psi_b"] * (n - 1) / n + hpz["psi_b"] * (h - 1) / h)
        assert hsdp["cross"] == pytest.approx(2 * hsdp["psi_b"] * (k - 1) / n)
        assert ("dp_inter_host", "all_reduce") in hsdp["groups"] and ("dp", "all_gather") not in hsdp["groups"]
        assert hsdp["cross"] < hpz["cross"] < plain["cross"]


@pytest.mark.slow
def test_stage_1_2_cross_host_bytes_match_formulas(more):
    n, h, k = WORLD, PER_HOST, WORLD // PER_HOST
    for rank, out in enumerate(more):
        for stage in (1, 2):
            p, s = out[(f"stage{stage}", "plain")], out[(f"stage{stage}", "hsdp")]
            assert p["cross"] == pytest.approx(2 * p["psi_b"] * (n - h) / n)
            assert s["cross"] == pytest.approx(2 * s["psi_b"] * (k - 1) / n)


def test_memory_reports(core):
    for rank, out in enumerate(core):
        plain, hpz, hsdp = (out[("stage3", v)] for v in ("plain", "hpz", "hsdp"))
        psi = sum(v.size for v in plain["params"].values())
        assert hpz["formula"]["param16_secondary"] == pytest.approx(4 * psi / PER_HOST)   # fp32
        assert hpz["measured"]["param16_secondary"] == pytest.approx(
            hpz["formula"]["param16_secondary"] + hpz["overhead"]["secondary_padding"])
        assert plain["measured"]["param16_secondary"] == 0
        assert hsdp["formula"]["master32"] == 0 and hsdp["formula"]["param16"] == pytest.approx(
            4 * psi / PER_HOST)                      # partitioned over the host's 2, not DP 4
        assert sum(hsdp["measured"][c] for c in ("param16", "grad16", "master32", "adam_moments")) \
            == pytest.approx(sum(hsdp["formula"].values()) + sum(hsdp["overhead"].values()))


@pytest.mark.slow
def test_checkpoints_load_with_and_without_the_options(more):
    for rank, out in enumerate(more):
        for case, (saver, loader) in out["ckpt"].items():
            assert loader == pytest.approx(saver, rel=1e-6), (rank, case)
