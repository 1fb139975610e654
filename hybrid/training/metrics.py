"""Training metrics: one ``log(metrics, step)`` interface, a console line and TensorBoard scalars.

Scalar names follow Megatron-LM so its users' dashboards work: ``lm loss``, ``learning-rate``,
``loss-scale``, ``grad-norm``, ``batch-size``, ``iteration-time`` (s), ``throughput`` (model TFLOP/s
per rank, as in Megatron), ``mem-*``, and
for evaluation ``lm loss validation`` / ``lm loss validation ppl``. Beyond Megatron we log the
measured model-state bytes per category (``model-state/<category>-bytes``, ZeRO §5) and the bytes
each rank moved per step per group (``comm/dp-bytes-per-step``, ``comm/tp-bytes-per-step``, ZeRO §7).

Throughput uses Megatron's model-FLOPs formula (docs/design.md §Paper, via :mod:`hybrid.perf.flops`); MFU is
TFLOP/s per rank over a configurable peak. Only the writer rank opens a TensorBoard writer; every
rank may call ``log`` (the others drop it), so no caller needs ``if rank == 0``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Megatron's "throughput" is model TFLOP/s per GPU; tokens/s has no Megatron scalar, ours is
# "tokens-per-second".
SCALAR_NAMES = ("lm loss", "learning-rate", "loss-scale", "grad-norm", "batch-size", "iteration-time",
                "throughput", "tokens-per-second", "mfu", "skipped-iterations", "consumed-samples",
                "mem-rss-bytes", "mem-max-rss-bytes", "mem-max-allocated-bytes")
VALIDATION_NAMES = ("lm loss validation", "lm loss validation ppl")


class MetricsWriter:
    """``log(metrics, step)``: TensorBoard scalars on the writer rank, nothing elsewhere."""

    def __init__(self, tensorboard_dir: str | None, rank: int, writer_rank: int = 0):
        self.is_writer = rank == writer_rank
        self._tb = None
        if tensorboard_dir and self.is_writer:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is optional
            self._tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
            log.info("TensorBoard logs in %s (view: tensorboard --logdir %s)", tensorboard_dir,
                     tensorboard_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._tb is None:
            return
        for name, value in metrics.items():
            if value is not None and math.isfinite(float(value)):
                self._tb.add_scalar(name, float(value), step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, "```\n" + text + "\n```", step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


@dataclass
class ThroughputModel:
    """Per-iteration FLOPs of the whole job and the per-rank peak, for TFLOP/s and MFU."""

    flops_per_iteration: float   # model FLOPs of one global batch (all ranks)
    world_size: int
    peak_tflops: float           # per rank

    def tflops_per_rank(self, seconds_per_iteration: float) -> float:
        return self.flops_per_iteration / self.world_size / seconds_per_iteration / 1e12

    def mfu(self, seconds_per_iteration: float) -> float:
        return self.tflops_per_rank(seconds_per_iteration) / self.peak_tflops


def gpt_flops_per_iteration(global_batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (engineer C's hybrid.perf)."""
    from hybrid.perf.flops import model_flops_per_iteration
    return model_flops_per_iteration(global_batch, seq, layers, hidden, vocab)


def memory_bytes(device) -> dict[str, float]:
    """Process memory: CUDA allocator (current and peak) on GPU, resident set size (current and
    peak) on CPU."""
    import torch
    if getattr(device, "type", "cpu") == "cuda":
        return {"mem-allocated-bytes": float(torch.cuda.memory_allocated(device)),
                "mem-max-allocated-bytes": float(torch.cuda.max_memory_allocated(device))}
    import resource
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss     # Linux reports KiB
    return {"mem-rss-bytes": float(rss_pages * os.sysconf("SC_PAGE_SIZE")),
            "mem-max-rss-bytes": float(peak_kib * 1024)}


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
             f"MFU {100 * m['mfu']:.3f}%",
             f"lr {m['learning-rate']:.3e}",
             f"lm loss {m['lm loss']:.4f}",
             f"loss scale {m['loss-scale']:.0f}",
             f"grad norm {m['grad-norm']:.3f}",
             f"skipped {int(m['skipped-iterations'])}",
             f"mem {mem / 2**20:.0f} MB",
             f"ETA {format_duration(eta_seconds)}"]
    return " | ".join(parts)


def install_rank_logging(rank: int, level: int = logging.INFO, all_ranks: bool = False) -> None:
    """Root logger with a ``[rank N]`` prefix; ranks other than 0 only warn unless ``all_ranks``."""
    fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level if (rank == 0 or all_ranks) else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", force=True)
