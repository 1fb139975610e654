"""Training metrics: one ``log(metrics, step)`` interface, a console line and the scalars of every
chosen logger backend (TensorBoard, Weights & Biases, JSON lines: :mod:`pretrain.loggers`).

Scalar names follow Megatron-LM so its users' dashboards work: ``lm loss``, ``learning-rate``,
``loss-scale``, ``grad-norm``, ``batch-size``, ``iteration-time`` (s), ``throughput`` (model TFLOP/s
per rank, as in Megatron), ``mem-*``, and for evaluation ``lm loss validation`` /
``lm loss validation ppl``. Beyond Megatron we log the measured model-state bytes per category
(``model-state/<category>-bytes``, ZeRO §5), the bytes each rank moved per step per group
(``comm/dp-bytes-per-step``, ``comm/tp-bytes-per-step``, ZeRO §7) and the part of them that crossed
hosts (``comm/dp-cross-host-bytes-per-step``, ..., and per group and op,
``comm/dp-reduce_scatter-cross-host-bytes-per-step``, ...), with pipeline parallelism the measured bubble
(``pipeline/bubble-fraction``) and the bytes sent to the neighbouring stages
(``comm/pp-bytes-per-step``), the step as a fraction of its GEMM-bound time
(``perf/gemm-bound-fraction``, hybrid.perf.roofline: the roofline beside MFU), with MoE layers the
expert load, aux / z losses and dropped routes (``moe/...``, :func:`moe_metrics`), and the seconds
spent outside training steps (``eval-time``, ``checkpoint-save-time``). docs/tensorboard.md gives every unit.

Throughput uses Megatron's model-FLOPs formula (docs/design.md §Paper, via :mod:`hybrid.perf.flops`);
with mixture-of-experts layers it counts the active FLOPs only (router, the k chosen experts, the
shared expert: docs/moe.md), never the experts a token skips. MFU is TFLOP/s per rank over a
configurable peak. Only the writer rank opens the backends;
every rank may call ``log`` (the others drop it), so no caller needs ``if rank == 0``. Each run
writes to its own run directory under ``--tensorboard-dir`` (``--run-name``, else its start time),
so ``tensorboard --logdir`` on the parent shows re-runs side by side instead of overlaid.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from pretrain.loggers import JsonlLogger, TensorBoardLogger, WandbLogger, flat_hparams  # noqa: F401

log = logging.getLogger(__name__)

# Logged every --log-interval. Megatron's "throughput" is model TFLOP/s per GPU; tokens/s has no
# Megatron scalar, ours is "tokens-per-second".
SCALAR_NAMES = ("lm loss", "learning-rate", "loss-scale", "grad-norm", "batch-size", "iteration-time",
                "throughput", "tokens-per-second", "mfu", "skipped-iterations", "consumed-samples")
HOST_MEMORY_NAMES = ("mem-rss-bytes", "mem-max-rss-bytes")            # every device
CUDA_MEMORY_NAMES = ("mem-allocated-bytes", "mem-max-allocated-bytes", "mem-reserved-bytes",
                     "mem-max-reserved-bytes", "mem-alloc-retries")   # CUDA ranks only
VALIDATION_NAMES = ("lm loss validation", "lm loss validation ppl")
# The HParams tab shows these scalars as the metrics of a run, beside its config.
HPARAMS_METRICS = ("lm loss", "lm loss validation")


class MetricsWriter:
    """``log(metrics, step)``: every scalar to every chosen backend (:mod:`pretrain.loggers`:
    TensorBoard, W&B, JSON lines) on the writer rank, nothing elsewhere.

    ``run_dir`` is this run's TensorBoard directory (None on the other ranks or without
    ``tensorboard_dir``). Backends open here, before training: one that cannot start raises
    :class:`pretrain.loggers.LoggerStartError`."""

    def __init__(self, tensorboard_dir: str | None, rank: int, writer_rank: int = 0,
                 run_name: str | None = None, run_id: str | None = None, *,
                 wandb_project: str | None = None, wandb_exp_name: str | None = None,
                 wandb_save_dir: str | None = None, jsonl_log: str | None = None):
        """``run_id``: the run's identity (pretrain.resume.TrainState.run_id, kept by every
        checkpoint), which names the run directory unless ``run_name`` does: a resumed run
        continues the curves of the run it resumes (and its W&B run)."""
        self.is_writer = rank == writer_rank
        self.backends: list = []
        self._tb = None
        self.run_dir: Path | None = None
        if not self.is_writer:
            return
        try:
            if tensorboard_dir:
                self.run_dir = claim_run_dir(Path(tensorboard_dir), run_name, run_id=run_id)
                self._tb = TensorBoardLogger(self.run_dir, HPARAMS_METRICS)
                self.backends.append(self._tb)
                log.info("TensorBoard run %s (view every run: tensorboard --logdir %s)",
                         self.run_dir, tensorboard_dir)
            if wandb_project:
                self.backends.append(WandbLogger(wandb_project, wandb_exp_name or run_name or "run",
                                                 wandb_save_dir or "wandb", run_id=run_id))
            if jsonl_log:
                self.backends.append(JsonlLogger(jsonl_log))
        except BaseException:
            self.close()   # the backends that did start
            raise

    def log(self, metrics: dict[str, float], step: int) -> None:
        for backend in self.backends:
            backend.log(metrics, step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        if self._tb is not None:
            self._tb.log_text(tag, text, step)

    def log_config(self, config: dict) -> None:
        """The resolved ``{section: {field: value}}`` config, once: in TensorBoard as YAML in the
        TEXT tab (tag ``config``; it loads back with ``--config``) and field by field in the
        HPARAMS tab; as the W&B run's config; as the first JSON line."""
        for backend in self.backends:
            backend.log_config(config)

    def flush(self) -> None:
        for backend in self.backends:
            backend.flush()

    def close(self) -> None:
        backends, self.backends, self._tb = self.backends, [], None
        for backend in backends:
            backend.close()


