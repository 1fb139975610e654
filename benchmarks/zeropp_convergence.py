"""Convergence of ZeRO++'s quantized communication against the exact run (issue 17; ZeRO++ §3.1 qwZ,
§3.3 qgZ): the same GPT trained 200 steps with ZeRO stage 3 exact, with --zero-quantized-weights,
with --zero-quantized-gradients and with both, and the loss gap at the end.

The model is the trainer's default (the ``tiny`` preset's 2 layers x hidden 64, 4 heads, seq 64) on
the embedded default corpus, bf16 parameters with fp32 masters, 4 CPU ranks started by the trainer's
multi-node launch (launch/multinode.sh) on 2 hosts x 2 ranks of the test bed tools/netns_cluster.py
(network namespaces, links unshaped: this measures losses, not time), so qgZ runs both of its hops
(inside a host, then across). Needs root, as the test bed does. Same seed, data order and schedule in every run.

A fifth run repeats the exact training with TP 2 x DP 2 instead of DP 4: mathematically the same
steps, different only in bf16 rounding (summation order), which a 200-step run amplifies. Its gap
is the noise floor: a quantized option whose gap is of that size costs no measurable loss.

Per variant the table gives the training loss (mean of the last 20 iterations, from TensorBoard's
``lm loss``), the validation loss at the end (the same 4 validation batches for every run) and
their gaps to the exact run, and the DP bytes per step each rank sent, all of them and the part
that crossed hosts (the ledger, ``comm/dp-*bytes-per-step``).

    python -m benchmarks.zeropp_convergence [--iters 200] [--out benchmarks/results/zeropp_convergence.json]

Prints the markdown table (benchmarks/README.md has a run of it) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS, PER_HOST = 4, 2
VARIANTS = [("exact stage 3", []), ("qwZ", ["--zero-quantized-weights"]),
            ("qgZ", ["--zero-quantized-gradients"]),
            ("qwZ + qgZ", ["--zero-quantized-weights", "--zero-quantized-gradients"]),
            # the same exact training in another layout: only bf16 rounding differs (summation
            # order), so its gap is the noise floor the quantized gaps are judged against
            ("exact, TP 2 x DP 2", ["--tensor-model-parallel-size", "2"])]
TAIL = 20           # iterations the final training loss averages over
LOG_INTERVAL = 10


def train_args(work: Path, iters: int, extra: list[str]) -> list[str]:
    return ["--zero-stage", "3", "--bf16", "--dp-transport", "gloo",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(iters),
            "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "15", "--seed", "1234",
            "--eval-interval", str(iters), "--eval-iters", "4", "--log-interval", str(LOG_INTERVAL),
            "--data-cache-dir", str(work / "cache"), "--tensorboard-dir", str(work / "tb"),
            *extra]


def run_variant(cluster, work: Path, name: str, iters: int, extra: list[str]) -> dict:
    """Train one variant on ``cluster``; its losses and bytes from TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    job = work / name.replace(" ", "").replace("+", "_")
    job.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHON=sys.executable)
    codes = cluster.run_job(train_args(job, iters, extra), job, "train", timeout=3600, env=env)
    if codes != [0] * cluster.hosts:
        log = (job / "train_host0.log").read_text()[-3000:]
        raise RuntimeError(f"{name} failed (exit codes {codes}):\n{log}")
    (run_dir,) = [d for d in (job / "tb").iterdir() if d.is_dir()]
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    train = [(e.step, e.value) for e in acc.Scalars("lm loss")]   # interval means
    tail = [v for step, v in train if step > iters - TAIL]

    def last(tag: str) -> float:
        return acc.Scalars(tag)[-1].value
    return {"variant": name, "flags": extra, "train_loss_curve": train,
            "final_train_loss": sum(tail) / len(tail),
            "final_validation_loss": last("lm loss validation"),
            "dp_bytes_per_step": last("comm/dp-bytes-per-step"),
            "dp_cross_host_bytes_per_step": last("comm/dp-cross-host-bytes-per-step")}


def compare(iters: int = 200) -> list[dict]:
    """Every variant, the exact one first; each result carries its gaps to the exact run."""
    from tools.netns_cluster import NetnsCluster
    with tempfile.TemporaryDirectory(prefix="zeropp-convergence-") as tmp, \
            NetnsCluster(RANKS // PER_HOST, PER_HOST) as cluster:
        results = [run_variant(cluster, Path(tmp), name, iters, flags) for name, flags in VARIANTS]
    exact = results[0]
    for r in results:
        r["train_gap"] = r["final_train_loss"] - exact["final_train_loss"]
        r["validation_gap"] = r["final_validation_loss"] - exact["final_validation_loss"]
    return results


def table(results: list[dict], iters: int) -> str:
    lines = [f"| variant | train loss (last {TAIL} of {iters}) | gap | validation loss | gap | "
             f"DP MB/step | cross-host MB/step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['variant']} | {r['final_train_loss']:.4f} | {r['train_gap']:+.4f} | "
                     f"{r['final_validation_loss']:.4f} | {r['validation_gap']:+.4f} | "
                     f"{r['dp_bytes_per_step'] / 1e6:.3f} | "
                     f"{r['dp_cross_host_bytes_per_step'] / 1e6:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/zeropp_convergence.json"))
    args = p.parse_args(argv)
    if args.iters < TAIL:
        p.error(f"--iters must be at least {TAIL}")
    results = compare(args.iters)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"iters": args.iters, "results": results}, indent=1))
    print(table(results, args.iters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
