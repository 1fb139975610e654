"""CUDA graphs of the training step (issue 36 item 3; Megatron-LM's ``--enable-cuda-graph`` and
``--cuda-graph-scope``).

A small GPU step is bound by kernel launches: the host issues each layer's few dozen kernels
one by one. A CUDA graph records them once and replays them with one launch. Scope ``full``
(Megatron's default: each transformer layer) captures every layer's forward and backward with
``torch.cuda.make_graphed_callables``: static input, output and gradient buffers per layer, the
layer's parameters read in place (so the graphs are taken after the ZeRO engine has moved them
into its flat buffers), the weight gradients handed back to autograd, which accumulates them and
runs the engine's gradient hooks as before.

What cannot be captured is refused when the config is read (:func:`cuda_graph_problems`, no
torch), each with its reason and the way out, and at set-up where the device is known
(:func:`capture_layers`: CPU devices). The refusals:

* ``--cuda-graph-scope attn`` (the attention block alone) and ``full_iteration`` (the whole step:
  the ZeRO engines decide per micro-batch on the host which bucket to reduce and when, the
  pipeline's sends and receives are host-scheduled, the loss scaler's state is host-readable only
  at the log interval; a whole-step graph would freeze those choices);
* ZeRO stage 3 (its module hooks gather and free each layer's parameters around its use; a graph
  would bake in one gather's buffers), optimizer offload (host copies), pipeline parallelism (the
  schedule's p2p is host-driven), activation recompute (the checkpoint reruns the forward inside
  the backward under a host RNG state) and dropout (the TP RNG tracker swaps generator states on
  the host), ``--reset-position-ids`` / ``--reset-attention-mask`` (per-micro-batch positions and
  document blocks), ``--compile`` (inductor's own ``reduce-overhead`` mode is the graph route there);
* a CPU device.

The tensor-parallel collectives inside a layer are NCCL calls, which a graph captures; the comm
ledger records them once, at capture. Gradient-accumulation fusion (weight gradients written into
the engine's buffer by the layers themselves) is switched off for the captured layers: their
weight gradients are graph outputs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def cuda_graph_problems(cfg) -> list[str]:
    """Why this config's step cannot be captured with ``--enable-cuda-graph`` (empty: it can).
    Pure: the config checks call it before torch loads."""
    t, p, m = cfg.training, cfg.parallel, cfg.model
    if not t.enable_cuda_graph:
        return []
    out = []
    if t.cuda_graph_scope == "attn":
        out.append("--cuda-graph-scope attn (the attention block alone) is not implemented; use "
                   "--cuda-graph-scope full (each transformer layer)")
    if t.cuda_graph_scope == "full_iteration":
        out.append("--cuda-graph-scope full_iteration cannot capture this framework's step: the ZeRO "
                   "engines pick buckets and collectives per micro-batch on the host; use "
                   "--cuda-graph-scope full (each transformer layer)")
    if p.zero_stage == 3:
        out.append("ZeRO stage 3 gathers and frees each layer's parameters around its use, which a "
                   "graph would freeze; use --zero-stage 0, 1 or 2 with --enable-cuda-graph")
    if p.offload_config() is not None:
        out.append("optimizer offload copies between host and device every step; drop "
                   "--offload-optimizer / --offload-nvme-path or --enable-cuda-graph")
    if p.pipeline_model_parallel_size > 1:
        out.append("pipeline parallelism drives its sends and receives from the host; use "
                   "--pipeline-model-parallel-size 1 with --enable-cuda-graph")
    if t.recompute != "none":
        out.append(f"--recompute {t.recompute} reruns layers inside the backward; use --recompute "
                   f"none with --enable-cuda-graph (a smaller --micro-batch-size if memory is short)")
    if m.hidden_dropout or m.attention_dropout:
        out.append(f"dropout (--hidden-dropout {m.hidden_dropout}, --attention-dropout "
                   f"{m.attention_dropout}) draws from RNG states swapped on the host; set both to 0 "
                   f"with --enable-cuda-graph")
    if t.compile:
        out.append("--compile and --enable-cuda-graph both take over the layers; pick one")
    if p.context_parallel_size > 1:
        out.append(f"--context-parallel-size {p.context_parallel_size}: the CP attention's ring "
                   f"and all-to-all run inside each layer with per-micro-batch token indices, which "
                   f"a layer's graph would freeze (not verified under capture); use "
                   f"--context-parallel-size 1 with --enable-cuda-graph")
    d = cfg.data
    if d.reset_position_ids or d.reset_attention_mask:
        out.append("--reset-position-ids / --reset-attention-mask give each micro-batch its own "
                   "positions and document blocks, which a layer's graph would freeze; drop them "
                   "or --enable-cuda-graph")
    return out


def capture_layers(cfg, models: list, state, micro_batch: int) -> int:
    """--enable-cuda-graph: capture every transformer layer of ``models`` (the model, or this
    stage's chunks) after the engine has placed the parameters; returns the number of layers
    captured (0 without the flag). Raises ValueError on a device that has no CUDA graphs."""
    if not cfg.training.enable_cuda_graph:
        return 0
    import torch
    if state.device.type != "cuda":
        raise ValueError(f"--enable-cuda-graph needs a CUDA device; this rank trains on "
                         f"{state.device.type}. Drop the flag on this machine")
    from hybrid import comm
    from models.gpt.cuda_graph import graph_layers
    seq = cfg.model.seq_length
    if cfg.parallel.sequence_parallel and state.tp_size > 1:
        seq //= state.tp_size
    n = 0
    with comm.unrecorded(state.world):   # the warm-up and capture runs are not training traffic
        for model in models:
            dtype = next(model.parameters()).dtype
            n += graph_layers(model, (seq, micro_batch, cfg.model.hidden_size), dtype=dtype,
                              warmup=cfg.training.cuda_graph_warmup_steps)
    torch.cuda.synchronize()
    log.info("CUDA graphs: %d transformer layers captured (forward and backward, [%d, %d, %d])",
             n, seq, micro_batch, cfg.model.hidden_size)
    return n
