"""GPT-2 model for the hybrid framework: config and presets, the tensor-parallel model and the
single-device reference used as the numerical oracle (ZeRO paper §10, Megatron-LM §3)."""

from models.gpt.config import ConfigError, GPTConfig
from models.gpt.presets import PAPER_RUNS, PRESETS, PaperRun, get_config, get_paper_run

__all__ = ["ConfigError", "GPTConfig", "PAPER_RUNS", "PRESETS", "PaperRun", "get_config",
           "get_paper_run"]
