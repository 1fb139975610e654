"""Issue 18 benchmark: the benchmark GPT with and without ``--compile`` (regional torch.compile of each
transformer layer, models/gpt/compile.py), and what compiling costs, cold and from the cache.

GPT: 4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4 per rank, 2 gloo CPU ranks
(DP 2, TP 1), one thread each, ZeRO stage ``--stage`` (default 1), fp32 and bf16 (the model and
data of benchmarks/zero_vs_peers.py). A step is forward + backward + AdamW update.

Two invocations of the same ranks' program, each in fresh processes, on one inductor cache
directory: the first starts with an empty cache (cold: dynamo traces, inductor generates and builds
C++), the second finds every graph cached (warm: dynamo traces, inductor loads). Each builds eager
and compiled models of both precisions, times the first compiled step's compilation with the
compile clock, then steps every variant round-robin (order rotating each round) and reports the
median step wall time of the slower rank.

Run:  python benchmarks/compiled_layers.py [--steps 10] [--stage 1]
Writes benchmarks/results/compiled_layers.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO, SEED, WARMUP = 4, 256, 4, 128, 8192, 4, 0, 2
VARIANTS = [(p, c) for p in ("fp32", "bf16") for c in (False, True)]   # (precision, compiled)


def _build(state, stage: int, precision: str, compiled: bool, cache_dir: str):
    import torch
    from hybrid.zero import AdamWConfig, ZeroConfig, build_zero_optimizer
    from models.gpt.compile import compile_layers
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    config = GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                       attention_dropout=0.0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = GPTModel(config, state, device="meta", dtype=dtype)
    if stage < 3:
        model.init_weights(SEED)
    clock = compile_layers(model, cache_dir=cache_dir) if compiled else None
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision=precision,
                                                        bucket_size=1_000_000),
                               AdamWConfig(lr=1e-4), **({"seed": SEED} if stage == 3 else {}))

    def step(tokens, labels):
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        opt.backward(loss)
        opt.step()
        return loss.detach()
    return step, clock


def _ranks(rank, world, stage, steps, cache_dir):
    """Per variant: compile seconds of its first step (compiled ones), step wall times, last loss."""
    import torch
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world))
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
                torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)) for _ in range(steps + WARMUP)]
    built, out = {}, {}
    for precision, compiled in VARIANTS:
        name = f"{precision} {'compiled' if compiled else 'eager'}"
        step, clock = _build(state, stage, precision, compiled, cache_dir)
        before = (clock.seconds, clock.cache_counts()) if clock else None
        start = time.perf_counter()
        step(*batches[0])                                 # compiles forward and backward
        out[name] = {"first_step_s": time.perf_counter() - start, "times": [],
                     "compile_s": clock.seconds - before[0] if clock else 0.0,
                     "cache": {k: v - before[1][k] for k, v in clock.cache_counts().items()}
                     if clock else None}
        built[name] = step
    names = list(built)
    for r, (tokens, labels) in enumerate(batches[1:]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            out[name]["loss"] = float(built[name](tokens, labels).float())
            out[name]["times"].append(time.perf_counter() - start)
    return out


def _merge(per_rank: list[dict]) -> dict:
    """The slower rank's time per round, its median over the timed rounds."""
    merged = {}
    for name in per_rank[0]:
        rounds = [max(r[name]["times"][i] for r in per_rank)
                  for i in range(WARMUP - 1, len(per_rank[0][name]["times"]))]
        merged[name] = {"median_step_s": statistics.median(rounds),
                        "compile_s": max(r[name]["compile_s"] for r in per_rank),
                        "cache": per_rank[0][name]["cache"], "loss": per_rank[0][name]["loss"]}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help=f"timed rounds (+{WARMUP} warm-up)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=1, help="ZeRO stage")
    args = parser.parse_args()
    from hybrid.testing.multirank import run_on_ranks
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
        runs = {start: _merge(run_on_ranks(_ranks, 2, args=(args.stage, args.steps, cache_dir),
                                           timeout=3000))
                for start in ("cold", "warm")}
    result = {"stage": args.stage, "steps": args.steps, "load_average_at_start": load, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compiled_layers.json").write_text(json.dumps(result, indent=2))
    print(f"| variant | start | compile s | cache hit/miss | median step ms | vs eager | loss |\n"
          f"| --- | --- | --- | --- | --- | --- | --- |")
    for start, run in runs.items():
        for name, row in run.items():
            eager = run[name.replace("compiled", "eager")]["median_step_s"]
            cache = f"{row['cache']['hit']}/{row['cache']['miss']}" if row["cache"] else "-"
            print(f"| {name} | {start} | {row['compile_s']:.1f} | {cache} | "
                  f"{1e3 * row['median_step_s']:.1f} | {row['median_step_s'] / eager:.2f} | "
                  f"{row['loss']:.4f} |")


if __name__ == "__main__":
    main()
