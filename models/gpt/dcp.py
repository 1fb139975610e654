"""torch.distributed.checkpoint (DCP) interop in torchtitan's Llama layout (issue 34, part 2), both ways.

Export: a training checkpoint of this framework (any TP/PP/DP layout and ZeRO stage; the pieces are
reassembled by :class:`hybrid.checkpoint.CheckpointReader`) -> a DCP directory whose state dict is the
one torchtitan's checkpointer saves for a Llama model:

    <fqn>                                    the model, flattened to the top level (fp32: the master
                                             weights, else the trained weights)
    optimizer.state.<fqn>.exp_avg            Adam moments, in torch's flattened optimizer state dict
    optimizer.state.<fqn>.exp_avg_sq         (``flatten_optimizer_state_dict=True``, what
    optimizer.state.<fqn>.step               torchtitan's optimizer container saves)
    optimizer.param_groups.<fqn>.<option>    torch.optim.AdamW's group options (lr, betas, eps, ...)
    train_state.step                         the iteration (int32, as torchtitan's TrainState)

with torchtitan's Llama parameter names (``tok_embeddings``, ``layers.i.attention.wq|wk|wv|wo``,
``layers.i.attention_norm``, ``layers.i.feed_forward.w1|w2|w3`` (gate, down, up),
``layers.i.ffn_norm``, ``norm``, ``output``; torchtitan 0.3's ``attention.qkv_linear.wq|wk|wv``
and ``lm_head`` with ``naming="qkv_linear"``, and either read on import). torchtitan's rotary multiplies interleaved channel pairs
(2i, 2i+1) as complex numbers (Meta's layout); ours pairs (i, i + d/2), so the rows of wq and wk are
permuted per head on the way (the same permutation HF's Llama conversion applies). The file is
written by ``torch.distributed.checkpoint.save`` in one process; DCP reshards on load, so any
number of ranks and any torchtitan parallelism load it.

Import: a DCP directory in that layout (written by torchtitan, or by ``dcp.save`` of a plain model's
state dict, any number of ranks and any sharding) -> a training checkpoint here, which any layout
resumes (``--load``). DCP's ``.metadata`` pickle is parsed as data from its opcodes, never
unpickled (:mod:`hybrid.checkpoint.dcp_reader`), and the tensor chunks read by torch's weights-only
unpickler: nothing in the directory can run code. The model dims come from the caller (a GPTConfig: DCP stores shapes,
not head counts); the shapes are checked against them. Optimizer moments are taken when present
(else fresh, zero); the data position is not (torchtitan's dataloader state is its own): the
imported run starts at the checkpoint's step with the sample count at 0.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch

from hybrid import comm
from hybrid.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from hybrid.checkpoint.dcp_reader import DCPReader
from hybrid.checkpoint.format import Piece
from hybrid.checkpoint.lock import new_run_id
from hybrid.checkpoint.state import COUNTERS_KEY
from models.gpt.config import GPTConfig
from models.gpt.hf_llama import is_llama, permute_for_rotate_half
from models.gpt.sharding import (VOCAB_TABLES, WORD_EMBEDDING, canonical_shapes, from_tp_layout,
                                 partition_dim, to_tp_layout)

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
_LAYER = {"ln1.weight": "attention_norm.weight", "ln2.weight": "ffn_norm.weight",
          "attn.proj.weight": "attention.wo.weight", "mlp.fc2.weight": "feed_forward.w2.weight"}


# torchtitan 0.3 renamed two things: the q/k/v projections sit in a fused module
# (``attention.qkv_linear.wq``) and the output layer is ``lm_head``; the tensors are the same.
NAMING = ("classic", "qkv_linear")


def rename(titan: dict, naming: str) -> dict:
    """torchtitan's classic names (``attention.wq``, ``output``) -> ``naming``'s."""
    if naming == "classic":
        return titan
    if naming != "qkv_linear":
        raise DCPInteropError(f"unknown torchtitan naming {naming!r}; one of {', '.join(NAMING)}")
    out = {}
    for key, value in titan.items():
        key = "lm_head.weight" if key == "output.weight" else key
        for w in ("wq", "wk", "wv"):
            key = key.replace(f".attention.{w}.", f".attention.qkv_linear.{w}.")
        out[key] = value
    return out


def naming_of(keys) -> str:
    """The naming a DCP checkpoint's keys use."""
    return "qkv_linear" if any(".attention.qkv_linear." in k for k in keys) else "classic"


