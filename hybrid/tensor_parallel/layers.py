"""Tensor-parallel layers (Megatron-LM §3, Fig. 3; sequence parallelism: Korthikanti et al. 2022 §4.2.2).

Activations use Megatron's ``[s, b, h]`` layout (sequence first), so the sequence-parallel shards are
slices of dim 0.

* :class:`ColumnParallelLinear` - ``Y_i = X A_i``: weight split along the output features. Its input
  enters through ``f`` (or ``g-bar`` with SP), fused with the GEMM so the backward collective overlaps
  the weight-gradient GEMM (:mod:`~hybrid.tensor_parallel.async_linear`); its output stays sharded
  ``[s, b, out/tp]``.
* :class:`RowParallelLinear` - ``Y = sum_i X_i A_i``: weight split along the input features; the
  partial sums leave through ``g`` (all-reduce) or, with SP, a reduce-scatter to ``[s/tp, b, out]``.
* :class:`VocabParallelEmbedding` - rows of the (padded) vocabulary split across ranks; ids owned by
  another rank look up zeros, and the partial embeddings are summed across TP.
* :class:`LayerNorm` - replicated; under SP each rank sees a sequence shard, so its weight and bias go
  through ``f`` and autograd sums their gradients across the TP group. :class:`RMSNorm` (gain only)
  likewise.

Every parameter carries ``tensor_model_parallel`` (sharded across TP, whatever the degree),
``partition_dim`` (-1 when replicated) and ``sequence_parallel`` (replicated but applied to a
sequence shard: LayerNorm and the row-parallel bias under SP, whose gradients ``f`` sums over TP);
the attributes survive ``.to()``/``.to_empty()``. Layers built with ``device="meta"`` allocate
nothing; ``init_weights(seed, std=, prefix=)`` fills materialised parameters from
:func:`~hybrid.tensor_parallel.init.full_init`, so values do not depend on the TP degree, and
``load_full_(weight=, bias=)`` loads this rank's shard of given full tensors.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.comm import Group
from hybrid.tensor_parallel import grad_fusion
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.async_linear import column_parallel_linear
from hybrid.tensor_parallel.fp8_linear import fp8_linear
from hybrid.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from hybrid.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence, gather_from_tp,
                                             reduce_from_tp, reduce_scatter_to_sequence)

DEFAULT_INIT_STD = 0.02  # GPT-2 / Megatron default for normal(0, std) weights


def set_tp_attributes(param: nn.Parameter, *, tensor_model_parallel: bool, partition_dim: int,
                      sequence_parallel: bool = False) -> None:
    """Mark ``param`` for optimizers, checkpoints and ZeRO (see module docstring)."""
    param.tensor_model_parallel = tensor_model_parallel
    param.partition_dim = partition_dim
    param.sequence_parallel = sequence_parallel


def _divide(total: int, group: Group, what: str) -> int:
    if total % group.size:
        raise ValueError(f"{what} {total} is not divisible by the tensor-parallel size {group.size}; "
                         f"choose a multiple of {group.size}")
    return total // group.size


class _TPModule(nn.Module):
    """Shared bookkeeping: creates parameters with their TP attributes and re-applies them after
    ``_apply`` (``to``/``to_empty``/``cuda`` may replace the Parameter objects)."""

    def __init__(self, group: Group, sequence_parallel: bool):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self._partition_dims: dict[str, int] = {}
        self._on_sequence_shard: set[str] = set()

    def _new_param(self, name: str, shape: tuple[int, ...], partition_dim: int, device, dtype,
                   on_sequence_shard: bool = False) -> None:
        """``on_sequence_shard``: a replicated parameter applied to a sequence shard, whose gradient
        autograd sums over TP through ``f`` (marked ``sequence_parallel`` like Megatron does)."""
        tensor = torch.empty(shape, device=device, dtype=dtype)
        self.register_parameter(name, nn.Parameter(tensor))
        self._partition_dims[name] = partition_dim
        if on_sequence_shard:
            self._on_sequence_shard.add(name)
        self._mark(name)

    def _mark(self, name: str) -> None:
        param = getattr(self, name)
        if param is not None:
            dim = self._partition_dims[name]
            set_tp_attributes(param, tensor_model_parallel=dim >= 0, partition_dim=dim,
                              sequence_parallel=name in self._on_sequence_shard)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for name in self._partition_dims:
            self._mark(name)
        return out

    @torch.no_grad()
    def load_full_(self, **full: torch.Tensor | None) -> None:
        """Copy this rank's shard of full (unsharded) tensors into the parameters, e.g.
        ``layer.load_full_(weight=w, bias=b)``; casts to the parameters' dtype and device."""
        for name, tensor in full.items():
            if name not in self._partition_dims:
                raise KeyError(f"{type(self).__name__} has no parameter {name!r}; it has "
                               f"{sorted(self._partition_dims)}")
            param = getattr(self, name)
            if tensor is None or param is None:
                continue
            if param.is_meta:
                raise RuntimeError(f"{type(self).__name__}.{name} is on the meta device; call "
                                   f"module.to_empty(device=...) before loading values into it")
            piece = tp_init.shard(tensor, self._partition_dims[name], self.group.rank, self.group.size)
            if piece.shape != param.shape:
                raise ValueError(f"{type(self).__name__}.{name}: full tensor {tuple(tensor.shape)} "
                                 f"gives a shard {tuple(piece.shape)}, expected {tuple(param.shape)}")
            param.copy_(piece)

    def _init_weight_and_bias(self, seed: int, std: float, prefix: str) -> None:
        weight = self.weight
        full_shape = list(weight.shape)
        dim = self._partition_dims["weight"]
        if dim >= 0:
            full_shape[dim] *= self.group.size
        full = tp_init.full_init(prefix + "weight", tuple(full_shape), std, seed)
        bias = getattr(self, "bias", None)
        self.load_full_(weight=full)
        if bias is not None:
            with torch.no_grad():
                bias.zero_()