def run_dir_name(run_id: str | None) -> str | None:
    """The run directory of the run ``run_id`` (``20261123T231500Z-1a2b3c4d``, its UTC start time
    and a random part; hybrid.checkpoint.lock.new_run_id): ``20261123-231500-1a2b3c4d``."""
    if run_id is None:
        return None
    match = re.fullmatch(r"(\d{8})T(\d{6})Z-(\w+)", run_id)
    return "-".join(match.groups()) if match else run_id


def claim_run_dir(parent: Path, run_name: str | None, now: float | None = None,
                  run_id: str | None = None) -> Path:
    """``parent/run_name``, else the directory of ``run_id`` (:func:`run_dir_name`; a resumed run
    has the id of the run it resumes, so its curves continue there), else ``parent/<start time>``
    (``20261123-231500``, local time) made new: a second run started in the same second takes
    ``-2``, ``-3``... A named run that exists is appended to, with a warning."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if run_id and not run_name:
            path = parent / run_dir_name(run_id)
            if any(path.glob("events.out.tfevents.*")):
                log.info("TensorBoard run %s: this resumed run continues its curves", path)
            path.mkdir(parents=True, exist_ok=True)
            return path
        if run_name:
            path = parent / run_name
            if any(path.glob("events.out.tfevents.*")):
                log.warning("TensorBoard run %s already holds events; this run adds to its curves "
                            "(pass another --run-name to keep the runs apart)", path)
            path.mkdir(parents=True, exist_ok=True)
            return path
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        for n in range(1, 1000):
            path = parent / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"{parent / stamp}-* (999 runs in one second)")
    except OSError as err:
        raise ValueError(f"cannot create a TensorBoard run directory under --tensorboard-dir "
                         f"{str(parent)!r} ({err.strerror or err}); choose a writable directory "
                         f"or pass --tensorboard-dir '' to log no TensorBoard events") from None


@dataclass
class ThroughputModel:
    """Per-iteration FLOPs of the whole job and the per-rank peak, for TFLOP/s and MFU."""

    flops_per_iteration: float   # model FLOPs of one global batch (all ranks)
    world_size: int
    peak_tflops: float | None    # per rank; None: unknown (a CPU), MFU is NaN
    # seconds this rank's GEMMs of an iteration take at the measured rate (hybrid.perf.roofline);
    # None: not measured (--no-roofline)
    gemm_bound_s: float | None = None

    def tflops_per_rank(self, seconds_per_iteration: float) -> float:
        return self.flops_per_iteration / self.world_size / seconds_per_iteration / 1e12

    def mfu(self, seconds_per_iteration: float) -> float:
        if self.peak_tflops is None:
            return float("nan")
        return self.tflops_per_rank(seconds_per_iteration) / self.peak_tflops

    def roofline(self, seconds_per_iteration: float) -> dict[str, float]:
        """``perf/gemm-bound-fraction``: the GEMM-bound time over the iteration time (1 = the step
        did nothing but its GEMMs, at their measured rate), and ``perf/gemm-bound-time`` (s)."""
        if self.gemm_bound_s is None:
            return {}
        return {"perf/gemm-bound-fraction": self.gemm_bound_s / seconds_per_iteration,
                "perf/gemm-bound-time": self.gemm_bound_s}


def memory_bytes(device) -> dict[str, float]:
    """Process memory of this rank: the host resident set (current and peak) on every device, and
    on CUDA the caching allocator's state (:func:`cuda_memory_bytes`)."""
    out = host_memory_bytes()
    if getattr(device, "type", "cpu") == "cuda":
        import torch
        out.update(cuda_memory_bytes(torch.cuda.memory_stats(device)))
    return out


