"""FP8 scaling recipes for training GEMMs (issue 36 item 4; the recipes of NVIDIA Transformer Engine
and torchao's float8 training; formats from Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", §2-3).

Formats (``--fp8-format``): ``e4m3`` casts every GEMM operand to E4M3 (max 448); ``hybrid`` casts
the forward's operands (input, weight) to E4M3 and the gradients of the backward to E5M2 (max
57344, wider range, one mantissa bit less), Transformer Engine's HYBRID.

A tensor ``t`` is cast with a scale ``s`` (fp32): ``q = fp8(clamp(t * s, -F, F))`` with ``F`` the
format's largest finite value (the clamp saturates instead of overflowing); the GEMM receives the
inverse ``1 / s`` and returns ``(q_a / s_a) (q_b / s_b)`` in the output dtype. The scale comes from
an amax, the largest ``|t|`` over the elements it covers:

    s = F / max(amax, 1e-12) / 2^margin          (computed in fp64, rounded once to fp32)

Recipes (``--fp8-recipe``), for ``Y = X W^T`` with X ``[M, K]`` and W ``[N, K]``:

* ``tensorwise`` - current scaling: one scale per tensor from the tensor's own amax, computed just
  before the cast (torchao's tensorwise, TE's Float8CurrentScaling).
* ``delayed`` - delayed scaling (TE's DelayedScaling): one scale per tensor from an amax *history*
  of the last ``--fp8-amax-history-len`` casts of that tensor role (input, weight, output
  gradient of this linear), reduced by ``--fp8-amax-compute-algo`` (``max`` of the window, or
  ``most_recent``). The history holds the casts before the current one: a call computes its scale
  from the history, casts, then pushes its own amax (newest first). A history that is still all
  zeros (the first call, or a tensor that was zero throughout the window) falls back to the
  current amax, so the first step is not cast with an arbitrary scale.
* ``rowwise`` - torchao's rowwise recipe: one scale per row of the left operand and one per column
  of the right operand of every GEMM, i.e. along the dimension the GEMM does *not* sum over, each
  rounded down to a power of two (torchao rounds rowwise scales so; dequantization is then exact).
  Forward: X per row (over K), W per output feature (over K). Backward ``dX = dY W``: dY per row
  (over N), W per column (over N); ``dW = dY^T X``: dY per column (over M), X per column (over M).

A NaN or Inf in a tensor gives a NaN or zero scale, so the cast and the GEMM's output are NaN: a
non-finite value is still seen by the engines' checks after an FP8 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "rowwise")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
AMAX_EPS = 1e-12   # an all-zero tensor gets scale F / 1e-12 instead of a division by zero


@dataclass(frozen=True)
class Fp8Recipe:
    """How every FP8 linear casts its operands (module docstring); ``margin``: scales are divided
    by ``2^margin`` (Megatron's --fp8-margin), headroom against an amax that grows."""

    format: str = "hybrid"
    recipe: str = "tensorwise"
    amax_history_len: int = 1          # Megatron's defaults (Transformer Engine's: 1024, "max")
    amax_compute_algo: str = "most_recent"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"--fp8-format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo must be max or most_recent, got "
                             f"{self.amax_compute_algo!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be a positive integer, got "
                             f"{self.amax_history_len!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"--fp8-margin must be an integer >= 0, got {self.margin!r}")

    @property
    def forward_dtype(self) -> torch.dtype:
        """The fp8 dtype of inputs and weights."""
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        """The fp8 dtype of output gradients: E5M2 with ``hybrid``, E4M3 with ``e4m3``."""
        return E5M2 if self.format == "hybrid" else E4M3


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


def amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| in fp32: a 0-dim tensor (``dim`` None) or kept-dim ``[R, 1]`` / ``[1, C]`` of a 2-D
    ``t`` reduced over ``dim``."""
    a = t.abs()
    a = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    return a.to(torch.float32)


def scale_from_amax(a: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                    power_of_two: bool = False) -> torch.Tensor:
    """``F / max(a, 1e-12) / 2^margin`` in fp64, rounded to fp32; with ``power_of_two`` rounded
    down to a power of two (rowwise). An Inf amax gives 0, a NaN amax NaN."""
    s = fp8_max(dtype) / torch.clamp(a.to(torch.float64), min=AMAX_EPS) / (2.0 ** margin)
    s = s.to(torch.float32)
    if power_of_two:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(clamp(t * scale, -F, F))``: ``scale`` broadcasts against ``t`` (0-dim, ``[R, 1]`` or
    ``[1, C]``); the product is taken in fp32."""
    bound = fp8_max(dtype)
    return (t.to(torch.float32) * scale).clamp(-bound, bound).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values an fp8 GEMM computes with: ``q / scale`` (as ``q * (1 / scale)``)."""
    return q.to(torch.float32) * scale.reciprocal()


def history_amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale is computed from: the window's maximum, or its newest entry
    (index 0)."""
    return history.amax() if algo == "max" else history[0]


def push_history(history: torch.Tensor, a: torch.Tensor) -> None:
    """Record amax ``a`` as the newest entry (index 0), dropping the oldest, in place."""
    history.copy_(torch.roll(history, 1))
    history[0] = a
