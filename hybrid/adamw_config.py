"""AdamW hyper-parameters and its parameter-group rule, shared by every optimizer backend.

A leaf module (layer 0 of docs/design.md §Architecture): the ZeRO engines (:mod:`hybrid.zero`) and
the host / NVMe backends of optimizer offload (:mod:`hybrid.offload`) both read it, so neither of
those packages has to import the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # a leaf: read by the config checks before torch is loaded
    import torch

ADAMW_KERNELS = ("fused", "foreach", "compiled")


@dataclass
class AdamWConfig:
    """AdamW (Loshchilov & Hutter 2019) hyper-parameters, same meaning as torch.optim.AdamW.

    Weight decay applies only to parameters with ``ndim >= 2`` (matrices, embeddings); biases and
    norm weights are left undecayed (see :func:`uses_weight_decay`). ``kernel``: ``fused`` (torch's
    single-pass kernel), ``foreach`` (bitwise ``torch.optim.AdamW(foreach=True)``), see
    :mod:`hybrid.zero.adamw`, or ``compiled`` (one torch.compile'd pass that also casts the 16-bit
    gradient and rounds the 16-bit parameters, :mod:`hybrid.zero.adamw_compiled`; ZeRO engines
    without offload)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    kernel: str = "fused"

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if not self.lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need eps > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.kernel not in ADAMW_KERNELS:
            raise ValueError(f"AdamW kernel must be one of {ADAMW_KERNELS}, got {self.kernel!r}")


def uses_weight_decay(param: torch.Tensor) -> bool:
    """The param-group rule: decay matrices and embeddings, not biases or norm weights."""
    return param.ndim >= 2
