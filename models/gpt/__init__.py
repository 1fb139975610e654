"""GPT model for the hybrid framework - GPT-2, and the Llama family through GPTConfig's options: config
and presets, the tensor-parallel model and the single-device reference used as the numerical oracle
(ZeRO paper §10, Megatron-LM §3).

The config and presets import without torch (a launcher checks a config before it starts any rank);
the two models are imported on first use (PEP 562).
"""

from models.gpt.config import ConfigError, GPTConfig
from models.gpt.presets import PAPER_RUNS, PRESETS, PaperRun, get_config, get_paper_run

__all__ = ["ConfigError", "GPTConfig", "GPTModel", "PAPER_RUNS", "PRESETS", "PaperRun", "ReferenceGPT",
           "get_config", "get_paper_run"]


def __getattr__(name: str):
    if name == "GPTModel":
        from models.gpt.model import GPTModel
        return GPTModel
    if name == "ReferenceGPT":
        from models.gpt.reference import ReferenceGPT
        return ReferenceGPT
    raise AttributeError(f"module 'models.gpt' has no attribute {name!r}")
