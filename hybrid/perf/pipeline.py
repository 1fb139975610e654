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
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.layout import LayoutError, RunLayout
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.memory import device_memory
from hybrid.perf.throughput import ThroughputAssumptions, estimate_iteration
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

    def describe(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        return (f"TP {self.tp}{sp} x PP {self.pp}" + (f" (v {self.virtual})" if self.virtual > 1 else "")
                + f" x DP {self.dp}, ZeRO {self.stage}, recompute {self.recompute}, b {self.micro_batch}")


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
                    optimizer_bytes_per_param: int = 12) -> LayoutEstimate:
    """Time and memory of one layout. ``optimizer_bytes_per_param``: K of the model states (12, or 8
    with bf16 Adam moments); the optimizer step's memory traffic is the ``assumptions``'."""
    cluster = cluster or dgx2_v100_cluster()
    t, p, d, v, b = layout.tp, layout.pp, layout.dp, layout.virtual, layout.micro_batch
    if layers % (p * v):
        raise ValueError(f"{layout.describe()}: {layers} layers do not split into {p * v} chunks")
    try:
        run = RunLayout.for_world(t * p * d, tensor_parallel=t, pipeline_parallel=p, micro_batch_size=b,
                                  global_batch=global_batch, model_chunks=v, seq_length=seq)
    except LayoutError as err:
        raise ValueError(f"{layout.describe()}: {err}") from None
    m = run.micro_batches
    stage_layers = layers // p
    zero_stage = check_layout(layout.stage, p)   # the stage the engine runs (ValueError: refused)
    it = estimate_iteration(layers=stage_layers, hidden=hidden, seq=seq, vocab=vocab, micro_batch=b,
                            tp=t, dp=d, stage=zero_stage, grad_accumulation=m,
                            recompute=layout.recompute, cluster=cluster, assumptions=assumptions)
    work = it.compute_s + it.tp_comm_s + it.memory_s + it.overhead_s
    bubble = work * (p - 1) / (v * m)
    crosses = t * d >= cluster.gpus_per_node
    bandwidth = cluster.ring_bandwidth(crosses)
    sent = p2p_bytes_per_step(pp=p, virtual=v, micro_batches=m, micro_batch=b, seq=seq, hidden=hidden,
                              tp=t, sequence_parallel=layout.sequence_parallel)
    p2p = sent / bandwidth + (2 * m * v * cluster.collective_latency if p > 1 else 0.0)
    mem = device_memory(layers=stage_layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab,
                        micro_batch=b, tp=t, dp=d, stage=zero_stage, recompute=layout.recompute,
                        sequence_parallel=layout.sequence_parallel,
                        optimizer_bytes_per_param=optimizer_bytes_per_param)
    flight = micro_batches_in_flight(p, v)
    held = mem.checkpoints * flight + mem.working * (1 if layout.recompute == "full" else flight)
    activations = held + mem.logits
    total = mem.model_states.total + activations + mem.buffers + mem.reserved
    model_flops = model_flops_per_iteration(run.global_batch, seq, layers, hidden, vocab) / run.world_size
    return LayoutEstimate(layout, m, work + bubble + p2p + it.dp_comm_s + it.optimizer_s, work + bubble,
                          bubble, p2p, it.dp_comm_s, it.optimizer_s, total, activations,
                          mem.model_states.total, model_flops)
