"""Automatic recompute planner: the cheapest per-layer plan whose activations fit a memory budget
(Korthikanti et al. 2022 §5 selective vs full recompute; ZeRO §6.1 Pa / Pa+cpu).

Memory per layer and rank comes from :mod:`hybrid.perf.activations` (the selective-recompute paper's
formulas, 16-bit values and 1-byte dropout masks) converted to the activation element size: value
bytes scale by ``bytes_per_element / 2``, the masks (two hidden-dropout masks ``sbh``, ``/t`` with SP,
and the attention-dropout mask ``as²b/t`` unless selective) take ``mask_bytes`` each (1 on CUDA,
where dropout keeps a bool mask; on CPU torch's dropout keeps a mask in the activation dtype), plus
the fp32 mean and rstd of the two LayerNorms (``16 sb`` bytes, which the paper neglects). The
attention core's own bytes are those of the core that runs
(:func:`~hybrid.perf.activations.attention_core_bytes`, issue 31): on CUDA SDPA's fused kernels keep
only an fp32 log-sum-exp per query row (``"flash"``, no [s, s] term); the CPU attention core
(models/gpt/attention_core.py, ``"cpu"``) keeps the probabilities of its causal blocks and a bool
attention-dropout mask and recomputes the dropped probabilities in backward instead of keeping them
(``cpu_core``); ``"megatron"`` is the paper's explicit core. With context parallelism (``cp``) every
term is that of the rank's ``s / cp`` tokens and the recompute FLOPs are the rank's ``1 / cp``. Checkpoints are one
``[s, b, h]`` layer input: :func:`~hybrid.perf.activations.checkpoint_bytes` (``/t`` with Pa, 0 on the
device with Pa+cpu; under SP already a ``[s/t, b, h]`` shard, never partitioned twice).

Cost model (seconds per layer and micro-batch, documented and deliberately simple):

* recompute FLOPs / ``flops_per_s``: ``full*`` reruns the layer's forward, the difference of
  :func:`~hybrid.perf.flops.model_flops_per_iteration` with and without full recompute for one
  layer, ``(24 b s h² + 4 b s² h) / t``; ``selective`` reruns the attention core, two batched
  matmuls ``QK^T`` and ``(softmax) V``: ``4 b s² h / t`` (softmax and dropout are not counted);
* transfers / bandwidth: Pa adds one TP all-gather of the checkpoint, ``(t-1)/t s b h`` elements per
  rank over ``tp_bandwidth``; Pa+cpu also moves its ``1/t`` slice to host and back, ``2 s b h / t``
  elements over ``host_bandwidth`` (on CUDA this overlaps compute; counted anyway, conservatively).

Peak activation bytes of a plan = ``other_bytes`` (embedding, output layer, loss) + the largest,
over the segments in backward order, of what the layers up to it keep plus its transient: a
``full*`` segment of ``k`` layers rebuilds ``k`` layers' complete activations at once, a selective
layer its attention core (an upper bound: it ignores what a layer frees before its transient).

Search: the layers are identical, and the LP relaxation of this multiple-choice knapsack is solved
by mixing at most two modes (neighbours on the lower convex hull of (bytes, seconds)). The planner
therefore tries every pair of modes and every split point - the first ``k`` layers in one mode, the
rest in the other, O(25 L) plan estimates - and keeps the cheapest plan that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.perf import activations as act
from hybrid.perf.architecture import GPT2, Architecture
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.recompute.plan import FULL_MODES, MODES, RecomputePlan


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs to know about the model and the layout of one rank."""

    num_layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    bytes_per_element: int = 4      # activation dtype: 4 fp32, 2 bf16/fp16
    mask_bytes: int = 1             # a dropout-mask element: 1 (CUDA bool mask); CPU dropout keeps a
                                    # mask of the activation dtype (bytes_per_element)
    other_bytes: float = 0.0        # activations outside the layers (embedding, logits, loss)
    cpu_core: bool = False          # the CPU attention core: its dropout mask is bool, its dropout
                                    # output is recomputed, not kept (Megatron's core keeps both)
    arch: Architecture = GPT2       # the model's options (GQA, SwiGLU, RMSNorm, ...)
    attention_core: str | None = None   # megatron | flash | cpu; None: cpu if cpu_core else megatron
    attention_dropout: bool = True  # the core keeps a dropout mask (attention dropout > 0)
    cp: int = 1                     # context-parallel degree: the rank holds seq / cp tokens
    cp_comm_type: str = "p2p"       # p2p (ring) | a2a | allgather
    hidden_dropout: bool = True     # the two hidden dropouts keep masks (hidden dropout > 0)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "seq", "micro_batch", "tp", "bytes_per_element",
                     "mask_bytes", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads or self.heads % self.tp:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, tp {self.tp}: heads must divide "
                             f"hidden and tp must divide heads")
        if self.core not in act.ATTENTION_CORES:
            raise ValueError(f"attention_core must be one of {act.ATTENTION_CORES}, got "
                             f"{self.attention_core!r}")

    @property
    def core(self) -> str:
        """The attention core that runs: ``attention_core``, else the CPU one with ``cpu_core``."""
        if self.attention_core is not None:
            return self.attention_core
        return "cpu" if self.cpu_core else "megatron"

    @classmethod
    def from_config(cls, config, *, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                    bytes_per_element: int = 4, device: str = "cuda",
                    other_bytes: float | None = None, cp: int = 1,
                    cp_comm_type: str = "p2p") -> "ModelDims":
        """From a :class:`models.gpt.config.GPTConfig` for our GPT model on ``device``'s type. On
        CPU, hidden-dropout masks take the activation dtype and the attention core is the CPU one
        (``cpu_core``); on CUDA masks are bool and the core is SDPA's fused kernels (``"flash"``:
        no [s, s] scores kept). ``other_bytes`` defaults to the fp32
        logits shard the vocab-parallel loss keeps (:func:`~hybrid.perf.activations.logits_bytes`)
        plus the ``sbh`` tensors around the final LayerNorm and the output layer: its input and
        output (two), and with hidden dropout the embedding dropout's mask and output (four; the
        count measured by tests/recompute), of the rank's ``seq / cp`` tokens."""
        on_cpu = str(device).startswith("cpu")
        mask_bytes = bytes_per_element if on_cpu else 1
        if other_bytes is None:
            seq = config.seq_length // cp
            sbh = seq * micro_batch * config.hidden_size
            vocab = config.padded_vocab_size(tp)
            around = 4 if config.hidden_dropout > 0 else 2
            other_bytes = (act.logits_bytes(seq, micro_batch, vocab, tp=tp)
                           + around * sbh * bytes_per_element)
        return cls(config.num_layers, config.hidden_size, config.num_attention_heads, config.seq_length,
                   micro_batch, tp, sequence_parallel and tp > 1, bytes_per_element, mask_bytes,
                   other_bytes, on_cpu, config.perf_architecture(),
                   attention_core="cpu" if on_cpu else "flash",
                   attention_dropout=config.attention_dropout > 0, cp=cp, cp_comm_type=cp_comm_type,
                   hidden_dropout=config.hidden_dropout > 0)

    @property
    def local_seq(self) -> int:
        """Tokens of one CP rank."""
        return self.seq // self.cp

    @property
    def sbh(self) -> int:
        return self.local_seq * self.micro_batch * self.hidden


