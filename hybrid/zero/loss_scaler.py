"""Loss scaling for fp16 mixed precision (Micikevicius et al. 2018 §3.2; ZeRO §3.1 trains in fp16).

fp16 gradients underflow below 2^-24, so the loss is multiplied by a scale S before backward and the
gradients divided by S before the update. :class:`DynamicLossScaler` raises S after a run of clean
steps and lowers it after overflows (with hysteresis: only after ``hysteresis`` overflowed steps).
An overflowed step must be skipped by EVERY rank: the engines agree on it through the global
gradient norm, all-reduced over DP and TP, which is non-finite on every rank as soon as any rank's
partition holds an Inf or NaN (:mod:`hybrid.zero.engine`). bf16 and fp32 need no scaling:
:class:`NoOpScaler`.
"""

from __future__ import annotations

import logging

from hybrid.zero.config import LossScaleConfig, ZeroConfig

log = logging.getLogger(__name__)


class NoOpScaler:
    """bf16 / fp32: the scale is always 1 and no step is ever skipped for overflow."""

    dynamic = False

    @property
    def scale(self) -> float:
        return 1.0

    def update(self, overflow: bool) -> None:
        del overflow

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


class DynamicLossScaler:
    """fp16 dynamic loss scale with growth interval, hysteresis, back-off and a floor.

    ``update(overflow)`` is called once per optimizer step with the agreed overflow flag. When an
    overflow asks for a scale below ``min_scale`` a FloatingPointError says so: the gradients are
    non-finite even unscaled, which lowering the scale cannot fix.
    """

    dynamic = True

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self._scale = float(config.initial_scale)
        self._clean_steps = 0
        self._hysteresis_left = config.hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        cfg = self.config
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)  # 0 until the next growth
            if self._hysteresis_left > 0:
                log.info("fp16 overflow: step skipped, loss scale kept at %g (hysteresis %d left)",
                         self._scale, self._hysteresis_left)
                return
            if self._scale <= cfg.min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflow at the minimum loss scale {cfg.min_scale:g}: the scale "
                    f"cannot go lower. Check the data and learning rate for divergence, lower "
                    f"LossScaleConfig.min_scale, or train in bf16")
            self._scale = max(self._scale * cfg.backoff_factor, cfg.min_scale)
            log.info("fp16 overflow: step skipped, loss scale lowered to %g", self._scale)
            return
        self._clean_steps += 1
        if self._clean_steps >= cfg.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = cfg.hysteresis
            self._scale *= cfg.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def build_loss_scaler(config: ZeroConfig) -> DynamicLossScaler | NoOpScaler:
    """fp16 gets a dynamic scaler; bf16 and fp32 the no-op one."""
    return DynamicLossScaler(config.loss_scale) if config.precision == "fp16" else NoOpScaler()
