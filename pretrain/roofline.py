"""The trainer's GEMM roofline: a run's own GEMM shapes (hybrid.perf.roofline) at this machine's
measured rate (hybrid.perf.gemm_rate, cached in ``--data-cache-dir``), giving the GEMM-bound time
of one iteration on this rank. The trainer logs each interval's step time as a fraction of it
(``perf/gemm-bound-fraction``) beside MFU; ``--no-roofline`` skips the measurement."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid.perf.gemm_rate import GemmRateCache
from hybrid.perf.roofline import Gemm, distinct_shapes, gemm_bound_seconds, training_gemms
from hybrid.recompute.plan import FULL_MODES

GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHE_FILE = "gemm-rates.json"


def run_gemms(cfg, tp: int, accumulation: int, models: list) -> list[Gemm]:
    """The GEMMs one rank of this run executes per iteration (forward, backward, full recompute's
    forward reruns as each model's recompute plan has them). ``models``: the model, or with
    pipeline parallelism this stage's chunks (their layers only; the output layer on the last
    stage; ``accumulation`` is then the pipeline's micro-batches per step)."""
    m = cfg.model
    rerun = sum(n for model in models if model.recomputer is not None
                for mode, n in model.recomputer.plan.counts().items() if mode in FULL_MODES)
    return training_gemms(micro_batch=cfg.data.micro_batch_size, seq=m.seq_length,
                          layers=sum(len(model.layers) for model in models), hidden=m.hidden_size,
                          vocab_padded=models[0].config.padded_vocab_size(tp), tp=tp,
                          micro_batches=accumulation, recomputed_layers=rerun,
                          heads=m.num_attention_heads, arch=m.perf_architecture(),
                          logits=any(model.post_process for model in models))


def gemm_bound_time(gemms: list[Gemm], precision: str, device, cache_dir: str | Path) -> float:
    """Seconds the GEMMs take at this machine's cached (or now measured) rate of each shape."""
    cache = GemmRateCache(Path(cache_dir) / CACHE_FILE)
    rates = cache.rates(distinct_shapes(gemms), GEMM_DTYPES[precision], device)
    return gemm_bound_seconds(gemms, rates)
