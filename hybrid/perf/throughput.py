"""Throughput model of one training iteration of a TP x ZeRO-DP GPT run (ZeRO §10, Figure 2;
Megatron-LM §3 for the tensor-parallel communication).

time = compute + exposed TP communication + exposed DP communication + optimizer step, per GPU:

- compute: hardware FLOPs of the iteration (Megatron's formula plus what recompute reruns: every
  layer's forward when full, the attention core when selective) / GPUs / (peak x
  :func:`sustained_efficiency`);
- TP: Megatron's all-reduces of the b s h activations - 2 in forward and 2 in backward per layer, 2
  more when the forward is recomputed (+ Pa's all-gather of the checkpoint), plus the embedding's
  and the output layer's and the loss's 3 values per token - ring volume 2 (t-1)/t x 2 b s h bytes
  each (:func:`tp_ring_bytes_per_microbatch`), over NVSwitch when the TP group stays in a node,
  otherwise over the GPU's share of the node's InfiniBand links; on the critical path;
- DP: 2Ψ (stages 0-2) or 3Ψ (stage 3) 16-bit elements of the MP rank's parameters, ring factor
  (Nd-1)/Nd, a named fraction overlapped with the backward pass; with gradient accumulation stage 2
  reduce-scatters every micro-batch and stage 3 repeats all its 3Ψ per micro-batch;
- optimizer: the Adam step streams the fp32 states of the parameters this GPU updates through HBM;
- memory-bound ops: the elementwise passes over the activations each layer makes (LayerNorms,
  residual adds, GELU, the context copy; :func:`elementwise_bytes_per_layer`) at the cluster's
  ``elementwise_bandwidth``, forward x (1 + ``elementwise_backward_factor``), the forward again when
  recomputed;
- attention core at ``attention_core_flops`` when the cluster gives it a rate of its own, and a host
  ``layer_overhead_s`` per layer per micro-batch (both 0 on the V100: folded into the efficiency).

Each collective call costs latency + bytes / bandwidth, both from :meth:`Cluster.link` for the
links its group uses and its algorithm (TP: ring; DP: ``dp_algorithm``). A cluster may add a
measured ``step_overhead_s`` per iteration; on a link with a token bucket (``link_burst_s`` > 0)
each call that crosses nodes overlaps up to the burst with the work before it
(:func:`link_overlap`).

Every assumption is a field of :class:`ThroughputAssumptions` or of the :class:`Cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.perf.architecture import GPT2, Architecture
from hybrid.perf.flops import (expert_params_per_rank, gpt_param_count, model_flops_per_iteration,
                               pad_vocab, recompute_flops_per_iteration)
from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.model_states import dp_communication_elements
from hybrid.topology import Topology


@dataclass(frozen=True)
class ThroughputAssumptions:
    # Sustained fraction of peak of a whole training step with large GEMMs. Megatron-LM (2019) ran
    # its 1.2B model at 39 TFLOP/s on one V100 (30% of peak); the best ZeRO runs reach ~33%.
    max_efficiency: float = 0.40
    # Micro-batch tokens (b s) at which the efficiency halves: small batches make thin GEMMs and
    # leave kernel-launch and memory-bound ops (softmax, LayerNorm, dropout) exposed.
    half_efficiency_tokens: float = 2048.0
    # Hidden columns per TP rank (h / t) at which the efficiency halves: the GEMMs' inner width.
    half_efficiency_hidden: float = 64.0
    tp_allreduces_per_layer: int = 4          # Megatron: f and g in attention and MLP, fwd + bwd
    recompute_allreduces_per_layer: int = 2   # the recomputed forward repeats the 2 forward ones
    activation_bytes: int = 2                 # 16-bit activations on the wire
    grad_bytes: int = 2                       # 16-bit gradients / parameters on the DP wire
    zero_dp_overlap: float = 0.5              # ZeRO overlaps its reduce-scatter with backward
    baseline_dp_overlap: float = 0.0          # Megatron-LM (2019) all-reduces after backward
    optimizer_bytes_per_param: float = 28.0   # Adam: read grad 2, r/w master, m, v (24), write 2
    # Elementwise passes of one layer's forward over b s h activations, counted from models/gpt/
    # layer.py (read + write of each op, bias adds fused into the GEMMs, dropout off at p = 0):
    # replicated - 2 LayerNorms (r 1 w 1 each) + 2 residual adds (r 2 w 1 each) = 10;
    # sharded (/t) - GELU on 4h (r 4 w 4) + the attention context's permute copy (r 1 w 1) = 10.
    elementwise_passes_replicated: float = 10.0
    elementwise_passes_sharded: float = 10.0
    # Backward of an elementwise op reads the incoming gradient and the saved input and writes the
    # input gradient (+ the residual's gradient sum): about twice its forward traffic.
    elementwise_backward_factor: float = 2.0
    # Passes over the b s V/t logits of the vocab-parallel cross-entropy, forward + backward: max,
    # exp + sum, the target gather, softmax - one-hot (r 1 w 1) and the output GEMM's input copy.
    logit_passes: float = 6.0
    # DP collective calls per micro-batch, each paying the cluster's collective_latency: with one
    # gradient bucket (hybrid.zero_policy.DEFAULT_BUCKET_ELEMENTS) stage 0 all-reduces once, stages 1-2
    # reduce-scatter and all-gather once; stage 3 gathers every unit in forward and in backward and
    # reduce-scatters it: 3 x (layers + the embedding and final-LayerNorm units).
    dp_calls_stage0: int = 1
    dp_calls_stage12: int = 2
    stage3_extra_units: int = 2
    # True when ``max_efficiency`` comes from measured whole training steps (the V100's 30-40%:
    # Megatron-LM's and ZeRO's runs include softmax, LayerNorm, GELU, dropout), so the memory-bound
    # term is already inside it: reported in details, not added. The CPU calibration measures a
    # pure GEMM rate instead and sets it False.
    elementwise_in_efficiency: bool = True
    # How the DP collectives move their bytes (hybrid.perf.links): NCCL's rings on GPUs; on gloo,
    # hybrid.comm's point-to-point all-gather and all-to-all reduce-scatter are "direct".
    dp_algorithm: str = "ring"

    def __post_init__(self) -> None:
        if self.dp_algorithm not in ("ring", "direct"):
            raise ValueError(f"dp_algorithm must be ring or direct, got {self.dp_algorithm!r}")
        if not 0 < self.max_efficiency <= 1:
            raise ValueError(f"max_efficiency must be in (0, 1], got {self.max_efficiency}")
        for name in ("zero_dp_overlap", "baseline_dp_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def sustained_efficiency(tokens: float, hidden_per_rank: float,
                         assumptions: ThroughputAssumptions = ThroughputAssumptions()) -> float:
    """Fraction of peak FLOP/s a GPU sustains on the compute of a training step.

    eff = max_efficiency x T / (T + T_half) x H / (H + H_half), T = micro-batch tokens b s and
    H = hidden per TP rank h / t: saturating in both GEMM dimensions a GPU sees.
    """
    if tokens <= 0 or hidden_per_rank <= 0:
        raise ValueError(f"tokens ({tokens}) and hidden per rank ({hidden_per_rank}) must be positive")
    a = assumptions
    return (a.max_efficiency * tokens / (tokens + a.half_efficiency_tokens)
            * hidden_per_rank / (hidden_per_rank + a.half_efficiency_hidden))


@dataclass(frozen=True)
class IterationEstimate:
    gpus: int
    model_flops_per_gpu: float   # model FLOPs, recompute not counted
    hardware_flops_per_gpu: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float             # exposed part only
    optimizer_s: float
    memory_s: float = 0.0        # memory-bound elementwise ops
    overhead_s: float = 0.0      # host overhead per layer (0 on the V100)
    link_overlap_s: float = 0.0  # work hidden behind token-bucket bursts (shaped test bed only)
    details: dict = field(default_factory=dict, compare=False)

    @property
    def time_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.dp_comm_s + self.optimizer_s + self.memory_s
                + self.overhead_s - self.link_overlap_s)

    def tflops_per_gpu(self, hardware: bool = True) -> float:
        flops = self.hardware_flops_per_gpu if hardware else self.model_flops_per_gpu
        return flops / self.time_s / 1e12

    def pflops_aggregate(self, hardware: bool = True) -> float:
        return self.tflops_per_gpu(hardware) * self.gpus / 1e3


def estimate_iteration(*, layers: int, hidden: int, seq: int, vocab: int, micro_batch: int, tp: int,
                       dp: int, stage: int, grad_accumulation: int = 1, recompute: str = "full",
                       partition_activations: bool = False, cluster: Cluster | None = None,
                       assumptions: ThroughputAssumptions = ThroughputAssumptions(),
                       heads: int | None = None, arch: Architecture = GPT2,
                       dp_seconds: float | None = None, ep: int = 1,
                       expert_dp: int | None = None) -> IterationEstimate:
    """Time of one iteration of ``grad_accumulation`` micro-batches of ``micro_batch`` sequences per
    replica on ``tp`` x ``dp`` GPUs (TP fastest, docs/design.md §2). ``arch`` (with ``heads`` for
    GQA) changes the FLOPs and the parameters; the elementwise and TP traffic terms stay GPT-2's.
    ``dp_seconds``: the DP collectives' seconds per iteration when the caller models them itself
    (hybrid.perf.zeropp's topology-aware options); None: ZeRO §7's 2Ψ / 3Ψ. With MoE layers in
    ``arch``, ``ep`` splits the routed experts and ``expert_dp`` (default ``dp / ep``) ranks hold
    each expert (issue 32): the DP collectives and the optimizer step run over the dense
    parameters with ``dp`` and the rank's experts with ``expert_dp``; FLOPs are the active ones."""
    cluster = cluster or dgx2_v100_cluster()
    topo = Topology(tp * dp, tp, cluster.gpus_per_node, allow_tp_across_nodes=True)
    gpus, a = topo.world_size, assumptions
    batch = micro_batch * grad_accumulation * dp
    model = model_flops_per_iteration(batch, seq, layers, hidden, vocab, heads=heads, arch=arch)
    hw = model + recompute_flops_per_iteration(batch, seq, layers, hidden, recompute, heads=heads,
                                               arch=arch)
    full_recompute = recompute == "full"
    eff = sustained_efficiency(micro_batch * seq, hidden / tp, a)
    compute = hw / gpus / (cluster.peak_flops * eff)
    if cluster.attention_core_flops > 0:   # the core at its own measured rate, not the GEMMs'
        core = attention_core_flops_per_iteration(batch, seq, layers, hidden, recompute) / gpus
        compute += core / cluster.attention_core_flops - core / (cluster.peak_flops * eff)
    forwards = 1 + a.elementwise_backward_factor + (1 if full_recompute else 0)
    memory = (grad_accumulation * layers * forwards * a.activation_bytes
              * elementwise_elements_per_layer(micro_batch * seq, hidden, tp, a)
              / cluster.elementwise_bandwidth)
    memory += (grad_accumulation * a.logit_passes * a.activation_bytes * micro_batch * seq
               * pad_vocab(vocab, tp) / tp / cluster.elementwise_bandwidth)
    memory_alone = memory
    memory = 0.0 if a.elementwise_in_efficiency else memory
    overhead = grad_accumulation * layers * cluster.layer_overhead_s
    overhead += cluster.step_overhead_s
    tp_comm = grad_accumulation * _tp_time_per_microbatch(layers, hidden, seq, micro_batch, tp,
                                                          full_recompute, partition_activations,
                                                          topo.tp_crosses_nodes, cluster, a)
    psi_rank = gpt_param_count(layers, hidden, pad_vocab(vocab, tp), seq, tp=tp, heads=heads,
                               arch=arch, ep=ep)
    experts = expert_params_per_rank(layers, hidden, arch, tp=tp, ep=ep)
    expert_dp = expert_dp or max(1, dp // ep)
    tp_crosses, dp_crosses = topo.tp_crosses_nodes, _dp_crosses_nodes(topo)
    dp_total = (_dp_time(psi_rank - experts, stage, dp, grad_accumulation, dp_crosses, cluster, a)
                + _dp_time(experts, stage, expert_dp, grad_accumulation, dp_crosses, cluster, a)
                if dp_seconds is None else dp_seconds)
    overlap = a.zero_dp_overlap if stage >= 1 else a.baseline_dp_overlap
    dp_exposed = max(dp_total * (1 - overlap), dp_total - compute * 2 / 3)  # hide behind backward
    dp_latency = cluster.link(dp_crosses, a.dp_algorithm)[1]
    dp_exposed += _dp_calls(stage, dp, layers, grad_accumulation, a) * dp_latency
    updated = ((psi_rank - experts) / dp + experts / expert_dp) if stage >= 1 else psi_rank
    optimizer = updated * a.optimizer_bytes_per_param / cluster.hbm_bandwidth
    crossing_calls = ((grad_accumulation * _tp_calls(layers, tp, full_recompute, partition_activations, a)
                       if tp_crosses else 0)
                      + (_dp_calls(stage, dp, layers, grad_accumulation, a) if dp_crosses else 0))
    crossing_comm = (tp_comm if tp_crosses else 0.0) + (dp_exposed if dp_crosses else 0.0)
    hidden_by_link = link_overlap(compute + memory + overhead + optimizer, crossing_calls,
                                  crossing_comm, cluster.link_burst_s)
    return IterationEstimate(gpus, model / gpus, hw / gpus, compute, tp_comm, dp_exposed, optimizer,
                             memory, overhead, hidden_by_link,
                             details={"efficiency": eff, "memory_bound_s": memory_alone,
                                      "dp_total_s": dp_total,
                                      "tp_crosses_nodes": tp_crosses,
                                      "params_per_rank": psi_rank})


def elementwise_elements_per_layer(tokens: int, hidden: int, tp: int,
                                   assumptions: ThroughputAssumptions = ThroughputAssumptions()) -> float:
    """Activation elements one layer's forward reads + writes in memory-bound ops on one TP rank:
    (replicated passes + sharded passes / t) x b s h."""
    a = assumptions
    return (a.elementwise_passes_replicated + a.elementwise_passes_sharded / tp) * tokens * hidden


def attention_core_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int,
                                       recompute: str) -> float:
    """FLOPs of q k^T and scores x v: 4 B s^2 h per layer forward, x 3 with backward, + 1 forward
    when recomputed (full or selective) - the s/(6h) share of Megatron's formula."""
    reruns = 0 if recompute == "none" else 1
    return (3 + reruns) * 4.0 * batch * seq * seq * hidden * layers


def tp_ring_bytes_per_microbatch(layers: int, hidden: int, seq: int, micro_batch: int, tp: int, *,
                                 full_recompute: bool = True, partition_activations: bool = False,
                                 activation_bytes: int = 2,
                                 assumptions: ThroughputAssumptions = ThroughputAssumptions()
                                 ) -> tuple[float, int]:
    """(bytes each rank moves, number of collectives) in the TP group for one micro-batch.

    Per layer: Megatron's all-reduces of the b s h activations (2 forward + 2 backward, + 2 for the
    recomputed forward), ring volume 2 (t-1)/t each, plus Pa's all-gather (t-1)/t of the checkpoint.
    Per micro-batch: the vocab-parallel embedding's forward all-reduce and the tied output layer's
    backward one (b s h each), and the vocab-parallel cross-entropy's 3 fp32 values per token.
    """
    if tp == 1:
        return 0.0, 0
    a = assumptions
    message = micro_batch * seq * hidden * activation_bytes
    per_layer = a.tp_allreduces_per_layer + (a.recompute_allreduces_per_layer if full_recompute else 0)
    allreduce = 2 * (tp - 1) / tp
    ring = allreduce * (per_layer * layers + 2) * message + allreduce * 3 * micro_batch * seq * 4
    calls = per_layer * layers + 2 + 2
    if partition_activations:
        ring += layers * (tp - 1) / tp * message
        calls += layers
    return ring, calls


def link_overlap(work_s: float, crossing_calls: float, crossing_comm_s: float, burst_s: float) -> float:
    """Seconds of ``work_s`` (everything but communication) hidden by a token-bucket link.

    A bucket refills while the node computes and then sends up to ``burst_s`` of traffic at line
    rate, so the gap before each of the ``crossing_calls`` calls that cross nodes overlaps that
    call's transfer, up to the burst: with the work spread evenly over the gaps, hidden =
    calls x min(work / calls, burst) = min(work, calls x burst), and never more than those calls'
    own time ``crossing_comm_s``. Megatron's TP across hosts makes dozens of calls with gaps shorter
    than the burst: nearly all its work hides; ZeRO-1's two large DP calls per step hide at most two
    bursts.
    """
    if crossing_calls <= 0 or burst_s <= 0:
        return 0.0
    return min(work_s, crossing_calls * burst_s, crossing_comm_s)


def _tp_calls(layers: int, tp: int, full_recompute: bool, partitioned: bool,
              a: ThroughputAssumptions) -> int:
    return tp_ring_bytes_per_microbatch(layers, 1, 1, 1, tp, full_recompute=full_recompute,
                                        partition_activations=partitioned, assumptions=a)[1]


def _tp_time_per_microbatch(layers, hidden, seq, micro_batch, tp, full_recompute, partitioned,
                            crosses_nodes, cluster: Cluster, a: ThroughputAssumptions) -> float:
    ring, calls = tp_ring_bytes_per_microbatch(
        layers, hidden, seq, micro_batch, tp, full_recompute=full_recompute,
        partition_activations=partitioned, activation_bytes=a.activation_bytes, assumptions=a)
    bandwidth, latency = cluster.link(crosses_nodes, "ring")
    return ring / bandwidth + calls * latency


def _dp_time(psi_rank, stage, dp, grad_accumulation, crosses_nodes, cluster: Cluster,
             a: ThroughputAssumptions) -> float:
    if dp == 1 or not psi_rank:
        return 0.0
    elements = dp_communication_elements(psi_rank, stage)          # 2Ψ or 3Ψ per step
    if stage == 2:
        elements += (grad_accumulation - 1) * psi_rank             # a reduce-scatter per micro-batch
    elif stage == 3:
        elements *= grad_accumulation                               # gathers + reduce-scatter each
    volume = elements * a.grad_bytes * (dp - 1) / dp
    return volume / cluster.link(crosses_nodes, a.dp_algorithm)[0]


def _dp_calls(stage: int, dp: int, layers: int, grad_accumulation: int,
              a: ThroughputAssumptions) -> float:
    """DP collective calls per iteration (each pays the latency, none of it overlapped)."""
    if dp == 1:
        return 0
    if stage == 3:
        return 3 * (layers + a.stage3_extra_units) * grad_accumulation
    if stage == 2:   # a reduce-scatter per micro-batch, one all-gather
        return a.dp_calls_stage12 + grad_accumulation - 1
    return a.dp_calls_stage0 if stage == 0 else a.dp_calls_stage12


def _dp_crosses_nodes(topo: Topology) -> bool:
    return any(len(topo.nodes_of(group)) > 1 for group in topo.dp_groups())
