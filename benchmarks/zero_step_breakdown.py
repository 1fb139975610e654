"""Where a step of ``benchmarks/zero_vs_peers.py``'s own variant goes (issue 18): rank 0 of its DP 2
layout profiled with ``tools.step_breakdown``'s categories (GEMMs, attention core, elementwise /
norm / activation, casts, optimizer, communication, framework overhead), beside the step's
GEMM-bound fraction. ``tools.step_breakdown`` does the same for a trainer config; this one profiles
the benchmark's exact model, engine and batches, so its figures explain the benchmark's rows.

Run:  python benchmarks/zero_step_breakdown.py [--stage 1] [--precision bf16] [--compile]
                                               [--size benchmark|gpt2-small] [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rank(rank, world, size, stage, precision, compiled, steps):
    import torch
    from benchmarks import zero_vs_peers as bench
    from benchmarks.step_roofline import SIZES
    from tools.step_breakdown import profile_steps
    bench._setup({"peer_model": "ours", "dp_transport": "auto",
                  "dims": {**SIZES[size], "attention_fp32": False}})
    torch.set_num_threads(1)
    step, _ = bench._ours(rank, world, stage, precision, compiled)
    warmup = 5
    batches = iter(bench._batches(rank, warmup + 2 * steps))
    return profile_steps(lambda: step(*next(batches)), step.optimizer, warmup=warmup, steps=steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("benchmark", "gpt2-small"), default="benchmark")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=1)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--compile", action="store_true", help="regional compile of each layer")
    parser.add_argument("--steps", type=int, default=6, help="profiled steps")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    from benchmarks.step_roofline import SIZES, gemm_bound_ms
    from hybrid.testing.multirank import run_on_ranks
    from tools.step_breakdown import report
    result = run_on_ranks(_rank, 2, args=(args.size, args.stage, args.precision, args.compile,
                                          args.steps), timeout=1800)[0]
    result.update(gemm_bound_s=gemm_bound_ms(SIZES[args.size], args.precision) / 1e3,
                  precision=args.precision, world=2, tp=1, dp=2, zero_stage=args.stage)
    print(report(result))
    print("(with --compile, GEMMs include the attention core's products: they run inside the "
          "compiled layer, whose own kernels count as elementwise)" if args.compile else "")


if __name__ == "__main__":
    main()
