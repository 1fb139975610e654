"""Pipeline-parallel layouts in the performance model (Narayanan et al. 2021 §2.2, §3.3): the bubble,
the point-to-point cost and the activations a stage holds, on top of the TP x ZeRO-DP model of
:mod:`hybrid.perf.throughput` and :mod:`hybrid.perf.memory`.

A layout is (TP t, PP p, virtual stages v, DP d, ZeRO stage, recompute, micro-batch b) with
m = global batch / (b d) micro-batches per step (:class:`hybrid.layout.RunLayout`). The stage modelled is the last one: L / p layers
plus the output layer and loss (the embedding's parameters too, as on the first stage), so it is the
slowest stage and holds the most model states. Its iteration on t x d GPUs is
:func:`~hybrid.perf.throughput.estimate_iteration` of L / p layers and m micro-batches, under the
ZeRO stage the engine runs (:func:`hybrid.zero_policy.check_layout`: stage 2 as stage 1; stage 3 with
PP is refused with the engine's message); then

    pipelined work  = (compute + TP comm + memory-bound + host overhead) x (1 + (p - 1) / (v m))
    p2p             = 2 m v messages of b s h (/ t with sequence parallelism) 16-bit elements per
                      stage and step, each at the GPU's share of the inter-node links (stages are
                      contiguous blocks of t d ranks: whole nodes once t d >= GPUs per node), none
                      assumed hidden, plus one collective latency each
    time            = pipelined work + p2p + exposed DP comm + optimizer step
    TFLOP/s per GPU = the whole model's FLOPs of the step / (t p d GPUs) / time

Memory: the stage's model states and buffers, and the activations of the micro-batches in flight:
p on the first stage under 1F1B, p (1 + (p - 1) / (p v)) interleaved (Megatron §2.2.2), times one
micro-batch's checkpoints (full recompute) or stored activations (otherwise); the logits once.

Context parallelism (issue 31, ``cp`` C > 1, world t p d C): each rank runs ``s / C`` tokens of every
sample, so the iteration is modelled at ``s / C`` tokens per sample, plus the attention its queries
pay against the keys of the other ranks (``4 b (s/C) s h`` per layer forward instead of
``4 b (s/C)^2 h``, at the same rate), plus the CP traffic of
:func:`hybrid.perf.context_parallel.cp_bytes_per_step` at the ring bandwidth of the CP group (inside a
node when t C fits one): the ring (p2p) overlaps each transfer with one block's attention, so only
what the attention does not hide is exposed; a2a's all-to-alls are exposed whole. Memory: the
activations of ``s / C`` tokens (:func:`hybrid.perf.memory.device_memory` with ``cp``), model states
partitioned over d C.

Mixture of experts (issue 32, ``arch`` with MoE layers, ``ep`` E > 1): the experts split over E
ranks carved out of d C (E divides d C and the number of experts). FLOPs are the active ones
(:func:`hybrid.perf.flops.model_flops_per_iteration`); model states put the dense parameters over
d C and the rank's experts over the expert-DP group d C / E
(:func:`hybrid.perf.model_states.moe_model_state_bytes`), the DP collectives and the optimizer step
likewise; the all-to-all token dispatch of every MoE layer and micro-batch
(:func:`hybrid.perf.moe_comm.dispatch_bytes`, even routing; its forward half again under full
recompute) crosses nodes when t E exceeds a node, is exposed whole and pays 4 call latencies a
layer and micro-batch (6 with full recompute) (``ep_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.layout import LayoutError, RunLayout
from hybrid.perf.architecture import GPT2, Architecture
from hybrid.perf.context_parallel import check_a2a_heads, cp_bytes_per_step, local_seq
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.memory import device_memory
from hybrid.perf.moe_comm import dispatch_bytes
from hybrid.perf.throughput import (ThroughputAssumptions, attention_core_flops_per_iteration,
                                    estimate_iteration, sustained_efficiency)
from hybrid.zero_policy import check_layout


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    virtual: int
    stage: int            # ZeRO stage
    recompute: str        # none | selective | full
    micro_batch: int
    sequence_parallel: bool = False
    cp: int = 1                 # context-parallel degree (issue 31)
    cp_comm_type: str = "p2p"   # p2p (ring) | a2a
    ep: int = 1                 # expert-parallel degree, carved out of DP x CP (issue 32)

    def describe(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        cp = f" x CP {self.cp} ({self.cp_comm_type})" if self.cp > 1 else ""
        ep = f" (EP {self.ep})" if self.ep > 1 else ""
        return (f"TP {self.tp}{sp}{cp} x PP {self.pp}"
                + (f" (v {self.virtual})" if self.virtual > 1 else "")
                + f" x DP {self.dp}{ep}, ZeRO {self.stage}, recompute {self.recompute}, "
                f"b {self.micro_batch}")


@dataclass(frozen=True)
class LayoutEstimate:
    layout: Layout
    micro_batches: int
    time_s: float
    compute_s: float       # pipelined work: compute, TP comm, memory-bound ops, host overhead
    bubble_s: float        # the part of compute_s that is the bubble
    p2p_s: float
    dp_s: float
    optimizer_s: float
    memory_bytes: float
    activation_bytes: float
    model_state_bytes: float
    model_flops_per_gpu: float
    cp_s: float = 0.0      # exposed context-parallel communication (0 without CP)
    ep_s: float = 0.0      # the MoE layers' all-to-all token dispatch (0 at EP 1)

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_gpu / self.time_s / 1e12


def bubble_fraction(pp: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle time over step time of a flushed 1F1B pipeline: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (virtual * micro_batches + pp - 1)


def micro_batches_in_flight(pp: int, virtual: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at once."""
    return pp * (1 + (pp - 1) / (pp * virtual)) if virtual > 1 else float(pp)