def host_memory_bytes(status: str | None = None) -> dict[str, float]:
    """Current and peak resident set size from ONE read of ``/proc/self/status`` (VmRSS, VmHWM).

    Both come from the same exact counters in one read, and the kernel reports VmHWM as the
    larger of its high-water mark and that current RSS, so the peak is never below the current
    value. The former pair was not: ``getrusage().ru_maxrss`` derives from per-CPU cached RSS
    counters that lag the exact sum /proc reports, and was read at another instant; on this
    machine's kernel it came out below /proc/self/statm's RSS in about one read in ten."""
    if status is None:
        with open("/proc/self/status") as f:
            status = f.read()
    kib = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            kib[key] = int(value.split()[0])          # "  123456 kB"
    return {"mem-rss-bytes": float(kib["VmRSS"] * 1024), "mem-max-rss-bytes": float(kib["VmHWM"] * 1024)}


def cuda_memory_bytes(stats: dict) -> dict[str, float]:
    """Megatron's ``mem-*`` scalars from ``torch.cuda.memory_stats()``: bytes held by tensors
    (allocated) and by the caching allocator (reserved), current and peak since the process
    started, and how often a cudaMalloc failed and the cache was flushed to retry (a count; a
    rising value means fragmentation is costing time)."""
    keys = {"mem-allocated-bytes": "allocated_bytes.all.current",
            "mem-max-allocated-bytes": "allocated_bytes.all.peak",
            "mem-reserved-bytes": "reserved_bytes.all.current",
            "mem-max-reserved-bytes": "reserved_bytes.all.peak",
            "mem-alloc-retries": "num_alloc_retries"}
    # memory_stats() is {} until the first CUDA allocation: zeros then
    return {name: float(stats.get(key, 0)) for name, key in keys.items()}


