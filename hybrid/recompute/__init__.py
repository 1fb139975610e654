"""Activation recomputation and ZeRO-R activation memory (ZeRO §6.1-6.3; Korthikanti et al. 2022 §5):
full / selective recompute, Pa (checkpoints partitioned across TP), Pa+cpu (host tier), MD arenas with
CB chunk sizes, an automatic planner under a memory budget, and saved-tensor measurement.

The plans and the planner import without torch (a launcher checks a config before it starts any
rank); the parts that run torch are imported on first use (PEP 562). The ``checkpoint`` function is
imported from :mod:`hybrid.recompute.checkpoint`, the module of the same name.
"""

import importlib

from hybrid.recompute.plan import FULL_MODES, MODES, RecomputePlan, Segment
from hybrid.recompute.planner import (CostModel, ModelDims, PlanEstimate, estimate, plan_for_budget,
                                      plan_from_cli)

__all__ = [
    "ActivationMeter", "Arena", "ArenaStats", "CheckpointStore", "CostModel", "FULL_MODES", "MODES",
    "ModelDims", "PlanEstimate", "RecomputePlan", "Recomputer", "Segment", "TorchRNG",
    "estimate", "plan_for_budget", "plan_from_cli",
]

_ON_FIRST_USE = {"Arena": "arena", "ArenaStats": "arena", "TorchRNG": "checkpoint",
                 "ActivationMeter": "measure", "CheckpointStore": "partitioned", "Recomputer": "runner"}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)
