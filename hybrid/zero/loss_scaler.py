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

import torch

from hybrid.zero.config import LossScaleConfig, ZeroConfig

log = logging.getLogger(__name__)


class NoOpScaler:
    """bf16 / fp32: the scale is always 1 and no step is ever skipped for overflow."""

    dynamic = False

    @property
    def scale(self) -> float:
        return 1.0

    def scale_tensor(self) -> float:
        return 1.0

    def update(self, overflow) -> None:
        del overflow

    def check(self) -> None:
        """Nothing to read."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


class DynamicLossScaler:
    """fp16 dynamic loss scale with growth interval, hysteresis, back-off and a floor, kept on the
    training device (issue 36: nothing in a step waits on the host).

    ``update(overflow)`` is called once per optimizer step with the agreed overflow flag, a Python
    bool or a 0-dim bool tensor on the device; with a tensor every rule below runs as ``torch.where``
    on the device, so the step never reads the flag. An overflow that asks for a scale below
    ``min_scale`` raises FloatingPointError (the gradients are non-finite even unscaled, which
    lowering the scale cannot fix): at once for a Python flag, at the next :meth:`check` (the
    trainer's log interval) for a device flag; the scale stays at the floor meanwhile, and every
    step in between is skipped (its gradients overflow at that scale too).

    ``scale`` reads the scale to the host (reports, tests); the step multiplies by
    :meth:`scale_tensor` instead.
    """

    dynamic = True

    def __init__(self, config: LossScaleConfig, device: torch.device | str = "cpu"):
        self.config, self.device = config, torch.device(device)
        # [scale, clean steps, hysteresis left, floor hit (0/1), overflows since the last check]
        self._state = torch.tensor([float(config.initial_scale), 0.0, float(config.hysteresis), 0.0,
                                    0.0], dtype=torch.float64, device=self.device)

    @property
    def scale(self) -> float:
        return float(self._state[0].item())

    def scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim fp32 tensor on the device (what backward multiplies the loss by)."""
        return self._state[0].to(torch.float32)

    def update(self, overflow) -> None:
        if not isinstance(overflow, torch.Tensor):
            self._update_host(bool(overflow))
            return
        cfg, st = self.config, self._state
        scale, clean, hyst = st[0], st[1], st[2]
        o = overflow.to(device=self.device, dtype=torch.bool).reshape(())
        hyst_o = torch.clamp(hyst - 1, min=0)                 # 0 until the next growth
        back = o & (hyst_o == 0)                              # overflow past the hysteresis
        floor = back & (scale <= cfg.min_scale)
        scale_o = torch.where(back, torch.clamp(scale * cfg.backoff_factor, min=cfg.min_scale), scale)
        clean_c = clean + 1
        grow = ~o & (clean_c >= cfg.growth_interval)
        new = torch.stack([
            torch.where(o, scale_o, torch.where(grow, scale * cfg.growth_factor, scale)),
            torch.where(o | grow, torch.zeros_like(clean), clean_c),
            torch.where(o, hyst_o, torch.where(grow, torch.full_like(hyst, cfg.hysteresis), hyst)),
            torch.maximum(st[3], floor.to(st.dtype)),
            st[4] + o.to(st.dtype)])
        st.copy_(new)

    def check(self) -> None:
        """Read the device state (once per log interval): log the overflows since the last check and
        raise FloatingPointError if one of them hit the floor."""
        scale, _, _, floor, overflows = self._state.tolist()
        self._state[4] = 0.0
        if floor:
            raise self._floor_error()
        if overflows:
            log.info("fp16 overflow: %d step(s) skipped since the last log line, loss scale now %g",
                     int(overflows), scale)

    def _floor_error(self) -> FloatingPointError:
        return FloatingPointError(
            f"fp16 gradients overflow at the minimum loss scale {self.config.min_scale:g}: the scale "
            f"cannot go lower. Check the data and learning rate for divergence, lower "
            f"LossScaleConfig.min_scale, or train in bf16")

    def _update_host(self, overflow: bool) -> None:
        """The same rules on host values (callers that hold a Python flag)."""
        cfg = self.config
        scale, clean, hyst, _, _ = self._state.tolist()
        if overflow:
            clean, hyst = 0, max(hyst - 1, 0)
            if hyst == 0:
                if scale <= cfg.min_scale:
                    raise self._floor_error()
                scale = max(scale * cfg.backoff_factor, cfg.min_scale)
            log.info("fp16 overflow: step skipped, loss scale %g (hysteresis %d left)", scale, hyst)
        else:
            clean += 1
            if clean >= cfg.growth_interval:
                clean, hyst, scale = 0, cfg.hysteresis, scale * cfg.growth_factor
        self._state[:3] = torch.tensor([scale, clean, hyst], dtype=torch.float64)

    def state_dict(self) -> dict:
        scale, clean, hyst, _, _ = self._state.tolist()
        return {"scale": scale, "clean_steps": int(clean), "hysteresis_left": int(hyst)}

    def load_state_dict(self, state: dict) -> None:
        self._state[:3] = torch.tensor([float(state["scale"]), float(state["clean_steps"]),
                                        float(state["hysteresis_left"])], dtype=torch.float64)


def build_loss_scaler(config: ZeroConfig, device: torch.device | str = "cpu"
                      ) -> DynamicLossScaler | NoOpScaler:
    """fp16 gets a dynamic scaler (its state on ``device``); bf16 and fp32 the no-op one."""
    return (DynamicLossScaler(config.loss_scale, device) if config.precision == "fp16"
            else NoOpScaler())
