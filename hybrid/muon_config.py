"""Muon's hyper-parameters, its parameter rule and its pure cost formulas (issue 33 part 1-2).

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; Liu et al. 2025, "Muon is
scalable for LLM training", the Moonlight paper) updates a 2-D weight with the orthogonalised
momentum: SGD momentum (Nesterov by default here), whose matrix is replaced by the nearest
semi-orthogonal one (five Newton-Schulz iterations of the quintic 3.4445, -4.7750, 2.0315),
scaled by ``extra_scale_factor * sqrt(max(m, n))`` (Moonlight: 0.2, so AdamW learning rates and
weight decays carry over), with decoupled weight decay. Muon trains the hidden matrices of the
transformer layers; AdamW trains the rest (embeddings, the output layer, norms, biases).

A leaf (layer 0 of docs/design.md §Architecture, no torch): the ZeRO engines, the pretraining
config checks and the reference optimizer of the tests read it.
"""

from __future__ import annotations

from dataclasses import dataclass

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Jordan's quintic: a x + b x^3 + c x^5
NS_EPS = 1e-7                                 # X / (||X||_F + eps) before the iterations
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")   # Megatron's names
MUON_NS_DTYPES = ("bf16", "fp32")
MUON_TP_MODES = ("duplicated",)   # whole matrix gathered over TP (Megatron's name); see docs
COMM_CATEGORY = "muon"            # the ledger's category of Muon's extra traffic (hybrid.comm)


@dataclass(frozen=True)
class MuonConfig:
    """``momentum``: the SGD momentum mu (m <- mu m + g); ``nesterov``: update from g + mu m;
    ``ns_steps``: Newton-Schulz iterations; ``scale_mode`` / ``extra_scale_factor``: the update is
    O x scale(m, n) x extra (spectral: sqrt(max(m, n)); with 0.2 Moonlight's AdamW-RMS match);
    ``ns_dtype``: the iteration's dtype (bf16 as published; fp32 for exact tests), also the dtype
    of Muon's communication; ``tp_mode``: how a TP-sharded matrix is orthogonalised (only
    ``duplicated``: gathered whole on every TP rank of its owner, never per shard)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    scale_mode: str = "spectral"
    extra_scale_factor: float = 0.2
    ns_dtype: str = "bf16"
    tp_mode: str = "duplicated"

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {self.momentum}")
        if int(self.ns_steps) != self.ns_steps or self.ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be an integer >= 1, got {self.ns_steps}")
        if self.scale_mode not in MUON_SCALE_MODES:
            raise ValueError(f"--muon-scale-mode must be one of {', '.join(MUON_SCALE_MODES)}, "
                             f"got {self.scale_mode!r}")
        if not self.extra_scale_factor > 0:
            raise ValueError(f"--muon-extra-scale-factor must be > 0, got "
                             f"{self.extra_scale_factor}")
        if self.ns_dtype not in MUON_NS_DTYPES:
            raise ValueError(f"--muon-ns-dtype must be bf16 or fp32, got {self.ns_dtype!r}")
        if self.tp_mode not in MUON_TP_MODES:
            raise ValueError(f"--muon-tp-mode {self.tp_mode!r} is not supported: only duplicated "
                             f"(each TP-sharded matrix is orthogonalised whole; blockwise would "
                             f"orthogonalise each shard on its own, a different optimizer)")

    @property
    def ns_itemsize(self) -> int:
        return 2 if self.ns_dtype == "bf16" else 4

    def scale(self, rows: int, cols: int) -> float:
        """The update's factor for a whole (unsharded) ``rows x cols`` matrix."""
        if self.scale_mode == "spectral":
            base = max(rows, cols) ** 0.5
        elif self.scale_mode == "unit_rms_norm":
            base = (rows / cols) ** 0.5
        else:
            base = max(1.0, rows / cols) ** 0.5
        return base * self.extra_scale_factor


def is_muon_param(name: str, ndim: int, expert: bool = False) -> bool:
    """The reference recipe's rule: the 2-D weights inside the transformer layers (attention QKV
    and projection, MLP matrices); embeddings, the output layer, norms and biases go to AdamW.
    An ``expert`` weight (issue 32) is a stack over the experts: a 3-D one [E, rows, cols] is E
    matrices, each trained by Muon on its own (Moonlight trains its MoE experts so); a 2-D
    stack [E, n] is E vectors (biases), trained by AdamW."""
    if "layers." not in name or "embedding" in name or "output" in name:
        return False
    return ndim == (3 if expert else 2)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of ``steps`` quintic iterations on a rows x cols matrix:
    with s = min, l = max dimensions, each iteration forms A = X X^T (2 s^2 l), A A (2 s^3) and
    B X (2 s^2 l)."""
    s, l = min(rows, cols), max(rows, cols)
    return steps * (4 * s * s * l + 2 * s ** 3)


def muon_comm_bytes(region: int, dp: int, tp: int, itemsize: int, tp_sharded: bool = True) -> float:
    """Logical bytes per rank and step of Muon's extra traffic (docs/optimizers.md): a
    reduce-scatter and an all-gather over the DP partition group of a dp x ``region`` buffer
    (``region``: the largest owner's Muon elements, TP-local), plus an all-gather of the owner's
    region over TP when the matrices are TP-sharded:

        2 (dp - 1) R b  +  (tp - 1) R b
    """
    dp_bytes = 2 * (dp - 1) * region * itemsize if dp > 1 else 0
    tp_bytes = (tp - 1) * region * itemsize if tp > 1 and tp_sharded else 0
    return float(dp_bytes + tp_bytes)
