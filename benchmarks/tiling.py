"""Issue 35 benchmark: the price of memory-centric tiling (ZeRO-Infinity; hybrid/zero/tiling.py).

The benchmark GPT (4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4 per rank, the
model and data of benchmarks/zero_vs_peers.py) under ZeRO stage 3 on 2 gloo CPU ranks (DP 2, one
thread each), with ``--tile-factor`` 1 (whole weights), 2, 4 and 8, fp32 and bf16. A step is
forward + backward + AdamW update. All variants are built in the same two ranks and stepped
round-robin (the order rotating each round), so the shared machine's load hits each alike; a
step's time is the slower rank's, the median over ``--steps`` after 2 warm-up rounds.

Beside the times: the gathered working memory of one transformer layer, tiled and untiled (the
engine's own buffers: the largest bytes its units hold gathered during a layer's forward and
backward, measured at every gather, without look-ahead prefetch), and the engine's number of
sharding units.

Run:  python benchmarks/tiling.py [--steps 10]
Writes benchmarks/results/tiling.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO, SEED, WARMUP = 4, 256, 4, 128, 8192, 4, 0, 2
FACTORS = (1, 2, 4, 8)
VARIANTS = [(p, t) for p in ("fp32", "bf16") for t in FACTORS]


def _build(state, precision: str, factor: int):
    import torch
    from hybrid.zero import AdamWConfig, ZeroConfig, build_zero_optimizer
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    config = GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = GPTModel(config, state, device="meta", dtype=dtype)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=3, precision=precision,
                                                        tile_factor=factor),
                               AdamWConfig(lr=1e-4), seed=SEED)

    def step(tokens, labels):
        opt.zero_grad()
        opt.backward(model(tokens, labels).mean())
        opt.step()
    return step, opt


def _layer_peak(opt) -> int:
    """Largest gathered bytes while layer 1 runs forward and backward (units of the layer only)."""
    from hybrid.zero.stage3_unit import ShardedUnit
    index = 2   # sharding units: embedding, layers 0.., final norm
    mine = ([opt.units[index]] if opt.units[index] is not None else []) + \
        [u for t in opt.tiles[index] for u in t.units]
    peak = [0]
    original = ShardedUnit.gather

    def gather(unit, async_op=True):
        original(unit, async_op)
        peak[0] = max(peak[0], sum(u.held_bytes() for u in mine))
    ShardedUnit.gather = gather
    return peak, original


def _rank(rank: int, world: int, steps: int) -> dict:
    import torch
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    from hybrid.zero.stage3_unit import ShardedUnit
    torch.set_num_threads(1)
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world))
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
                torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)) for _ in range(WARMUP + steps)]
    built = {v: _build(state, *v) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    memory = {}
    for v, (step, opt) in built.items():   # one measured step each (also a warm-up)
        opt.scheduler.prefetch = False
        for t in opt.tiles:
            for w in t:
                w.prefetch = False
        peak, original = _layer_peak(opt)
        try:
            step(*batches[0])
        finally:
            ShardedUnit.gather = original
        opt.scheduler.prefetch = True
        for t in opt.tiles:
            for w in t:
                w.prefetch = True
        memory[v] = {"layer_peak": peak[0], "units": len(opt.all_units), **opt.working_memory()}
    for r in range(WARMUP + steps):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            torch.distributed.barrier()
            start = time.perf_counter()
            built[v][0](*batches[r])
            torch.distributed.barrier()   # the slower rank's time
            if r >= WARMUP:
                times[v].append(time.perf_counter() - start)
    return {f"{p} T{t}": {"ms": 1000 * statistics.median(times[(p, t)]), **memory[(p, t)]}
            for p, t in VARIANTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from hybrid.testing.multirank import run_on_ranks
    results = run_on_ranks(_rank, 2, args=(args.steps,), timeout=3600)[0]
    print("| precision | --tile-factor | median ms/step | vs T=1 | layer gathered peak MiB "
          "(measured) | working memory MiB tiled / untiled (engine) | sharding units |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, row in results.items():
        precision, factor = name.split(" T")
        base = results[f"{precision} T1"]["ms"]
        print(f"| {precision} | {factor} | {row['ms']:.1f} | {row['ms'] / base:.2f}x | "
              f"{row['layer_peak'] / 2**20:.3f} | {row['tiled'] / 2**20:.3f} / "
              f"{row['untiled'] / 2**20:.3f} | {row['units']} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tiling.json").write_text(json.dumps({"steps": args.steps, "results": results},
                                                    indent=1))


if __name__ == "__main__":
    main()
