"""Activation recomputation and ZeRO-R activation memory (ZeRO §6.1-6.3; Korthikanti et al. 2022 §5):
full / selective recompute, Pa (checkpoints partitioned across TP), Pa+cpu (host tier), MD arenas with
CB chunk sizes, an automatic planner under a memory budget, and saved-tensor measurement."""

from hybrid.recompute.arena import Arena, ArenaStats
from hybrid.recompute.checkpoint import TorchRNG, checkpoint
from hybrid.recompute.measure import ActivationMeter
from hybrid.recompute.partitioned import CheckpointStore
from hybrid.recompute.plan import FULL_MODES, MODES, RecomputePlan, Segment
from hybrid.recompute.planner import (CostModel, ModelDims, PlanEstimate, estimate, plan_for_budget,
                                      plan_from_cli)
from hybrid.recompute.runner import Recomputer

__all__ = [
    "ActivationMeter", "Arena", "ArenaStats", "CheckpointStore", "CostModel", "FULL_MODES", "MODES",
    "ModelDims", "PlanEstimate", "RecomputePlan", "Recomputer", "Segment", "TorchRNG", "checkpoint",
    "estimate", "plan_for_budget", "plan_from_cli",
]
