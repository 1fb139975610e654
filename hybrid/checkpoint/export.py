"""Export a checkpoint's model weights in the canonical layout of ``models/gpt/reference.py``.

Checkpoint pieces are stored in the TP model's full layout (QKV rows interleaved per head, word
embedding padded to a multiple of 128 x TP; see :mod:`models.gpt.sharding`), which concatenating any
TP degree's shards reproduces. This module undoes those two differences so the weights load into the
single-device reference (or any plain GPT-2 implementation), whatever layout trained them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid.checkpoint.format import CheckpointError
from hybrid.checkpoint.loader import CheckpointReader


def canonical_state_dict(path: str | Path, kind: str = "master") -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, gpt_config_dict)`` of the checkpoint at ``path`` (a save dir or an iter dir).

    ``kind="master"`` gives the fp32 master weights (exact training state); ``"model"`` the 16-bit
    parameters the forward pass used."""
    from models.gpt.config import GPTConfig
    from models.gpt.sharding import canonical_shapes, from_tp_layout
    reader = CheckpointReader(path)
    config_dict = reader.metadata.get("model_config")
    if config_dict is None:
        raise CheckpointError(f"{reader.directory} stores no model_config; it was not written by "
                              f"hybrid.training.checkpointing")
    config = GPTConfig.from_dict(config_dict)
    out = {}
    for name in canonical_shapes(config):
        full = reader.full_tensor(kind, name)
        out[name] = from_tp_layout(config, name, full).clone()
    return out, config_dict
