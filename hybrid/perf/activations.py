"""Activation and residual memory per device (ZeRO §3.2 and §6 "ZeRO-R"; Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4).

Per-layer activation bytes of a GPT layer with 16-bit activations (s sequence, b micro-batch,
h hidden, a heads, t tensor-parallel degree), from the selective-recompute paper:

    no parallelism       s b h (34 + 5 a s / h)
    TP                   s b h (10 + 24/t + 5 a s / (h t))
    TP + SP              s b h / t (34 + 5 a s / h)
    TP + selective       s b h (10 + 24/t)
    TP + SP + selective  34 s b h / t
    full recompute       2 s b h            (the layer input only; / t with SP)

ZeRO-R keeps one activation checkpoint (the layer input, b s h elements) per layer. Pa partitions
each checkpoint across the MP ranks (/ Nm) and all-gathers it before the layer is recomputed; Pa+cpu
moves the partitions to host memory (about 0 bytes on the device). The paper's own rough total is
12 h b s l elements (§3.2: a 1.5B GPT-2 at seq 1K, batch 32 needs about 60 GB).
Temporary buffers (§3.2): a baseline run fuses all gradients into one fp32 buffer (4 Ψ / Nm bytes);
ZeRO-R's CB keeps constant-size buckets instead.

With the options of :class:`~hybrid.perf.architecture.Architecture` the TP-sharded 24 becomes
``arch.saved_sharded_elements`` (GQA keeps smaller K and V, SwiGLU more MLP activations); the 10
replicated (norm and block inputs, dropout masks) and the attention scores are unchanged.
"""

from __future__ import annotations

import math

from hybrid.perf.architecture import GPT2, Architecture

RECOMPUTE_MODES = ("none", "selective", "full")


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               arch: Architecture = GPT2) -> float:
    """Bytes one layer keeps for backward on one TP rank (selective-recompute paper, Table 2)."""
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h  # softmax, its dropout mask, QK^T
    sharded = arch.saved_sharded_elements(h, a)                     # 24 for GPT-2
    if sequence_parallel:
        return sbh / t * (10 + sharded + attention)
    return sbh * (10 + sharded / t + attention / t)


def checkpoint_bytes(seq: int, micro_batch: int, hidden: int, layers: int, *, mp: int = 1,
                     partitioned: bool = False, cpu_offload: bool = False,
                     bytes_per_element: int = 2) -> float:
    """Device bytes of ZeRO-R activation checkpoints: one b s h checkpoint per layer, replicated on
    every MP rank, divided by ``mp`` with Pa (``partitioned``), ~0 with Pa+cpu."""
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden, layers=layers, mp=mp,
              bytes_per_element=bytes_per_element)
    if cpu_offload and not partitioned:
        raise ValueError("Pa+cpu offloads the partitioned checkpoints: set partitioned=True as well")
    if cpu_offload:
        return 0.0
    total = seq * micro_batch * hidden * layers * bytes_per_element
    return total / mp if partitioned else total


def zero_paper_activation_bytes(hidden: int, batch: int, seq: int, layers: int, *,
                                bytes_per_element: int = 2) -> float:
    """The ZeRO paper's rough estimate of all activations without checkpointing: 12 h b s l
    elements of 16 bits (§3.2)."""
    _positive(hidden=hidden, batch=batch, seq=seq, layers=layers)
    return 12 * hidden * batch * seq * layers * bytes_per_element


def zero_paper_checkpointed_bytes(hidden: int, batch: int, seq: int, layers: int) -> float:
    """The ZeRO paper's "about 8 GB" for the 1.5B GPT-2 with checkpointing: it says checkpointing cuts
    activation memory to "approximately the square root of the total"; numerically sqrt(60 GB in GB)
    GB. Kept only to show where 8 GB comes from; :func:`checkpoint_bytes` is the physical model."""
    total_gb = zero_paper_activation_bytes(hidden, batch, seq, layers) / 1e9
    return math.sqrt(total_gb) * 1e9


def logits_bytes(seq: int, micro_batch: int, vocab_padded: int, *, tp: int = 1,
                 bytes_per_element: int = 4) -> float:
    """The vocab-parallel output layer's logits shard kept for the loss's backward: s b V / t values,
    fp32 by default because the cross-entropy runs in fp32."""
    _positive(seq=seq, micro_batch=micro_batch, vocab_padded=vocab_padded, tp=tp)
    return seq * micro_batch * vocab_padded / tp * bytes_per_element


def fused_gradient_buffer_bytes(num_params: float, *, mp: int = 1, bytes_per_element: int = 4) -> float:
    """Baseline temporary buffer: all gradients of an MP rank fused into one fp32 buffer for the
    all-reduce (ZeRO §3.2: 12 GB for a 3B model)."""
    _positive(mp=mp)
    return num_params / mp * bytes_per_element


def constant_buffer_bytes(bucket_elements: int, *, buffers: int = 2, bytes_per_element: int = 2) -> float:
    """ZeRO-R CB: ``buffers`` constant-size buckets of ``bucket_elements`` each (a gradient
    reduce-scatter bucket and a parameter all-gather bucket), independent of the model size."""
    _positive(bucket_elements=bucket_elements, buffers=buffers, bytes_per_element=bytes_per_element)
    return bucket_elements * buffers * bytes_per_element


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
