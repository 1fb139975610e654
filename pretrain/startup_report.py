"""What a launched run reports at start-up: the rank grid, the hosts each of this rank's groups
spans (hybrid.perf.links), the pipeline layout, the resolved config, and once the ZeRO engine exists
the DP bytes per step ZeRO's formulas expect (pretrain.traffic; the trainer logs the measured bytes
after the first logged step)."""

from __future__ import annotations

from hybrid.layout import RunLayout
from hybrid.parallel_state import ParallelState
from hybrid.perf.links import describe_collectives, describe_group, nodes_of
from pretrain.config import TrainConfig
from pretrain.traffic import expected_dp_collectives


def startup_report(cfg: TrainConfig, state: ParallelState, pipeline) -> str:
    """The rank grid, :func:`link_report` and the resolved config, one line per value."""
    return (f"{state.topology.describe()}\n{link_report(state, pipeline)}\n"
            f"resolved config:\n{cfg.describe()}")


def link_report(state: ParallelState, pipeline=None) -> str:
    """This rank's TP and DP groups (and PP group): the hosts they span and the share of their
    bytes that cross hosts (the ledger measures it per step, hybrid.perf.links), then the pipeline
    layout of ``pipeline`` (the run's :class:`~hybrid.pipeline.PipelineConfig`, None without PP)."""
    per_node = state.ledger.ranks_per_node
    groups = [state.tp, state.dp]
    if state.cp_size > 1:   # the CP attention's group, and the DP x CP group gradients reduce over
        groups += [state.cp, state.dp_cp]
    if state.dp_intra_host_group is not None and state.dp_inter_host_group.size > 1:
        groups += [state.dp_intra_host_group, state.dp_inter_host_group]   # hybrid shard, hpZ
    lines = [describe_group(g.kind, g.ranks, per_node) for g in groups]
    if pipeline is not None:
        hosts = nodes_of(state.pp.ranks, per_node)
        crossings = sum(a != b for a, b in zip(hosts, hosts[1:]))
        lines += [f"pp group {state.pp.ranks}: {crossings} of its {state.pp_size - 1} stage "
                  f"boundaries cross hosts (point-to-point activations and gradients)",
                  pipeline_report(pipeline, state.pp_rank)]
    return "\n".join(lines)


def expected_dp_report(cfg: TrainConfig, layout: RunLayout, state: ParallelState, psi: int,
                       model_cfg=None) -> str:
    """The DP bytes per rank per step ZeRO's formulas expect for this rank's ``psi`` parameters, per
    group and op, inside hosts and across them (pretrain.traffic, the dry run's formulas, as NCCL
    rings); with ``model_cfg`` (the run's GPTConfig) stage 3's forward-only gathers as the engine
    makes them."""
    param_bytes = 4 if cfg.optimizer.precision == "fp32" else 2
    ops = expected_dp_collectives(cfg.parallel, state, float(psi), param_bytes,
                                  state.ledger.ranks_per_node, micro_batches=layout.micro_batches,
                                  model=model_cfg)
    return "\n".join(["DP bytes per rank per step, expected (ZeRO's formulas over NCCL rings):",
                      *describe_collectives(ops)])


def pipeline_report(pcfg, stage: int) -> str:
    """The PP layout in one line: schedule, stages, chunks, micro-batches, this stage's layers and
    the bubble the schedule implies (hybrid.pipeline.schedules)."""
    from hybrid.pipeline import bubble_formula
    layers = ", ".join("[%d, %d)" % pcfg.layer_range(stage, c) for c in range(pcfg.num_model_chunks))
    return (f"pipeline: {pcfg.schedule}, PP {pcfg.num_stages} stages x {pcfg.num_model_chunks} "
            f"model chunk(s) of {pcfg.layers_per_chunk} layers, m {pcfg.num_micro_batches} "
            f"micro-batches per step; stage {stage} holds layers {layers}; bubble "
            f"(p-1)/(v m+p-1) = {bubble_formula(pcfg):.3f}")
