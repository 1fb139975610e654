"""Description of the cluster the throughput model runs on (ZeRO §10.1: 400 V100 32 GB GPUs in 25
NVIDIA DGX-2 nodes; NVSwitch inside a node, 8 x 100 Gbps InfiniBand EDR between nodes).

Every number is a named field with its source; the benchmark plugs this machine's measured GEMM rate
and gloo bandwidth into the same dataclass (benchmarks/calibrate_perf_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Per-GPU bandwidths of a DGX-2 node to offloaded state (the ZeRO-Infinity authors' SC21 slides,
# pp. 8-9: 64 GB/s CPU and 28 GB/s NVMe per 16-GPU node; a parameter partitioned over many GPUs is
# gathered at up to 70 GB/s, the GPU-to-GPU bound of bandwidth-centric partitioning).
DGX2_HOST_OFFLOAD_BANDWIDTH = 4e9
DGX2_NVME_OFFLOAD_BANDWIDTH = 1.75e9
DGX2_PARAM_GATHER_BANDWIDTH = 70e9


@dataclass(frozen=True)
class Cluster:
    """Per-GPU rates of a homogeneous cluster. Bandwidths are bytes/s, compute FLOP/s."""

    name: str
    gpus_per_node: int = 16
    peak_flops: float = 125e12            # V100 fp16 tensor-core peak
    memory_bytes: float = 32e9            # V100 32 GB
    hbm_bandwidth: float = 900e9          # V100 HBM2, bounds the optimizer step
    intra_node_bandwidth: float = 300e9   # NVSwitch per GPU, both directions together
    intra_node_efficiency: float = 0.5    # a ring sends one way: 150 GB/s usable
    ib_link_bandwidth: float = 12.5e9     # one InfiniBand EDR link (100 Gbps)
    ib_links_per_node: int = 8            # DGX-2: 8 links = 800 Gbps per node
    ib_efficiency: float = 1.0            # fraction of link bandwidth a collective achieves
    collective_latency: float = 20e-6     # fixed cost per collective call (launch + sync), seconds
    # Memory-bound ops (LayerNorm, GELU, residual adds, head copies) stream activations at this rate;
    # on a V100 they run from HBM2 (900 GB/s). The CPU calibration measures it at the run's size.
    elementwise_bandwidth: float = 900e9
    # FLOP/s of the attention core (q k^T, softmax, x v) when it runs at a rate of its own; 0 = at
    # the GEMMs' sustained rate (V100: cuBLAS batched GEMMs, folded into the efficiency).
    attention_core_flops: float = 0.0
    # Host time per transformer layer per forward + backward not overlapped with the device (Python,
    # autograd dispatch). 0 on a V100: kernel launches are asynchronous and hide behind layers of
    # h >= 1536; the CPU calibration measures it with an empty (tiny) layer's forward + backward.
    layer_overhead_s: float = 0.0
    # Seconds a collective call whose group crosses nodes pays beyond its bytes; 0 = the
    # ``collective_latency`` of any call. The shaped CPU test bed measures it per algorithm
    # (benchmarks/shaped_link_probe.py): TCP round trips through the link's token-bucket queue.
    inter_node_latency: float = 0.0
    # Collectives built of point-to-point sends and receives all posted at once ("direct" in
    # hybrid.perf.links: hybrid.comm's gloo all-gather and all-to-all reduce-scatter) send and
    # receive at the same time on the node's link. Bytes/s per GPU they get across nodes and their
    # latency per call; 0 = the ring's (inter_node_ring_bandwidth, inter_node_latency). On a V100
    # cluster NCCL runs rings: both 0.
    inter_node_direct_bandwidth: float = 0.0
    inter_node_direct_latency: float = 0.0
    # Seconds of line-rate traffic a node's link sends at once after being idle: a token bucket's
    # burst / rate on the shaped CPU test bed (tools/netns_cluster.py), 0 on InfiniBand. Work between
    # two cross-node collective calls refills it, so up to this much of each call's transfer
    # overlaps the work before it (IterationEstimate.link_overlap_s).
    link_burst_s: float = 0.0
    # Seconds per iteration the model's terms leave out, measured: on the CPU test bed the step at
    # unlimited inter-host bandwidth minus the model's estimate of that step (host work outside the
    # layers, gloo calls' CPU time, ranks sharing cores); 0 on the V100 (folded into the efficiency).
    step_overhead_s: float = 0.0
    # Bytes/s per GPU to offloaded state (ZeRO-Offload / ZeRO-Infinity): host memory over PCIe,
    # NVMe through host memory, and the GPU-to-GPU bound of gathering an offloaded parameter
    # partitioned over the DP group (hybrid.perf.infinity.partitioned_param_bandwidth).
    host_offload_bandwidth: float = DGX2_HOST_OFFLOAD_BANDWIDTH
    nvme_offload_bandwidth: float = DGX2_NVME_OFFLOAD_BANDWIDTH
    param_gather_bandwidth: float = DGX2_PARAM_GATHER_BANDWIDTH

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "peak_flops", "memory_bytes", "hbm_bandwidth",
                     "intra_node_bandwidth", "ib_link_bandwidth", "ib_links_per_node",
                     "elementwise_bandwidth", "host_offload_bandwidth", "nvme_offload_bandwidth",
                     "param_gather_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        for name in ("intra_node_efficiency", "ib_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"cluster {self.name!r}: {name} must be in (0, 1], "
                                 f"got {getattr(self, name)}")
        for name in ("attention_core_flops", "layer_overhead_s", "collective_latency",
                     "inter_node_latency", "inter_node_direct_bandwidth", "inter_node_direct_latency",
                     "link_burst_s", "step_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def intra_node_ring_bandwidth(self) -> float:
        """Bytes/s one GPU pushes into a ring that stays inside its node."""
        return self.intra_node_bandwidth * self.intra_node_efficiency

    @property
    def inter_node_ring_bandwidth(self) -> float:
        """Bytes/s one GPU pushes into a ring that leaves its node: its share of the node's links.

        All GPUs of a node communicate across nodes at once (every DP group spans nodes; a TP group
        wider than a node keeps all 16 GPUs of each node busy in the same collective), so each gets
        links x link bandwidth / GPUs per node (8 x 12.5 / 16 = 6.25 GB/s on a DGX-2)."""
        node = self.ib_links_per_node * self.ib_link_bandwidth * self.ib_efficiency
        return node / self.gpus_per_node

    def ring_bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes/s per GPU of a ring inside its node or across nodes."""
        return self.inter_node_ring_bandwidth if crosses_nodes else self.intra_node_ring_bandwidth

    def link(self, crosses_nodes: bool, algorithm: str = "ring") -> tuple[float, float]:
        """(bytes/s per GPU, seconds per call) of a collective of ``algorithm`` (ring | direct,
        hybrid.perf.links) whose group does or does not cross nodes."""
        if algorithm not in ("ring", "direct"):
            raise ValueError(f"algorithm must be ring or direct, got {algorithm!r}")
        if not crosses_nodes:
            return self.intra_node_ring_bandwidth, self.collective_latency
        bandwidth = self.inter_node_ring_bandwidth
        latency = self.inter_node_latency or self.collective_latency
        if algorithm == "direct":
            bandwidth = self.inter_node_direct_bandwidth or bandwidth
            latency = self.inter_node_direct_latency or latency
        return bandwidth, latency

    def with_changes(self, **changes) -> "Cluster":
        return replace(self, **changes)


def dgx2_v100_cluster() -> Cluster:
    """The paper's cluster: DGX-2 nodes of 16 V100 32 GB (ZeRO §10.1)."""
    return Cluster(name="DGX-2 V100 32GB")