@dataclass(frozen=True)
class CostModel:
    """Rates of one rank. Defaults: a V100 (125 TFLOP/s fp16, NVSwitch ring 150 GB/s, PCIe 3 x16)."""

    flops_per_s: float = 125e12
    tp_bandwidth: float = 150e9
    host_bandwidth: float = 12e9


@dataclass(frozen=True)
class ModeCost:
    """Per layer and rank: bytes kept on the device and in the host tier, the backward transient,
    recompute FLOPs, transfer bytes and the modelled seconds."""

    mode: str
    device_bytes: float
    host_bytes: float
    transient_bytes: float
    recompute_flops: float
    tp_bytes: float
    host_transfer_bytes: float
    seconds: float


def layer_activation_bytes(d: ModelDims, recompute: str) -> float:
    """Bytes one layer keeps without checkpointing (``recompute`` none | selective), element-size aware."""
    t, sp = d.tp, d.sequence_parallel
    # the paper's 16-bit bytes outside the attention core (10 + 24/t, or 34/t with SP)
    b16 = act.activation_bytes_per_layer(d.seq, d.micro_batch, d.hidden, d.heads, tp=t,
                                         sequence_parallel=sp, recompute="selective", arch=d.arch,
                                         cp=d.cp)
    masks = 2 * d.sbh / (t if sp else 1)                 # hidden-dropout mask elements (1 byte in b16)
    stats = 1 if d.arch.rmsnorm else 2                   # fp32 rstd (RMSNorm) or mean and rstd
    ln_stats = 2 * stats * 4 * d.local_seq * d.micro_batch / (t if sp else 1)   # of the 2 norms
    value = ((b16 - masks) * d.bytes_per_element / 2 + ln_stats
             + (masks * d.mask_bytes if d.hidden_dropout else 0.0))   # p = 0: no dropout runs
    if recompute == "none":   # the core that runs: scores, probabilities, masks or log-sum-exp
        value += act.attention_core_bytes(d.seq, d.micro_batch, d.hidden, d.heads, tp=t,
                                          core=d.core, dropout=d.attention_dropout,
                                          value_bytes=d.bytes_per_element, mask_bytes=d.mask_bytes,
                                          cp=d.cp, cp_comm_type=d.cp_comm_type,
                                          kv_hidden=d.arch.kv_hidden(d.hidden, d.heads))
    if d.core == "cpu" and d.cp == 1:
        # its own copies of q, k, v are the paper's Q, K, V: nothing beside them (core_input_copies)
        # unless selective recompute of a rotary core keeps the core's inputs
        if recompute == "none" or d.arch.learned_positions:
            copies = d.arch.core_input_copies(d.hidden, d.heads)
            value -= copies * d.sbh / t * d.bytes_per_element / 2
    return value


