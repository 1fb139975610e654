"""Building ZeRO-3's partitioned parameters from a meta-device model (ZeRO paper §5.3, Pos+g+p).

The model is constructed on the meta device (nothing allocated); each rank then materialises only
its 1/Nd chunk of every unit's flat parameter buffer. Values come from a per-parameter initialiser
keyed by canonical name (independent of TP and DP degree), computed one parameter at a time: the
largest transient tensor is one TP-local parameter, never the whole model.

Steps, each a small function used by :class:`~hybrid.zero.stage3.ParameterPartitioning`:
``assign_units`` (which unit owns which parameter, persistent small ones apart), ``initial_values``
(where values come from), ``make_units`` (flat buffers, meta parameters replaced by views),
``tied_units`` / ``backward_reads`` (hints for the gather schedule). The engine then fills each
unit's chunk (:meth:`~hybrid.zero.stage3_unit.ShardedUnit.materialize`) together with its fp32
master, and gathers the persistent unit.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hybrid.comm import Group
from hybrid.zero.stage3_unit import ShardedUnit
from hybrid.zero.tiling import TiledWeight, TilePlan, placeholder

InitFn = Callable[[str], torch.Tensor]   # canonical name -> full TP-local value (any float dtype)


def assign_units(model: nn.Module, modules: list[nn.Module], threshold: int,
                 tiled: set[int] = frozenset(), never_whole: set[int] = frozenset()
                 ) -> tuple[list[list[tuple[str, nn.Parameter]]], list[tuple[str, nn.Parameter]]]:
    """Per unit, its (canonical name, parameter) pairs to partition; plus the persistent ones
    (fewer than ``threshold`` elements, kept whole on every rank). A tied parameter belongs to the
    first unit that holds it; every parameter must belong to some unit. Parameters in ``tiled``
    (ids) are left out: their tiles get units of their own (:func:`make_tile_units`); those in
    ``never_whole`` (ids: expert-parallel ones) are partitioned whatever their size."""
    names = {id(p): n for n, p in model.named_parameters()}   # first (canonical) name of each
    seen: set[int] = set(tiled)
    per_unit, persistent = [], []
    for index, module in enumerate(modules):
        mine = []
        for param in module.parameters():
            if id(param) not in names:
                raise ValueError(f"sharding unit {index} ({type(module).__name__}) holds a parameter "
                                 f"that is not a parameter of the model")
            if id(param) in seen:
                continue
            seen.add(id(param))
            pair = (names[id(param)], param)
            small = param.numel() < threshold and id(param) not in never_whole
            (persistent if small else mine).append(pair)
        per_unit.append(mine)
    outside = [n for n, p in model.named_parameters() if id(p) not in seen]
    if outside:
        raise ValueError(f"parameters {outside[:4]} are in no module of model.sharding_units(); "
                         f"ZeRO stage 3 partitions unit by unit, so add their modules to a unit")
    return per_unit, persistent


def initial_values(model: nn.Module, init_fn: InitFn | None, seed: int
                   ) -> Callable[[str, nn.Parameter], torch.Tensor]:
    """Where each parameter's initial value comes from: ``init_fn(name)``, else
    ``model.init_parameter(name, seed)``, else the parameter's current (materialised) value."""
    if init_fn is not None:
        return lambda name, param: init_fn(name)
    if hasattr(model, "init_parameter"):
        return lambda name, param: model.init_parameter(name, seed)
    current = {n: p.detach() for n, p in model.named_parameters()}
    meta = [n for n, p in current.items() if p.is_meta]
    if meta:
        raise ValueError(f"parameter {meta[0]!r} is on the meta device and there is no initialiser: "
                         f"pass init_fn(name) -> TP-local tensor to the stage-3 optimizer or give "
                         f"the model an init_parameter(name, seed) method")
    return lambda name, param: current[name]