def p2p_bytes_per_step(*, pp: int, virtual: int, micro_batches: int, micro_batch: int, seq: int,
                       hidden: int, tp: int = 1, sequence_parallel: bool = False,
                       bytes_per_element: int = 2) -> float:
    """Bytes one middle stage sends per step: one activation forward and one gradient back per
    micro-batch and model chunk (pp 1: nothing)."""
    if pp == 1:
        return 0.0
    message = micro_batch * seq * hidden * bytes_per_element / (tp if sequence_parallel else 1)
    return 2 * micro_batches * virtual * message


def estimate_layout(layout: Layout, *, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                    global_batch: int, cluster: Cluster | None = None,
                    assumptions: ThroughputAssumptions = ThroughputAssumptions(),
                    optimizer_bytes_per_param: int = 12,
                    attention_core: str = "megatron", arch: Architecture = GPT2) -> LayoutEstimate:
    """Time and memory of one layout. ``optimizer_bytes_per_param``: K of the model states (12, or 8
    with bf16 Adam moments); the optimizer step's memory traffic is the ``assumptions``'.
    ``attention_core``: the core whose activations count (:mod:`hybrid.perf.activations`; the
    papers' explicit "megatron" by default, "flash" for SDPA's fused kernels). ``arch``: the model's
    options (GPT-2 by default; with MoE layers ``layout.ep`` splits the experts, module docstring)."""
    cluster = cluster or dgx2_v100_cluster()
    t, p, d, v, b = layout.tp, layout.pp, layout.dp, layout.virtual, layout.micro_batch
    c, full_seq = layout.cp, seq
    try:
        seq = local_seq(seq, c)   # the tokens of one CP rank: what the iteration runs
        if c > 1 and layout.cp_comm_type == "a2a":
            check_a2a_heads(heads, None, t, c)
    except ValueError as err:
        raise ValueError(f"{layout.describe()}: {err}") from None
    if layers % (p * v):
        raise ValueError(f"{layout.describe()}: {layers} layers do not split into {p * v} chunks")
    try:
        run = RunLayout.for_world(t * p * d, tensor_parallel=t, pipeline_parallel=p, micro_batch_size=b,
                                  global_batch=global_batch, model_chunks=v, seq_length=seq)
    except LayoutError as err:
        raise ValueError(f"{layout.describe()}: {err}") from None
    m = run.micro_batches
    stage_layers = layers // p
    _check_ep(layout, arch)
    zero_stage = check_layout(layout.stage, p)   # the stage the engine runs (ValueError: refused)
    it = estimate_iteration(layers=stage_layers, hidden=hidden, seq=seq, vocab=vocab, micro_batch=b,
                            tp=t, dp=d, stage=zero_stage, grad_accumulation=m,
                            recompute=layout.recompute, cluster=cluster, assumptions=assumptions,
                            heads=heads, arch=arch, ep=layout.ep, expert_dp=d * c // layout.ep)
    work = it.compute_s + it.tp_comm_s + it.memory_s + it.overhead_s
    bubble = work * (p - 1) / (v * m)
    cp_s = 0.0
    if c > 1:   # the queries of this rank against the other ranks' keys, and the CP traffic
        core = (attention_core_flops_per_iteration(b * m, full_seq, stage_layers, hidden,
                                                   layout.recompute) / c
                - attention_core_flops_per_iteration(b * m, seq, stage_layers, hidden,
                                                     layout.recompute)) / t
        core_s = core / (cluster.peak_flops * sustained_efficiency(b * seq, hidden / t, assumptions))
        work += core_s
        cp_bytes = cp_bytes_per_step(layers=stage_layers, micro_batches=m, recompute=layout.recompute,
                                     comm_type=layout.cp_comm_type, cp=c, micro_batch=b,
                                     seq=full_seq, hidden=hidden, heads=heads, tp=t)
        comm_s = cp_bytes / cluster.ring_bandwidth(t * c > cluster.gpus_per_node)
        cp_s = max(0.0, comm_s - core_s) if layout.cp_comm_type == "p2p" else comm_s
    crosses = t * c * d >= cluster.gpus_per_node
    bandwidth = cluster.ring_bandwidth(crosses)
    sent = p2p_bytes_per_step(pp=p, virtual=v, micro_batches=m, micro_batch=b, seq=seq, hidden=hidden,
                              tp=t, sequence_parallel=layout.sequence_parallel)
    p2p = sent / bandwidth + (2 * m * v * cluster.collective_latency if p > 1 else 0.0)
    mem = device_memory(layers=stage_layers, hidden=hidden, heads=heads, seq=full_seq, vocab=vocab,
                        micro_batch=b, tp=t, dp=d, stage=zero_stage, recompute=layout.recompute,
                        sequence_parallel=layout.sequence_parallel,
                        optimizer_bytes_per_param=optimizer_bytes_per_param,
                        attention_core=attention_core, cp=c, cp_comm_type=layout.cp_comm_type,
                        arch=arch, ep=layout.ep)
    flight = micro_batches_in_flight(p, v)
    held = mem.checkpoints * flight + mem.working * (1 if layout.recompute == "full" else flight)
    activations = held + mem.logits
    total = mem.model_states.total + activations + mem.buffers + mem.reserved
    model_flops = (model_flops_per_iteration(run.global_batch, full_seq, layers, hidden, vocab,
                                             heads=heads, arch=arch) / (run.world_size * c))
    ep_s = expert_dispatch_seconds(layout, arch, stage_layers=stage_layers, micro_batches=m,
                                   seq=seq, hidden=hidden, cluster=cluster)
    return LayoutEstimate(layout, m, work + bubble + p2p + cp_s + ep_s + it.dp_comm_s + it.optimizer_s,
                          work + bubble, bubble, p2p, it.dp_comm_s, it.optimizer_s, total, activations,
                          mem.model_states.total, model_flops, cp_s=cp_s, ep_s=ep_s)


def _check_ep(layout: Layout, arch: Architecture) -> None:
    ep = layout.ep
    if ep == 1:
        return
    if not arch.is_moe:
        raise ValueError(f"{layout.describe()}: EP {ep} needs MoE layers (an arch with num_experts)")
    if (layout.dp * layout.cp) % ep or arch.num_experts % ep:
        raise ValueError(f"{layout.describe()}: EP {ep} must divide DP x CP "
                         f"{layout.dp * layout.cp} and the {arch.num_experts} experts")


def expert_dispatch_seconds(layout: Layout, arch: Architecture, *, stage_layers: int,
                            micro_batches: int, seq: int, hidden: int, cluster: Cluster) -> float:
    """Exposed seconds of one stage's all-to-all token dispatch per step (module docstring):
    ``seq`` is a CP rank's tokens of a sample. 0 at EP 1."""
    if layout.ep == 1:
        return 0.0
    one = dispatch_bytes("alltoall", layout.micro_batch * seq, arch.moe_topk, hidden, layout.ep,
                         arch.num_experts, 2)
    per_layer = one.total + (one.forward + one.metadata if layout.recompute == "full" else 0.0)
    calls_per_layer = 4 + (2 if layout.recompute == "full" else 0)
    moe_layers = arch.moe_layers(stage_layers)
    bandwidth, latency = cluster.link(layout.tp * layout.ep > cluster.gpus_per_node, "direct")
    return micro_batches * moe_layers * (per_layer / bandwidth + calls_per_layer * latency)