class DCPInteropError(CheckpointError):
    """A model or a DCP directory that cannot be converted; the message names why."""


def check_llama(config: GPTConfig) -> None:
    if not is_llama(config) or config.add_bias_linear:
        raise DCPInteropError(
            f"torchtitan's Llama layout needs rotary positions, RMSNorm, SwiGLU and no linear "
            f"biases; this model has position_embedding_type={config.position_embedding_type}, "
            f"normalization={config.normalization}, swiglu={config.swiglu}, add_bias_linear="
            f"{config.add_bias_linear}")


def _to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in our rotate-half pairs (i, i + d/2) -> Meta's interleaved pairs (2i, 2i+1);
    the inverse of :func:`models.gpt.hf_llama.permute_for_rotate_half`: [heads * d, h]."""
    d = weight.size(0) // heads
    return weight.view(heads, 2, d // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def to_titan(config: GPTConfig, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors (a parameter, or its Adam moment: the same rearrangement) -> torchtitan's."""
    check_llama(config)
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.query_groups * config.head_dim
    out = {"tok_embeddings.weight": canonical[WORD_EMBEDDING],
           "norm.weight": canonical["final_norm.weight"],
           # torchtitan's Llama has no tied variant: a tied model's output is its embedding
           "output.weight": canonical.get("output_layer.weight", canonical[WORD_EMBEDDING])}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"layers.{i}."
        for a, b in _LAYER.items():
            out[theirs + b] = canonical[ours + a]
        q, k, v = canonical[ours + "attn.qkv.weight"].split([q_rows, kv_rows, kv_rows])
        out[theirs + "attention.wq.weight"] = _to_interleaved(q, config.num_attention_heads)
        out[theirs + "attention.wk.weight"] = _to_interleaved(k, config.query_groups)
        out[theirs + "attention.wv.weight"] = v
        gate, up = canonical[ours + "mlp.fc1.weight"].chunk(2)
        out[theirs + "feed_forward.w1.weight"] = gate
        out[theirs + "feed_forward.w3.weight"] = up
    return {k: v.contiguous() for k, v in out.items()}


