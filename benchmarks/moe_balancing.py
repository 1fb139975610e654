"""Expert load balance with and without DeepSeek-V3's aux-loss-free balancing (issue 32): a small
MoE GPT (the ``tiny-llama-cpu`` preset's options at 2 layers, hidden 64, sequence 64; both layers
MoE with 8 SwiGLU experts of width 64, top-2, sigmoid router scores) trained ``--iters`` steps on
the embedded default corpus, bf16 with fp32 masters, one rank, ZeRO stage 1, micro-batch 8 = global
batch 8 (512 tokens, 1024 routes per layer and step), lr 2e-3 cosine, no aux loss and no capacity
(dropless) in every run. The runs differ only in the expert bias:

    none       --moe-router-load-balancing-type none
    bias-1e-3  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 (DeepSeek-V3's)
    bias-1e-2  the same with rate 1e-2

The trainer logs ``moe/load-max-over-mean`` every step (the busiest expert's routes over the mean,
the worse of the two layers; 1.0 = perfectly balanced). Curves to docs/moe_balancing.png, numbers
to benchmarks/results/moe_balancing.json, a markdown table to stdout.

    python benchmarks/moe_balancing.py [--iters 300] [--work DIR] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"none": ["--moe-router-load-balancing-type", "none"],
        "bias-1e-3": ["--moe-router-load-balancing-type", "none", "--moe-router-enable-expert-bias",
                      "--moe-router-bias-update-rate", "1e-3"],
        "bias-1e-2": ["--moe-router-load-balancing-type", "none", "--moe-router-enable-expert-bias",
                      "--moe-router-bias-update-rate", "1e-2"]}
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--seq-length", "64", "--num-experts", "8",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
         "--moe-router-score-function", "sigmoid"]


def train_args(name: str, iters: int, work: Path) -> list[str]:
    return ["launch/pretrain_gpt.py", "--config", "tiny-llama-cpu", *MODEL, *RUNS[name],
            "--world-size", "1", "--gpus-per-node", "1", "--tensor-model-parallel-size", "1",
            "--zero-stage", "1", "--train-iters", str(iters), "--eval-iters", "0",
            "--log-interval", "1", "--micro-batch-size", "8", "--global-batch-size", "8",
            "--save-interval", "100000", "--save", str(work / f"ckpt-{name}"),
            "--jsonl-log", str(work / f"{name}.jsonl"), "--tensorboard-dir",
            str(work / f"tb-{name}"), "--overwrite"]


def run(name: str, iters: int, work: Path) -> None:
    (work / f"{name}.jsonl").unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = ["nice", "-n", "15", sys.executable, "launch/torchrun.py", "--standalone", "--nnodes",
           "1", "--nproc-per-node", "1", *train_args(name, iters, work)]
    with open(work / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def curves(work: Path) -> dict:
    out = {}
    for name in RUNS:
        rows = [json.loads(line) for line in open(work / f"{name}.jsonl") if line.strip()]
        rows = [r for r in rows if "moe/load-max-over-mean" in r.get("metrics", {})]
        out[name] = {"step": [r["step"] for r in rows],
                     "max_over_mean": [r["metrics"]["moe/load-max-over-mean"] for r in rows],
                     "lm_loss": [r["metrics"]["lm loss"] for r in rows]}
    return out


def summary(data: dict, window: int = 50) -> dict:
    """Per run and 50-step window: the largest and the mean per-step max/mean, and the run's mean
    lm loss over its last 10 steps."""
    out = {}
    for name, c in data.items():
        v = c["max_over_mean"]
        windows = {f"{a + 1}-{min(a + window, len(v))}": (max(v[a:a + window]),
                                                          sum(v[a:a + window]) / len(v[a:a + window]))
                   for a in range(0, len(v), window)}
        out[name] = {"windows": windows, "final_lm_loss": sum(c["lm_loss"][-10:]) / 10}
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, c in data.items():
        ax.plot(c["step"], c["max_over_mean"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("expert load max / mean (worse layer)")
    ax.set_title("8 experts, top-2, sigmoid router: aux-loss-free expert bias vs none")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "moe_balancing")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        for name in RUNS:
            run(name, args.iters, args.work)
    data = curves(args.work)
    table = summary(data)
    (ROOT / "benchmarks" / "results" / "moe_balancing.json").write_text(
        json.dumps({"summary": table, "curves": data}, indent=1) + "\n")
    plot(data, ROOT / "docs" / "moe_balancing.png")
    spans = list(next(iter(table.values()))["windows"])
    print("max/mean expert load per step, largest | mean over each window of steps")
    print("| run | " + " | ".join(f"steps {w}" for w in spans) + " | lm loss, last 10 |")
    print("| --- |" + " --- |" * (len(spans) + 1))
    for name, row in table.items():
        cells = " | ".join(f"{hi:.2f} \\| {mean:.2f}" for hi, mean in row["windows"].values())
        print(f"| {name} | {cells} | {row['final_lm_loss']:.3f} |")

if __name__ == "__main__":
    main()
