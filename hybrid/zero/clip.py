"""Gradient clipping by the global norm across DP and TP (Pascanu et al. 2013; Megatron-LM §3).

The global norm is that of the whole model's gradient, as one device would compute it. Each rank
sums the squares of what it holds; TP-sharded parameters contribute on every TP rank (their shards
are disjoint), TP-replicated parameters (``tensor_model_parallel`` False) only on TP rank 0, so they
count once - but a non-finite value in them counts on every rank, so that a NaN or Inf anywhere makes
the norm non-finite everywhere (the ZeRO engines detect overflow with it). With ZeRO stages >= 1 the
DP ranks hold disjoint gradient partitions and the sum runs over the world group; with stage 0 every
DP rank holds the whole gradient and only TP is summed.

Expert parallelism (issue 32): expert parameters are partitioned over the expert-DP group, and the
EP ranks hold different experts, so at stages >= 1 the world sum still counts every element once.
At stage 0 each class counts on its own group's rank 0 only (dense: DP rank 0; experts: expert-DP
rank 0 of every EP rank), summed over the world, the other copies adding only non-finite values.
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.comm import Group

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6)


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 sum of squares of all elements (one-element tensor on ``device``)."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for t in tensors:
        if t.numel():
            total += torch.linalg.vector_norm(t, dtype=torch.float32).square().to(device)
    return total


def global_grad_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], *, tp: Group,
                     reduce_group: Group, device: torch.device | str = "cpu") -> float:
    """:func:`global_grad_norm_tensor` read to the host (tests, tools; the engines keep the tensor)."""
    return float(global_grad_norm_tensor(sharded, replicated, tp=tp, reduce_group=reduce_group,
                                         device=device).item())


def global_grad_norm_tensor(sharded: list[torch.Tensor], replicated: list[torch.Tensor], *,
                            tp: Group, reduce_group: Group,
                            device: torch.device | str = "cpu") -> torch.Tensor:
    """L2 norm of the model's gradient from this rank's pieces, a 0-dim float64 tensor on ``device``
    (never read to the host: the ZeRO step decides on it on the device).

    ``sharded``: gradient pieces of TP-sharded parameters; ``replicated``: pieces of TP-replicated
    ones (counted on TP rank 0 only). ``reduce_group`` sums the squares: the world group when DP ranks
    hold disjoint partitions, the TP group when every DP rank holds the full gradient.
    """
    sq = local_sum_of_squares(sharded, replicated, tp=tp, device=device)
    comm.all_reduce(sq, reduce_group)
    return sq.double().sqrt().reshape(())   # float64, as math.sqrt of the sum was


def local_sum_of_squares(sharded: list[torch.Tensor], replicated: list[torch.Tensor], *, tp: Group,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's share of the squared global norm (one-element fp32 tensor): the TP-sharded
    pieces' squares plus, on TP rank 0 only, the TP-replicated ones' (elsewhere only when they
    are not finite)."""
    sq = sum_of_squares(sharded, device)
    replicated_sq = sum_of_squares(replicated, device)
    if tp.rank == 0:
        sq += replicated_sq
    else:   # no host sync: add it only when it is not finite
        sq += only_if_not_finite(replicated_sq)
    return sq


def only_if_not_finite(sq: torch.Tensor) -> torch.Tensor:
    """``sq`` where it is NaN or Inf, else 0: a copy that must not count still spreads an overflow
    (no host sync)."""
    return torch.where(torch.isfinite(sq), torch.zeros_like(sq), sq)


def clip_coefficient(total_norm, max_norm: float):
    """Factor to multiply gradients by so their global norm is at most ``max_norm`` (<= 1); a
    tensor norm gives a tensor (computed on its device, no read)."""
    if max_norm <= 0:
        return 1.0
    if isinstance(total_norm, torch.Tensor):
        return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
    return min(1.0, max_norm / (total_norm + CLIP_EPS))
