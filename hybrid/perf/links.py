"""Which of a collective's bytes cross hosts (ZeRO §7's volumes, split by link; docs/design.md §5).

The ledger counts a collective's logical volume per rank: (n-1)/n of the tensor for an all-gather or
a reduce-scatter, twice that for an all-reduce, the tensor for a broadcast. How much of it leaves a
host depends on where the group's ranks live and on the algorithm that moves it:

- ``ring`` (NCCL's collectives, gloo's all-reduce): rank i sends its whole volume to its ring
  neighbour i+1 (mod n) in group order. The volume crosses hosts for the ranks whose neighbour is
  on another host, so the group-average fraction is (crossing neighbour pairs) / n. A group of n
  ranks spread over k hosts in blocks (the TP-fastest rank order, docs/design.md §2) has k
  crossing pairs: a DP group with one rank per host crosses at every hop (fraction 1), Megatron's
  TP 128 over 8 DGX-2 nodes at 8 of 128.
- ``direct`` (hybrid.comm's gloo all-gather and all-to-all reduce-scatter, and every all-to-all):
  every rank sends 1/n of the tensor straight to each of its n-1 peers, so a rank's fraction is the share of its peers on
  other hosts, (n - ranks on its own host) / (n - 1), averaged over the group.
- a broadcast runs as a chain from the source over the ring order (NCCL's pipelined broadcast): of
  its n-1 hops, those between hosts cross.
- ``shm`` (hybrid.shm_collectives): every byte moves through one host's memory; nothing crosses.

All fractions are averages over the group's ranks: fraction x per-rank volume x n is what the
collective puts on links between hosts.
"""

from __future__ import annotations

from functools import lru_cache

ALGORITHMS = ("ring", "direct", "shm")


