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

The attention core that actually runs (issue 31), ``core``:

* ``"megatron"`` - the paper's explicit core: softmax output (2), its dropout mask (1) and the
  dropped probabilities (2 bytes) of every [s, s] score, ``5 a s^2 b / t`` bytes (the default: the
  papers' tables and their tools reproduce it);
* ``"flash"`` - SDPA's fused kernels on CUDA (flash / memory-efficient attention) keep no [s, s]
  tensor: beside q, k, v and the output (the paper's Q, K, V and projection input) only the fp32
  log-sum-exp of every query row, ``4 a s b / t`` bytes; dropout reruns from its RNG seed;
* ``"cpu"`` - the blocked CPU core (models/gpt/attention_core.py): the probabilities of the causal
  blocks only (query block i of ``BLOCK`` rows sees ``(i + 1) BLOCK`` keys; one block of all ``s``
  keys when ``s < 2 BLOCK``), in the compute dtype, and a bool dropout mask over the same.

Context parallelism over ``cp`` ranks (:mod:`hybrid.perf.context_parallel`): every term is per token,
and each CP rank holds ``s / cp`` tokens. The ring (p2p) merges its blocks with the log-sum-exp and
reruns each block in backward, keeping ``out`` and the fp32 log-sum-exp of its ``s / cp`` queries
whatever the core (as "flash" does for ``s / cp`` rows); all-to-all (a2a) runs the same kernel on the
whole sequence for ``a / (t cp)`` heads: the same counts.
"""

from __future__ import annotations

import math

from hybrid.perf.architecture import GPT2, Architecture

RECOMPUTE_MODES = ("none", "selective", "full")
ATTENTION_CORES = ("megatron", "flash", "cpu")
CPU_CORE_BLOCK = {4: 64, 8: 64, 2: 128}   # compute bytes -> query rows per causal block, as
                                          # models/gpt/attention_core.py's BLOCK / BLOCK_16BIT
LSE_BYTES = 4                             # fp32 log-sum-exp per query row and head


def causal_block_elements(seq: int, block: int) -> int:
    """Probabilities the CPU core keeps per (batch, head) for ``seq`` queries: causal blocks of
    ``block`` rows when ``seq >= 2 block`` and ``block`` divides it (block i sees ``(i + 1) block``
    keys), else one block of ``seq x seq``."""
    if seq >= 2 * block and seq % block == 0:
        n = seq // block
        return block * block * n * (n + 1) // 2
    return seq * seq


def attention_core_bytes(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                         core: str = "megatron", dropout: bool = True, value_bytes: int = 2,
                         mask_bytes: int = 1, cp: int = 1, cp_comm_type: str = "p2p",
                         kv_hidden: int | None = None) -> float:
    """Bytes one layer's attention core keeps for backward on one rank beyond q, k, v and the
    output projection's input (the module docstring's ``core``): ``value_bytes`` per probability
    or output element, ``mask_bytes`` per element of Megatron's dropout mask (the CPU core's is
    bool: 1). ``seq`` is the whole sequence.

    * megatron: ``a s^2 b / t`` probabilities, with dropout also their mask and the dropped copy;
    * cpu: the probabilities of the causal blocks and, with dropout, a bool mask over them;
    * flash, and every context-parallel core (``cp > 1``: ring, all-to-all and all-gather-KV run a
      flash-style blocked kernel, hybrid/context_parallel/block_attention.py, and no dropout): the
      core's own output ``b (s / cp) h / t`` (a tensor of its own beside the projection's
      permuted input) and the fp32 log-sum-exp ``b (a / t) (s / cp)``; a2a holds ``a / cp`` heads
      of all ``s`` tokens, the same count; all-gather-KV also keeps the gathered K and V of the
      whole sequence (a tensor of its own, its own part included), ``2 b s g d / t`` elements
      (``kv_hidden`` = ``g d``; None: ``h``).
    """
    if core not in ATTENTION_CORES:
        raise ValueError(f"attention core must be one of {ATTENTION_CORES}, got {core!r}")
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp, cp=cp)
    rows_heads = micro_batch * heads / tp          # (batch, head) pairs of this TP rank
    if core == "flash" or cp > 1:
        queries = seq / cp
        kept = rows_heads * queries * (hidden // heads * value_bytes + LSE_BYTES)
        if cp > 1 and cp_comm_type == "allgather":   # K and V of the whole sequence, gathered
            kv = hidden if kv_hidden is None else kv_hidden
            kept += 2 * cp * micro_batch * queries * kv / tp * value_bytes
        return kept
    if core == "cpu":
        pairs = causal_block_elements(seq, CPU_CORE_BLOCK[value_bytes])
        return rows_heads * pairs * (value_bytes + (1 if dropout else 0))
    return rows_heads * seq * seq * (value_bytes + (mask_bytes + value_bytes if dropout else 0))


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               arch: Architecture = GPT2, core: str = "megatron",
                               attention_dropout: bool = True, cp: int = 1,
                               cp_comm_type: str = "p2p") -> float:
    """Bytes one layer keeps for backward on one TP (and CP) rank (selective-recompute paper,
    Table 2, with the attention ``core`` that runs and ``cp`` ranks holding ``seq / cp`` tokens
    each; ``seq`` is the whole sequence)."""
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp, cp=cp)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    s, b, h, a, t = seq / cp, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    sharded = arch.saved_sharded_elements(h, a)                     # 24 for GPT-2
    kept = sbh / t * (10 + sharded) if sequence_parallel else sbh * (10 + sharded / t)
    if recompute == "selective":
        return kept
    # softmax, its dropout mask, QK^T: 5 a s^2 b / t with Megatron's core
    return kept + attention_core_bytes(seq, b, h, a, tp=t, core=core, dropout=attention_dropout,
                                       cp=cp, cp_comm_type=cp_comm_type,
                                       kv_hidden=arch.kv_hidden(h, a))


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
