"""The DP traffic a run's config expects per rank per step, split by link: ZeRO's collectives (ZeRO
§7: 2Ψ stages 0-2, 3Ψ stage 3; docs/design.md §Paper) with the topology-aware options of
hybrid.zero (hybrid sharding, hpZ, and ZeRO++'s qwZ and qgZ, whose int8 blocks carry one fp32 scale
per 256 elements: hybrid.perf.zeropp's q_w and q_g), per group and op, as NCCL rings over the
groups of a :class:`ParallelState` (:func:`hybrid.perf.links.zero_dp_collectives`). One function for
the dry run and for the start-up report of a launched run, so both show the same formulas.
"""

from __future__ import annotations

from hybrid.parallel_state import ParallelState
from hybrid.perf.links import zero_dp_collectives
from hybrid.perf.zeropp import ZeroOptions
from hybrid.zero_policy import stage_with_pipeline


def expected_dp_collectives(parallel, state: ParallelState, psi: float, param_bytes: int,
                            ranks_per_node: int | None,
                            micro_batches: int = 1,
                            model=None) -> list[tuple[str, str, float, float]]:
    """(group, op, bytes, cross-host bytes) per rank per step of the DP collectives of a run with
    ``parallel`` (the config's ParallelSection) on ``state``'s groups, for ``psi`` parameters of
    ``param_bytes`` bytes on this rank, with ``micro_batches`` backwards per step. The host-split
    options need the state's host groups (their layout is checked where the engine or the dry run
    builds them). Stage 2 with pipeline parallelism counts as the stage 1 it runs as
    (:func:`hybrid.zero_policy.stage_with_pipeline`). With ``model`` (the run's GPTConfig,
    vocab resolved), stage 3's backward gather leaves out the parameters gathered in forward only
    (:func:`forward_only_parameters`), as the engine does. With context parallelism the collectives
    run over DP x CP (``state.dp_cp``, issue 31), the ranks that hold the same parameters."""
    quantized = ZeroOptions()   # int8 blocks (hybrid.zero.quantize)
    intra, inter = state.dp_intra_host_group, state.dp_inter_host_group
    stage = stage_with_pipeline(parallel.zero_stage, state.pp_size)
    forward_only = 0 if model is None else forward_only_parameters(model, state.tp_size,
                                                                   state.pp_rank == 0)
    return zero_dp_collectives(
        psi * param_bytes, stage, getattr(state, "dp_cp", state.dp).ranks, ranks_per_node,
        intra=intra.ranks if intra is not None else None,
        inter=inter.ranks if inter is not None else None,
        hybrid_shard=parallel.zero_hybrid_shard, hpz=parallel.zero_hpz,
        weight_ratio=quantized.weight_bytes / param_bytes if parallel.zero_quantized_weights else 1.0,
        gradient_ratio=(quantized.gradient_bytes / param_bytes if parallel.zero_quantized_gradients
                        else None),
        micro_batches=micro_batches, backward_gather_bytes=(psi - forward_only) * param_bytes)


def forward_only_parameters(model, tp: int, holds_embedding: bool = True) -> int:
    """Parameters of this rank that ZeRO-3 gathers in forward only: the embedding unit (the word
    embedding's V/tp x h rows and learned positions) when the output layer is untied, because the
    backward of a lookup reads no weight value; a tied embedding is gathered again for the output
    layer, which covers its backward (hybrid.zero.stage3_hooks). ``model`` is the GPTConfig."""
    if not model.untie_embeddings_and_output_weights or not holds_embedding:
        return 0
    positions = model.max_position_embeddings if model.position_embedding_type == "learned_absolute" else 0
    return (model.padded_vocab_size(tp) // tp + positions) * model.hidden_size