def make_units(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]],
               persistent: list[tuple[str, nn.Parameter]], group: Group, *, dtype: torch.dtype,
               device: torch.device, alignment: int, replicas: Group | None = None,
               secondary_group: Group | None = None, name: str = "unit"
               ) -> tuple[list[ShardedUnit | None], ShardedUnit | None]:
    """One :class:`ShardedUnit` per unit with partitioned parameters (None otherwise) and one for the
    persistent parameters; every model parameter is replaced by a view of its unit's buffer. The
    chunks hold zeros until materialised (the initial values of :func:`initial_values` read a
    materialised model through its old parameters, taken before this call). ``replicas`` and
    ``secondary_group``: hybrid sharding's and hpZ's groups (:mod:`hybrid.zero.host_groups`)."""
    owners = _parameter_owners(model)
    options = dict(dtype=dtype, device=device, alignment=alignment, replicas=replicas)
    units: list[ShardedUnit | None] = []
    for index, pairs in enumerate(groups):
        units.append(_build_unit(f"{name}{index}", pairs, group, owners, **options,
                                 secondary_group=secondary_group) if pairs else None)
    kept = _build_unit("persistent", persistent, group, owners, **options,
                       persistent=True) if persistent else None
    return units, kept


def make_tile_units(model: nn.Module, plans: list[list[TilePlan]], group: Group, *,
                    dtype: torch.dtype, device: torch.device, alignment: int,
                    replicas: Group | None = None, secondary_group: Group | None = None,
                    prefetch: bool = True) -> list[list[TiledWeight]]:
    """Memory-centric tiling (:mod:`hybrid.zero.tiling`): per sharding unit, one
    :class:`TiledWeight` per planned weight, each tile a :class:`ShardedUnit` of its own whose slot
    is the weight's name with the tile's element offset. The module reads its weight through
    ``weight_tiles``; its registered ``weight`` becomes a storage-less placeholder."""
    owners = _parameter_owners(model)
    options = dict(dtype=dtype, device=device, alignment=alignment, replicas=replicas,
                   secondary_group=secondary_group)
    out = []
    for index, mine in enumerate(plans):
        tiled = []
        for plan in mine:
            units = []
            for k, (tile, base, whole) in enumerate(plan.tile_params()):
                unit = ShardedUnit(f"unit{index}.{plan.name}.tile{k}", [(plan.name, tile)], group,
                                   tile_of={id(tile): (base, whole)}, **options)
                unit.bind(lambda old, view: _replace(old, view, owners, dtype, device))
                units.append(unit)
            plan.module.weight_tiles = TiledWeight(plan.name, units, prefetch)
            stand_in = placeholder(plan.param, dtype, device)
            for module, key in owners[id(plan.param)]:
                module._parameters[key] = stand_in
            tiled.append(plan.module.weight_tiles)
        out.append(tiled)
    return out


def _build_unit(name, pairs, group, owners, *, dtype, device, alignment, persistent=False,
                replicas=None, secondary_group=None):
    unit = ShardedUnit(name, pairs, group, dtype=dtype, device=device, alignment=alignment,
                       persistent=persistent, replicas=replicas, secondary_group=secondary_group)
    unit.bind(lambda old, view: _replace(old, view, owners, dtype, device))
    return unit


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, key))
    return owners


def _replace(old: nn.Parameter, view: torch.Tensor, owners, dtype, device) -> nn.Parameter:
    """A real parameter (same attributes, e.g. ``tensor_model_parallel``) that is ``view``; put in
    every module slot that held ``old`` (a tied weight has two)."""
    new = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    new.data = view
    for module, key in owners.get(id(old), ()):   # a tile belongs to no module
        module._parameters[key] = new
    return new


def tied_units(model: nn.Module, modules: list[nn.Module]) -> list[int]:
    """Units whose parameters the model uses again after the last unit (GPT's output layer reuses
    the word embedding). ``model.tied_sharding_units`` overrides; otherwise units holding an
    embedding are assumed tied when the model has no output weight of its own (a wrong guess only
    costs one extra gather, a missed tie would read a released weight)."""
    explicit = getattr(model, "tied_sharding_units", None)
    if explicit is not None:
        return list(explicit)
    return [i for i, m in enumerate(modules) if _is_embedding_unit(m)]


def backward_reads(modules: list[nn.Module]) -> list[bool]:
    """Whether each unit's backward needs its parameter values. An embedding lookup's gradient is a
    scatter-add of the output gradient (and a position slice's a copy): no weight values, so such
    units are not gathered again in backward. A module may say ``backward_reads_parameters``."""
    out = []
    for m in modules:
        explicit = getattr(m, "backward_reads_parameters", None)
        out.append(bool(explicit) if explicit is not None else not _is_embedding_unit(m))
    return out


def _is_embedding_unit(module: nn.Module) -> bool:
    """Every submodule owning parameters is an embedding (a lookup table)."""
    owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return bool(owners) and all(isinstance(m, nn.Embedding) or "Embedding" in type(m).__name__
                                for m in owners)
