"""Find and read a Megatron-LM / megatron-core GPT checkpoint: its ``args`` and its full tensors.

Two formats, both under a save directory whose ``latest_checkpointed_iteration.txt`` names the
iteration (a number, or ``release``):

    torch_dist   iter_NNNNNNN/ metadata.json ({"sharded_backend": "torch_dist", ...}),
                 common.pt (torch.save: args, iteration, checkpoint_version), .metadata and
                 __R_I.distcp (torch.distributed.checkpoint: hybrid/checkpoint/dcp_reader.py).
                 Keys are global: word embedding [V_padded, h]; the transformer layers stacked,
                 ``decoder.layers.<param>`` [L, ...] (or ``decoder.layers.<i>.<param>`` per layer
                 when written with non-homogeneous layers); SwiGLU's fc1 global rows are
                 ``[gate; up]`` (or two keys ``..._w`` / ``..._v``). Norms are named as Transformer
                 Engine fuses them: ``linear_qkv.layer_norm_weight`` (input norm),
                 ``linear_fc1.layer_norm_weight`` (pre-MLP norm), whatever spec trained it.
    legacy       iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt (PP 1) or mp_rank_TT_PPP/ (PP > 1), one
                 torch.save per model-parallel rank: {'args', 'iteration', 'model' (or 'model0',
                 'model1', ... with virtual pipeline stages), 'optimizer', 'rng_state', ...}. Each
                 holds its TP shard of each tensor with the layers of its pipeline stage numbered
                 from 0; column-parallel tensors (word embedding, output layer, linear_qkv,
                 linear_fc1) are split by rows, row-parallel ones (linear_proj, linear_fc2) by
                 columns, the rest replicated. Per TP rank, SwiGLU's fc1 rows are
                 ``[gate_r; up_r]``.

:func:`read_megatron` returns a :class:`MegatronCheckpoint`: ``args`` (None when not stored),
the iteration, and ``{name: full tensor}`` with names ``decoder.layers.<global i>.<param>``, each tensor in Megatron's global layout except SwiGLU's fc1,
put in ``[gate; up]`` order for both formats. Every ``torch.save`` file is read through
:mod:`hybrid.checkpoint.foreign_files`; DCP's ``.metadata`` is parsed as data, never unpickled
(:mod:`hybrid.checkpoint.dcp_reader`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.dcp_reader import DCPReader
from hybrid.checkpoint.format import CheckpointError
from hybrid.checkpoint.foreign_files import load_torch

TRACKER_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
_EXPERT_RANK_DIR = re.compile(r"mp_rank_\d{2}_\d{3}_\d{3}$")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
ROW_SPLIT = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.weight", ".linear_fc1.bias",
             "embedding.word_embeddings.weight", "output_layer.weight")
COLUMN_SPLIT = (".linear_proj.weight", ".linear_fc2.weight")
FC1 = (".linear_fc1.weight", ".linear_fc1.bias")


@dataclass
class MegatronCheckpoint:
    args: object | None            # Megatron-LM's training arguments (argparse.Namespace)
    iteration: int | None
    tensors: dict[str, torch.Tensor]
    description: str               # format and directory, for messages


def iteration_dir(path: str | Path) -> Path:
    """The checkpoint directory to read: ``path`` itself when it holds one, else the iteration
    its ``latest_checkpointed_iteration.txt`` names."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--load {path} is not a directory; pass Megatron's --save directory "
                              f"or one of its iter_NNNNNNN directories")
    if _is_checkpoint(path):
        return path
    tracker = path / TRACKER_FILE
    if not tracker.is_file():
        raise CheckpointError(f"{path} holds no Megatron checkpoint: no {TRACKER_FILE}, no "
                              f"mp_rank_* directories and no torch_dist files; pass Megatron's "
                              f"--save directory or one of its iter_NNNNNNN directories")
    text = tracker.read_text().strip()
    if text == "release":
        found = path / "release"
    elif text.isdigit():
        found = path / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{tracker} says {text!r}, neither an iteration number nor 'release'")
    if not found.is_dir():
        raise CheckpointError(f"{tracker} names {found.name}, which does not exist in {path}")
    return found


def _is_checkpoint(path: Path) -> bool:
    return (path / "metadata.json").is_file() or any(_RANK_DIR.match(p.name) for p in path.iterdir())


def read_megatron(path: str | Path) -> MegatronCheckpoint:
    """The Megatron checkpoint at ``path`` (module docstring)."""
    directory = iteration_dir(path)
    if (directory / "metadata.json").is_file():
        return _read_dist(directory)
    return _read_legacy(directory)


# ---- torch_dist ----------------------------------------------------------------------------------
def _read_dist(directory: Path):
    config = json.loads((directory / "metadata.json").read_text())
    backend = config.get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{directory} is a Megatron {backend!r} checkpoint; only torch_dist "
                              f"and the legacy torch format are read. Convert it with Megatron-LM "
                              f"(--ckpt-convert-format torch_dist)")
    common_file = directory / "common.pt"
    common = load_torch(common_file) if common_file.is_file() else {}
    reader = DCPReader(directory)
    out = {}
    for key, shape in reader.tensor_shapes().items():
        if key.startswith("optimizer.") or "._extra_state" in key:
            continue
        full = reader.full_tensor(key)
        if key.startswith("decoder.layers.") and not _LAYER.match(key):   # stacked: [L, ...]
            param = key[len("decoder.layers."):]
            out.update({f"decoder.layers.{i}.{param}": full[i] for i in range(shape[0])})
        else:
            out[key] = full
    return MegatronCheckpoint(_args_of(common, common_file), _iteration_of(common),
                              _join_swiglu_halves(out), f"torch_dist checkpoint {directory}")


