"""ZeRO-DP (Rajbhandari et al. 2019, §5): partition optimizer states (stage 1, Pos), gradients
(stage 2, Pos+g) and parameters (stage 3, Pos+g+p) across the data-parallel group, on top of
Megatron tensor parallelism (each TP rank's shard is what its DP group partitions).

Shared core: :mod:`.config`, :mod:`.loss_scaler`, :mod:`.adamw`, :mod:`.clip`, :mod:`.report`.
Stages 0-2: :mod:`.partition` (flat buffers, buckets), :mod:`.reducer` (bucketed gradient
communication overlapped with backward), :mod:`.optimizer` (the engine). Stage 3: ``stage3*``.
"""

from hybrid.adamw_config import AdamWConfig, uses_weight_decay
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.optimizer import ZeroOptimizer
from hybrid.zero.results import Fragment, StepResult

__all__ = ["AdamWConfig", "Fragment", "LossScaleConfig", "StepResult", "ZeroConfig",
           "ZeroOptimizer", "build_zero_optimizer", "uses_weight_decay"]
