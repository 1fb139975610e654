"""Megatron's precision-aware optimizer flags (issue 33 part 4): --use-precision-aware-optimizer,
--exp-avg-dtype, --exp-avg-sq-dtype, --main-params-dtype. What they set, what they refuse and why,
and the dry run's and tools/rank_layouts.py's model states following K = 4 + 2 + 2."""

import pytest

from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.dry_run import dry_run_report, format_report

BF16 = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def test_flags_set_the_moment_dtypes_and_the_engine_gets_them():
    cfg, _ = parse_args(BF16)
    assert (cfg.optimizer.exp_avg_dtype, cfg.optimizer.exp_avg_sq_dtype) == ("bf16", "bf16")
    assert cfg.optimizer.adamw_moment_dtypes() == {"exp_avg_dtype": "bf16",
                                                   "exp_avg_sq_dtype": "bf16"}
    default, _ = parse_args([])
    assert default.optimizer.adamw_moment_dtypes() == {"exp_avg_dtype": "fp32",
                                                       "exp_avg_sq_dtype": "fp32"}


@pytest.mark.parametrize("argv, message", [
    (["--exp-avg-dtype", "bf16"], "add --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], "fp32 or bf16"),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp16"], "fp32 or bf16"),
    (["--main-params-dtype", "fp16"], "stochastic rounding is not implemented"),
    (["--main-params-dtype", "bf16"], "must be fp32"),
    (BF16 + ["--zero-stage", "1", "--offload-optimizer", "cpu"], "no 16-bit path"),
])
def test_refusals_name_the_problem_and_the_fix(argv, message):
    with pytest.raises(TrainConfigError, match=message):
        parse_args(argv)


def test_dry_run_model_states_follow_the_moment_dtypes():
    full = dry_run_report(parse_args(["--config", "tiny-cpu"])[0])          # TP 2 x DP 2, ZeRO 2
    low = dry_run_report(parse_args(["--config", "tiny-cpu", *BF16])[0])
    psi, nd = full["params_per_rank"], 2
    assert full["optimizer_bytes_per_param"] == 12 and low["optimizer_bytes_per_param"] == 8
    drop = full["model_states_per_rank"]["total"] - low["model_states_per_rank"]["total"]
    assert drop == pytest.approx((12 - 8) * psi / nd)           # Pos+g: K Ψ / Nd
    assert low["model_states_per_rank"]["adam_moments"] == pytest.approx(4 * psi / nd)
    assert "K = 4 + 2 + 2 = 8" in format_report(low)
    assert "K = 4 + 4 + 4 = 12" in format_report(full)


def test_rank_layouts_follow_the_moment_dtypes():
    import dataclasses
    from hybrid.perf.pipeline import estimate_layout
    from tools.rank_layouts import PRESETS
    preset = PRESETS["zero-100b"]
    full = estimate_layout(preset.published, **preset.model())
    low = estimate_layout(preset.published,
                          **dataclasses.replace(preset, moments=("bf16", "bf16")).model())
    psi = full.model_state_bytes / (2 + 14 / 25)                 # Pos+g: (2 + (2 + 12)/Nd) Ψ
    assert full.model_state_bytes - low.model_state_bytes == pytest.approx(4 * psi / 25)
    assert low.optimizer_s == pytest.approx(full.optimizer_s * 20 / 28)
