"""PNG plots of the paper's figures from tools/paper_tables.py's numbers (ZeRO Figure 1 memory bars,
Figure 2 ZeRO vs Megatron throughput, Figure 3 60B superlinear scaling). Agg backend: no display."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)


def write_plots(out: Path, data: dict) -> list[Path]:
    return [_figure1(out, data["figure1"]), _figure2(out, data["table5"]), _figure3(out, data["table6"])]


def _figure1(out: Path, rows: list[dict]) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["name"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in (("params_gb", "16-bit params"), ("grads_gb", "16-bit grads"),
                       ("optimizer_gb", "optimizer states (K=12)")):
        values = [r[key] for r in rows]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, r in enumerate(rows):
        ax.text(x, r["total_gb"] + 2, f'{r["formatted"]} GB', ha="center")
    ax.set_ylabel("GB per device")
    ax.set_title("Figure 1: model states, Ψ = 7.5B, Nd = 64")
    ax.legend()
    return _save(fig, out / "figure1.png")


def _figure2(out: Path, rows: list[dict]) -> Path:
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    by = {(r["size"], r["system"]): r["pflops"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(sizes))
    ax.bar([x - 0.2 for x in xs], [by[(s, "Megatron")] for s in sizes], 0.4, label="Megatron baseline")
    ax.bar([x + 0.2 for x in xs], [by[(s, "ZeRO")] for s in sizes], 0.4, label="ZeRO (Pos+g + ZeRO-R)")
    stated = {"100B": ("ZeRO", 15.0), "40B": ("Megatron", 5e-3 * 384)}  # PFLOP/s the paper states
    for size, (system, pf) in stated.items():
        x = sizes.index(size) + (0.2 if system == "ZeRO" else -0.2)
        ax.plot([x], [pf], "k*", markersize=10, label="paper's stated figure" if size == "100B" else None)
    ax.set_xticks(list(xs), sizes)
    ax.set_xlabel("model size")
    ax.set_ylabel("predicted PFLOP/s (aggregate)")
    ax.set_title("Figure 2 (predicted): throughput on up to 400 V100")
    ax.set_ylim(0, 22)
    ax.legend(loc="upper center", ncol=3, fontsize="small")
    return _save(fig, out / "figure2.png")


def _figure3(out: Path, rows: list[dict]) -> Path:
    gpus = [r["gpus"] for r in rows]
    pf = [r["pflops"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(gpus, pf, "o-", label="predicted")
    ax.plot(gpus, [pf[0] * g / gpus[0] for g in gpus], "--", label="linear from 64 GPUs")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("PFLOP/s")
    ax.set_title("Figure 3 (predicted): 60B superlinear scaling")
    ax.legend()
    return _save(fig, out / "figure3.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
