"""Per-device memory of one training configuration: model states + activations + buffers
(ZeRO §3 "where did all the memory go", §5 ZeRO-DP, §6 ZeRO-R).

Combines :mod:`hybrid.perf.model_states` and :mod:`hybrid.perf.activations` for a GPT given by its
dimensions and layout. With full recompute the device holds the checkpoints of every layer plus the
working activations of the one layer being recomputed (and, with Pa, that layer's all-gathered
checkpoint); without it, every layer's activations. Fragmentation (ZeRO-R MD) and the CUDA context are
not modelled: :data:`DEFAULT_RESERVED_BYTES` stands for them.

Context parallelism (issue 31): each of the ``cp`` ranks of a CP group holds ``seq / cp`` tokens, so
its activations, checkpoints and logits are those of ``seq / cp`` tokens (the attention core's term as
:func:`hybrid.perf.activations.attention_core_bytes` gives it for the ring or the all-to-all), while
gradients are reduced and ZeRO partitions built over the ``dp x cp`` ranks that hold the same
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.perf import activations as act
from hybrid.perf.architecture import GPT2, Architecture
from hybrid.perf.flops import (expert_params_per_rank, gpt_param_count, layer_param_count,
                               pad_vocab)
from hybrid.perf.model_states import ModelStateBytes, model_state_bytes, moe_model_state_bytes
from hybrid.zero_policy import DEFAULT_BUCKET_ELEMENTS

DEFAULT_RESERVED_BYTES = 1.0e9   # CUDA context + allocator slack per GPU (an assumption, not measured)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device."""

    model_states: ModelStateBytes
    checkpoints: float       # activation checkpoints (all layers)
    working: float           # activations of the layer(s) live during backward
    logits: float
    buffers: float           # fused gradient buffer (baseline) or ZeRO-R constant buffers
    reserved: float

    @property
    def activations(self) -> float:
        return self.checkpoints + self.working + self.logits

    @property
    def total(self) -> float:
        return self.model_states.total + self.activations + self.buffers + self.reserved

    def fits(self, device_bytes: float) -> bool:
        return self.total <= device_bytes


def device_memory(*, layers: int, hidden: int, heads: int, seq: int, vocab: int, micro_batch: int,
                  tp: int, dp: int, stage: int, recompute: str = "full",
                  sequence_parallel: bool = False, partition_activations: bool = False,
                  cpu_offload: bool = False, bucket_elements: int | None = DEFAULT_BUCKET_ELEMENTS,
                  reserved_bytes: float = DEFAULT_RESERVED_BYTES,
                  arch: Architecture = GPT2,
                  optimizer_bytes_per_param: int = 12, attention_core: str = "megatron",
                  attention_dropout: bool = True, cp: int = 1,
                  cp_comm_type: str = "p2p", ep: int = 1) -> MemoryEstimate:
    """Memory of one GPU of a GPT run with ``tp`` x ``dp`` GPUs under ZeRO ``stage``.

    ``bucket_elements=None`` models the baseline's fused fp32 gradient buffer (4 Ψ / Nm bytes);
    an integer models ZeRO-R's constant buffers (CB) of that many elements (default: the engine's,
    :data:`hybrid.zero_policy.DEFAULT_BUCKET_ELEMENTS`). Stage 3 also holds the
    gathered 16-bit parameters of two layers (the one running and the prefetched next one).
    ``arch``: the model's options (GQA, SwiGLU, untied output layer, ...); GPT-2 by default.
    ``optimizer_bytes_per_param``: K, the paper's 12 (fp32 master and moments) or what the moment
    dtypes make it (:func:`hybrid.perf.model_states.optimizer_bytes_per_param`: 8 with bf16 moments).
    ``attention_core``: the core that runs (:data:`hybrid.perf.activations.ATTENTION_CORES`; the
    paper's explicit "megatron" by default, "flash" for SDPA on CUDA); ``cp``, ``cp_comm_type``:
    context parallelism (``seq`` stays the whole sequence; model states partitioned over ``dp x cp``).
    ``ep``: with MoE layers in ``arch`` (issue 32), the routed experts split over ``ep`` ranks
    carved out of ``dp x cp``, their states partitioned over the expert-DP group ``dp cp / ep``
    (:func:`hybrid.perf.model_states.moe_model_state_bytes`).
    """
    psi_rank = gpt_param_count(layers, hidden, pad_vocab(vocab, tp), seq, tp=tp, heads=heads,
                               arch=arch)
    experts = expert_params_per_rank(layers, hidden, arch, tp=tp)   # all E experts / TP
    if experts:
        states = moe_model_state_bytes(psi_rank - experts, experts, stage, dp * cp, ep,
                                       optimizer_bytes_per_param=optimizer_bytes_per_param).total
    else:
        states = model_state_bytes(psi_rank, stage, dp * cp,
                                   optimizer_bytes_per_param=optimizer_bytes_per_param)
    core = dict(core=attention_core, attention_dropout=attention_dropout, cp=cp,
                cp_comm_type=cp_comm_type)
    checkpoints, working = _activations(layers, hidden, heads, seq, micro_batch, tp, recompute,
                                        sequence_parallel, partition_activations, cpu_offload, arch,
                                        core)
    logits = act.logits_bytes(seq // cp, micro_batch, pad_vocab(vocab, tp), tp=tp)
    if bucket_elements is None:
        buffers = act.fused_gradient_buffer_bytes(psi_rank)
    else:
        buffers = act.constant_buffer_bytes(bucket_elements)
    if stage == 3:   # the all-gathered 16-bit parameters of the current and the prefetched layer
        buffers += 2 * 2 * layer_param_count(hidden, heads=heads, arch=arch) / tp
    return MemoryEstimate(states, checkpoints, working, logits, buffers, reserved_bytes)


def _activations(layers, hidden, heads, seq, micro_batch, tp, recompute, sequence_parallel,
                 partitioned, cpu_offload, arch, core) -> tuple[float, float]:
    one_layer = act.activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp=tp,
                                               sequence_parallel=sequence_parallel,
                                               recompute="none" if recompute == "full" else recompute,
                                               arch=arch, **core)
    seq //= core["cp"]   # the tokens of this CP rank
    if recompute != "full":
        if partitioned or cpu_offload:
            raise ValueError("Pa / Pa+cpu partition activation checkpoints: they need "
                             "recompute='full'")
        return 0.0, layers * one_layer
    checkpoints = act.checkpoint_bytes(seq, micro_batch, hidden, layers, mp=tp,
                                       partitioned=partitioned, cpu_offload=cpu_offload)
    if sequence_parallel and not partitioned:
        checkpoints /= tp   # with SP each rank keeps its own sequence shard of the layer input
    gathered = 2 * seq * micro_batch * hidden if partitioned else 0.0  # Pa's all-gathered checkpoint
    return checkpoints, one_layer + gathered
