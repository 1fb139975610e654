"""GPT model for the hybrid framework - GPT-2, and the Llama family through GPTConfig's options: config
and presets, the tensor-parallel model and the single-device reference used as the numerical oracle
(ZeRO paper §10, Megatron-LM §3)."""

from models.gpt.config import ConfigError, GPTConfig
from models.gpt.model import GPTModel
from models.gpt.presets import PAPER_RUNS, PRESETS, PaperRun, get_config, get_paper_run
from models.gpt.reference import ReferenceGPT

__all__ = ["ConfigError", "GPTConfig", "GPTModel", "PAPER_RUNS", "PRESETS", "PaperRun", "ReferenceGPT",
           "get_config", "get_paper_run"]
