"""AdamW vs Muon at the same learning-rate schedule (issue 33): the README's GPT-2-style tiny model
(``tiny-cpu``: 4 layers, hidden 128, learned positions, LayerNorm, GELU, tied embedding) and its
Llama-style twin (``tiny-llama-cpu``: RoPE, RMSNorm, SwiGLU, GQA, untied output), each trained
``--iters`` steps on the embedded default corpus with ``--optimizer adamw`` and ``--optimizer muon``
(Moonlight's 0.2 sqrt(max(m, n)) scale, bf16 Newton-Schulz, Nesterov momentum 0.95): one rank,
ZeRO stage 1, bf16 with fp32 masters, micro-batch 8, global batch 16, the presets' schedule
(lr 2e-3 -> 2e-4 cosine after 15 warm-up steps, weight decay 0.01, clip 1.0), validation every 25
steps on 2 batches. The validation-loss curves go to docs/muon_convergence.png, the numbers to
JSON, a markdown table to stdout.

    python benchmarks/muon_convergence.py [--iters 300] [--work DIR] [--plot-only]

Each run is its own ``launch/torchrun.py`` job (nice'd); ``--plot-only`` re-reads ``--work``'s
TensorBoard logs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tiny-cpu": "GPT-2-style tiny", "tiny-llama-cpu": "Llama-style tiny"}
OPTIMIZERS = ("adamw", "muon")


def train_args(config: str, optimizer: str, iters: int, work: Path) -> list[str]:
    name = f"{config}-{optimizer}"
    return ["launch/pretrain_gpt.py", "--config", config, "--world-size", "1", "--gpus-per-node",
            "1", "--tensor-model-parallel-size", "1", "--zero-stage", "1", "--optimizer", optimizer,
            "--train-iters", str(iters), "--eval-interval", "25", "--eval-iters", "2",
            "--log-interval", "10", "--micro-batch-size", "8", "--global-batch-size", "16",
            "--save-interval", "100000", "--save", str(work / f"ckpt-{name}"),
            "--tensorboard-dir", str(work / f"tb-{name}"), "--overwrite"]


def run(config: str, optimizer: str, iters: int, work: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = ["nice", "-n", "15", sys.executable, "launch/torchrun.py", "--standalone", "--nnodes",
           "1", "--nproc-per-node", "1", *train_args(config, optimizer, iters, work)]
    with open(work / f"{config}-{optimizer}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def curves(work: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = {}
    for config in MODELS:
        for optimizer in OPTIMIZERS:
            runs = sorted(d for d in (work / f"tb-{config}-{optimizer}").iterdir() if d.is_dir())
            acc = EventAccumulator(str(runs[-1]), size_guidance={"scalars": 0})
            acc.Reload()
            out[f"{config}/{optimizer}"] = {
                "validation": [(e.step, e.value) for e in acc.Scalars("lm loss validation")],
                "train": [(e.step, e.value) for e in acc.Scalars("lm loss")]}
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(MODELS), figsize=(11, 4), sharey=True)
    for ax, (config, title) in zip(axes, MODELS.items()):
        for optimizer in OPTIMIZERS:
            steps, losses = zip(*data[f"{config}/{optimizer}"]["validation"])
            ax.plot(steps, losses, marker="o", markersize=3, label=optimizer)
        ax.set_title(f"{title} ({config})")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(data: dict) -> str:
    lines = ["| model | iteration | AdamW val loss | Muon val loss | Muon - AdamW |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for config, title in MODELS.items():
        adamw = dict(data[f"{config}/adamw"]["validation"])
        muon = dict(data[f"{config}/muon"]["validation"])
        for step in sorted(set(adamw) & set(muon)):
            if step % 50 == 0 or step == max(adamw):
                lines.append(f"| {title} | {step} | {adamw[step]:.4f} | {muon[step]:.4f} | "
                             f"{muon[step] - adamw[step]:+.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--work", default="/tmp/muon-convergence")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--png", default=str(ROOT / "docs/muon_convergence.png"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/muon_convergence.json"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        for config in MODELS:
            for optimizer in OPTIMIZERS:
                run(config, optimizer, args.iters, work)
    data = curves(work)
    plot(data, Path(args.png))
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))


if __name__ == "__main__":
    main()
