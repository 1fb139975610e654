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


def zero_dp_bytes_per_step(psi_bytes: float, stage: int, dp: list[int], ranks_per_node: int | None,
                           *, intra: list[int] | None = None, inter: list[int] | None = None,
                           hybrid_shard: bool = False, hpz: bool = False) -> tuple[float, float]:
    """(bytes, cross-host bytes) per rank per step of ZeRO's DP collectives over NCCL rings, for
    ``psi_bytes`` 16-bit parameter bytes (ZeRO §7: 2Ψ stages 1-2, 3Ψ stage 3), plainly over the DP
    group ``dp``, or with the host split of hybrid.zero.host_groups (``intra``: this rank's DP ranks
    on its host, ``inter``: the same position on every host):

    - hpZ (stage 3): forward all-gather and reduce-scatter over DP, the backward's all-gather over
      ``intra`` (never crossing);
    - hybrid sharding: every all-gather and reduce-scatter over ``intra``, then the all-reduce of
      this rank's Ψ/h slice of the gradients over ``inter``.
    """
    def ring(elements: float, ranks: list[int], op: str = "all_gather") -> tuple[float, float]:
        n = len(ranks)
        if n < 2:
            return 0.0, 0.0
        volume = elements * (n - 1) / n * (2 if op == "all_reduce" else 1)
        return volume, volume * cross_host_fraction(op, "ring", nodes_of(ranks, ranks_per_node))

    passes = 3 if stage == 3 else 2                      # all-gathers + the reduce-scatter
    if hybrid_shard:
        parts = [ring(passes * psi_bytes, intra),
                 ring(psi_bytes / len(intra), inter, "all_reduce")]
    elif hpz:
        parts = [ring(2 * psi_bytes, dp), ring(psi_bytes, intra)]
    else:
        parts = [ring(passes * psi_bytes, dp)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)