def moe_metrics(per_layer: dict, dp_group, pp_group=None, moe_layers=(), num_experts: int = 0,
                device=None) -> dict[str, float]:
    """The MoE scalars of an interval (issue 32; docs/moe.md) from
    ``GPTModel.pop_moe_metrics()`` (per layer, summed over the interval's micro-batches; merged
    over this rank's chunks), summed over ``dp_group`` first (one all-reduce). Under pipeline
    parallelism (``pp_group`` of size > 1) each stage holds only its layers' counters: every rank
    of the PP group calls this (a stage without MoE layers too, with ``per_layer`` empty), and one
    all-reduce over ``pp_group`` of a table over all the model's ``moe_layers`` (global indices,
    ``num_experts`` E, on ``device``) gives every stage, the first (the writer rank) included,
    every layer's row. Per layer ``moe/layer{i}/load-max-over-mean`` (the
    busiest expert's routes over the mean, 1 = balanced), ``moe/layer{i}/tokens-per-expert/{e}``
    (routes per micro-batch, before drops), ``moe/layer{i}/aux-loss`` and ``.../z-loss`` (per
    micro-batch, times their coefficients) and ``moe/layer{i}/dropped-fraction``; over all layers
    ``moe/load-max-over-mean`` (the worst layer), ``moe/aux-loss`` and ``moe/z-loss`` (summed over
    layers: what the training loss adds) and ``moe/dropped-fraction``."""
    import torch

    from hybrid import comm
    keys = ("dropped", "routes", "aux_loss", "z_loss", "micro_batches")

    def row_of(i):
        return torch.cat([per_layer[i]["load"].float(),
                          torch.stack([per_layer[i][k].float() for k in keys])])   # [E + 5]
    if pp_group is not None and pp_group.size > 1 and moe_layers:
        layers = sorted(moe_layers)
        rows = torch.stack([row_of(i).to(device) if i in per_layer else
                            torch.zeros(num_experts + 5, device=device) for i in layers])
        with comm.unrecorded(pp_group):   # each layer lives on one stage: the sum is its row
            comm.all_reduce(rows, pp_group)
        ran = rows[:, -1] > 0   # the layers that ran a training forward in the interval
        layers, rows = [i for i, r in zip(layers, ran.tolist()) if r], rows[ran]
    elif not per_layer:
        return {}
    else:
        layers = sorted(per_layer)
        rows = torch.stack([row_of(i) for i in layers])                        # [L, E + 5]
    if not layers:
        return {}
    if dp_group is not None and dp_group.size > 1:
        with comm.unrecorded(dp_group):
            comm.all_reduce(rows, dp_group)
    rows = rows.cpu().double()
    out, worst, dropped, routes, aux, z = {}, 0.0, 0.0, 0.0, 0.0, 0.0
    for i, row in zip(layers, rows):
        load, (drop, routed, aux_sum, z_sum, micro) = row[:-5], row[-5:].tolist()
        ratio = float(load.max() / load.mean()) if load.sum() > 0 else float("nan")
        out[f"moe/layer{i}/load-max-over-mean"] = ratio
        for e, count in enumerate((load / micro).tolist()):
            out[f"moe/layer{i}/tokens-per-expert/{e}"] = count
        out[f"moe/layer{i}/aux-loss"] = aux_sum / micro
        out[f"moe/layer{i}/z-loss"] = z_sum / micro
        out[f"moe/layer{i}/dropped-fraction"] = drop / routed if routed else 0.0
        worst = max(worst, ratio) if ratio == ratio else worst
        dropped, routes, aux, z = dropped + drop, routes + routed, aux + aux_sum / micro, z + z_sum / micro
    out.update({"moe/load-max-over-mean": worst, "moe/aux-loss": aux, "moe/z-loss": z,
                "moe/dropped-fraction": dropped / routes if routes else 0.0})
    return out


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def console_line(m: dict[str, float], iteration: int, train_iters: int, eta_seconds: float) -> str:
    """One Megatron-style progress line from the metrics of an interval."""
    mem = m.get("mem-max-allocated-bytes", m.get("mem-rss-bytes", 0.0))
    parts = [f"iteration {iteration:>6}/{train_iters}",
             f"consumed samples {int(m['consumed-samples'])}",
             f"ms/iter {m['iteration-time'] * 1e3:.1f}",
             f"tokens/s {m['tokens-per-second']:.0f}",
             f"TFLOP/s/rank {m['throughput']:.4f}",
             *([f"MFU {100 * m['mfu']:.3f}%"] if m["mfu"] == m["mfu"] else []),   # NaN: no peak
             *([f"GEMM-bound {100 * m['perf/gemm-bound-fraction']:.1f}%"]
               if "perf/gemm-bound-fraction" in m else []),
             f"lr {m['learning-rate']:.3e}",
             f"lm loss {m['lm loss']:.4f}",
             f"loss scale {m['loss-scale']:.0f}",
             f"grad norm {m['grad-norm']:.3f}",
             f"skipped {int(m['skipped-iterations'])}",
             f"mem {mem / 2**20:.0f} MiB",
             f"ETA {format_duration(eta_seconds)}"]
    if "moe/load-max-over-mean" in m:   # mixture of experts: before the ETA
        parts[-1:-1] = [f"moe load max/mean {m['moe/load-max-over-mean']:.2f}",
                        f"aux {m['moe/aux-loss']:.4f}", f"z {m['moe/z-loss']:.4f}",
                        f"dropped {100 * m['moe/dropped-fraction']:.2f}%"]
    if "pipeline/bubble-fraction" in m:   # pipeline parallelism: before the ETA
        parts[-1:-1] = [f"bubble {m['pipeline/bubble-fraction']:.3f}",
                        f"pp {m['comm/pp-bytes-per-step'] / 2**20:.2f} MiB/step"]
    return " | ".join(parts)


def install_rank_logging(rank: int, level: int = logging.INFO, all_ranks: bool = False) -> None:
    """Root logger with a ``[rank N]`` prefix; ranks other than 0 only warn unless ``all_ranks``."""
    fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level if (rank == 0 or all_ranks) else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", force=True)
