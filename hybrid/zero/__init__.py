"""ZeRO-DP (Rajbhandari et al. 2019, §5): partition optimizer states (stage 1, Pos), gradients
(stage 2, Pos+g) and parameters (stage 3, Pos+g+p) across the data-parallel group, on top of
Megatron tensor parallelism (each TP rank's shard is what its DP group partitions).

One engine class per stage, named after what it partitions (:mod:`.factory` maps the stage number
to it): :class:`DataParallel`, :class:`OptimizerStatePartitioning`, :class:`GradientPartitioning`
(:mod:`.flat`: one :class:`FlatEngine` of flat buffers, each stage declaring the parts it uses) and
:class:`ParameterPartitioning` (:mod:`.stage3`). All share one step,
:class:`hybrid.zero.engine.ZeroEngine`, and hold their fp32 master and Adam moments in one
optimizer-state backend (:mod:`.optimizer_state`: on the device, or offloaded by
:mod:`hybrid.offload`).

Parameter classes (issue 32, :mod:`.param_classes`): expert-parallel parameters are reduced and
partitioned over the expert-DP group, with flat buffers (:mod:`.flat_class`) or stage-3 units
(:mod:`.stage3_classes`) of their own.

Shared core: :mod:`.config`, :mod:`.engine` (the step), :mod:`.pieces`, :mod:`.optimizer_state`,
:mod:`.loss_scaler`, :mod:`.adamw`, :mod:`.clip`, :mod:`.report`. Stages 0-2: :mod:`.partition`
(flat buffers, buckets), :mod:`.reducer` (gradient storage and its bucketed reduction overlapped
with backward). Stage 3: ``stage3*``, :mod:`.shard_store`.
"""

from hybrid.adamw_config import AdamWConfig, uses_weight_decay
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.flat import (DataParallel, FlatEngine, GradientPartitioning,
                              OptimizerStatePartitioning)
from hybrid.zero.results import Fragment, StepResult
from hybrid.zero.stage3 import ParameterPartitioning

__all__ = ["AdamWConfig", "DataParallel", "FlatEngine", "Fragment", "GradientPartitioning",
           "LossScaleConfig", "OptimizerStatePartitioning", "ParameterPartitioning", "StepResult",
           "ZeroConfig", "build_zero_optimizer", "uses_weight_decay"]
