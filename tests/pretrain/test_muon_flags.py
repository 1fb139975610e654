"""--optimizer muon and Megatron's Muon flags (issue 33): parsed into the ZeRO engine's MuonConfig,
Megatron's spellings kept, the unsupported combinations refused at config time with one message."""

import pytest

from hybrid.muon_config import MuonConfig
from pretrain.arguments import parse_args
from pretrain.sections import TrainConfigError


def test_muon_flags_reach_the_muon_config():
    cfg, _ = parse_args(["--optimizer", "muon", "--muon-momentum", "0.9", "--muon-num-ns-steps", "6",
                         "--no-muon-use-nesterov", "--muon-scale-mode", "shape_scaling",
                         "--muon-extra-scale-factor", "1.0", "--muon-ns-dtype", "fp32"])
    assert cfg.optimizer.muon_config() == MuonConfig(momentum=0.9, nesterov=False, ns_steps=6,
                                                     scale_mode="shape_scaling",
                                                     extra_scale_factor=1.0, ns_dtype="fp32")


def test_defaults_are_adamw_and_moonlight_muon():
    cfg, _ = parse_args([])
    assert cfg.optimizer.optimizer == "adamw" and cfg.optimizer.muon_config() is None
    cfg, _ = parse_args(["--optimizer", "adam"])          # Megatron's name for AdamW
    assert cfg.optimizer.optimizer == "adamw"
    cfg, _ = parse_args(["--optimizer", "muon"])
    m = cfg.optimizer.muon_config()
    assert (m.nesterov, m.ns_steps, m.ns_dtype, m.scale(96, 32)) == (True, 5, "bf16",
                                                                     pytest.approx(0.2 * 96 ** 0.5))


@pytest.mark.parametrize("argv, words", [
    (["--optimizer", "sgd"], "adamw or muon"),
    (["--optimizer", "muon", "--muon-tp-mode", "blockwise"], "orthogonalised whole"),
    (["--optimizer", "muon", "--zero-stage", "1", "--offload-optimizer", "cpu"], "offload"),
    (["--optimizer", "muon", "--muon-momentum", "1.0"], "--muon-momentum"),
    (["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"], "--muon-ns-dtype"),
])
def test_unsupported_muon_settings_are_refused(argv, words):
    with pytest.raises(TrainConfigError) as err:
        parse_args(argv)
    assert words in str(err.value)
