"""ZeRO-DP (Rajbhandari et al. 2019, §5): partition optimizer states (stage 1, Pos), gradients
(stage 2, Pos+g) and parameters (stage 3, Pos+g+p) across the data-parallel group, on top of
Megatron tensor parallelism (each TP rank's shard is what its DP group partitions).

One engine class per stage, named after what it partitions (:mod:`.factory` maps the stage number
to it): :class:`DataParallel`, :class:`OptimizerStatePartitioning`, :class:`GradientPartitioning`
(:mod:`.optimizer`, flat buffers) and :class:`ParameterPartitioning` (:mod:`.stage3`). All share
one step, :class:`hybrid.zero.engine.ZeroEngine`.

Shared core: :mod:`.config`, :mod:`.engine`, :mod:`.loss_scaler`, :mod:`.adamw`, :mod:`.clip`,
:mod:`.report`. Stages 0-2: :mod:`.partition` (flat buffers, buckets), :mod:`.reducer` (bucketed
gradient communication overlapped with backward). Stage 3: ``stage3*``.
"""

from hybrid.adamw_config import AdamWConfig, uses_weight_decay
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.optimizer import (DataParallel, GradientPartitioning, OptimizerStatePartitioning,
                                   ZeroOptimizer)
from hybrid.zero.results import Fragment, StepResult
from hybrid.zero.stage3 import ParameterPartitioning

__all__ = ["AdamWConfig", "DataParallel", "Fragment", "GradientPartitioning", "LossScaleConfig",
           "OptimizerStatePartitioning", "ParameterPartitioning", "StepResult", "ZeroConfig",
           "ZeroOptimizer", "build_zero_optimizer", "uses_weight_decay"]
