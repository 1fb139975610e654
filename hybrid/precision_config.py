"""Mixed-precision training's loss-scaling settings (Micikevicius et al. 2018, as ZeRO §3.1 uses it).

A leaf module (layer 0 of docs/design.md §Architecture) without torch: the ZeRO engines' loss scaler
(:mod:`hybrid.zero.loss_scaler`) and the application's config checks, which run before torch is
loaded (pretrain.preflight), read the same defaults from it.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass
class LossScaleConfig:
    """Dynamic loss scaling (fp16 only): start at ``initial_scale``; after ``hysteresis`` overflowed
    steps multiply by ``backoff_factor`` (never below ``min_scale``); after ``growth_interval``
    clean steps in a row multiply by ``growth_factor``."""

    initial_scale: float = 2.0 ** 16
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        if not self.min_scale > 0:
            raise ValueError(f"loss scale min_scale must be > 0, got {self.min_scale}")
        if not self.initial_scale >= self.min_scale:
            raise ValueError(f"initial loss scale {self.initial_scale} is below min_scale "
                             f"{self.min_scale}; raise initial_scale or lower min_scale")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"growth_interval ({self.growth_interval}) and hysteresis "
                             f"({self.hysteresis}) must be >= 1")
        if not self.growth_factor > 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{self.growth_factor} and {self.backoff_factor}")
