"""The benchmark sizes of benchmarks/zero_vs_peers.py and their GEMM-bound step time (the roofline of
hybrid.perf.roofline at this machine's measured rate, cached in ``$HYBRID_CACHE/gemm-rates.json``).

``benchmark``: the issue-3 GPT (4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4 per
rank), every variant interleaved. ``gpt2-small``: GPT-2 small (124M: 12 layers, hidden 768, 12 heads,
vocab 50257) at seq 256 and micro-batch 1 per rank, so a round of every variant fits the time of a
run on 2 shared cores (seq 1024 with ``--seq 1024``); its variants run one after another, since
they do not fit in memory together.
"""

from __future__ import annotations

import os
from pathlib import Path

SIZES = {
    "benchmark": dict(layers=4, hidden=256, heads=4, seq=128, vocab=8192, micro=4, rounds=10,
                      warmup=2, sequential=False, rss_steps=3),
    "gpt2-small": dict(layers=12, hidden=768, heads=12, seq=256, vocab=50257, micro=1, rounds=3,
                       warmup=1, sequential=True, rss_steps=0),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def cache_path() -> Path:
    return Path(os.environ.get("HYBRID_CACHE", "./data-cache")) / "gemm-rates.json"


def gemm_bound_ms(dims: dict, precision: str, tp: int = 1) -> float:
    """Milliseconds one DP rank's GEMMs of a step take at the measured rate (one thread, the ranks'
    setting): forward, input and weight gradients of QKV, projection, MLP and the output layer."""
    import torch
    from hybrid.perf.flops import pad_vocab
    from hybrid.perf.gemm_rate import GemmRateCache
    from hybrid.perf.roofline import distinct_shapes, gemm_bound_seconds, training_gemms
    gemms = training_gemms(micro_batch=dims["micro"], seq=dims["seq"], layers=dims["layers"],
                           hidden=dims["hidden"], vocab_padded=pad_vocab(dims["vocab"], tp), tp=tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = GemmRateCache(cache_path()).rates(distinct_shapes(gemms),
                                                  getattr(torch, DTYPES[precision]))
    finally:
        torch.set_num_threads(threads)
    return 1e3 * gemm_bound_seconds(gemms, rates)
