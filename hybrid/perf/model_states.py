"""Model-state memory per device under ZeRO-DP (ZeRO paper §5, Figure 1, Tables 1 and 2).

Mixed-precision Adam keeps, per parameter: a 16-bit parameter (2 bytes), a 16-bit gradient (2 bytes)
and K = 12 bytes of optimizer state (fp32 master parameter, Adam momentum and variance, 4 bytes each).
With data parallelism of degree Nd, ZeRO partitions them:

    stage 0 (baseline DP)  (2 + 2 + K) Ψ
    stage 1 (Pos)          2Ψ + 2Ψ + K Ψ / Nd
    stage 2 (Pos+g)        2Ψ + (2 + K) Ψ / Nd
    stage 3 (Pos+g+p)      (2 + 2 + K) Ψ / Nd

K is what the optimizer state really takes (issue 33 part 4, Megatron's precision-aware optimizer):
K = master + exp_avg + exp_avg_sq bytes, :func:`optimizer_bytes_per_param`. The paper's K = 12 is
4 + 4 + 4; with both moments in bf16 K = 4 + 2 + 2 = 8, with one of them K = 4 + 2 + 4 = 10; in plain
fp32 training the master is the parameter itself, K = 0 + 4 + 4 (or 0 + 2 + 2).

With model (tensor) parallelism of degree Nm, Ψ is the per-MP-rank share Ψ / Nm.

Mixture of experts with expert parallelism EP (issue 32): the experts are split over EP ranks carved
out of DP and each expert is replicated over the expert-DP group of Nd / EP ranks only, so per rank

    dense Ψ_d / Nm x (bytes at the stage, over Nd)  +  Ψ_e / (EP Nm) x (bytes at the stage, over Nd / EP)

(:func:`moe_model_state_bytes`; Ψ_e counts all experts of the model). Pure functions of
numbers (docs/design.md §7): the runtime's start-up memory report, tools/paper_tables.py and the
tests call these same functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STAGE_NAMES = {0: "baseline", 1: "Pos", 2: "Pos+g", 3: "Pos+g+p"}
GB = 1e9  # the paper's GB


STATE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_bytes_per_param(*, master: str | None = "fp32", exp_avg: str = "fp32",
                              exp_avg_sq: str = "fp32") -> int:
    """K of the formulas: bytes of optimizer state per parameter, the master copy (``None``: no
    separate master, plain fp32 training) plus Adam's two moments in their storage dtypes."""
    for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
        if value not in STATE_DTYPE_BYTES and not (name == "master" and value is None):
            raise ValueError(f"{name} dtype must be one of {tuple(STATE_DTYPE_BYTES)}, got {value!r}")
    return ((0 if master is None else STATE_DTYPE_BYTES[master]) + STATE_DTYPE_BYTES[exp_avg]
            + STATE_DTYPE_BYTES[exp_avg_sq])


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states held by ONE device, per category (ZeRO §3.1)."""

    params_16bit: float
    grads_16bit: float
    master_fp32: float
    adam_moments: float     # momentum + variance

    @property
    def optimizer(self) -> float:
        return self.master_fp32 + self.adam_moments

    @property
    def total(self) -> float:
        return self.params_16bit + self.grads_16bit + self.master_fp32 + self.adam_moments

    def plus(self, other: "ModelStateBytes") -> "ModelStateBytes":
        return ModelStateBytes(self.params_16bit + other.params_16bit,
                               self.grads_16bit + other.grads_16bit,
                               self.master_fp32 + other.master_fp32,
                               self.adam_moments + other.adam_moments)

    def as_dict(self) -> dict[str, float]:
        return {"params_16bit": self.params_16bit, "grads_16bit": self.grads_16bit,
                "master_fp32": self.master_fp32, "adam_moments": self.adam_moments,
                "total": self.total}


def model_state_bytes(num_params: float, stage: int, dp: int, *, mp: int = 1, param_bytes: int = 2,
                      grad_bytes: int = 2, optimizer_bytes_per_param: int = 12,
                      master_bytes_per_param: int = 4) -> ModelStateBytes:
    """Model-state bytes per device for a model of ``num_params`` parameters.

    ``num_params`` is the whole model (Ψ); it is divided by ``mp`` first (Ψ / Nm). ``stage`` 0-3 is the
    ZeRO stage (0 = plain data parallel); ``dp`` the data-parallel degree Nd. The K bytes of optimizer
    state split into ``master_bytes_per_param`` (fp32 copy) and the rest (Adam moments).
    """
    _check(num_params, stage, dp, mp)
    if not 0 <= master_bytes_per_param <= optimizer_bytes_per_param:
        raise ValueError(f"master bytes per parameter {master_bytes_per_param} must lie between 0 "
                         f"and the optimizer bytes per parameter {optimizer_bytes_per_param}")
    psi = num_params / mp
    opt_share = psi / dp if stage >= 1 else psi
    grad_share = psi / dp if stage >= 2 else psi
    param_share = psi / dp if stage >= 3 else psi
    return ModelStateBytes(params_16bit=param_bytes * param_share,
                           grads_16bit=grad_bytes * grad_share,
                           master_fp32=master_bytes_per_param * opt_share,
                           adam_moments=(optimizer_bytes_per_param - master_bytes_per_param) * opt_share)


@dataclass(frozen=True)
class MoEModelStateBytes:
    """Model-state bytes of ONE device split into the dense parameters and the experts."""

    dense: ModelStateBytes
    expert: ModelStateBytes

    @property
    def total(self) -> ModelStateBytes:
        return self.dense.plus(self.expert)


def moe_model_state_bytes(dense_params: float, expert_params: float, stage: int, dp: int, ep: int,
                          *, mp: int = 1, **bytes_options) -> MoEModelStateBytes:
    """Model states per device of a model with ``dense_params`` dense parameters (partitioned over
    DP = ``dp``) and ``expert_params`` expert parameters in all (each EP rank holds 1/``ep`` of
    them, partitioned over expert-DP = ``dp`` / ``ep``); both divided by ``mp`` (TP) first.
    ``bytes_options``: those of :func:`model_state_bytes`. ``expert_params`` 0: the dense model."""
    _check(1.0, stage, dp, mp)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"the expert-parallel size must be a positive divisor of the data-parallel "
                         f"degree {dp}, got {ep!r}")
    if expert_params < 0:
        raise ValueError(f"expert parameter count must be >= 0, got {expert_params!r}")
    dense = model_state_bytes(dense_params, stage, dp, mp=mp, **bytes_options)
    expert = (model_state_bytes(expert_params / ep, stage, dp // ep, mp=mp, **bytes_options)
              if expert_params else ModelStateBytes(0.0, 0.0, 0.0, 0.0))
    return MoEModelStateBytes(dense, expert)


def bytes_per_param(stage: int, dp: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                    optimizer_bytes_per_param: int = 12) -> float:
    """Model-state bytes per device per (per-MP-rank) parameter: the coefficient of Ψ in the table."""
    return model_state_bytes(1.0, stage, dp, param_bytes=param_bytes, grad_bytes=grad_bytes,
                             optimizer_bytes_per_param=optimizer_bytes_per_param).total


def max_params_for_memory(memory_bytes: float, stage: int, dp: int, *, mp: int = 1,
                          reserved_bytes: float = 0.0, param_bytes: int = 2, grad_bytes: int = 2,
                          optimizer_bytes_per_param: int = 12) -> float:
    """Largest Ψ whose model states fit ``memory_bytes - reserved_bytes`` per device (Table 2)."""
    _check(1.0, stage, dp, mp)
    free = memory_bytes - reserved_bytes
    if free <= 0:
        raise ValueError(f"reserved bytes {reserved_bytes:.3g} leave no room in {memory_bytes:.3g} bytes")
    per_param = bytes_per_param(stage, dp, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                optimizer_bytes_per_param=optimizer_bytes_per_param)
    return free / per_param * mp


def paper_table2_params(memory_bytes: float, stage: int, dp: int, mp: int) -> float:
    """Table 2's formula column as the paper prints it: the largest Ψ for ONE MP rank, rounded to
    0.1B, times MP (7.64B -> 7.6B -> 15.2B at MP 2; the unrounded value would be 15.3B)."""
    per_rank = max_params_for_memory(memory_bytes, stage, dp, mp=1)
    return round(per_rank / 1e8) * 1e8 * mp


def dp_communication_elements(num_params: float, stage: int, *, mp: int = 1) -> float:
    """Elements each device moves per step in the DP group, in the paper's units (ZeRO §7):
    2Ψ for stages 0-2 (all-reduce = reduce-scatter + all-gather), 3Ψ for stage 3 (§7.2.2).
    Multiply by (Nd - 1) / Nd and the element size for a ring's bytes."""
    _check(num_params, stage, 1, mp)
    return (3.0 if stage == 3 else 2.0) * num_params / mp


def _check(num_params: float, stage: int, dp: int, mp: int) -> None:
    if stage not in STAGE_NAMES:
        raise ValueError(f"ZeRO stage must be one of 0, 1, 2, 3 (0 = plain data parallel), got {stage!r}")
    for name, value in (("data-parallel degree", dp), ("model-parallel degree", mp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not num_params > 0 or math.isinf(num_params):
        raise ValueError(f"parameter count must be a positive finite number, got {num_params!r}")