def from_titan(config: GPTConfig, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's tensors -> canonical ones (the inverse of :func:`to_titan`)."""
    check_llama(config)
    out = {WORD_EMBEDDING: titan["tok_embeddings.weight"], "final_norm.weight": titan["norm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = titan["output.weight"]
    elif "output.weight" in titan and not torch.equal(titan["output.weight"],
                                                      titan["tok_embeddings.weight"]):
        raise DCPInteropError("the checkpoint's output.weight differs from tok_embeddings.weight, "
                              "but this model ties them; pass "
                              "--untie-embeddings-and-output-weights")
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"layers.{i}."
        for a, b in _LAYER.items():
            out[ours + a] = titan[theirs + b]
        q = permute_for_rotate_half(titan[theirs + "attention.wq.weight"], config.num_attention_heads)
        k = permute_for_rotate_half(titan[theirs + "attention.wk.weight"], config.query_groups)
        out[ours + "attn.qkv.weight"] = torch.cat([q, k, titan[theirs + "attention.wv.weight"]])
        out[ours + "mlp.fc1.weight"] = torch.cat([titan[theirs + "feed_forward.w1.weight"],
                                                  titan[theirs + "feed_forward.w3.weight"]])
    return {k: v.contiguous() for k, v in out.items()}


def titan_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """torchtitan's parameter names and shapes for ``config``."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in canonical_shapes(config).items()}
    return {k: tuple(v.shape) for k, v in to_titan(config, meta).items()}


# ---- export ------------------------------------------------------------------------------------
def adamw_group_options(optimizer_config: dict | None) -> dict:
    """torch.optim.AdamW's param-group options (every key its state dict holds) with the run's lr,
    betas, eps and weight decay (our config's ``optimizer`` section; defaults without one)."""
    o = optimizer_config or {}
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)],
                              lr=o.get("lr", 1e-3), betas=(o.get("adam_beta1", 0.9),
                                                           o.get("adam_beta2", 0.999)),
                              eps=o.get("adam_eps", 1e-8), weight_decay=o.get("weight_decay", 0.01))
    group = dict(probe.state_dict()["param_groups"][0])
    group.pop("params")
    return group


def export_dcp(checkpoint: str | Path, out_dir: str | Path, *, optimizer: bool = True,
               naming: str = "classic") -> Path:
    """Write the training checkpoint ``checkpoint`` (a save dir or an iter dir, any layout) as a DCP
    directory ``out_dir`` in torchtitan's Llama layout (``naming``: ``classic`` names, or
    torchtitan 0.3's ``qkv_linear`` ones); returns ``out_dir``. One process."""
    import torch.distributed.checkpoint as dcp
    reader = CheckpointReader(checkpoint)
    if "model_config" not in reader.metadata:
        raise DCPInteropError(f"{reader.directory} stores no model_config; it was not written by a "
                              f"training run of this framework")
    config = GPTConfig.from_dict(reader.metadata["model_config"])
    check_llama(config)
    kind = "master" if reader.has("master", WORD_EMBEDDING) else "model"

    def canonical(k: str) -> dict[str, torch.Tensor]:
        return {name: from_tp_layout(config, name, reader.full_tensor(k, name)).float()
                for name in canonical_shapes(config)}

    state: dict = rename(to_titan(config, canonical(kind)), naming)
    iteration = int(reader.metadata.get("iteration", 0))
    if optimizer and all(reader.has(m, WORD_EMBEDDING) for m in MOMENTS):
        counters = reader.metadata.get(COUNTERS_KEY) or {}
        step = float(counters.get("step_count", iteration))
        moments = {m: rename(to_titan(config, canonical(m)), naming) for m in MOMENTS}
        group = adamw_group_options((reader.metadata.get("config") or {}).get("optimizer"))
        flat = {}
        for fqn in state:
            flat[f"state.{fqn}.step"] = torch.tensor(step)       # torch keeps AdamW's step a tensor
            for m in MOMENTS:
                flat[f"state.{fqn}.{m}"] = moments[m][fqn]
            for option, value in group.items():
                flat[f"param_groups.{fqn}.{option}"] = value
        state["optimizer"] = flat
    elif optimizer:
        log.info("%s holds no optimizer state: exporting the model only", reader.directory)
    state["train_state"] = {"step": torch.tensor(iteration, dtype=torch.int32),
                            **{k: _saved_empty_list() for k in ("global_avg_losses",
                                                                "global_max_losses", "log_steps")}}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(out_dir), no_dist=True)
    log.info("exported %s (iteration %d, %s weights) to DCP %s", reader.directory, iteration, kind,
             out_dir)
    return out_dir


def _saved_empty_list() -> io.BytesIO:
    """torchtitan's TrainState keeps its loss histories as torch.save'd lists (bytes items)."""
    buf = io.BytesIO()
    torch.save([], buf)
    buf.seek(0)
    return buf


