"""Per-step DP traffic, its time and the model-state memory of ZeRO stage 3 with the topology-aware
options of ZeRO++ (Wang et al. 2023, §3: qwZ, hpZ, qgZ) and with hybrid sharding (FSDP2's HSDP,
MiCS), per GPU - the options ``--zero-hpz``, ``--zero-quantized-weights``,
``--zero-quantized-gradients`` and ``--zero-hybrid-shard`` of the trainer, given here as plain
arguments (:class:`ZeroOptions`).

Notation (per MP rank, TP fastest in the rank order, docs/design.md §2):

- Ψ parameters of one MP rank, n the DP degree, d the ranks of one DP group that share a node
  (``gpus_per_node / Nm`` when the TP group fits in a node; 1 when it fills the node, as in
  Table 5's MP 16 on DGX-2), k = n / d the nodes a DP group spans;
- b = 2 bytes per 16-bit parameter or gradient on the wire; q_w, q_g the bytes per element of the
  block-wise quantized weights and gradients: bits / 8 + scale bytes / block (int8 with one fp32
  scale per 256 elements: 1 + 4/256 = 1.016; int4: 0.516);
- volumes are per GPU and per micro-batch in the ledger's sense (hybrid.comm): a collective over m
  ranks moves (m-1)/m of the full tensor; the cross-node part is what the link-aware ledger counts
  (hybrid.perf.links): a ring over the n ranks of a node-blocked DP group crosses at k of its n
  hops (fraction 1/d when k > 1), a collective inside one node crosses nothing, one among the k
  nodes' corresponding ranks crosses at every hop.

Per micro-batch, (intra-node, cross-node) bytes per GPU:

    stage 3        forward all-gather   Ψ b (n-1)/n        (1 - 1/d, 1/d of it)
                   backward all-gather  Ψ b (n-1)/n        (same split)
                   reduce-scatter       Ψ b (n-1)/n        (same split)
                   cross-node total     3 Ψ b (n-1)/(n d)  (ZeRO §7's 3Ψ)
    + hpZ          the backward all-gather comes from a secondary 16-bit partition over the node's
                   d ranks: Ψ b (d-1)/d, all intra-node; memory + b Ψ / d per GPU
    + qwZ          every all-gather from the primary partition carries q_w per element instead of b
                   (the forward one; the backward one too unless hpZ serves it)
    + qgZ          the reduce-scatter in two hops: an all-to-all among the node's d ranks,
                   Ψ q_g (d-1)/d intra, then among the k nodes on the 1/d shard each rank reduced,
                   Ψ q_g (k-1)/(k d), all cross-node
    hybrid shard   stage 3 over the node's d ranks only (two all-gathers and a reduce-scatter,
                   3 Ψ b (d-1)/d, all intra-node), then the shard's gradient all-reduce over the k
                   replicas: 2 Ψ b (k-1)/(k d), all cross-node; model states 16 Ψ / d per GPU

With all three ZeRO++ options the cross-node bytes fall from 3 Ψ b (n-1)/(n d) to about
(q_w + q_g) Ψ / d: with ZeRO++'s int8 weights and int4 gradients 1.53 bytes against 6 (ZeRO++'s
"3M to 0.75M", about 4x); with int8 gradients (this project's qgZ) 2.03 bytes, about 3x.

Time (:meth:`DPTraffic.seconds`): the collectives run one after another; each takes the longer of
its intra-node bytes at the NVSwitch ring bandwidth and its cross-node bytes at the GPU's share of
the node's InfiniBand links (hybrid.perf.hardware). For stage 3 with d = 1 this is ZeRO §7's
3Ψ b (n-1)/n at the inter-node rate, exactly the throughput model's stage-3 term. Quantization
kernels are taken as free (ZeRO++ fuses them; their cost is a small fraction of a step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybrid.perf.flops import gpt_param_count, pad_vocab
from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.links import cross_host_fraction
from hybrid.perf.model_states import model_state_bytes
from hybrid.perf.throughput import IterationEstimate, ThroughputAssumptions, estimate_iteration
from hybrid.topology import Topology
from hybrid.zero_policy import QUANT_BLOCK, QUANT_SCALE_BYTES   # hybrid.zero's block-wise int8


@dataclass(frozen=True)
class ZeroOptions:
    """The topology-aware options of a stage-3 run, each off by default."""

    hpz: bool = False                     # --zero-hpz
    quantized_weights: bool = False       # --zero-quantized-weights (qwZ)
    quantized_gradients: bool = False     # --zero-quantized-gradients (qgZ)
    hybrid_shard: bool = False            # --zero-hybrid-shard (HSDP / MiCS)
    weight_bits: int = 8
    gradient_bits: int = 8                # ZeRO++ sends int4 gradients; this project int8

    def __post_init__(self) -> None:
        for name in ("weight_bits", "gradient_bits"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {getattr(self, name)!r}")
        if self.hybrid_shard and (self.hpz or self.quantized_weights or self.quantized_gradients):
            raise ValueError("hybrid sharding is modelled on its own: its all-gathers already stay "
                             "inside a node; drop hpZ / qwZ / qgZ or hybrid sharding")

    @property
    def weight_bytes(self) -> float:
        """q_w: bytes per element of a quantized all-gather, scales included."""
        return self.weight_bits / 8 + QUANT_SCALE_BYTES / QUANT_BLOCK

    @property
    def gradient_bytes(self) -> float:
        """q_g: bytes per element of a quantized reduce-scatter, scales included."""
        return self.gradient_bits / 8 + QUANT_SCALE_BYTES / QUANT_BLOCK

    @property
    def flags(self) -> str:
        """The trainer's flags for these options (on top of ``--zero-stage 3``)."""
        names = [("hpz", "--zero-hpz"), ("quantized_weights", "--zero-quantized-weights"),
                 ("quantized_gradients", "--zero-quantized-gradients"),
                 ("hybrid_shard", "--zero-hybrid-shard")]
        return " ".join(flag for field, flag in names if getattr(self, field))