def mode_costs(d: ModelDims, cost: CostModel = CostModel()) -> dict[str, ModeCost]:
    """Per-layer memory and cost of every mode (transients of one layer)."""
    t, e = d.tp, d.bytes_per_element
    full_act = layer_activation_bytes(d, "none")
    sel_act = layer_activation_bytes(d, "selective")
    flops = dict(heads=d.heads, arch=d.arch)
    layer_flops = (model_flops_per_iteration(d.micro_batch, d.seq, 1, d.hidden, 1, full_recompute=True,
                                             **flops)
                   - model_flops_per_iteration(d.micro_batch, d.seq, 1, d.hidden, 1, **flops)) / t / d.cp
    core_flops = 4 * d.micro_batch * d.seq * d.seq * d.hidden / t / d.cp   # the rank's queries

    def ckpt(partitioned: bool, offload: bool) -> float:
        if d.sequence_parallel:   # already a [s/t, b, h] shard
            return 0.0 if offload else d.sbh * e / t
        return act.checkpoint_bytes(d.local_seq, d.micro_batch, d.hidden, 1, mp=t, partitioned=partitioned,
                                    cpu_offload=offload, bytes_per_element=e)

    shard = d.sbh * e / t
    gather = 0.0 if d.sequence_parallel else d.sbh * e * (t - 1) / t
    transient = full_act   # backward of a recomputed layer rebuilds all of its activations
    return {
        "none": ModeCost("none", full_act, 0, 0, 0, 0, 0, 0.0),
        "selective": ModeCost("selective", sel_act, 0, full_act - sel_act, core_flops, 0, 0,
                              core_flops / cost.flops_per_s),
        "full": ModeCost("full", ckpt(False, False), 0, transient, layer_flops, 0, 0,
                         layer_flops / cost.flops_per_s),
        "full-pa": ModeCost("full-pa", ckpt(True, False), 0, transient, layer_flops, gather, 0,
                            layer_flops / cost.flops_per_s + gather / cost.tp_bandwidth),
        "full-pa-cpu": ModeCost("full-pa-cpu", ckpt(True, True), shard, transient, layer_flops, gather,
                                2 * shard, layer_flops / cost.flops_per_s + gather / cost.tp_bandwidth
                                + 2 * shard / cost.host_bandwidth),
    }


@dataclass(frozen=True)
class PlanEstimate:
    peak_bytes: float           # device tier, incl. other_bytes and the largest transient
    host_bytes: float
    recompute_flops: float
    tp_bytes: float
    host_transfer_bytes: float
    seconds: float


def estimate(plan: RecomputePlan, d: ModelDims, cost: CostModel = CostModel()) -> PlanEstimate:
    """Modelled peak memory and overheads of ``plan`` per rank and micro-batch."""
    costs = mode_costs(d, cost)
    # backward runs from the last layer to the first and frees what each layer kept as it goes:
    # while segment i is in backward, layers before it still keep their bytes, later ones do not
    peak, kept = 0.0, 0.0
    for seg in plan.segments():
        here = sum(costs[m].device_bytes for m in plan.modes[seg.start:seg.stop])
        peak = max(peak, kept + here + _transient(seg.mode, seg.stop - seg.start, costs))
        kept += here
    total = {f: sum(getattr(costs[m], f) for m in plan.modes)
             for f in ("host_bytes", "recompute_flops", "tp_bytes", "host_transfer_bytes", "seconds")}
    return PlanEstimate(d.other_bytes + peak, **total)


