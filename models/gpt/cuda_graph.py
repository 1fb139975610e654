"""Per-layer CUDA graphs of a GPT model's transformer layers (issue 36 item 3; the policy and the
refusals live in pretrain/cuda_graphs.py).

:func:`graph_layers` hands the model's layers to ``torch.cuda.make_graphed_callables`` with one
static sample input ``[s(/tp), b, h]`` each: every layer's forward and backward are captured once
(after ``warmup`` eager runs, which also let cuBLAS pick its kernels and the caching allocator
settle) and from then on replayed with one launch each. A graphed layer still runs eagerly in
``eval()`` mode (validation, generation with a KV cache): make_graphed_callables replays only in
the training state it captured.

The captured layers' weight gradients leave the graph as outputs that autograd accumulates
(gradient-accumulation fusion writes into engine buffers decided per micro-batch on the host, so
it is switched off for them).
"""

from __future__ import annotations

import torch

from hybrid.tensor_parallel import grad_fusion


def graph_layers(model, input_shape: tuple[int, int, int], *, dtype: torch.dtype,
                 warmup: int = 3) -> int:
    """Capture each of ``model.layers`` for inputs of ``input_shape`` and ``dtype``; returns how
    many. The model must be in training mode, on a CUDA device, with its final parameters."""
    layers = list(model.layers)
    if not layers:
        return 0
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device.type}")
    for layer in layers:
        if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks:
            raise ValueError("a transformer layer has module hooks (ZeRO stage 3?): CUDA graphs "
                             "would freeze what they do; use ZeRO stage 0-2")
        grad_fusion.allow(list(layer.parameters()), enabled=False)   # gradients as graph outputs
    model.train()
    samples = tuple((torch.randn(input_shape, device=device, dtype=dtype, requires_grad=True),)
                    for _ in layers)
    torch.cuda.synchronize()
    torch.cuda.make_graphed_callables(tuple(layers), samples, num_warmup_iters=warmup)
    return len(layers)
