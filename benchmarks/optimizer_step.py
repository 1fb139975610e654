"""The optimizer step of Muon vs AdamW under ZeRO (issue 33): the benchmark GPT of
``benchmarks/zero_vs_peers.py`` (4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4,
bf16 with fp32 masters, one thread per rank) at TP 1 x DP 2 with ZeRO stages 1 and 3, trained with
AdamW and with Muon (bf16 Newton-Schulz, 5 steps). Per variant: the median of the whole training
step (forward, backward, ``opt.step()``) and of ``opt.step()`` alone (the slower rank's), and the
share of the step the optimizer takes; Muon's extra bytes per rank per step from the ledger.

Each variant runs in its own two gloo ranks, after warm-up steps, one after the other in one
invocation:

    python benchmarks/optimizer_step.py [--steps 8] [--out benchmarks/results/optimizer_step.json]
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
DIMS = dict(layers=4, hidden=256, heads=4, seq=128, vocab=8192, micro=4)
VARIANTS = [(stage, opt) for stage in (1, 3) for opt in ("adamw", "muon")]
SEED, WARMUP = 1234, 2


def _rank(rank, world, stage, optimizer, steps):
    import torch
    from hybrid import comm
    from hybrid.muon_config import COMM_CATEGORY, MuonConfig
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    from hybrid.zero import AdamWConfig, ZeroConfig, build_zero_optimizer
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    torch.set_num_threads(1)
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world))
    d = DIMS
    config = GPTConfig(d["layers"], d["hidden"], d["heads"], vocab_size=d["vocab"],
                       seq_length=d["seq"], hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, state, device="meta", dtype=torch.bfloat16)
    if stage < 3:
        model.init_weights(SEED)
    muon = MuonConfig() if optimizer == "muon" else None
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision="bf16",
                                                        bucket_size=1_000_000, muon=muon),
                               AdamWConfig(lr=1e-4), **({"seed": SEED} if stage == 3 else {}))
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (d["micro"], d["seq"])
    step_s, opt_s, muon_bytes = [], [], 0.0
    for i in range(WARMUP + steps):
        tokens = torch.randint(0, d["vocab"], shape, generator=g)
        labels = torch.randint(0, d["vocab"], shape, generator=g)
        comm.barrier(state.dp)
        start = time.perf_counter()
        opt.zero_grad()
        opt.backward(model(tokens, labels).mean())
        mid = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        if i >= WARMUP:
            step_s.append(end - start)
            opt_s.append(end - mid)
            muon_bytes = sum(r.bytes_per_rank for r in opt._last_step_records
                             if r.category == COMM_CATEGORY)
    expected = (opt.optimizer_state.expected_comm_bytes() if muon is not None else 0.0)
    return {"step_s": step_s, "opt_s": opt_s, "muon_bytes": muon_bytes, "expected": expected}


def measure(steps: int) -> list[dict]:
    from hybrid.testing.multirank import run_on_ranks
    rows = []
    for stage, optimizer in VARIANTS:
        ranks = run_on_ranks(_rank, 2, args=(stage, optimizer, steps), timeout=1800)
        step = [max(a, b) for a, b in zip(ranks[0]["step_s"], ranks[1]["step_s"])]
        opt = [max(a, b) for a, b in zip(ranks[0]["opt_s"], ranks[1]["opt_s"])]
        rows.append({"stage": stage, "optimizer": optimizer,
                     "step_ms": 1e3 * statistics.median(step),
                     "opt_ms": 1e3 * statistics.median(opt),
                     "muon_bytes_per_step": ranks[0]["muon_bytes"],
                     "muon_bytes_formula": ranks[0]["expected"]})
        rows[-1]["opt_share"] = rows[-1]["opt_ms"] / rows[-1]["step_ms"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| ZeRO stage | optimizer | median step (ms) | median opt.step() (ms) | share of step "
             "| Muon bytes/rank/step (ledger = formula) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        extra = (f"{r['muon_bytes_per_step']:.0f} = {r['muon_bytes_formula']:.0f}"
                 if r["optimizer"] == "muon" else "-")
        lines.append(f"| {r['stage']} | {r['optimizer']} | {r['step_ms']:.1f} | {r['opt_ms']:.1f} "
                     f"| {100 * r['opt_share']:.1f}% | {extra} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/optimizer_step.json"))
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    rows = measure(args.steps)
    print(table(rows))
    Path(args.out).write_text(json.dumps({"dims": DIMS, "steps": args.steps, "rows": rows},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
