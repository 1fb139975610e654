"""``pretrain_gpt.py --dry-run``: check a config at its full GPU count on one CPU machine.

No process group and no communication (torchtitan-style dry run): the pure :class:`Topology` lays
out every rank, :meth:`ParallelState.dry_run` gives one rank's groups, the real tensor-parallel GPT is
built on the meta device (shapes only) to count that rank's parameters, and the pure models of
:mod:`hybrid.perf` give model-state bytes per rank (ZeRO §5), DP traffic per step (ZeRO §7) and
FLOPs per iteration (Megatron's formula, docs/design.md §Paper), plus the activation estimate of
:func:`hybrid.perf.memory.device_memory` for ``--recompute``. DP and TP traffic are split into the
bytes that stay inside a node and those that cross nodes (:mod:`hybrid.perf.links`, NCCL rings
in rank order over the rank's groups). With ``--zero-hybrid-shard`` model states are partitioned over
the DP ranks of a host and the DP traffic is split by host; with ``--zero-hpz`` the secondary
partition (2Ψ/h in bf16) is a model-state row of its own (:mod:`hybrid.zero.host_groups`). With
``--zero-quantized-weights`` (qwZ) the all-gathers from the primary partition and with
``--zero-quantized-gradients`` (qgZ) the reduce-scatter's two all-to-alls (inside the host, then
across hosts) carry int8 blocks with an fp32 scale each. The DP bytes are listed per group and op
(:mod:`pretrain.traffic`: the start-up report's formulas too).

With pipeline parallelism the rank holds its stage's model chunks only (their parameters are counted
from the meta-built chunks), the activations of the micro-batches its schedule keeps in flight
(1F1B: p - stage, GPipe: m, interleaved: the schedule's chunk count / v; hybrid.pipeline.schedules)
through its L / p layers, and the logits on the last stage only; its point-to-point bytes are the
activations and gradients it sends per step. ZeRO stage 2 with PP is counted as stage 1, which the
engine runs instead (:func:`hybrid.zero_policy.stage_with_pipeline`).

Context parallelism (issue 31, ``--context-parallel-size C --cp-comm-type``): each rank holds
``s / C`` tokens of every sample, so its activations, logits and TP/PP messages are those of
``s / C`` tokens, model states are partitioned (and gradients reduced) over DP x CP, and the CP
group's attention traffic per step is :func:`hybrid.perf.context_parallel.cp_bytes_per_step` (the
ring's K/V blocks, or a2a's four all-to-alls each way). The activation estimate counts the attention
core that runs on the GPUs a dry run describes: SDPA's fused kernels keep no [s, s] scores, only an
fp32 log-sum-exp per query row (:func:`hybrid.perf.activations.attention_core_bytes`, ``"flash"``).

ZeRO-Infinity §3-§4 (:mod:`hybrid.perf.infinity`, issue 35): the working memory (the largest
parameter gathered whole with its gradient; one recomputed layer's activations) and, for what the
run offloads, the bandwidth per GPU the step needs for --offload-target-efficiency at --peak-tflops
against the declared --host-offload-bandwidth / --nvme-offload-bandwidth.
"""

from __future__ import annotations

from hybrid.parallel_state import ParallelState
from hybrid.perf import infinity
from hybrid.perf.context_parallel import cp_bytes_per_step
from hybrid.perf.hardware import DGX2_PARAM_GATHER_BANDWIDTH
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.links import cross_host_fraction, describe_collectives, nodes_of
from hybrid.perf.memory import device_memory
from hybrid.perf.model_states import (model_state_bytes, moe_model_state_bytes,
                                      optimizer_bytes_per_param)
from hybrid.perf.throughput import tp_ring_bytes_per_microbatch
from hybrid.topology import Topology
from hybrid.zero_policy import stage_with_pipeline
from models.gpt.presets import GPT2_VOCAB_SIZE
from pretrain.config import TrainConfig, TrainConfigError
from pretrain.traffic import expected_dp_collectives

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GPU_ATTENTION_CORE = "flash"   # SDPA on CUDA: flash / memory-efficient kernels (models/gpt/layer.py)


