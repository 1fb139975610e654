"""ZeRO stage 3, Pos+g+p: optimizer states, gradients AND parameters partitioned (ZeRO paper §5.3).

Each DP rank of a TP shard holds 1/Nd of every unit's 16-bit parameters, 16-bit gradients, fp32
master weights and Adam moments: (2 + 2 + 12)Ψ/Nd bytes of model states (Ψ = this TP rank's
parameters). Parameters are gathered unit by unit around their use (:mod:`.stage3_hooks`), gradients
are reduce-scattered unit by unit (asynchronously, at most two in flight) as soon as all of a unit's
gradients have been accumulated (a post-accumulate-grad hook counts them; a tied weight's hook fires
once, after both of its uses), so a step moves 3Ψ(n-1)/n per rank: two parameter all-gathers and one
gradient reduce-scatter (§7.2.2).

Each rank initialises only its chunks, one parameter at a time, in fp32: the fp32 master keeps those
values and the 16-bit chunk is their rounding, so the master starts where the fp32 model of stages
0-2 starts (one seed, one curve at every stage; ``--init-from-hf`` keeps the checkpoint's fp32).

Usage (the same engine interface as stages 0-2)::

    model = GPTModel(config, state, device="meta")
    opt = ParameterPartitioning(model, state, ZeroConfig(stage=3, precision="bf16"), AdamWConfig(),
                                init_fn=lambda name: value_of(name))     # full TP-local value
    for micro in batches:  opt.backward(model(tokens, labels).mean() / len(batches))
    result = opt.step()

Small parameters (< ``stage3_param_persistence_threshold`` elements) stay whole on every rank in one
persistent flat buffer; their gradients are still reduce-scattered and the updated chunks gathered
once per step (2Ψ_small instead of 3Ψ_small), and the memory report counts them whole.

ZeRO++ options (``ZeroConfig``): ``quantized_weights`` (qwZ) makes every unit's all-gather send
int8 blocks, dequantized into the 16-bit buffer the layer computes with (the persistent unit stays
exact); ``quantized_gradients`` (qgZ) reduce-scatters the gradients in int8, inside each host and
then across hosts (:mod:`.quantized_collectives`). Shards, masters and moments stay exact, so a
checkpoint does not depend on either option.

The fp32 masters and moments of the owned chunks live in an optimizer-state backend
(:mod:`.optimizer_state`): on the device, or, with ``offload=OffloadConfig(mode="cpu"|"nvme")``
(:mod:`hybrid.offload`), in host memory or on NVMe; the backend runs AdamW and writes the updated
values into the 16-bit partitions, which live in memory or, with ``OffloadConfig(params="nvme")``,
in a file (:mod:`.shard_store`).

Outside forward/backward the model's partitioned parameters hold no storage: read them through
``gathered_state_dict()`` (collective) or ``named_local_params()``, never ``model.state_dict()``.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from hybrid import comm
from hybrid.adamw_config import AdamWConfig, uses_weight_decay
from hybrid.parallel_state import ParallelState
from hybrid.zero import stage3_build as build
from hybrid.zero import tiling
from hybrid.zero.config import ZeroConfig
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.host_groups import expert_secondary_group, place_classes, secondary_group
from hybrid.zero.optimizer_state import build_optimizer_state
from hybrid.zero.param_classes import expert_dp_group, is_expert, split_classes
from hybrid.zero.pieces import OwnedPiece
from hybrid.zero.quantized_collectives import gradient_reduce_scatter, tp_agreed_scales
from hybrid.zero.report import MemoryReport, class_formula_bytes, measure_storages
from hybrid.zero.results import Fragment
from hybrid.zero.shard_store import open_shard_store, resident_param_bytes
from hybrid.zero.stage3_classes import merge_units, split_pairs
from hybrid.zero.stage3_hooks import Stage3Scheduler
from hybrid.zero.stage3_unit import ShardedUnit
from hybrid.zero.weak_hooks import add_post_accumulate_hooks

log = logging.getLogger(__name__)
MAX_REDUCES_IN_FLIGHT = 2   # overlap one unit's reduce-scatter with the next unit's backward


class ParameterPartitioning(ZeroEngine):
    """Pos+g+p, parameter partitioning (ZeRO §5.3, stage 3): Pos+g, and each rank keeps only its
    1/Nd of the 16-bit parameters, gathered unit by unit around their use. ``backward(loss)`` per
    micro-batch, ``step()`` once, see the module docstring. The step itself is
    :class:`hybrid.zero.engine.ZeroEngine`'s; gradients arrive summed over DP and are divided
    inside the AdamW pass (``grad_divisor``)."""

    stage = 3

    def __init__(self, model: nn.Module, state: ParallelState, zero_config: ZeroConfig,
                 adamw_config: AdamWConfig, *, init_fn: build.InitFn | None = None, seed: int = 0,
                 offload=None, expert_dp=None):
        super().__init__(state, zero_config, adamw_config)
        if not hasattr(model, "sharding_units"):
            raise TypeError(f"{type(model).__name__} has no sharding_units(): ZeRO stage 3 needs the "
                            f"ordered submodules it gathers one at a time")
        self.model = model
        modules = list(model.sharding_units())
        threshold = zero_config.stage3_param_persistence_threshold
        self.tile_factor = zero_config.tile_factor
        tiling.check_working_memory(model, modules, threshold, self.tile_factor,
                                    zero_config.max_working_memory, self.dtype.itemsize)
        # parameter classes (issue 32): expert-parallel ones get units over expert-DP of their own
        params = list({id(p): p for p in model.parameters()}.values())
        classes = split_classes(params, self.shard_group, expert_dp_group(state, expert_dp),
                                state.dp_cp.size)   # dense replicas: DP x CP
        classes = place_classes(state, zero_config, classes, self.replicas)   # hybrid: by host
        expert_class = next((c for c in classes if c.name == "expert"), None)
        expert_ids = {id(params[i]) for i in expert_class.members} if expert_class else set()
        self.expert_group = expert_class.group if expert_class else None
        if expert_class is not None:
            self.expert_replicas = expert_class.replicas
        plans = tiling.plan_tiles(model, modules, self.tile_factor, threshold)
        groups, small = build.assign_units(model, modules, threshold,
                                           tiled={id(t.param) for mine in plans for t in mine},
                                           never_whole=expert_ids)
        groups, expert_groups = split_pairs(groups, expert_ids)
        self.psi = sum(p.numel() for p in model.parameters())
        self.expert_psi = sum(p.numel() for p in params if id(p) in expert_ids)
        self.persistent_numel = sum(p.numel() for _, p in small)
        init = build.initial_values(model, init_fn, seed)   # before make_units replaces parameters
        self.secondary_group = secondary_group(state, zero_config)
        # hpZ for the expert units: the expert-DP ranks on this host (host_groups)
        self.expert_secondary = (expert_secondary_group(state, zero_config, expert_class.group)
                                 if expert_class is not None else None)
        layout = dict(dtype=self.dtype, device=self.device, alignment=zero_config.alignment_elements,
                      replicas=self.replicas, secondary_group=self.secondary_group)
        dense_units, self.persistent = build.make_units(model, groups, small, self.shard_group,
                                                        **layout)
        expert_units = (build.make_units(model, expert_groups, [], self.expert_group,
                                         **dict(layout, replicas=self.expert_replicas,
                                                secondary_group=self.expert_secondary),
                                         name="expert_unit")[0]
                        if self.expert_group is not None else [None] * len(modules))
        # what the scheduler gathers per module (both classes' units as one UnitSet)
        self.units, members = merge_units(dense_units, expert_units)
        self.tiles = build.make_tile_units(model, plans, self.shard_group, **layout,
                                           prefetch=zero_config.stage3_prefetch)
        self.all_units: list[ShardedUnit] = []   # each unit, then its tiles (ZeRO-Infinity tiling)
        for mine, tiles in zip(members, self.tiles):
            self.all_units += mine + [u for t in tiles for u in t.units]
        if self.persistent is not None:
            self.all_units.append(self.persistent)
        reduce_scatter = gradient_reduce_scatter(state, zero_config.quantized_gradients)
        expert_reduce_scatter = (gradient_reduce_scatter(state, zero_config.quantized_gradients,
                                                         expert=True)
                                 if self.expert_group is not None else None)   # qgZ over expert-DP
        for unit in self.all_units:   # qwZ spares the persistent unit: gathered once a step, small
            quantized = zero_config.quantized_weights and unit is not self.persistent
            mine = expert_reduce_scatter if unit.group is self.expert_group else reduce_scatter
            unit.use_collectives(mine, quantized,
                                 tp_agreed_scales(state.tp) if quantized else None,
                                 zero_config.quantized_weights_format)
        pieces = [OwnedPiece(seg.slot.name, k, seg.chunk_offset, seg.param_offset, seg.length,
                             uses_weight_decay(seg.slot.param),
                             bool(getattr(seg.slot.param, "tensor_model_parallel", False)),
                             int(unit.group is self.expert_group))
                  for k, unit in enumerate(self.all_units) for seg in unit.segments]
        optimizer_state = build_optimizer_state(
            offload, [u.shard for u in self.all_units], pieces, adamw_config,
            mixed_precision=zero_config.mixed_precision, device=self.device, rank=state.rank,
            resident_bytes=self._resident_bytes(offload),
            muon=self._muon_setup([(slot.name, slot.shape, getattr(slot.param, "partition_dim", -1),
                                    is_expert(slot.param), int(unit.group is self.expert_group))
                                   for unit in self.all_units for slot in unit.slots],
                                  [self.shard_group, self.expert_group]))
        for k, unit in enumerate(self.all_units):   # the chunks and their fp32 masters
            unit.materialize(init, functools.partial(optimizer_state.write_master, k))
        if self.persistent is not None:
            self.persistent.gather(async_op=False)   # the small parameters stay whole
        self.param_store = open_shard_store(offload, self.all_units, dtype=self.dtype,
                                            rank=state.rank, device=self.device)
        self.scheduler = Stage3Scheduler(model, modules, self.units,
                                         tied=build.tied_units(model, modules),
                                         backward_reads=build.backward_reads(modules),
                                         prefetch=zero_config.stage3_prefetch,
                                         sizes=[(u.numel if u is not None else 0) +
                                                sum(t.numel for w in mine for t in w.units)
                                                for u, mine in zip(self.units, self.tiles)])
        self._remaining = [len(u.slots) for u in self.all_units]
        self._backward_open = False
        self._in_flight: list[int] = []    # units whose reduce-scatter is running, oldest first
        largest = max(u.padded for u in self.all_units)
        comm.reserve_transport(self.shard_group, largest * self.dtype.itemsize)   # a whole unit
        if self.expert_group is not None:
            comm.reserve_transport(self.expert_group, largest * self.dtype.itemsize)
        for group in (self.secondary_group, self.expert_secondary):          # per collective
            if group is not None:
                comm.reserve_transport(group, largest * self.dtype.itemsize)
        self._reduce_buffers = _ReduceBuffers(largest, self.dtype, self.device,
                                              comm.needs_reduce_scratch(self.shard_group))
        self._module_of = {k: i for k, u in enumerate(self.all_units)   # unit -> sharding unit index
                           for i, mine in enumerate(members) if any(v is u for v in mine)}
        self._members = {i: [k for k, j in self._module_of.items() if j == i]
                         for i in set(self._module_of.values())}
        add_post_accumulate_hooks(self, "_on_unit_grad", ((slot.param, (k,))
                                                          for k, unit in enumerate(self.all_units)
                                                          for slot in unit.slots))
        self.optimizer_state_replicated = False   # each DP rank holds its partition (Pos)
        self.parameters_replicated = False        # and of every unit (ZeRO §5.3 Pos+g+p)
        # disjoint partitions; with an expert class, each class counted on its first host's copy
        self._init_step(optimizer_state, pieces, state.world,
                        counted=None if self.expert_group is None else
                        [r is None or r.rank == 0 for r in (self.replicas, self.expert_replicas)])
        if state.rank == 0:
            log.info("ZeRO stage 3: %d units\n%s", len(self.all_units), self.memory_report())

    def _resident_bytes(self, offload) -> int:
        """What this rank keeps in host memory besides an offloaded optimizer state: its 16-bit
        chunks (or the NVMe store's buffers), gradient partitions and reduce buffers."""
        item = torch.empty((), dtype=self.dtype).element_size()
        chunks = sum(u.chunk for u in self.all_units)
        largest = max(u.padded for u in self.all_units)
        params = resident_param_bytes(offload, self.all_units, self.dtype)
        return params + item * (chunks + 4 * largest)

    # ---- gradients -------------------------------------------------------------------------
    def _on_unit_grad(self, k: int, param: torch.Tensor) -> None:
        """Post-accumulate hook of each parameter of unit ``k``: the unit's last one reduces it."""
        self._backward_open = True
        self._remaining[k] -= 1
        if self._remaining[k] == 0:
            self._reduce_unit(k)

    def _reduce_unit(self, k: int) -> None:
        """Release unit k (its backward is over) and start its gradient reduce-scatter. At most
        MAX_REDUCES_IN_FLIGHT full-size gradient buffers exist: older reduces are finished first."""
        unit = self.all_units[k]
        mine = self._members.get(self._module_of.get(k), [k])
        if k in self._module_of and (len(mine) == 1 or all(self._remaining[j] == 0 for j in mine)):
            # (a module with a dense and an expert unit: released once both are done)
            self.scheduler.release(self._module_of[k])
        while len(self._in_flight) >= MAX_REDUCES_IN_FLIGHT:
            self._finish_reduce(self._in_flight.pop(0))
        unit.reduce_gradients(*self._reduce_buffers.take(k))
        self.scheduler.record("reduce", k)
        self._in_flight.append(k)
        if not self.config.overlap_communication:
            self._finish_reduce(self._in_flight.pop())

    def _finish_reduce(self, k: int) -> None:
        self.all_units[k].finish_reduce()
        self._reduce_buffers.give_back(k)
        self.scheduler.record("reduce_done", k)
        if self._micro_batches == self.config.gradient_accumulation_steps:
            # final for this step: an offloaded optimizer state streams it to the host now
            self.optimizer_state.accept_grad(k, self.all_units[k].grad)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch (the caller divides by the number of micro-batches)."""
        scale = self.scaler.scale_tensor()   # a device tensor (fp16) or 1.0: no read
        self._backward_open = True
        self._micro_batches += 1
        (loss if isinstance(scale, float) else loss * scale).backward()
        self._finish_backward()

    def _finish_backward(self) -> None:
        """After a backward: reduce units whose gradients never all arrived (unused parameters),
        wait for every reduce-scatter, release everything. A no-op when no backward ran since."""
        if not self._backward_open:
            return
        self._backward_open = False
        for k, unit in enumerate(self.all_units):
            if self._remaining[k] != 0 and not unit.reduce_pending:
                self._reduce_unit(k)
        for k in self._in_flight:
            self._finish_reduce(k)
        self._in_flight = []
        self.scheduler.release_all()
        for unit in self.all_units:   # a tile gathered ahead that autograd did not run next
            if unit.gathered and unit is not self.persistent:
                unit.release()
        self._remaining = [len(u.slots) for u in self.all_units]

    def drop_gradients(self) -> None:
        """Discard this step's gradients without an update (a skipped step): finish the backward's
        reduce-scatters and releases first, so nothing lands in a partition after it is zeroed."""
        self._finish_backward()
        self.zero_grad()

    def _zero_grads(self) -> None:
        for unit in self.all_units:
            unit.zero_grad()
            for slot in unit.slots:
                slot.param.grad = None

    # ---- storage methods of the shared step (ZeroEngine.step) -------------------------------
    def _land_gradients(self) -> None:
        self._finish_backward()

    def _owned_grads(self) -> list[torch.Tensor]:
        return [u.grad for u in self.all_units]

    def _param_chunks(self):
        """The owned 16-bit chunks (with parameters on NVMe: the store's writer)."""
        return self.param_store.writer()

    def _gather_params(self) -> None:
        """The 16-bit partitions changed: units gather them when next used; the persistent
        parameters are gathered now."""
        for unit in self.all_units:
            unit.invalidate_secondary()   # hpZ: the next gather is the forward's full one
        if self.persistent is not None:
            self.persistent.regather()    # the updated small parameters, whole again

    def _end_step(self) -> None:
        self.zero_grad()
        self.param_store.end_step()   # NVMe: the first step's fetches become the read-ahead order

    # ---- reports ---------------------------------------------------------------------------
    @property
    def num_local_params(self) -> int:
        """Ψ of this TP rank: parameters it trains, without padding."""
        return self.psi

    def memory_report(self) -> MemoryReport:
        resident = self.optimizer_state.resident()   # the device's, or what offload keeps
        measured = measure_storages({
            "param16": [t for u in self.all_units for t in (u.shard, u.full)] +
                       self.param_store.resident(),
            "grad16": [u.grad for u in self.all_units],
            "param16_secondary": [u.secondary for u in self.all_units if u.secondary is not None],
            "master32": resident["master32"],
            "adam_moments": resident["adam_moments"],
            "buffers": list(self.model.buffers()) + self._reduce_buffers.tensors() +
                       comm.transport_buffers(self.shard_group) +
                       (comm.transport_buffers(self.expert_group)
                        if self.expert_group is not None else []) +
                       [t for g in (self.secondary_group, self.expert_secondary) if g is not None
                        for t in comm.transport_buffers(g)] +
                       resident["buffers"]})
        param_bytes = torch.empty((), dtype=self.dtype).element_size()
        shares = {"dense": (self.psi - self.expert_psi, self.shard_group.size)}
        if self.expert_group is not None:
            shares["expert"] = (self.expert_psi, self.expert_group.size)
        formula = class_formula_bytes(shares.values(), self.stage, param_bytes=param_bytes,
                                      mixed_precision=self.config.mixed_precision,
                                      moment_bytes=self.adamw.moment_bytes_per_param)
        if self.secondary_group is not None:   # hpZ: 2(Ψ - persistent)/h in bf16
            formula["param16_secondary"] = (param_bytes * (self.psi - self.expert_psi -
                                                           self.persistent_numel)
                                            / self.secondary_group.size)
            if self.expert_secondary is not None:   # experts: 2 Ψ_e / h_e
                formula["param16_secondary"] += (param_bytes * self.expert_psi
                                                  / self.expert_secondary.size)
        return MemoryReport(self.stage, self.shard_group.size, self.state.tp_size,
                            self.config.precision, self.psi, measured, formula,
                            working_memory=self.working_memory(), tile_factor=self.tile_factor,
                            classes=shares if len(shares) > 1 else None)

    def working_memory(self) -> dict[str, int]:
        """Parameter bytes gathered while one sharding unit computes (no look-ahead): "tiled"
        with this engine's tile factor, "untiled" with every weight whole
        (:func:`hybrid.zero.tiling.working_memory`)."""
        return tiling.working_memory(self.units, self.tiles, self.dtype.itemsize)

    def gathered_bytes(self) -> int:
        """Bytes of the partitioned units' full buffers holding storage right now (the persistent
        small parameters, always whole, apart)."""
        return sum(u.held_bytes() for u in self.all_units if u is not self.persistent)

    def expected_overhead_bytes(self) -> dict[str, float]:
        """What stage 3 holds beyond (2+2+12)Ψ/Nd: alignment padding of the chunks (all state
        categories) and the whole 16-bit copy of the persistent small parameters, held beside the
        chunk this rank owns of them (which the formula already counts); with hpZ, the padding
        of the secondary partitions too."""
        param_bytes = torch.empty((), dtype=self.dtype).element_size()
        per_elem = 2 * param_bytes + (4 if self.config.mixed_precision else 0) + 8
        padding = sum(u.padded - u.numel for u in self.all_units
                      if u.group is self.shard_group) / self.shard_group.size
        if self.expert_group is not None:   # expert units: their padding over expert-DP
            padding += sum(u.padded - u.numel for u in self.all_units
                           if u.group is self.expert_group) / self.expert_group.size
        persistent = self.persistent.padded * param_bytes if self.persistent is not None else 0
        out = {"padding": padding * per_elem, "persistent_params": float(persistent)}
        if self.secondary_group is not None:
            out["secondary_padding"] = param_bytes * sum(
                u.secondary.numel() - u.numel / u.secondary_group.size
                for u in self.all_units if u.secondary is not None)
        return out

    # ---- reading the parameters --------------------------------------------------------------
    def named_local_params(self) -> dict[str, tuple[int, torch.Tensor]]:
        """name -> (offset in the flattened TP-local parameter, this rank's 16-bit slice); a tiled
        weight of which this rank owns pieces of several tiles appears once per piece in
        :meth:`_parameter_fragments` and only with its first piece here."""
        out = {}
        for fragment in self._parameter_fragments():
            out.setdefault(fragment.param_name, (fragment.offset, fragment.tensor))
        return out

    def _parameter_fragments(self) -> list[Fragment]:
        shards = self.param_store.shard_views()
        return [Fragment(seg.slot.name, "model", seg.param_offset, seg.of(shard))
                for unit, shard in zip(self.all_units, shards) for seg in unit.segments]

    @torch.no_grad()
    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Full TP-local parameters (collective over DP: every rank must call it); with qwZ the
        exact values, not the quantized compute copy."""
        out = {}
        for unit in self.all_units:
            if unit.quantized_gather:
                for slot, value in unit.exact_values().items():
                    _put(out, slot, value)
                continue
            was_gathered = unit.gathered
            unit.gather(async_op=False)
            for slot in unit.slots:
                _put(out, slot, slot.param.detach())
            if not was_gathered:
                unit.release()
        return out


def _put(out: dict[str, torch.Tensor], slot, value: torch.Tensor) -> None:
    """Copy a slot's gathered values into ``out[slot.name]``: the whole parameter, or a tile's
    rows of it (memory-centric tiling: the tiles of one weight assemble the untiled tensor)."""
    if slot.whole_shape is None:
        out[slot.name] = value.clone()
        return
    whole = out.setdefault(slot.name, torch.empty(slot.whole_shape, dtype=value.dtype,
                                                  device=value.device))
    whole.view(-1).narrow(0, slot.base, slot.numel).copy_(value.reshape(-1))


class _ReduceBuffers:
    """The constant-size buffers of the in-flight gradient reduce-scatters (ZeRO-R CB): per slot
    a flat gradient buffer of the largest unit and, where the backend needs one, its receive
    buffer. At most MAX_REDUCES_IN_FLIGHT slots ever exist."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, scratch: bool):
        self.numel, self.dtype, self.device, self.scratch = numel, dtype, device, scratch
        self._free: list[tuple] = []
        self._all: list[tuple] = []
        self._lent: dict[int, tuple] = {}

    def take(self, unit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self._free:
            new = lambda: torch.empty(self.numel, dtype=self.dtype, device=self.device)  # noqa
            self._all.append((new(), new() if self.scratch else None))
            self._free.append(self._all[-1])
        self._lent[unit] = self._free.pop()
        return self._lent[unit]

    def give_back(self, unit: int) -> None:
        self._free.append(self._lent.pop(unit))

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in self._all for t in pair if t is not None]
