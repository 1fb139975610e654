"""Rank 3D layouts (TP, PP, virtual stages, DP, ZeRO stage, recompute, micro-batch) of a GPT on a
cluster by predicted throughput under the device memory limit (hybrid/perf/pipeline.py).

    python tools/rank_layouts.py --preset zero-100b        # the ZeRO paper's 100B on 400 DGX-2 V100
    python tools/rank_layouts.py --preset zero-170b
    python tools/rank_layouts.py --preset gpt3-175b        # GPT-3 175B on 1024 A100 80GB (DGX A100)
    python tools/rank_layouts.py --layers 48 --hidden 1600 --heads 16 --gpus 64 --global-batch 512

Prints the top candidates with their memory and time breakdown, then where the layout the
published run used ranks among them (ZeRO: MP 16 x DP 25 without PP; Megatron-LM 2021, GPT-3
175B: TP 8 x PP 8 x DP 16).

The throughput assumptions are calibrated on the V100 (ZeRO's Figure 2); the A100 cluster is its
data sheet only, so its absolute TFLOP/s are not a prediction, the ranking is the output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.perf.hardware import Cluster, dgx2_v100_cluster  # noqa: E402
from hybrid.perf.pipeline import Layout, estimate_layout  # noqa: E402

A100_80GB = Cluster(name="DGX A100 80GB", gpus_per_node=8, peak_flops=312e12, memory_bytes=80e9,
                    hbm_bandwidth=2039e9, intra_node_bandwidth=600e9, ib_link_bandwidth=25e9,
                    ib_links_per_node=8)

PRESETS = {   # layers, hidden, heads, seq, vocab, GPUs, global batch, cluster, published layout
    "zero-100b": (125, 8192, 64, 1024, 50257, 400, 800, dgx2_v100_cluster(),
                  dict(tp=16, pp=1, dp=25, virtual=1, stage=2, recompute="full", micro_batch=32)),
    "zero-170b": (212, 8192, 64, 1024, 50257, 400, 300, dgx2_v100_cluster(),
                  dict(tp=16, pp=1, dp=25, virtual=1, stage=2, recompute="full", micro_batch=12)),
    "gpt3-175b": (96, 12288, 96, 2048, 51200, 1024, 1536, A100_80GB,
                  dict(tp=8, pp=8, dp=16, virtual=1, stage=0, recompute="full", micro_batch=1)),
}
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(layers, hidden, heads, gpus, global_batch, gpus_per_node):
    for tp in (k for k in _divisors(gpus_per_node) if hidden % k == 0 and heads % k == 0):
        for pp in (k for k in _divisors(layers) if gpus % (tp * k) == 0):
            dp = gpus // (tp * pp)
            for virtual in (v for v in (1, 2, 4) if layers % (pp * v) == 0 and (v == 1 or pp > 1)):
                for b in (b for b in MICRO_BATCHES if global_batch % (b * dp) == 0):
                    m = global_batch // (b * dp)
                    if virtual > 1 and (m < pp or m % pp):
                        continue
                    for stage in ((0, 1, 2) if pp > 1 else (0, 1, 2, 3)):
                        for recompute in RECOMPUTE:
                            yield Layout(tp, pp, dp, virtual, stage, recompute, b, tp > 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS))
    for name in ("layers", "hidden", "heads", "gpus", "global-batch"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    published = None
    if args.preset:
        layers, hidden, heads, seq, vocab, gpus, batch, cluster, published = PRESETS[args.preset]
    else:
        missing = [n for n in ("layers", "hidden", "heads", "gpus", "global_batch")
                   if getattr(args, n) is None]
        if missing:
            print(f"error: give --preset or all of --{', --'.join(m.replace('_', '-') for m in missing)}",
                  file=sys.stderr)
            return 2
        layers, hidden, heads, gpus, batch = (args.layers, args.hidden, args.heads, args.gpus,
                                              args.global_batch)
        seq, vocab, cluster = args.seq_length, args.vocab_size, dgx2_v100_cluster()
    model = dict(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, global_batch=batch,
                 cluster=cluster)
    found = []
    for layout in candidates(layers, hidden, heads, gpus, batch, cluster.gpus_per_node):
        try:
            est = estimate_layout(layout, **model)
        except ValueError:
            continue   # e.g. a recompute mode the memory model does not combine with the layout
        if est.memory_bytes <= cluster.memory_bytes:
            found.append(est)
    if not found:
        print(f"error: no layout of this model fits {cluster.memory_bytes / 1e9:.0f} GB per GPU on "
              f"{gpus} GPUs; add GPUs or lower the global batch", file=sys.stderr)
        return 1
    found.sort(key=lambda e: e.time_s)
    print(f"{layers} layers, hidden {hidden}, {heads} heads, seq {seq}, global batch {batch} on {gpus} "
          f"GPUs ({cluster.name}, {cluster.memory_bytes / 1e9:.0f} GB): {len(found)} layouts fit")
    print(f"{'#':>3} {'layout':<58} {'TFLOP/s':>7} {'step s':>7} {'work':>6} {'bubble':>6} "
          f"{'p2p':>5} {'DP':>5} {'opt':>5} {'mem GB':>6} {'act GB':>6} {'states':>6}")
    for i, e in enumerate(found[:args.top], 1):
        print(f"{i:>3} {e.layout.describe():<58} {e.tflops_per_gpu:7.1f} {e.time_s:7.2f} "
              f"{e.compute_s:6.2f} {e.bubble_s:6.2f} {e.p2p_s:5.2f} {e.dp_s:5.2f} {e.optimizer_s:5.2f} "
              f"{e.memory_bytes / 1e9:6.1f} {e.activation_bytes / 1e9:6.1f} "
              f"{e.model_state_bytes / 1e9:6.1f}")
    if published is not None:
        # ZeRO's Pa partitions the checkpoints over MP as SP's shards do: modelled as SP
        target = Layout(**published, sequence_parallel=args.preset.startswith("zero"))
        ranked = [e.layout.describe() for e in found]
        match = [i for i, e in enumerate(found, 1)
                 if (e.layout.tp, e.layout.pp, e.layout.dp, e.layout.virtual) ==
                 (target.tp, target.pp, target.dp, target.virtual)]
        est = estimate_layout(target, **model)
        where = (f"its TP/PP/DP/v first ranks #{match[0]} of {len(ranked)}" if match
                 else "no layout with its TP/PP/DP/v fits the memory model")
        print(f"published layout {target.describe()}: predicted {est.tflops_per_gpu:.1f} TFLOP/s, "
              f"{est.memory_bytes / 1e9:.1f} GB; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