def dry_run_report(cfg: TrainConfig, rank: int = 0) -> dict:
    """Everything --dry-run prints, as numbers (also used by tests)."""
    from pretrain.build import gpt_config
    from models.gpt.model import GPTModel
    world = cfg.parallel.world_size
    if world is None:
        raise TrainConfigError("--dry-run needs the GPU count the config is meant for; set "
                               "--world-size (presets in pretrain/presets/ set it)")
    layout = cfg.validate_for_world(world)
    p, m, o = cfg.parallel, cfg.model, cfg.optimizer
    cp = getattr(layout, "context_parallel", getattr(p, "context_parallel_size", 1))
    cp_comm = getattr(p, "cp_comm_type", "p2p")
    topology = Topology(world, layout.tensor_parallel, gpus_per_node=p.gpus_per_node,
                        allow_tp_across_nodes=p.allow_tp_across_nodes,
                        pipeline_parallel_size=layout.pipeline_parallel,
                        expert_model_parallel_size=p.expert_model_parallel_size,
                        **({"cp": cp} if cp > 1 else {}))
    state = ParallelState.dry_run(topology, rank)
    gcfg = gpt_config(cfg, m.vocab_size or GPT2_VOCAB_SIZE)
    gcfg.validate_for_tp(state.tp_size)
    pcfg = cfg.pipeline_config(layout)
    stage_layers = m.num_layers // state.pp_size
    if pcfg is None:
        chunks = [GPTModel(gcfg, state, sequence_parallel=p.sequence_parallel, device="meta")]
    else:
        chunks = [GPTModel(gcfg, state, sequence_parallel=p.sequence_parallel, device="meta",
                           layers=pcfg.layer_range(state.pp_rank, c),
                           pre_process=pcfg.is_first(state.pp_rank, c),
                           post_process=pcfg.is_last(state.pp_rank, c))
                  for c in range(pcfg.num_model_chunks)]
    psi_rank = sum(t.numel() for chunk in chunks for t in chunk.parameters())
    param_bytes = _BYTES[o.precision]
    mixed = o.precision != "fp32"
    shard, intra, inter = _host_split(cfg, state)
    zero_stage = stage_with_pipeline(p.zero_stage, state.pp_size)   # the engine's stage
    # K = master + exp_avg + exp_avg_sq bytes: 4 + 4 + 4 (the paper's 12), 4 + 2 + 2 with bf16
    # moments (--exp-avg-dtype / --exp-avg-sq-dtype); no master in plain fp32 training
    k_terms = ([4] if mixed else [0]) + [_BYTES[o.exp_avg_dtype], _BYTES[o.exp_avg_sq_dtype]]
    k = optimizer_bytes_per_param(master="fp32" if mixed else None, exp_avg=o.exp_avg_dtype,
                                  exp_avg_sq=o.exp_avg_sq_dtype)
    state_bytes = dict(param_bytes=param_bytes, grad_bytes=param_bytes, optimizer_bytes_per_param=k,
                       master_bytes_per_param=4 if mixed else 0)
    states = model_state_bytes(float(psi_rank), zero_stage, shard.size, **state_bytes).as_dict()
    # issue 32: expert parameters (this EP rank's) are partitioned over expert-DP = DP / EP
    expert_rank = sum(t.numel() for chunk in chunks for t in chunk.parameters()
                      if getattr(t, "expert_parallel", False))
    ep = getattr(state, "ep_size", 1)
    split = None
    if expert_rank and ep > 1:
        split = moe_model_state_bytes(float(psi_rank - expert_rank), float(expert_rank * ep),
                                      zero_stage, shard.size, ep, **state_bytes)
        states = split.total.as_dict()
    if p.zero_hpz:
        states["params_16bit_secondary"] = param_bytes * psi_rank / intra.size
        states["total"] += states["params_16bit_secondary"]
    dp = state.dp_size
    dp_ops = expected_dp_collectives(p, state, float(psi_rank), param_bytes, topology.gpus_per_node,
                                     micro_batches=layout.micro_batches, model=gcfg)
    comm_bytes, dp_cross = sum(c[2] for c in dp_ops), sum(c[3] for c in dp_ops)
    arch = dict(heads=gcfg.num_attention_heads, arch=gcfg.perf_architecture())   # GQA, SwiGLU, ...
    flops = model_flops_per_iteration(layout.global_batch, m.seq_length, m.num_layers, m.hidden_size,
                                      gcfg.padded_vocab_size(state.tp_size), **arch)
    mode = cfg.training.recompute
    if mode == "auto":   # the planner's per-layer plan, estimated for a GPU rank
        mode = _auto_plan_mode(cfg, gcfg, state, pcfg)
    estimate = device_memory(layers=stage_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                             seq=m.seq_length, vocab=gcfg.vocab_size,
                             micro_batch=cfg.data.micro_batch_size,
                             tp=state.tp_size, dp=dp, stage=zero_stage,
                             attention_core=GPU_ATTENTION_CORE,
                             attention_dropout=gcfg.attention_dropout > 0, cp=cp,
                             cp_comm_type=cp_comm,
                             recompute="full" if mode.startswith("full") else mode,
                             sequence_parallel=p.sequence_parallel,
                             partition_activations=mode.startswith("full-pa"),
                             cpu_offload=mode == "full-pa-cpu",
                             bucket_elements=p.zero_bucket_size if zero_stage else None,
                             arch=arch["arch"])
    flight = _micro_batches_held(pcfg, state.pp_rank)
    full = mode.startswith("full")
    activations = (estimate.checkpoints * flight + estimate.working * (1 if full else flight)
                   + (estimate.logits if state.is_last_stage else 0.0))
    local_seq = m.seq_length // cp   # the tokens of this CP rank
    pp_bytes = _pp_bytes_sent(pcfg, state.pp_rank, cfg.data.micro_batch_size * local_seq
                              * m.hidden_size * param_bytes
                              / (state.tp_size if p.sequence_parallel else 1))
    tp_bytes = layout.micro_batches * tp_ring_bytes_per_microbatch(
        stage_layers, m.hidden_size, local_seq, cfg.data.micro_batch_size, state.tp_size,
        full_recompute=mode.startswith("full"), partition_activations=mode.startswith("full-pa"),
        activation_bytes=param_bytes)[0]
    cp_bytes = cp_bytes_per_step(
        layers=stage_layers, micro_batches=layout.micro_batches, recompute=mode,
        comm_type=cp_comm, cp=cp, micro_batch=cfg.data.micro_batch_size, seq=m.seq_length,
        hidden=m.hidden_size, heads=m.num_attention_heads, query_groups=gcfg.query_groups,
        tp=state.tp_size, bytes_per_element=param_bytes)
    cp_group = state.cp.ranks if cp > 1 else [rank]
    return {"topology": topology.describe(), "rank": rank, "tp_rank": state.tp_rank,
            "dp_rank": state.dp_rank, "tp_group": state.tp.ranks, "dp_group": state.dp.ranks,
            "cp_size": cp, "cp_comm_type": cp_comm, "cp_rank": cp_group.index(rank),
            "cp_group": cp_group, "local_seq": local_seq, "cp_bytes_per_step": cp_bytes,
            "cp_cross_host_bytes_per_step": cp_bytes * _cp_cross(cp_group, cp_comm, topology),
            "pp_rank": state.pp_rank, "pp_group": state.pp.ranks, "pipeline": pcfg,
            "micro_batches_held": flight, "pp_bytes_per_step": pp_bytes,
            "pp_cross_host_bytes_per_step": pp_bytes * _p2p_cross(state.pp.ranks, state.pp_rank, topology,
                                                                  pcfg is not None
                                                                  and pcfg.num_model_chunks > 1),
            "tp_crosses_nodes": topology.tp_crosses_nodes,
            "params_total": gcfg.num_parameters(state.tp_size), "params_per_rank": psi_rank,
            "params_active": gcfg.num_active_parameters(state.tp_size),   # MoE: k of E experts
            "model_states_per_rank": states, "dp_bytes_per_step": comm_bytes,
            "model_states_split": (None if split is None else
                                   {"dense": (psi_rank - expert_rank, split.dense.total, shard.size),
                                    "expert": (expert_rank, split.expert.total, shard.size // ep)}),
            "optimizer_bytes_per_param": k, "optimizer_bytes_terms": k_terms,
            "moment_dtypes": (o.exp_avg_dtype, o.exp_avg_sq_dtype),
            "dp_cross_host_bytes_per_step": dp_cross, "dp_collectives": dp_ops,
            "dp_quantized": _quantized_names(p),
            "tp_bytes_per_step": tp_bytes,
            "tp_cross_host_bytes_per_step": tp_bytes * _ring_cross(state.tp.ranks, topology),
            "offload_optimizer": p.offload_optimizer,
            "offloaded_per_rank": (states["master_fp32"] + states["adam_moments"]
                                   if p.offload_optimizer != "none" else 0.0),
            "recompute": mode, "activations_per_rank": activations,
            "buffers_per_rank": estimate.buffers, "reserved_per_rank": estimate.reserved,
            "global_batch": layout.global_batch, "accumulation_steps": layout.micro_batches,
            "batch_ramp": _batch_ramp(cfg),
            "precision": o.precision,
            **_working_memory(chunks, param_bytes, estimate.working, p.tile_factor),
            "offload_needs": _offload_needs(cfg, mode, dp if zero_stage else 1, shard.size),
            "offload_target": p.offload_target_efficiency,
            "flops_per_iteration": flops, "flops_per_rank": flops / world,
            "peak_tflops": cfg.logging.peak_tflops,
            "moe": _moe_report(cfg, gcfg, state, chunks, layout, param_bytes, mode)}


def _moe_report(cfg, gcfg, state, chunks, layout, param_bytes: int, mode: str) -> dict | None:
    """Expert parallelism on this rank (issue 32): its EP and expert-DP groups, its experts'
    parameters and bytes, and the token dispatch's bytes per step (hybrid.perf.moe_comm's
    even-routing estimate for the tokens this rank routes, its CP share of each micro-batch, x the
    stage's MoE layers x micro-batches; a full recompute repeats the forward's). None for a dense
    model."""
    if gcfg.num_experts is None:
        return None
    from hybrid.perf.moe_comm import dispatch_bytes
    experts = sum(t.numel() for chunk in chunks for t in chunk.parameters()
                  if getattr(t, "expert_parallel", False))
    layers = sum(len(chunk.moe_layers()) for chunk in chunks)
    tokens = cfg.data.micro_batch_size * gcfg.seq_length // cfg.parallel.context_parallel_size
    per_layer = dispatch_bytes(gcfg.moe_token_dispatcher_type, tokens, gcfg.moe_router_topk,
                               gcfg.hidden_size, state.ep_size, gcfg.num_experts, param_bytes)
    forwards = 2 if mode.startswith("full") else 1
    step = layers * layout.micro_batches * (per_layer.total
                                            + (forwards - 1) * (per_layer.forward + per_layer.metadata))
    return {"ep": state.ep_size, "ep_group": state.ep.ranks, "expert_dp_group": state.expert_dp.ranks,
            "local_experts": gcfg.num_experts // state.ep_size, "moe_layers": layers,
            "expert_params_per_rank": experts, "expert_param_bytes_per_rank": experts * param_bytes,
            "dispatcher": gcfg.moe_token_dispatcher_type, "a2a_bytes_per_step": step}


def _batch_ramp(cfg) -> str:
    """'batch 16 from sample 0, 320 from sample 1171875, ...' for a batch ramp, else ''."""
    ramp = cfg.batch_schedule()
    if ramp is None:
        return ""
    return ", ".join(f"{batch} from sample {first}" for first, batch in ramp.entries)


def _working_memory(chunks, param_bytes: int, activation_working: float,
                    tile_factor: int = 1) -> dict:
    """ZeRO-Infinity §3's working memory of this rank: the largest parameter (its TP shard) gathered
    whole with its gradient in the run's precision, and one layer's recompute activations (the
    memory model's working term). Issue 35's --tile-factor passes ``tile_factor``: a linear's weight
    is then gathered a tile at a time (hybrid.perf.infinity.largest_gather)."""
    from hybrid.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelOutput
    tileable = set()
    for chunk in chunks:
        for module in chunk.modules():
            if (isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                    and not isinstance(module, VocabParallelOutput)):
                tileable.update(id(t) for t in module.parameters(recurse=False))
    sizes = [(name, t.numel(), id(t) in tileable) for chunk in chunks
             for name, t in chunk.named_parameters()]
    name, elements = infinity.largest_gather(sizes, tile_factor)
    return {"largest_gather": (name, elements), "tile_factor": tile_factor,
            "working_memory_per_rank": infinity.working_memory_bytes(
                elements, bytes_per_element=2 * param_bytes),
            "activation_working_per_rank": activation_working}


def _offload_needs(cfg: TrainConfig, mode: str, dp: int, shard: int) -> list:
    """ZeRO-Infinity §4 for what this run offloads: the bandwidth per GPU each kind of offloaded
    data needs for --offload-target-efficiency at --peak-tflops, against the declared host
    (--host-offload-bandwidth) or NVMe (--nvme-offload-bandwidth) bandwidth. Optimizer states are
    the rank's 1/shard partition; parameters offloaded to NVMe are read 1/dp per rank and
    all-gathered (bandwidth-centric partitioning, capped by the GPU-to-GPU 70 GB/s of a DGX-2);
    Pa+cpu checkpoints go to host memory (one per layer, ci 1)."""
    p, m = cfg.parallel, cfg.model
    if cfg.logging.peak_tflops is None:
        return []
    link = {"cpu": p.host_offload_bandwidth * 1e9, "nvme": p.nvme_offload_bandwidth * 1e9}
    params = (infinity.partitioned_param_bandwidth(link["nvme"], dp, DGX2_PARAM_GATHER_BANDWIDTH)
              if p.offload_params == "nvme" else None)
    return infinity.offload_needs(
        micro_batch=cfg.data.micro_batch_size, hidden=m.hidden_size, dp=shard,
        seq=m.seq_length // getattr(p, "context_parallel_size", 1),   # this CP rank's tokens
        peak_flops=cfg.logging.peak_tflops * 1e12, target=p.offload_target_efficiency,
        optimizer_bandwidth=link.get(p.offload_optimizer), param_bandwidth=params,
        checkpoint_bandwidth=link["cpu"] if mode == "full-pa-cpu" else None)


_KIND_NAMES = {"params_grads": "parameters and gradients",
               "optimizer_states": "optimizer states", "activation_checkpoints": "activation checkpoints"}


def _working_lines(r: dict) -> list[str]:
    name, elements = r["largest_gather"]
    lines = [f"working memory per rank (ZeRO-Infinity §3): largest gathered parameter {name} "
             f"({elements:,.0f} elements) with its gradient {_bytes(r['working_memory_per_rank'])}"
             + (f" (tile factor {r['tile_factor']})" if r["tile_factor"] > 1 else "")
             + (f"; activation working memory (one layer's recompute) "
                f"{_bytes(r['activation_working_per_rank'])}" if r["recompute"].startswith("full")
                else "; no recompute: every layer's activations stay live (the activations line)")]
    for need in r["offload_needs"]:
        verdict = "enough" if need.sufficient else "NOT enough"
        lines.append(f"  offloaded {_KIND_NAMES[need.kind]}: {need.required / 1e9:.2f} GB/s per GPU "
                     f"for {r['offload_target']:.0%} efficiency at {r['peak_tflops']:.0f} TFLOP/s "
                     f"(ait {need.ait:,.0f} FLOP/B); the host gives {need.available / 1e9:.2f} GB/s: "
                     f"{verdict}, {need.efficiency:.1%} efficient")
    return lines


def _micro_batches_held(pcfg, stage: int) -> float:
    """Micro-batches (of the stage's L / p layers) whose activations the stage holds at its peak."""
    if pcfg is None:
        return 1.0
    p, m, v = pcfg.num_stages, pcfg.num_micro_batches, pcfg.num_model_chunks
    if pcfg.schedule == "gpipe":
        return float(m)
    if pcfg.schedule == "1f1b":
        return float(min(p - stage, m))
    chunks = m * v if m == p else min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    return chunks / v


def _pp_bytes_sent(pcfg, stage: int, message: float) -> float:
    """Bytes the stage sends per step: an activation per micro-batch from each chunk that is not the
    last virtual stage, a gradient per micro-batch from each that is not the first."""
    if pcfg is None:
        return 0.0
    sends = sum((not pcfg.is_last(stage, c)) + (not pcfg.is_first(stage, c))
                for c in range(pcfg.num_model_chunks))
    return sends * pcfg.num_micro_batches * message


def _p2p_cross(ranks: list[int], stage: int, topology: Topology, wraps: bool) -> float:
    """Share of the stage's sends that cross nodes: a middle stage sends as much to the previous
    stage as to the next, the first and last stage one way only, unless the interleaved schedule
    (``wraps``) links the last stage to the first."""
    if len(ranks) == 1:
        return 0.0
    node = ranks[stage] // topology.gpus_per_node
    p = len(ranks)
    peers = [ranks[s % p] for s in (stage - 1, stage + 1) if wraps or 0 <= s < p]
    return sum(r // topology.gpus_per_node != node for r in peers) / len(peers)


def total_bytes(r: dict) -> float:
    """Estimated bytes of one device: model states (minus what is offloaded to host/NVMe) +
    activations + buffers + reserve."""
    return (r["model_states_per_rank"]["total"] - r["offloaded_per_rank"] + r["activations_per_rank"]
            + r["buffers_per_rank"] + r["reserved_per_rank"])


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_report(r: dict) -> str:
    s = {k: _bytes(v) for k, v in r["model_states_per_rank"].items()}
    lines = [f"layout: {r['topology']}",
             f"rank {r['rank']}: TP rank {r['tp_rank']} in {_span(r['tp_group'])}, DP rank "
             f"{r['dp_rank']} in {_span(r['dp_group'])}"
             + (f", CP rank {r['cp_rank']} in {_span(r['cp_group'])}" if r["cp_size"] > 1 else "")
             + ("  (WARNING: TP groups cross nodes)" if r["tp_crosses_nodes"] else ""),
             f"parameters: {r['params_total']:,} total"
             + (f" ({r['params_active']:,} active per token: MFU counts their FLOPs)"
                if r.get("params_active", r["params_total"]) != r["params_total"] else "")
             + f", {r['params_per_rank']:,} on this rank",
             f"model states per rank: {r['precision']} params {s['params_16bit']}, "
             f"{r['precision']} grads {s['grads_16bit']}, "
             f"fp32 master {s['master_fp32']}, Adam moments ({r['moment_dtypes'][0]} exp_avg, "
             f"{r['moment_dtypes'][1]} exp_avg_sq) {s['adam_moments']}"
             + (f", hpZ secondary params {s['params_16bit_secondary']}"
                if "params_16bit_secondary" in s else "") + f", total {s['total']} (optimizer "
             f"state K = {' + '.join(map(str, r['optimizer_bytes_terms']))} = "
             f"{r['optimizer_bytes_per_param']} bytes a parameter)",
             *(f"  of which {name}: {n:,} params over {group} ranks, {_bytes(b)}"
               for name, (n, b, group) in (r.get("model_states_split") or {}).items()),
             f"activations per rank (recompute {r['recompute']}, hybrid.perf estimate): "
             f"{_bytes(r['activations_per_rank'])}; buffers {_bytes(r['buffers_per_rank'])}; reserved "
             f"{_bytes(r['reserved_per_rank'])}; total {_bytes(total_bytes(r))}",
             *([f"optimizer state offloaded to {r['offload_optimizer']}: "
                f"{_bytes(r['offloaded_per_rank'])} per rank off the device"]
               if r["offloaded_per_rank"] else []),
             *_working_lines(r),
             f"DP traffic per rank per step: {_bytes(r['dp_bytes_per_step'])} "
             f"({_bytes(r['dp_cross_host_bytes_per_step'])} across nodes"
             + "".join(f"; {q}" for q in r["dp_quantized"]) + "); TP traffic "
             f"{_bytes(r['tp_bytes_per_step'])} ({_bytes(r['tp_cross_host_bytes_per_step'])} "
             f"across nodes)",
             *(f"  {line}" for line in describe_collectives(r["dp_collectives"])),
             *(_cp_lines(r) if r["cp_size"] > 1 else []),
             *(_pipeline_lines(r) if r["pipeline"] is not None else []),
             *(_moe_lines(r["moe"]) if r.get("moe") else []),
             f"global batch {r['global_batch']} = micro x DP x {r['accumulation_steps']} accumulation"
             + (f"; ramp: {r['batch_ramp']}" if r["batch_ramp"] else ""),
             f"model FLOPs per iteration {r['flops_per_iteration']:.3e} ({r['flops_per_rank']:.3e} per "
             f"rank; " + (f"at the {r['peak_tflops']:.0f} TFLOP/s peak, >= "
                          f"{r['flops_per_rank'] / r['peak_tflops'] / 1e12:.2f} s per iteration)"
                          if r["peak_tflops"] else "pass --peak-tflops for a time bound)")]
    return "\n".join(lines)


def _moe_lines(moe: dict) -> list[str]:
    return [f"experts: EP {moe['ep']} (EP group {_span(moe['ep_group'])}, expert-DP group "
            f"{_span(moe['expert_dp_group'])}), {moe['local_experts']} experts of each of "
            f"{moe['moe_layers']} MoE layers here: {moe['expert_params_per_rank']:,} expert "
            f"parameters, {_bytes(moe['expert_param_bytes_per_rank'])}; {moe['dispatcher']} token "
            f"dispatch {_bytes(moe['a2a_bytes_per_step'])} per rank per step (even routing, "
            f"docs/moe.md)"]


def _pipeline_lines(r: dict) -> list[str]:
    from pretrain.startup_report import pipeline_report
    return [pipeline_report(r["pipeline"], r["pp_rank"]),
            f"PP rank {r['pp_rank']} in {_span(r['pp_group'])}; activations of "
            f"{r['micro_batches_held']:g} micro-batch(es) held at the peak; PP traffic sent per "
            f"step {_bytes(r['pp_bytes_per_step'])} ({_bytes(r['pp_cross_host_bytes_per_step'])} "
            f"across nodes)"]


def _cp_lines(r: dict) -> list[str]:
    """Context parallelism: the sequence per rank and the CP group's attention traffic."""
    how = {"p2p": "ring: K, V 2(C-1) blocks forward; K, V and dK, dV 4(C-1) backward",
           "a2a": "all-to-all: q, k, v, out forward and their gradients backward, (C-1)/C each",
           "allgather": "all-gather of K, V forward, reduce-scatter of dK, dV backward"}
    return [f"context parallel {r['cp_size']} ({r['cp_comm_type']}): {r['local_seq']:,} of each "
            f"sample's tokens per rank; CP traffic per rank per step {_bytes(r['cp_bytes_per_step'])} "
            f"({_bytes(r['cp_cross_host_bytes_per_step'])} across nodes; "
            f"{how[r['cp_comm_type']]}, hybrid.perf.context_parallel)"]


def _cp_cross(ranks: list[int], comm_type: str, topology: Topology) -> float:
    """Share of the CP group's bytes that cross nodes: a ring's sends go to the next rank, an
    all-to-all's to every other rank (group average)."""
    if len(ranks) == 1:
        return 0.0
    node = [r // topology.gpus_per_node for r in ranks]
    if comm_type == "a2a":
        return sum(a != b for a in node for b in node) / (len(node) * (len(node) - 1))
    return sum(node[i] != node[(i + 1) % len(node)] for i in range(len(node))) / len(node)


def _host_split(cfg: TrainConfig, state: ParallelState):
    """(the group model states are partitioned over, this rank's intra- and inter-host DP groups);
    the options' errors (one host, unequal hosts, ...) as TrainConfigError."""
    from hybrid.zero.config import ZeroConfig
    from hybrid.zero.host_groups import partition_groups, secondary_group
    from hybrid.zero.quantized_collectives import gradient_reduce_scatter
    p = cfg.parallel
    if not p.zero_stage or not (p.zero_hybrid_shard or p.zero_hpz or p.zero_quantized_gradients):
        # ZeRO partitions over DP x CP (the DP group itself at CP 1)
        return (getattr(state, "dp_cp", state.dp), state.dp_intra_host_group,
                state.dp_inter_host_group)
    try:
        zcfg = ZeroConfig(stage=p.zero_stage, **p.zero_config_options())
        shard, _ = partition_groups(state, zcfg)
        secondary_group(state, zcfg)   # checks hpZ's layout
        gradient_reduce_scatter(state, p.zero_quantized_gradients)   # checks qgZ's
        intra, inter = state.require_host_groups("--zero-hybrid-shard" if p.zero_hybrid_shard
                                                 else "--zero-hpz" if p.zero_hpz
                                                 else "--zero-quantized-gradients")
    except ValueError as err:
        raise TrainConfigError(str(err)) from None
    return shard, intra, inter


def _quantized_names(p) -> list[str]:
    """What the ZeRO++ quantization options do to the DP traffic, for the report."""
    names = []
    if p.zero_quantized_weights:
        names.append("qwZ: int8 parameter all-gathers")
    if p.zero_quantized_gradients:
        names.append("qgZ: int8 gradient reduce-scatter, inside the host then across hosts")
    return names


def _ring_cross(ranks: list[int], topology: Topology) -> float:
    """Share of a ring collective's bytes over ``ranks`` that cross nodes (group average)."""
    return cross_host_fraction("all_gather", "ring", nodes_of(ranks, topology.gpus_per_node))


def _span(ranks: list[int]) -> str:
    if len(ranks) > 6:
        step = ranks[1] - ranks[0]
        return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] (stride {step}, {len(ranks)} ranks)"
    return str(ranks)


def _auto_plan_mode(cfg, gcfg, state, pipeline) -> str:
    """The most memory-saving mode of the ``--recompute auto`` plan, for the layer-uniform
    estimate of :func:`hybrid.perf.memory.device_memory` (conservative: every layer gets it)."""
    from hybrid.recompute.plan import MODES
    from pretrain.build import recompute_plan
    plan = recompute_plan(cfg, gcfg, state, pipeline, device="cuda")
    return max(set(plan.modes), key=MODES.index)
