"""Gathered working memory of ZeRO-3 with and without memory-centric tiling (ZeRO-Infinity,
Rajbhandari et al. SC'21; issue 35 part 1), as pure functions of shapes.

A ZeRO-3 sharding unit (a transformer layer) is gathered whole around its use: its working memory
is every parameter of the unit. With ``--tile-factor T`` (:mod:`hybrid.zero.tiling`) each linear
weight ``[rows, cols]`` becomes T row-block tiles gathered one at a time, so the unit holds its
small parameters (norms, biases: ``rest``) plus one tile of its largest weight. The runtime engine
measures the same quantity from its buffers (``ParameterPartitioning.working_memory()``); the dry
run and the layout chooser can call :func:`gpt_layer_working_memory` without building anything.
Bytes, no look-ahead prefetch (prefetching overlaps one more unit or tile).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerWeights:
    """One sharding unit's parameters (TP-local elements): the tileable linear weights
    ``(rows, cols)`` and everything else (``rest``)."""

    weights: tuple[tuple[int, int], ...]
    rest: int


def working_memory_elements(layer: LayerWeights, tile_factor: int = 1) -> int:
    """Elements gathered while the unit computes: all of it (T = 1), else ``rest`` plus the largest
    tile ``rows/T x cols``."""
    if tile_factor < 1:
        raise ValueError(f"tile factor must be >= 1, got {tile_factor}")
    if tile_factor == 1:
        return layer.rest + sum(r * c for r, c in layer.weights)
    return layer.rest + max((r // tile_factor * c for r, c in layer.weights), default=0)


def required_tile_factor(layer: LayerWeights, budget_elements: int, limit: int = 1 << 16
                         ) -> int | None:
    """The smallest tile factor (dividing every weight's rows) under which the unit's working
    memory fits ``budget_elements``; None when no tile factor fits (its ``rest`` alone is over)."""
    rows = [r for r, _ in layer.weights]
    for t in range(1, min([limit, *rows]) + 1):
        if all(r % t == 0 for r in rows) and working_memory_elements(layer, t) <= budget_elements:
            return t
    return None


def gpt_layer_weights(hidden: int, ffn_hidden: int, qkv_size: int, *, tp: int = 1,
                      swiglu: bool = False, linear_bias: bool = True, layer_norm: bool = True
                      ) -> LayerWeights:
    """A GPT transformer layer on one TP rank (models/gpt/layer.py): QKV ``[qkv/tp, h]``, attention
    output ``[h, h/tp]``, MLP in ``[f/tp, h]`` (``[2f/tp, h]`` SwiGLU), MLP out ``[h, f/tp]``; the
    norms' gains (and LayerNorm biases) and the linear biases are ``rest``."""
    mlp_in = 2 * ffn_hidden if swiglu else ffn_hidden
    weights = ((qkv_size // tp, hidden), (hidden, hidden // tp), (mlp_in // tp, hidden),
               (hidden, ffn_hidden // tp))
    norms = 2 * hidden * (2 if layer_norm else 1)
    biases = (qkv_size // tp + hidden + mlp_in // tp + hidden) if linear_bias else 0
    return LayerWeights(weights, norms + biases)


def gpt_layer_working_memory(hidden: int, ffn_hidden: int, qkv_size: int, *, tp: int = 1,
                             tile_factor: int = 1, param_bytes: int = 2, swiglu: bool = False,
                             linear_bias: bool = True, layer_norm: bool = True) -> dict[str, int]:
    """Bytes one GPT layer gathers under ZeRO-3: ``untiled`` and ``tiled`` (with ``tile_factor``)."""
    layer = gpt_layer_weights(hidden, ffn_hidden, qkv_size, tp=tp, swiglu=swiglu,
                              linear_bias=linear_bias, layer_norm=layer_norm)
    return {"untiled": param_bytes * working_memory_elements(layer, 1),
            "tiled": param_bytes * working_memory_elements(layer, tile_factor)}
