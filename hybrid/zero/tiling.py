"""Memory-centric tiling of ZeRO-3's linear weights (ZeRO-Infinity, Rajbhandari et al. SC'21,
"memory-centric tiling for working memory"; issue 35 part 1).

Under ZeRO-3 a sharding unit (a transformer layer) is all-gathered whole around its use, so the
working memory is bounded below by the unit's, i.e. by its largest weights. ZeRO-Infinity
represents a large linear operator as a mathematically equal sequence of smaller linears over
tiles of the original weight, each tile its own parameter, gathered, used and released in turn;
the largest operator then no longer has to fit whole. Here:

* **Tiles are row blocks of the stored weight** (output features): ``--tile-factor T`` splits a
  ``[rows, cols]`` weight (column-parallel ``[out/tp, in]``, row-parallel ``[out, in/tp]``) into T
  tiles ``[rows/T, cols]``, ``Y = cat_k(X W_k^T)`` along the output features. A row block is a
  contiguous range of the flattened parameter, so a tile's chunk maps straight onto the untiled
  parameter's elements: checkpoint fragments, optimizer pieces and initial values keep the
  untiled names, shapes and offsets, and the tile factor can change on resume. (Input tiles would
  give the same 1/T of working memory but strided pieces; they are not built.)
* **Each tile is its own** :class:`~hybrid.zero.stage3_unit.ShardedUnit`, outside the layer's
  unit (which keeps the norms and biases). The layer's ``weight`` stays registered with its shape
  and name but holds no storage; the tiles are parameters of their own (``TiledWeight.params``).
* **Forward and backward go tile by tile**: each tile is one autograd node (:class:`_TileLinear`)
  that gathers its tile, runs its GEMM(s) and releases it, in forward and again in backward, with
  the next tile's gather issued ahead when the engine prefetches. Each tile's gradient is
  reduce-scattered by the engine as soon as its node's backward has produced it, so the gradient
  working memory is one tile too. Activation recompute reruns the layer's forward, which gathers
  the tiles again one by one; NVMe parameter offload fetches each tile's chunk by itself.

Working memory (what :func:`working_memory` reports and ``--max-working-memory`` bounds): the
parameter bytes gathered while one sharding unit computes, without the look-ahead prefetch: the
unit's own buffer plus, when tiled, its largest tile (untiled: the unit with all its weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.perf.tiling import LayerWeights, required_tile_factor, working_memory_elements


def tileable_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules whose ``weight`` can be tiled: they say ``supports_tiling`` (the column- and
    row-parallel linears) and read the weight through ``weight_tiles`` when it is set."""
    return [m for m in module.modules() if getattr(m, "supports_tiling", False)]


@dataclass
class TilePlan:
    """One weight to tile: ``module.weight`` (canonical name ``name``) into ``factor`` row blocks."""

    module: nn.Module
    name: str
    param: nn.Parameter
    factor: int

    @property
    def rows(self) -> int:
        return self.param.shape[0] // self.factor

    def tile_params(self) -> list[tuple[nn.Parameter, int, tuple[int, ...]]]:
        """(meta parameter of one tile, its first element in the flattened weight, whole shape),
        with the weight's attributes (``tensor_model_parallel``, ``partition_dim``, ...)."""
        shape = tuple(self.param.shape)
        cols = self.param.numel() // shape[0]
        out = []
        for k in range(self.factor):
            tile = nn.Parameter(torch.empty((self.rows, *shape[1:]), device="meta",
                                            dtype=self.param.dtype),
                                requires_grad=self.param.requires_grad)
            tile.__dict__.update(self.param.__dict__)
            out.append((tile, k * self.rows * cols, shape))
        return out


def plan_tiles(model: nn.Module, modules: list[nn.Module], factor: int, threshold: int
               ) -> list[list[TilePlan]]:
    """Per sharding unit, the weights ``factor`` splits: the ``weight`` of every tileable
    submodule large enough to be partitioned (``threshold``: ZeRO-3's persistence threshold),
    expert-parallel weights excepted (they are sharded over expert-DP, untiled).
    A weight whose rows ``factor`` does not divide is refused (the error names the values that
    do)."""
    if factor <= 1:
        return [[] for _ in modules]
    names = {id(p): n for n, p in model.named_parameters()}
    plans = []
    for module in modules:
        mine = []
        for sub in tileable_modules(module):
            weight = sub.weight
            if weight is None or weight.numel() < threshold or id(weight) not in names:
                continue
            if getattr(weight, "expert_parallel", False):   # issue 32: expert stacks stay whole
                continue   # in their expert-DP units (a tile unit is partitioned over DP)
            rows = weight.shape[0]
            if rows % factor:
                fits = [t for t in range(2, min(rows, 64) + 1) if rows % t == 0]
                raise ValueError(f"--tile-factor {factor} splits the rows of {names[id(weight)]} "
                                 f"{tuple(weight.shape)} (this rank's, after TP) into {factor} "
                                 f"tiles, but {rows} rows do not divide by {factor}; use one of "
                                 f"{fits[:8]}")
            mine.append(TilePlan(sub, names[id(weight)], weight, factor))
        plans.append(mine)
    return plans


def placeholder(param: nn.Parameter, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """The untiled weight as the model keeps it: its shape and attributes, the engine's dtype and
    device, no storage (the tiles hold the values; read them through the engine, as any ZeRO-3
    parameter)."""
    new = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                       requires_grad=param.requires_grad)
    new.untyped_storage().resize_(0)
    new.__dict__.update(param.__dict__)
    return new


