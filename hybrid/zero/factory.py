"""The one place that reads the ZeRO stage number: ``ZeroConfig.stage`` -> the engine class.

Each stage is a class named after what the ZeRO paper (§5) partitions across the data-parallel
group (stages 0-2 declare which parts of :class:`hybrid.zero.flat.FlatEngine` they use); the
engines never branch on the stage number themselves:

=====  ============================  ==========================================================
stage  engine                        partitioned across DP
=====  ============================  ==========================================================
0      DataParallel                  nothing (plain data parallelism)
1      OptimizerStatePartitioning    Pos: fp32 master and Adam moments (§5.1)
2      GradientPartitioning          Pos+g: and the gradients (§5.2)
3      ParameterPartitioning         Pos+g+p: and the 16-bit parameters (§5.3)
=====  ============================  ==========================================================
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.perf.model_states import stage_with_pipeline
from hybrid.zero.config import ZeroConfig
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.flat import DataParallel, GradientPartitioning, OptimizerStatePartitioning
from hybrid.zero.stage3 import ParameterPartitioning

ENGINES: dict[int, type[ZeroEngine]] = {0: DataParallel, 1: OptimizerStatePartitioning,
                                        2: GradientPartitioning, 3: ParameterPartitioning}

log = logging.getLogger(__name__)


def build_zero_optimizer(model: nn.Module, state: ParallelState, zero_config: ZeroConfig,
                         adamw_config: AdamWConfig, offload=None, **stage3_options) -> ZeroEngine:
    """The engine for ``zero_config.stage`` (stage 2 under pipeline parallelism: stage 1, see
    :func:`hybrid.perf.model_states.stage_with_pipeline`). ``stage3_options`` (``init_fn``/``seed``
    for a meta-built model) apply to stage 3 only; ``offload``: a
    :class:`hybrid.offload.OffloadConfig` (optimizer state on host or NVMe; None or mode "none":
    on the device, see :func:`hybrid.zero.optimizer_state.build_optimizer_state`)."""
    stage = stage_with_pipeline(zero_config.stage, state.pp_size)
    if stage != zero_config.stage:
        if state.rank == 0:
            log.warning("ZeRO stage 2 with pipeline parallelism runs as stage 1: the gradients of "
                        "the step's micro-batches accumulate in a full-size buffer and are "
                        "reduce-scattered once, after the last backward (stage 2 would reduce in "
                        "each of the m backwards, m times the DP traffic)")
        zero_config = dataclasses.replace(zero_config, stage=stage)
    engine = ENGINES[stage]
    if engine is ParameterPartitioning and state.pp_size > 1:
        raise ValueError(
            "ZeRO stage 3 with pipeline parallelism is not supported: stage 3 all-gathers every "
            "layer's parameters over DP in each forward and again in each backward, so with m "
            "micro-batches per step a stage would gather its parameters 2m times instead of twice "
            "(m x the 3-Psi volume of ZeRO section 7), or hold them gathered across the whole "
            "schedule and lose the memory saving (DeepSpeed refuses it too); use ZeRO stage 1 or 2 "
            "with pipeline parallelism")
    if engine is ParameterPartitioning:
        return engine(model, state, zero_config, adamw_config, offload=offload, **stage3_options)
    if stage3_options:
        raise TypeError(f"options {sorted(stage3_options)} apply to ZeRO stage 3 only")
    return engine(model, state, zero_config, adamw_config, offload)