class ColumnParallelLinear(_TPModule):
    """``Y = X A + b`` with ``A`` split by output features: weight ``[out/tp, in]``, bias ``[out/tp]``.

    Input ``[s, b, in]`` (``[s/tp, b, in]`` with ``sequence_parallel``: all-gathered along the
    sequence by ``g-bar``); output ``[s, b, out/tp]``, or ``[s, b, out]`` with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, device=None,
                 dtype=None):
        super().__init__(group, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.weight_tiles = None   # hybrid.zero.tiling.TiledWeight under ZeRO-3 tiling
        self.fp8 = None   # an Fp8Scaling: the GEMMs run in fp8 (hybrid/tensor_parallel/fp8_linear.py)
        local_out = _divide(out_features, group, "ColumnParallelLinear output size")
        self._new_param("weight", (local_out, in_features), 0, device, dtype)
        if bias:
            self._new_param("bias", (local_out,), 0, device, dtype)
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            self.init_weights(0)

    def init_weights(self, seed: int, *, std: float = DEFAULT_INIT_STD, prefix: str = "") -> None:
        """weight ~ normal(0, std) of the full ``[out, in]`` matrix named ``prefix + "weight"``; bias 0."""
        self._init_weight_and_bias(seed, std, prefix)

    supports_tiling = True   # ZeRO-3 memory-centric tiling may set ``weight_tiles``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_tiles is not None:
            y = self._tiled(x)                                                 # [s, b, out/tp]
        elif self.fp8 is not None:   # f / g-bar, then the fp8 GEMMs (no backward overlap)
            total = (gather_from_sequence(x, self.group) if self.sequence_parallel
                     else copy_to_tp(x, self.group))                          # [s, b, in]
            y = fp8_linear(total, self.weight, self.bias, self.fp8, self.group, "N")
        else:
            # = F.linear(g_bar(x) if SP else f(x), W, b); backward overlaps the input-gradient
            # all-reduce (reduce-scatter with SP) with the weight-gradient GEMM
            y = column_parallel_linear(x, self.weight, self.bias, self.group,
                                       self.sequence_parallel)                 # [s, b, out/tp]
        if self.gather_output:
            y = gather_from_tp(y, self.group)         # [s, b, out]
        return y

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """The same ``F.linear(g_bar(x) or f(x), W, b)`` with W in row tiles gathered one at a time
        (hybrid.zero.tiling); the TP collectives run once around the tiles, without the
        overlapped backward (under SP the gathered input ``[s, b, in]`` is what the tiles keep)."""
        total = (gather_from_sequence(x, self.group) if self.sequence_parallel
                 else copy_to_tp(x, self.group))                              # [s, b, in]
        y = self.weight_tiles.linear(total)                                   # [s, b, out/tp]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.group.size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelOutput(ColumnParallelLinear):
    """An untied output layer ``[V/tp, h]`` (no bias) that, given targets, returns the per-token
    loss through :func:`~hybrid.tensor_parallel.linear_cross_entropy.linear_cross_entropy` instead
    of the logits (called as the module, so ZeRO-3's module hooks gather its weight). Not tiled:
    its fused loss reads the whole weight."""

    supports_tiling = False

    check_ids = True   # the target range check (off where the data loader made it on the host)

    def __init__(self, hidden_size: int, padded_vocab_size: int, group: Group, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, padded_vocab_size, group, bias=False,
                         sequence_parallel=sequence_parallel, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None,
                vocab_size: int | None = None) -> torch.Tensor:
        """Logits ``[s, b, V/tp]`` of x ``[s(/tp), b, h]``, or with ``target [s, b]`` its loss [s, b]."""
        if target is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, target, self.group,
                                    sequence_parallel=self.sequence_parallel, vocab_size=vocab_size,
                                    check_ids=self.check_ids)


class RowParallelLinear(_TPModule):
    """``Y = sum_i X_i A_i + b`` with ``A`` split by input features: weight ``[out, in/tp]``,
    bias ``[out]`` replicated and added after the reduction.

    Input ``[s, b, in/tp]`` (already split, e.g. the output of a ColumnParallelLinear); output
    ``[s, b, out]`` all-reduced by ``g``, or ``[s/tp, b, out]`` reduce-scattered with
    ``sequence_parallel`` (the bias then goes through ``f`` so its gradient sums over TP).
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(group, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.weight_tiles = None   # hybrid.zero.tiling.TiledWeight under ZeRO-3 tiling
        self.fp8 = None   # an Fp8Scaling: the GEMMs run in fp8 (hybrid/tensor_parallel/fp8_linear.py)
        local_in = _divide(in_features, group, "RowParallelLinear input size")
        self._new_param("weight", (out_features, local_in), 1, device, dtype)
        if bias:
            self._new_param("bias", (out_features,), -1, device, dtype, sequence_parallel)
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            self.init_weights(0)

    def init_weights(self, seed: int, *, std: float = DEFAULT_INIT_STD, prefix: str = "") -> None:
        """weight ~ normal(0, std) of the full ``[out, in]`` matrix named ``prefix + "weight"``; bias 0.
        (Megatron scales ``std`` by 1/sqrt(2 * layers) for output projections: the caller's choice.)"""
        self._init_weight_and_bias(seed, std, prefix)

    supports_tiling = True   # ZeRO-3 memory-centric tiling may set ``weight_tiles``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_tiles is not None:   # row tiles of W gathered one at a time (ZeRO-Infinity)
            partial = self.weight_tiles.linear(x)                     # [s, b, out], partial sum
        elif self.fp8 is not None:
            partial = fp8_linear(x, self.weight, None, self.fp8, self.group, "K")
        else:
            partial = grad_fusion.linear(x, self.weight)              # [s, b, out], partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.group)       # [s/tp, b, out]
            bias = None if self.bias is None else copy_to_tp(self.bias, self.group)
        else:
            y = reduce_from_tp(partial, self.group)                   # g: [s, b, out]
            bias = self.bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.group.size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_TPModule):
    """Embedding table ``[V, h]`` split by rows: rank ``r`` owns ids ``[r V/tp, (r+1) V/tp)``.

    ``num_embeddings`` is the padded vocabulary (divisible by tp). Input ids of any shape ``[*]``,
    output ``[*, h]``. With ``reduce_scatter_output`` (sequence parallelism) the ids must be
    ``[s, b]`` (sequence first) and the output is this rank's sequence shard ``[s/tp, b, h]``.
    """

    check_ids = True   # the host range check on CPU ids (off where the data loader made it)

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *,
                 reduce_scatter_output: bool = False, device=None, dtype=None):
        super().__init__(group, reduce_scatter_output)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_output = reduce_scatter_output
        self.per_rank = _divide(num_embeddings, group, "padded vocabulary size")
        self.vocab_start = group.rank * self.per_rank
        self._new_param("weight", (self.per_rank, embedding_dim), 0, device, dtype)
        if not self.weight.is_meta:
            self.init_weights(0)

    def init_weights(self, seed: int, *, std: float = DEFAULT_INIT_STD, prefix: str = "") -> None:
        """weight ~ normal(0, std) of the full ``[V, h]`` table named ``prefix + "weight"``."""
        self._init_weight_and_bias(seed, std, prefix)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        if self.group.size == 1:
            partial = grad_fusion.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            partial = grad_fusion.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_output:
            return reduce_scatter_to_sequence(partial, self.group)    # [s/tp, b, h]
        return reduce_from_tp(partial, self.group)                    # [*, h]

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be int64 or int32, got {ids.dtype}")
        # A host-side range check is free on CPU; on accelerators it would force a sync per step.
        # ``check_ids`` False: the data loader checked them on the host before the copy.
        if self.check_ids and ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0
                                                         or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}); got "
                             f"[{int(ids.min())}, {int(ids.max())}] - does the tokenizer match the "
                             f"model's vocabulary size?")

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.group.size}, "
                f"reduce_scatter_output={self.reduce_scatter_output}")