class TiledWeight:
    """The tiles of one linear's weight, each in its own ZeRO-3 unit; ``linear(x)`` computes
    ``x W^T`` tile by tile (see the module docstring). ``units[k]`` holds ``params[k]``."""

    def __init__(self, name: str, units: list, prefetch: bool):
        self.name, self.units, self.prefetch = name, units, prefetch
        self.params = [u.slots[0].param for u in units]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., cols] -> [..., rows]``, one autograd node per tile (eager: under a compiled
        layer, models/gpt/compile.py, the gathers and releases run outside the graph)."""
        return _tiled_linear(self, x)

    def acquire(self, k: int, step: int) -> None:
        """Gather tile k now and start the gather of the tile used next (``k + step``)."""
        self.units[k].gather(async_op=False)
        following = k + step
        if self.prefetch and 0 <= following < len(self.units):
            self.units[following].gather(async_op=True)

    def done(self, k: int) -> None:
        self.units[k].release()


@torch.compiler.disable
def _tiled_linear(tiles: TiledWeight, x: torch.Tensor) -> torch.Tensor:
    outs = [_TileLinear.apply(x, param, tiles, k) for k, param in enumerate(tiles.params)]
    return torch.cat(outs, dim=-1)                                         # [..., rows]


class _TileLinear(torch.autograd.Function):
    """``y_k = x W_k^T`` for one tile: gathered for the forward GEMM and again for the backward
    GEMMs, released after each. x ``[..., cols]``, W_k ``[rows/T, cols]`` -> ``[..., rows/T]``."""

    @staticmethod
    def forward(ctx, x, weight, tiles: TiledWeight, k: int):
        tiles.acquire(k, +1)
        y = F.linear(x, weight)
        tiles.done(k)
        ctx.save_for_backward(x)   # not the weight: its storage is released until the backward
        ctx.weight, ctx.tiles, ctx.k = weight, tiles, k
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        tiles, k, weight = ctx.tiles, ctx.k, ctx.weight
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            tiles.acquire(k, -1)               # autograd runs the later tiles' nodes first
            grad_x = grad.matmul(weight.detach())                              # [..., cols]
            tiles.done(k)
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.size(-1)).t().matmul(
                x.reshape(-1, x.size(-1)))                                     # [rows/T, cols]
        return grad_x, grad_w, None, None


def working_memory(units_of_modules: list, tiles: list[list[TiledWeight]], itemsize: int
                   ) -> dict[str, int]:
    """Gathered working memory in bytes of the built engine: ``tiled`` (each sharding unit's own
    buffer plus its largest tile) and ``untiled`` (each unit with all its weights whole), the
    maximum over the units; equal without tiling."""
    tiled = untiled = 0
    for unit, mine in zip(units_of_modules, tiles):
        own = unit.padded if unit is not None else 0
        tile_sizes = [u.padded for t in mine for u in t.units]
        whole = sum(u.numel for t in mine for u in t.units)
        tiled = max(tiled, own + max(tile_sizes, default=0))
        untiled = max(untiled, own + whole)
    return {"tiled": tiled * itemsize, "untiled": untiled * itemsize}


def check_working_memory(model: nn.Module, modules: list[nn.Module], threshold: int, factor: int,
                         budget: int | None, itemsize: int) -> None:
    """Refuse a layout whose sharding units gather more than ``budget`` bytes at once (the
    working memory of :func:`working_memory`, before anything is allocated): the error names
    the unit, what it gathers, and the ``--tile-factor`` that makes it fit, or why none does."""
    if budget is None:
        return
    names = {id(m): n for n, m in model.named_modules()}
    seen: set[int] = set()
    for index, module in enumerate(modules):
        weights = {id(m.weight): m.weight for m in tileable_modules(module)
                   if m.weight is not None and m.weight.numel() >= threshold}
        rest = 0
        for p in module.parameters():
            if id(p) not in seen and id(p) not in weights and p.numel() >= threshold:
                rest += p.numel()
            seen.add(id(p))
        layer = LayerWeights(tuple((w.shape[0], w.numel() // w.shape[0])
                                   for w in weights.values()), rest)
        used = working_memory_elements(layer, factor if weights else 1) * itemsize
        if used <= budget:
            continue
        what = (f"sharding unit {index} ({names.get(id(module), type(module).__name__) or 'model'})"
                f" gathers {used / 2**20:.3f} MiB of parameters at once")
        limit = f"over --max-working-memory {budget / 2**20:.3f} MiB"
        need = required_tile_factor(layer, budget // itemsize) if weights else None
        if need is not None:
            raise ValueError(f"{what} with --tile-factor {factor}, {limit}: its largest weight "
                             f"{max(layer.weights, key=lambda w: w[0] * w[1])} (rows, cols) "
                             f"must be split: use --tile-factor {need} (or more), or raise "
                             f"--max-working-memory")
        reason = ("its other parameters (norms, biases) alone are over it" if weights else
                  "it has no linear weight to tile (an embedding or norm is gathered whole)")
        raise ValueError(f"{what} with --tile-factor {factor}, {limit}, and no tile factor "
                         f"helps: {reason}; raise --max-working-memory or the tensor-parallel "
                         f"size")
