"""Checks of a training command that need no process group, made before any rank joins one.

``launch/torchrun.py`` runs :func:`check_command` on the trainer's arguments before it starts a rank
(it knows ``--nnodes`` and ``--nproc-per-node``), so a config or layout error prints once, within a
second, with no torch-elastic output: nothing here imports torch (the config, the topology and the
pipeline layout are pure). Under plain ``torchrun`` each rank runs :func:`check_layout` on its
launcher's variables before it joins the process group (launch/pretrain_gpt.py).
"""

from __future__ import annotations

from hybrid.topology import Topology, TopologyError
from pretrain.arguments import LaunchOptions, parse_args
from pretrain.config import TrainConfig, TrainConfigError


def check_layout(cfg: TrainConfig, world_size: int, ranks_per_node: int) -> None:
    """``cfg`` fits a job of ``world_size`` ranks, ``ranks_per_node`` on each host: the batch and
    pipeline arithmetic of the world size, and TP groups that stay inside a host (docs/design.md §2)."""
    cfg.validate_for_world(world_size)
    p = cfg.parallel
    try:
        Topology(world_size, p.tensor_model_parallel_size, gpus_per_node=ranks_per_node,
                 allow_tp_across_nodes=p.allow_tp_across_nodes,
                 pipeline_parallel_size=p.pipeline_model_parallel_size,
                 cp=p.context_parallel_size)
    except TopologyError as err:
        hosts = -(-world_size // ranks_per_node)
        raise TrainConfigError(f"a job of {hosts} host{'s' if hosts > 1 else ''} x {ranks_per_node} "
                               f"ranks: {err}") from None


def check_command(argv: list[str], nnodes: int | None,
                  nproc_per_node: int | None) -> tuple[TrainConfig, LaunchOptions]:
    """Parse the trainer's ``argv`` and check its layout on ``nnodes`` hosts of ``nproc_per_node``
    ranks (None: not known before the rendezvous, e.g. ``--nnodes 1:4`` or ``--nproc-per-node gpu``;
    then only what needs no world size is checked, and the ranks check the rest). A ``--dry-run``
    is laid out for its config's world size, not the launch's."""
    cfg, options = parse_args(argv)
    if not options.dry_run and nnodes is not None and nproc_per_node is not None:
        check_layout(cfg, nnodes * nproc_per_node, nproc_per_node)
    return cfg, options