def nodes_of(ranks: list[int], ranks_per_node: int | None) -> tuple[int, ...]:
    """The host of each rank (``rank // ranks_per_node``; None: every rank on host 0)."""
    if ranks_per_node is None:
        return tuple(0 for _ in ranks)
    return tuple(r // ranks_per_node for r in ranks)


def ring_crossings(nodes: tuple[int, ...]) -> int:
    """Neighbour pairs (i, i+1 mod n) of a ring in ``nodes``' order that sit on different hosts."""
    n = len(nodes)
    if n < 2:
        return 0
    return sum(nodes[i] != nodes[(i + 1) % n] for i in range(n))


@lru_cache(maxsize=4096)
def cross_host_fraction(op: str, algorithm: str, nodes: tuple[int, ...], src_index: int = 0) -> float:
    """Share of the per-rank logical volume of ``op`` over a group whose ranks live on ``nodes``
    that crosses hosts, averaged over the group (module docstring)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    n = len(nodes)
    if n < 2 or algorithm == "shm":
        return 0.0
    if op == "broadcast":
        if algorithm == "direct":   # the source sends the tensor to each peer
            return sum(b != nodes[src_index] for b in nodes) / (n - 1)
        hops = [(nodes[(src_index + i) % n], nodes[(src_index + i + 1) % n]) for i in range(n - 1)]
        return sum(a != b for a, b in hops) / (n - 1)
    if algorithm == "ring":
        return ring_crossings(nodes) / n
    off_host = sum(sum(b != a for b in nodes) for a in nodes)      # (sender, receiver) pairs
    return off_host / (n * (n - 1))


def split_bytes(bytes_per_rank: float, op: str, algorithm: str, nodes: tuple[int, ...],
                src_index: int = 0) -> tuple[float, float]:
    """(intra-host, cross-host) bytes per rank of one collective; they sum to ``bytes_per_rank``."""
    cross = bytes_per_rank * cross_host_fraction(op, algorithm, nodes, src_index)
    return bytes_per_rank - cross, cross


def describe_group(kind: str, ranks: list[int], ranks_per_node: int | None) -> str:
    """One start-up line: the hosts a group spans and the share of its bytes that cross them."""
    nodes = nodes_of(ranks, ranks_per_node)
    hosts = sorted(set(nodes))
    where = f"inside host {hosts[0]}" if len(hosts) == 1 else f"over {len(hosts)} hosts"
    ring = cross_host_fraction("all_gather", "ring", nodes)
    direct = cross_host_fraction("all_gather", "direct", nodes)
    return (f"{kind} group of {len(ranks)} ranks {where}: {ring:.0%} of its bytes cross hosts as a "
            f"ring, {direct:.0%} sent directly (gloo all-gather / reduce-scatter)")


def describe_collectives(collectives: list[tuple[str, str, float, float]]) -> list[str]:
    """One line per (group, op, bytes, cross-host bytes) per rank per step: the bytes that stay
    inside a host and those that cross (start-up report, trainer's first logged step)."""
    return [f"{group} {op}: {total:,.0f} B per step, {total - cross:,.0f} B inside hosts, "
            f"{cross:,.0f} B across hosts" for group, op, total, cross in collectives]


def zero_dp_collectives(psi_bytes: float, stage: int, dp: list[int], ranks_per_node: int | None,
                        *, intra: list[int] | None = None, inter: list[int] | None = None,
                        hybrid_shard: bool = False, hpz: bool = False, weight_ratio: float = 1.0,
                        gradient_ratio: float | None = None, micro_batches: int = 1,
                        backward_gather_bytes: float | None = None) -> list[tuple[str, str, float, float]]:
    """(group, op, bytes, cross-host bytes) per rank per step of ZeRO's DP collectives over NCCL
    rings, summed per group and op as the ledger sums them, for ``psi_bytes`` 16-bit parameter
    bytes (ZeRO §7: 2Ψ stages 0-2, 3Ψ stage 3), plainly over the DP group ``dp`` (group "dp"), or
    with the host split of hybrid.zero.host_groups (``intra``: this rank's h DP ranks on its host,
    "dp_intra_host"; ``inter``: the same position on each of the k hosts, "dp_inter_host"):

    - hpZ (stage 3): forward all-gather and reduce-scatter over DP, the backward's all-gather over
      ``intra`` (never crossing);
    - hybrid sharding: every all-gather and reduce-scatter over ``intra``, then the all-reduce of
      this rank's Ψ/h slice of the gradients over ``inter``;
    - qwZ (stage 3; ``weight_ratio`` = q_w / b, int8 bytes with their scales per 16-bit byte,
      hybrid.perf.zeropp): the all-gathers from the primary partition carry that share of their
      bytes (hpZ's secondary gather stays 16-bit);
    - qgZ (``gradient_ratio`` = q_g / b, None = off): the reduce-scatter as two direct all-to-alls
      (hybrid.zero.quantized_collectives), Ψ q_g (h-1)/h among the ``intra`` ranks, then the
      host's partial sum of this rank's chunks, Ψ q_g (k-1)/(k h), among the ``inter`` ranks.

    With ``micro_batches`` k > 1 (gradient accumulation), stage 2 reduces in each of the k backwards
    (it keeps no full gradient) and stage 3 also gathers in each forward and backward; stages 0-1
    communicate once, after the last.

    ``backward_gather_bytes`` (stage 3; default ``psi_bytes``): the bytes the backward gathers
    again. A unit whose backward reads no parameter value (an untied word embedding: its gradient
    is a scatter-add of the output gradient) is gathered in forward only (hybrid.zero.stage3_hooks),
    so 3Ψ is an upper bound that the untied models' embedding lowers.
    """
    groups = {"dp": dp, "dp_intra_host": intra, "dp_inter_host": inter}

    gathers = micro_batches if stage == 3 else 1        # per step
    reductions = micro_batches if stage >= 2 else 1

    def run(group: str, op: str, tensor_bytes: float) -> tuple[str, str, float, float]:
        nodes = nodes_of(groups[group], ranks_per_node)
        n = len(nodes)
        times = gathers if op == "all_gather" else reductions
        volume = tensor_bytes * times * (n - 1) / n * (2 if op == "all_reduce" else 1)
        algorithm = "direct" if op == "all_to_all" else "ring"
        return group, op, volume, volume * cross_host_fraction(op, algorithm, nodes)

    if stage == 0:
        return [run("dp", "all_reduce", psi_bytes)] if len(dp) > 1 else []
    shards = "dp_intra_host" if hybrid_shard else "dp"
    gather = psi_bytes * (weight_ratio if stage == 3 else 1.0)
    out = [run(shards, "all_gather", gather)]              # stage 3's forward, stages 1-2's update
    if stage == 3:                                         # the backward's
        again = psi_bytes if backward_gather_bytes is None else backward_gather_bytes
        out.append(run("dp_intra_host", "all_gather", again) if hpz
                   else run(shards, "all_gather", again * weight_ratio))
    if gradient_ratio is not None:
        out += [run("dp_intra_host", "all_to_all", psi_bytes * gradient_ratio),
                run("dp_inter_host", "all_to_all", psi_bytes * gradient_ratio / len(intra))]
    else:
        out.append(run(shards, "reduce_scatter", psi_bytes))
    if hybrid_shard:
        out.append(run("dp_inter_host", "all_reduce", psi_bytes / len(intra)))
    merged: dict[tuple[str, str], tuple[float, float]] = {}   # per (group, op), as the ledger sums
    for group, op, volume, cross in out:
        before = merged.get((group, op), (0.0, 0.0))
        merged[(group, op)] = (before[0] + volume, before[1] + cross)
    return [(group, op, volume, cross) for (group, op), (volume, cross) in merged.items() if volume > 0]