def _transient(mode: str, layers: int, costs: dict[str, ModeCost]) -> float:
    """Extra bytes while one segment is in backward: a ``full*`` segment of ``layers`` layers holds
    their complete activations (its own checkpoint is still referenced until it finishes)."""
    if mode in FULL_MODES:
        return layers * costs[mode].transient_bytes + costs[mode].device_bytes
    return costs[mode].transient_bytes


def _block_peak(kept: float, n: int, mode: str, costs: dict[str, ModeCost], granularity: int):
    """(peak, kept after) of ``n`` consecutive layers in ``mode`` after layers keeping ``kept``:
    :func:`estimate`'s loop in closed form. Along a block the kept bytes grow and transients only
    depend on segment size, so the peak is at its last full-size or its last (partial) segment."""
    if n == 0:
        return 0.0, kept
    per = costs[mode].device_bytes
    size = granularity if mode in FULL_MODES else 1
    full_segments, rest = divmod(n, size)
    peaks = []
    if full_segments:
        before = kept + (full_segments - 1) * size * per
        peaks.append(before + size * per + _transient(mode, size, costs))
    if rest:
        before = kept + full_segments * size * per
        peaks.append(before + rest * per + _transient(mode, rest, costs))
    return max(peaks), kept + n * per


def plan_for_budget(d: ModelDims, budget_bytes: float, *, cost: CostModel = CostModel(),
                    modes: tuple[str, ...] = MODES, **plan_kw) -> RecomputePlan:
    """The plan with the least modelled recompute + transfer time whose peak fits ``budget_bytes``
    (ties: the smaller peak). The first layers get the memory-saving mode."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown recompute modes {bad}; choose from {MODES}")
    costs, L, best = mode_costs(d, cost), d.num_layers, None
    granularity = plan_kw.get("granularity", 1)
    for high in modes:
        for low in modes:
            for k in (range(1, L + 1) if high != low else [L]):   # first k layers in ``high``
                peak_high, kept = _block_peak(0.0, k, high, costs, granularity)
                peak_low, _ = _block_peak(kept, L - k, low, costs, granularity)
                peak = d.other_bytes + max(peak_high, peak_low)
                seconds = k * costs[high].seconds + (L - k) * costs[low].seconds
                if peak <= budget_bytes and (best is None or (seconds, peak) < best[0]):
                    best = ((seconds, peak), (high,) * k + (low,) * (L - k))
    if best is None:
        floor = min(estimate(RecomputePlan.uniform(m, L, **plan_kw), d, cost).peak_bytes for m in modes)
        raise ValueError(f"no recompute plan fits a budget of {budget_bytes:,.0f} B per rank; the "
                         f"smallest needs {floor:,.0f} B. Raise --memory-budget, lower "
                         f"--micro-batch-size, or raise --tensor-model-parallel-size or "
                         f"--context-parallel-size")
    plan = RecomputePlan(best[1], **plan_kw)
    est = estimate(plan, d, cost)
    full = estimate(RecomputePlan.uniform("full", L, **plan_kw), d, cost)
    note = (f"planned for {budget_bytes:,.0f} B: peak {est.peak_bytes:,.0f} B, host {est.host_bytes:,.0f} B, "
            f"recompute {est.recompute_flops:.3g} FLOP (full: {full.recompute_flops:.3g}), "
            f"TP {est.tp_bytes:,.0f} B, host transfers {est.host_transfer_bytes:,.0f} B")
    return RecomputePlan(plan.modes, **{**plan_kw, "note": note})


def plan_from_cli(flag: str, config, *, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                  memory_budget: float | None = None, bytes_per_element: int = 4, device: str = "cuda",
                  cp: int = 1, cp_comm_type: str = "p2p", **plan_kw) -> RecomputePlan:
    """What the trainer's ``--recompute MODE|auto [--memory-budget BYTES]`` asks for, given a
    :class:`models.gpt.config.GPTConfig` and the layout of one rank (``cp``: its CP degree)."""
    if flag != "auto":
        if memory_budget is not None:
            raise ValueError(f"--memory-budget only applies to --recompute auto, not {flag!r}")
        return RecomputePlan.from_flag(flag, config.num_layers, **plan_kw)
    if memory_budget is None or memory_budget <= 0:
        raise ValueError("--recompute auto needs --memory-budget <bytes per rank> (e.g. 8e9)")
    dims = ModelDims.from_config(config, micro_batch=micro_batch, tp=tp,
                                 sequence_parallel=sequence_parallel,
                                 bytes_per_element=bytes_per_element, device=device, cp=cp,
                                 cp_comm_type=cp_comm_type)
    return plan_for_budget(dims, memory_budget, **plan_kw)
