"""The one place that reads the ZeRO stage number: ``ZeroConfig.stage`` and the layout -> the
engine class (the layout rules: :mod:`hybrid.zero_policy`, which the perf model and the config
checks read too).

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
from hybrid.zero.config import ZeroConfig
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.flat import DataParallel, GradientPartitioning, OptimizerStatePartitioning
from hybrid.zero.stage3 import ParameterPartitioning
from hybrid.zero_policy import STAGE2_AS_STAGE1_NOTE, check_layout

ENGINES: dict[int, type[ZeroEngine]] = {0: DataParallel, 1: OptimizerStatePartitioning,
                                        2: GradientPartitioning, 3: ParameterPartitioning}

log = logging.getLogger(__name__)


def build_zero_optimizer(model: nn.Module, state: ParallelState, zero_config: ZeroConfig,
                         adamw_config: AdamWConfig, offload=None, expert_dp=None,
                         **stage3_options) -> ZeroEngine:
    """The engine for ``zero_config.stage`` under ``state``'s layout, as
    :func:`hybrid.zero_policy.check_layout` decides it (stage 2 under pipeline parallelism runs as
    stage 1; stage 3 under it is refused, ValueError). ``stage3_options`` (``init_fn``/``seed``
    for a meta-built model) apply to stage 3 only; ``offload``: a
    :class:`hybrid.offload.OffloadConfig` (optimizer state on host or NVMe; None or mode "none":
    on the device, see :func:`hybrid.zero.optimizer_state.build_optimizer_state`); ``expert_dp``:
    the expert-data-parallel group of the ``expert_parallel`` parameters (default
    ``state.expert_dp``; :mod:`hybrid.zero.param_classes`)."""
    stage = check_layout(zero_config.stage, state.pp_size)
    if stage != zero_config.stage:
        if state.rank == 0:
            log.warning(STAGE2_AS_STAGE1_NOTE)
        zero_config = dataclasses.replace(zero_config, stage=stage)
    engine = ENGINES[stage]
    if engine is ParameterPartitioning:
        return engine(model, state, zero_config, adamw_config, offload=offload, expert_dp=expert_dp,
                      **stage3_options)
    if stage3_options:
        raise TypeError(f"options {sorted(stage3_options)} apply to ZeRO stage 3 only")
    return engine(model, state, zero_config, adamw_config, offload, expert_dp=expert_dp)
