"""The one place that reads the ZeRO stage number: ``ZeroConfig.stage`` -> the engine.

Stages 0-2 are the flat-buffer engine of :mod:`.optimizer`, stage 3 (Pos+g+p) the partitioned
engine of :mod:`.stage3`; neither engine module imports the other.
"""

from __future__ import annotations

from torch import nn

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.zero.config import ZeroConfig
from hybrid.zero.optimizer import ZeroOptimizer
from hybrid.zero.stage3 import Stage3Optimizer


def build_zero_optimizer(model: nn.Module, state: ParallelState, zero_config: ZeroConfig,
                         adamw_config: AdamWConfig, offload=None, **stage3_options):
    """The engine for ``zero_config.stage``. ``stage3_options`` (``init_fn``/``seed`` for a
    meta-built model) apply to stage 3 only; ``offload``: a :class:`hybrid.offload.OffloadConfig`
    (optimizer state on host or NVMe)."""
    if zero_config.stage == 3:
        return Stage3Optimizer(model, state, zero_config, adamw_config, offload=offload,
                               **stage3_options)
    if stage3_options:
        raise TypeError(f"options {sorted(stage3_options)} apply to ZeRO stage 3 only")
    return ZeroOptimizer(model, state, zero_config, adamw_config, offload)
