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
# Storage dtypes of Adam's two moments (Megatron's --exp-avg-dtype / --exp-avg-sq-dtype names), and
# their bytes per element: the step always computes in fp32 (docs/optimizer-precision.md).
MOMENT_DTYPES = {"fp32": 4, "bf16": 2}
OFFLOAD_MOMENTS_REFUSAL = (
    "16-bit Adam moments (--exp-avg-dtype / --exp-avg-sq-dtype bf16) are not supported with "
    "--offload-optimizer: the host and NVMe AdamW (hybrid/offload/cpu_adam.py) stream fp32 moments "
    "in blocks and have no 16-bit path; keep fp32 moments with offload (the moments then live in "
    "host memory or on NVMe, not on the device), or drop --offload-optimizer")


@dataclass
class AdamWConfig:
    """AdamW (Loshchilov & Hutter 2019) hyper-parameters, same meaning as torch.optim.AdamW.

    Weight decay applies only to parameters with ``ndim >= 2`` (matrices, embeddings); biases and
    norm weights are left undecayed (see :func:`uses_weight_decay`). ``kernel``: ``fused`` (torch's
    single-pass kernel), ``foreach`` (bitwise ``torch.optim.AdamW(foreach=True)``), see
    :mod:`hybrid.zero.adamw`, or ``compiled`` (one torch.compile'd pass that also casts the 16-bit
    gradient and rounds the 16-bit parameters, :mod:`hybrid.zero.adamw_compiled`; ZeRO engines
    without offload). ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: how the moments are STORED
    (``fp32`` or ``bf16``); the update reads them into fp32, computes in fp32 and rounds them back
    to nearest (ties to even) once per step (docs/optimizer-precision.md)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    kernel: str = "fused"
    exp_avg_dtype: str = "fp32"      # storage of the first moment: fp32 | bf16
    exp_avg_sq_dtype: str = "fp32"   # storage of the second moment: fp32 | bf16

    @property
    def moment_bytes_per_param(self) -> int:
        """Bytes of both moments per parameter: 8 (fp32, fp32), 6 or 4 (bf16, bf16)."""
        return MOMENT_DTYPES[self.exp_avg_dtype] + MOMENT_DTYPES[self.exp_avg_sq_dtype]

    @property
    def low_precision_moments(self) -> bool:
        return (self.exp_avg_dtype, self.exp_avg_sq_dtype) != ("fp32", "fp32")

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
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) not in MOMENT_DTYPES:
                raise ValueError(f"{name} must be one of {tuple(MOMENT_DTYPES)}, got "
                                 f"{getattr(self, name)!r}")


def uses_weight_decay(param: torch.Tensor) -> bool:
    """The param-group rule: decay matrices and embeddings, not biases or norm weights."""
    return param.ndim >= 2