# ---- import ------------------------------------------------------------------------------------
def read_dcp_llama(dcp_dir: str | Path, config: GPTConfig) -> tuple[dict, dict | None, int]:
    """(canonical weights fp32, canonical Adam moments {kind: dict} or None, step) of the DCP
    directory ``dcp_dir`` in torchtitan's Llama layout, checked against ``config``'s shapes."""
    reader = DCPReader(dcp_dir)
    shapes = reader.tensor_shapes()
    naming = naming_of(shapes)
    classic = titan_shapes(config)
    want = rename(classic, naming)              # the checkpoint's names -> their shapes
    output = rename({"output.weight": None}, naming).popitem()[0]
    if not config.untie_embeddings_and_output_weights and output not in shapes:
        want.pop(output)
    missing = [k for k in want if k not in shapes]
    if missing:
        raise DCPInteropError(f"{dcp_dir} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                              f" of torchtitan's Llama layout (it holds {', '.join(sorted(shapes)[:4])}"
                              f" ...); is it a torchtitan Llama checkpoint?")
    wrong = [f"{k}: {list(shapes[k])} vs {list(v)}" for k, v in want.items() if tuple(shapes[k]) != v]
    if wrong:
        raise DCPInteropError(f"{dcp_dir} holds other shapes than this model's ({'; '.join(wrong[:3])}"
                              f"); pass the model dims it was trained with (--num-layers, "
                              f"--hidden-size, --num-attention-heads, --num-query-groups, "
                              f"--ffn-hidden-size, --vocab-size)")

    back = {name: classic_name for classic_name, name in zip(classic, rename(classic, naming))}

    def titan(prefix: str, suffix: str) -> dict[str, torch.Tensor]:
        """The classic-named tensors ``prefix + <checkpoint name> + suffix``."""
        return {back[k]: reader.full_tensor(prefix + k + suffix).float() for k in want}

    weights = from_titan(config, titan("", ""))
    moments = None
    keys = [f"optimizer.state.{k}.{m}" for k in want for m in MOMENTS]
    if all(k in shapes for k in keys):
        moments = {m: from_titan(config, titan("optimizer.state.", f".{m}")) for m in MOMENTS}
    step_key = f"optimizer.state.{next(iter(want))}.step"
    step = 0
    if "train_state.step" in shapes:
        step = int(reader.full_tensor("train_state.step").item())
    elif step_key in shapes:
        step = int(reader.full_tensor(step_key).item())
    return weights, moments, step


def import_dcp(dcp_dir: str | Path, save_dir: str | Path, config: GPTConfig) -> Path:
    """Write the DCP directory ``dcp_dir`` (torchtitan's Llama layout) as a training checkpoint of
    ``config``'s model in ``save_dir`` (resumed by ``--load save_dir`` at any layout); returns its
    iteration directory. One process."""
    check_llama(config)
    weights, moments, step = read_dcp_llama(dcp_dir, config)
    kinds = {"model": weights, "master": weights, **(moments or {
        m: {k: torch.zeros_like(v) for k, v in weights.items()} for m in MOMENTS})}
    pieces = []
    for kind, tensors in kinds.items():
        for name, canonical in tensors.items():
            full = to_tp_layout(config, name, canonical, 1)
            pieces.append(Piece(name, kind, tuple(full.shape), partition_dim(name), 0, 1, 0,
                                full.reshape(-1).contiguous(),
                                config.vocab_size if name in VOCAB_TABLES else None))
    world = comm.Group("world", [0], 0, comm.CommLedger())
    run_id = new_run_id()
    metadata = {"train_state": {"iteration": step, "consumed_train_samples": 0,
                                "consumed_valid_samples": 0, "skipped_iterations": 0,
                                "lr_schedule": None},
                "model_config": config.to_dict(),
                "layout": {"world_size": 1, "tensor_model_parallel_size": 1,
                           "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
                           "zero_stage": 0},
                "imported_from": {"format": "torch.distributed.checkpoint (torchtitan Llama)",
                                  "path": str(dcp_dir), "optimizer_state": moments is not None},
                COUNTERS_KEY: {"step_count": step if moments is not None else 0,
                               "loss_scaler": None}}
    final = save_checkpoint(save_dir, step, pieces, {"cpu": torch.get_rng_state()}, metadata, world,
                            keep_last=0, run_id=run_id)
    log.info("imported DCP %s (step %d, %s) into %s", dcp_dir, step,
             "weights and Adam moments" if moments is not None else "weights only", final)
    return final