def _apex_fused_layer_norm():
    """NVIDIA apex's fused CUDA layer norm when apex is installed with its CUDA extension (optional,
    docs/design.md "Dependencies"), else None; torch's own kernel is the fallback."""
    if importlib.util.find_spec("fused_layer_norm_cuda") is None:
        return None
    try:
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine
    except ImportError:
        return None
    return fused_layer_norm_affine


# looked up once, at import: inside LayerNorm.forward the lookup (importlib's find_spec) made
# torch.compile break the graph at every layer norm on CUDA
APEX_FUSED_LAYER_NORM = _apex_fused_layer_norm()


class LayerNorm(_TPModule):
    """Layer norm over the last dim with replicated weight (ones) and bias (zeros).

    With ``sequence_parallel`` each TP rank normalises a different sequence shard, so weight and bias
    pass through ``f`` (copy_to_tp) and their gradients are summed over the TP group by autograd.
    """

    def __init__(self, hidden: int, group: Group, *, eps: float = 1e-5,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(group, sequence_parallel)
        self.hidden, self.eps = hidden, eps
        self._new_param("weight", (hidden,), -1, device, dtype, sequence_parallel)
        self._new_param("bias", (hidden,), -1, device, dtype, sequence_parallel)
        if not self.weight.is_meta:
            self.init_weights(0)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, *, std: float = 0.0, prefix: str = "") -> None:
        """weight 1, bias 0 (arguments accepted for a uniform interface; they do not matter)."""
        self.weight.fill_(1.0)
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = copy_to_tp(weight, self.group), copy_to_tp(bias, self.group)
        # apex's kernel is an extension dynamo cannot trace: under torch.compile torch's layer norm
        # stays in the layer's graph, where inductor fuses it with the residual add before it
        fused = APEX_FUSED_LAYER_NORM if x.is_cuda and not torch.compiler.is_compiling() else None
        if fused is not None:
            return fused(x, weight, bias, (self.hidden,), self.eps)
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            return _LayerNorm16Function.apply(x, weight, bias, self.eps)
        return F.layer_norm(x, (self.hidden,), weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class _LayerNorm16Function(torch.autograd.Function):
    """Layer norm of a 16-bit input on CPU with fp32 statistics and fp32 gradient sums.

    torch's CPU kernel for 16-bit weights returns mean and rstd in 16 bits, and its weight and bias
    gradients (sums over the tokens) carry ~10-20x the error of one rounding of the fp64 values
    (measured at [512, 256] and [1024, 768] in bf16; dx ~1.4x). Here the forward runs torch's kernel with
    fp32 weight and bias (the same 16-bit output; fp32 mean and rstd [..., 1] saved with the
    input), the backward torch's fp32 kernel on the upcast input and gradient, each result rounded
    once."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = torch.native_layer_norm(x, (x.size(-1),), weight.float(), bias.float(), eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        w = weight.float()   # also passed as the bias: the kernel only needs one to return grad_b
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), (x.size(-1),), mean, rstd, w, w, [True, True, True])
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b.to(ctx.bias_dtype), None


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), in fp32 for 16-bit inputs; saves only x
    and the fp32 rstd [..., 1] for backward (like LayerNorm's kernel), on every device:

        x_hat = x rstd,   dw = sum_tokens(dy x_hat),   dx = rstd (dy w - x_hat mean(dy w x_hat))"""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(_compute_dtype(x))
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)      # [..., 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        compute = rstd.dtype
        x_hat = x.to(compute) * rstd
        g = grad.to(compute) * weight.to(compute)                           # d loss / d x_hat
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
        grad_w = (grad.to(compute) * x_hat).reshape(-1, x.size(-1)).sum(dim=0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit inputs, the input's own dtype otherwise (fp32, fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(_TPModule):
    """Root-mean-square norm over the last dim (Zhang & Sennrich 2019, used by Llama): ``x / rms(x)
    * weight`` with a replicated gain (ones) and no bias, in fp32 for 16-bit inputs; backward keeps
    the input and one fp32 statistic per token.

    With ``sequence_parallel`` the gain passes through ``f`` (copy_to_tp) so autograd sums its
    gradient over the TP group, as for :class:`LayerNorm`.
    """

    def __init__(self, hidden: int, group: Group, *, eps: float = 1e-5,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(group, sequence_parallel)
        self.hidden, self.eps = hidden, eps
        self._new_param("weight", (hidden,), -1, device, dtype, sequence_parallel)
        if not self.weight.is_meta:
            self.init_weights(0)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, *, std: float = 0.0, prefix: str = "") -> None:
        """weight 1 (arguments accepted for a uniform interface; they do not matter)."""
        self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.group) if self.sequence_parallel else self.weight
        return _RMSNormFunction.apply(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