@dataclass(frozen=True)
class DPTraffic:
    """Bytes one GPU moves per micro-batch in its DP collectives: (intra-node, cross-node) per
    collective, in the order they run."""

    phases: tuple[tuple[str, float, float], ...]   # (collective, intra-node bytes, cross-node bytes)

    @property
    def intra_node(self) -> float:
        return sum(p[1] for p in self.phases)

    @property
    def cross_node(self) -> float:
        return sum(p[2] for p in self.phases)

    def seconds(self, cluster: Cluster) -> float:
        """Each collective: max(intra / NVSwitch ring bandwidth, cross / the GPU's InfiniBand share)."""
        intra_bw, cross_bw = cluster.link(False)[0], cluster.link(True)[0]
        return sum(max(intra / intra_bw, cross / cross_bw) for _, intra, cross in self.phases)


def dp_ranks_per_node(tp: int, dp: int, gpus_per_node: int) -> int:
    """d: how many ranks of a DP group share a node (TP fastest, then DP; docs/design.md §2)."""
    topo = Topology(tp * dp, tp, gpus_per_node, allow_tp_across_nodes=True)
    group = topo.dp_groups()[0]
    return sum(1 for r in group if r // gpus_per_node == group[0] // gpus_per_node)


def dp_traffic(psi: float, dp: int, per_node: int, options: ZeroOptions = ZeroOptions(),
               wire_bytes: float = 2.0) -> DPTraffic:
    """Per-micro-batch DP traffic of one GPU of a stage-3 run with ``options`` (module docstring);
    ``psi`` parameters per MP rank, ``dp`` = n, ``per_node`` = d, ``wire_bytes`` = b."""
    n, d = dp, per_node
    if n < 1 or d < 1 or n % d:
        raise ValueError(f"the DP degree ({n}) must be a positive multiple of its ranks per node ({d})")
    k = n // d
    spread = cross_host_fraction("all_gather", "ring", tuple(i // d for i in range(n)))   # 1/d or 0

    def whole_group(name: str, bytes_per_element: float) -> tuple[str, float, float]:
        volume = psi * bytes_per_element * (n - 1) / n
        return name, volume * (1 - spread), volume * spread

    def in_node(name: str, bytes_per_element: float) -> tuple[str, float, float]:
        return name, psi * bytes_per_element * (d - 1) / d, 0.0

    def across_nodes(name: str, bytes_per_element: float, factor: float = 1.0) -> tuple[str, float, float]:
        return name, 0.0, factor * psi / d * bytes_per_element * (k - 1) / k

    o, b = options, wire_bytes
    if o.hybrid_shard:
        return DPTraffic((in_node("forward all-gather", b), in_node("backward all-gather", b),
                          in_node("reduce-scatter", b),
                          across_nodes("replica all-reduce of the shard", b, factor=2.0)))
    gather = o.weight_bytes if o.quantized_weights else b
    phases = [whole_group("forward all-gather", gather),
              in_node("backward all-gather (secondary partition)", b) if o.hpz
              else whole_group("backward all-gather", gather)]
    if o.quantized_gradients:
        phases += [in_node("reduce-scatter, in node", o.gradient_bytes),
                   across_nodes("reduce-scatter, across nodes", o.gradient_bytes)]
    else:
        phases.append(whole_group("reduce-scatter", b))
    return DPTraffic(tuple(phases))


def model_state_bytes_per_gpu(psi: float, dp: int, per_node: int,
                              options: ZeroOptions = ZeroOptions()) -> dict[str, float]:
    """Model states of one GPU (mixed-precision Adam, ZeRO §5): stage 3's 16 Ψ / n partitioned
    over the DP group - over the node's d ranks with hybrid sharding - plus hpZ's secondary 16-bit
    partition 2 Ψ / d."""
    shards = per_node if options.hybrid_shard else dp
    primary = model_state_bytes(psi, 3, shards).total
    secondary = 2 * psi / per_node if options.hpz else 0.0
    return {"partitioned": primary, "hpz_secondary": secondary, "total": primary + secondary}


def estimate_step(*, layers: int, hidden: int, seq: int, vocab: int, micro_batch: int, tp: int,
                  dp: int, options: ZeroOptions = ZeroOptions(), grad_accumulation: int = 1,
                  recompute: str = "full", partition_activations: bool = False,
                  cluster: Cluster | None = None,
                  assumptions: ThroughputAssumptions = ThroughputAssumptions(),
                  heads: int | None = None) -> tuple[IterationEstimate, DPTraffic, int]:
    """The throughput model's stage-3 iteration (hybrid.perf.throughput) with its DP term from
    :func:`dp_traffic` (every micro-batch gathers and reduces again, as stage 3 does); with hybrid
    sharding the optimizer updates Ψ / d parameters instead of Ψ / n. Returns (estimate, the
    per-micro-batch traffic, d)."""
    cluster = cluster or dgx2_v100_cluster()
    psi = gpt_param_count(layers, hidden, pad_vocab(vocab, tp), seq, tp=tp, heads=heads)
    per_node = dp_ranks_per_node(tp, dp, cluster.gpus_per_node)
    traffic = dp_traffic(psi, dp, per_node, options, wire_bytes=assumptions.grad_bytes)
    est = estimate_iteration(layers=layers, hidden=hidden, seq=seq, vocab=vocab,
                             micro_batch=micro_batch, tp=tp, dp=dp, stage=3,
                             grad_accumulation=grad_accumulation, recompute=recompute,
                             partition_activations=partition_activations, cluster=cluster,
                             assumptions=assumptions, heads=heads,
                             dp_seconds=grad_accumulation * traffic.seconds(cluster) if dp > 1 else 0.0)
    if options.hybrid_shard:
        est = replace(est, optimizer_s=est.optimizer_s * dp / per_node)
    return est, traffic, per_node
