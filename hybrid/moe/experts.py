"""SwiGLU experts of a mixture-of-experts layer as grouped GEMMs (issue 32; Mixtral §2.1,
Megatron-Core's grouped GEMM), tensor-parallel like the dense MLP (Megatron-LM §3).

This rank holds ``E_local`` experts, each split over TP exactly as the dense
``ColumnParallelLinear`` / ``RowParallelLinear`` pair:

    fc1.weight [E_local, 2f/tp, h]   rows (gate/up interleaved: gate 0, up 0, gate 1, ...) over TP
    fc2.weight [E_local, h, f/tp]    columns over TP

Input: tokens [N, h] grouped by expert (``counts[e]`` rows for local expert e, as the dispatcher
gives them), the same on every TP rank. They enter through ``f`` (identity forward, all-reduce of
the gradient backward), each rank computes its slice ``silu(gate_r) * up_r`` and its partial
``fc2`` product, and the partial outputs leave through ``g`` (all-reduce forward): [N, h], equal on
every TP rank, so the probability weighting after it is replicated and the router's gradient is the
same on every TP rank (the router weight is replicated like a LayerNorm gain).

The products are ONE call per GEMM for all local experts, never a loop over tokens:

* ``torch._grouped_mm(tokens, W^T, offs)`` where the device supports it (CUDA with compute
  capability 9.0+ in bf16; the CPU kernel of torch 2.13 in fp32 and bf16), when every row stride is
  a multiple of 16 bytes (the kernel's requirement);
* otherwise a padded batched product: tokens scattered into ``[E_local, max_count, h]`` (zero rows
  past each expert's count), one ``bmm`` per GEMM, and gathered back.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.comm import Group
from hybrid.tensor_parallel import copy_to_tp, reduce_from_tp, set_tp_attributes


class ExpertWeight(nn.Module):
    """One stacked expert weight [E_local, rows, cols] split over TP along ``partition_dim`` (1:
    fc1's rows, 2: fc2's columns); carries ``expert_parallel = True`` (ZeRO reduces it over the
    expert-data-parallel group) and keeps its attributes through ``.to()`` / ``.to_empty()``."""

    def __init__(self, shape: tuple[int, int, int], partition_dim: int, tp: int, device, dtype):
        super().__init__()
        self.partition_dim, self.tp = partition_dim, tp
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self._mark()

    def _mark(self) -> None:
        set_tp_attributes(self.weight, tensor_model_parallel=True, partition_dim=self.partition_dim)
        self.weight.expert_parallel = True

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._mark()
        return out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (the grouped GEMM's backward
    rejects expanded gradients, e.g. of a ``sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands here (see the module docstring)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu":
        return False
    size = x.element_size()
    dims = [x.size(1)] + [d for w in weights for d in w.shape[1:]]
    return all(d * size % 16 == 0 for d in dims)


@torch.compiler.disable
def _grouped_mm_eager(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` outside any compiled graph: its fake-tensor (meta) kernel in torch 2.13
    accepts bf16 only, although the CPU kernel runs fp32, so under --compile an fp32 grouped GEMM
    runs eagerly between compiled regions (a graph break; the same kernel as without compile)."""
    return torch._grouped_mm(x, weight_t, offs=offs)


def _grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight_t, offs=offs)      # traced and compiled with the layer
    return _grouped_mm_eager(x, weight_t, offs)


def padded_bmm(x: torch.Tensor, weight_t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x [N, in] grouped by expert, weight_t [E, in, out] -> [N, out], one ``bmm`` over experts
    padded to the largest count."""
    e, n = weight_t.size(0), x.size(0)
    longest = max(counts) if counts else 0
    if n == 0 or longest == 0:
        # no rows (an EP rank that received no token): [0, out], still a function of x and the
        # weight, so the backward reaches the dispatcher's all-to-all as on every other rank
        return torch.mm(x, weight_t[0]) if e else x.new_zeros(n, weight_t.size(2))
    counts_t = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts_t,
                                     output_size=n)                                 # [N]
    starts = torch.cumsum(counts_t, 0) - counts_t
    slot = expert * longest + torch.arange(n, device=x.device) - starts[expert]       # [N]
    padded = x.new_zeros(e * longest, x.size(1)).index_copy(0, slot, x)
    out = torch.bmm(padded.view(e, longest, -1), weight_t)                            # [E, max, out]
    return out.view(e * longest, -1).index_select(0, slot)


class GroupedSwiGLUExperts(nn.Module):
    """``E_local`` SwiGLU experts of width f, TP-split over ``group`` (module docstring)."""

    def __init__(self, num_local_experts: int, hidden: int, ffn: int, group: Group, *,
                 device=None, dtype=None):
        super().__init__()
        tp = group.size
        if ffn % tp:
            raise ValueError(f"expert width {ffn} is not divisible by the tensor-parallel size {tp}; "
                             f"set --moe-ffn-hidden-size to a multiple of {tp}")
        self.group, self.num_local_experts = group, num_local_experts
        self.fc1 = ExpertWeight((num_local_experts, 2 * ffn // tp, hidden), 1, tp, device, dtype)
        self.fc2 = ExpertWeight((num_local_experts, hidden, ffn // tp), 2, tp, device, dtype)
        self.use_grouped_mm = True   # False forces the padded batched product

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """tokens [N, h] (``counts[e]`` rows per local expert, in order; a device tensor, as the
        dispatchers give it, or a list) -> outputs [N, h]."""
        x = copy_to_tp(tokens, self.group) if self.group.size > 1 else tokens
        # fc1's rows interleave gate and up (the checkpoint layout); one copy of the weight puts
        # the gate rows first, so the product is [gate | up] and silu and the product read
        # unit-stride rows (on the interleaved product they ran several times slower on a CPU)
        e, rows, h = self.fc1.weight.shape
        w1 = self.fc1.weight.view(e, rows // 2, 2, h).transpose(1, 2).reshape(e, rows, h)
        w1 = w1.transpose(1, 2)                                  # [E, h, 2f/tp] columns [gate | up]
        w2 = self.fc2.weight.transpose(1, 2)                     # [E, f/tp, h]
        # no rows: the padded path (torch._grouped_mm's backward rejects empty operands)
        if self.use_grouped_mm and x.size(0) > 0 and grouped_mm_supported(x, w1, w2):
            # offsets from the device counts: no host read
            offs = torch.cumsum(torch.as_tensor(counts, device=x.device), 0).to(torch.int32)
            y = _ContiguousGrad.apply(_grouped_mm(x, w1, offs))                          # [N, 2f/tp]
            gate, up = y.chunk(2, dim=-1)
            act = F.silu(gate) * up                                                      # [N, f/tp]
            out = _ContiguousGrad.apply(_grouped_mm(act, w2, offs))                      # [N, h]
        else:
            # the padded product sizes its batch by the largest count: one host read
            counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
            gate, up = padded_bmm(x, w1, counts).chunk(2, dim=-1)
            out = padded_bmm(F.silu(gate) * up, w2, counts)
        return reduce_from_tp(out, self.group) if self.group.size > 1 else out