def _join_swiglu_halves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``..linear_fc1.weight_w`` / ``_v`` (gate / up, saved as separate keys) -> one ``[gate; up]``."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(tuple(f"{s}_w" for s in FC1)):
            out[key[:-2]] = torch.cat([t, tensors[key[:-2] + "_v"]])
        elif not key.endswith(tuple(f"{s}_v" for s in FC1)):
            out[key] = t
    return out


# ---- legacy --------------------------------------------------------------------------------------
def _read_legacy(directory: Path):
    if any(_EXPERT_RANK_DIR.match(p.name) for p in directory.iterdir()):
        raise CheckpointError(f"{directory} has expert-parallel ranks (mp_rank_TT_PPP_EEE): a "
                              f"mixture-of-experts model, which this GPT cannot hold")
    ranks = {}   # (tp, pp) -> file
    for p in directory.iterdir():
        m = _RANK_DIR.match(p.name)
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = p / LEGACY_FILE
    if not ranks:
        raise CheckpointError(f"{directory} holds neither mp_rank_* directories (legacy format) "
                              f"nor metadata.json (torch_dist); pass a Megatron checkpoint")
    tp, pp = max(t for t, _ in ranks) + 1, max(s for _, s in ranks) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") for t in range(tp)
               for s in range(pp) if (t, s) not in ranks or not ranks[(t, s)].is_file()]
    if missing:
        raise CheckpointError(f"{directory} lacks {LEGACY_FILE} of {', '.join(missing)} (TP {tp} x "
                              f"PP {pp}); copy the whole checkpoint directory")
    args, iteration, chunks = None, None, {}   # chunks: (virtual stage, pp stage) -> [state dict of each TP rank]
    for (t, s), file in sorted(ranks.items(), key=lambda item: (item[0][1], item[0][0])):
        state = load_torch(file)
        if not isinstance(state, dict):
            raise CheckpointError(f"{file} holds a {type(state).__name__}, not Megatron's state dict")
        args, iteration = args or _args_of(state, file), _iteration_of(state)
        models = _model_chunks(state, file)
        for v, model in enumerate(models):
            chunks.setdefault((v, s), []).append(model)
        del state
    return MegatronCheckpoint(args, iteration, _merge_stages(chunks, directory),
                              f"legacy checkpoint {directory} (TP {tp}, PP {pp})")


def _model_chunks(state: dict, file: Path) -> list[dict]:
    if "model" in state:
        return [state["model"]]
    virtual = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not virtual:
        raise CheckpointError(f"{file} holds no 'model' entry (keys: {sorted(state)[:6]}); is it "
                              f"an optimizer-only or distributed-optimizer file?")
    return [state[k] for k in virtual]


def _merge_stages(chunks: dict, directory: Path) -> dict[str, torch.Tensor]:
    """Pipeline stages in model order (virtual stage, then stage) with their layers renumbered
    globally; each tensor's TP shards joined."""
    out, offset = {}, 0
    for key in sorted(chunks):
        merged = _merge_tp(chunks[key], directory)
        layers = sorted({int(m.group(1)) for m in map(_LAYER.match, merged) if m})
        for name, t in merged.items():
            m = _LAYER.match(name)
            if m:
                name = f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}"
            if name == "output_layer.weight" and name in out:
                continue
            out.setdefault(name, t)
        offset += len(layers)
    return out


def _merge_tp(shards: list[dict], directory: Path) -> dict[str, torch.Tensor]:
    if any("language_model" in k for k in shards[0]):
        raise CheckpointError(f"{directory} is a checkpoint of Megatron-LM's legacy model "
                              f"(language_model.* names), not megatron-core's GPTModel; convert it "
                              f"to megatron-core first (Megatron-LM's tools/checkpoint)")
    out = {}
    for name, first in shards[0].items():
        if not isinstance(first, torch.Tensor) or "_extra_state" in name:
            continue
        parts = [s[name] for s in shards]
        if name.endswith(ROW_SPLIT):
            if name.endswith(FC1) and _is_gated(name, parts, shards[0]):
                halves = [p.chunk(2) for p in parts]     # per rank [gate_r; up_r]
                out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                out[name] = torch.cat(parts, dim=0)
        elif name.endswith(COLUMN_SPLIT):
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = first
    return out


def _is_gated(name: str, parts: list[torch.Tensor], model: dict) -> bool:
    """SwiGLU: fc1 has twice the rows fc2 has columns (per rank)."""
    fc2 = model.get(name.rsplit(".linear_fc1.", 1)[0] + ".linear_fc2.weight")
    return fc2 is not None and parts[0].shape[0] == 2 * fc2.shape[1]


def _args_of(state, file: Path):
    args = state.get("args") if isinstance(state, dict) else None
    if args is not None and not hasattr(args, "num_layers"):
        raise CheckpointError(f"{file} stores 'args' of type {type(args).__name__} without "
                              f"num_layers; pass the model flags instead")
    return args


def _iteration_of(state) -> int | None:
    iteration = state.get("iteration") if isinstance(state, dict) else None
    return iteration if isinstance(iteration, int) else None
