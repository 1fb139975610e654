"""Write the ZeRO paper's tables and figures as predicted by hybrid.perf (ZeRO §5 Figure 1, Tables
1-2; §10 Table 5 / Figure 2, Table 6 / Figure 3) into docs/paper/: markdown, CSV and PNG plots, plus
the predictions-vs-paper table (tools/paper_claims.py).

    python -m tools.paper_tables                 # writes docs/paper/
    python -m tools.paper_tables --out DIR       # elsewhere
    python -m tools.paper_tables --json          # print every number as JSON (writes nothing)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from pathlib import Path

from hybrid.perf.hardware import dgx2_v100_cluster
from hybrid.perf.throughput import ThroughputAssumptions
from tools import paper_claims, paper_numbers as pn
from tools._cli import ArgumentParser, require, run_cli

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "paper"


def collect() -> dict:
    return {"assumptions": {**dataclasses.asdict(dgx2_v100_cluster()),
                            **dataclasses.asdict(ThroughputAssumptions())},
            "figure1": pn.figure1(), "table1": pn.table1(), "table2": pn.table2(),
            "table3": pn.table3(), "table5": pn.table5(), "table6": pn.table6(), "table10": pn.table10(),
            "predictions": [c.as_dict() for c in paper_claims.claims()]}


# ---- markdown / csv helpers -----------------------------------------------------------------
def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:.4g}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


# ---- sections -------------------------------------------------------------------------------
def figure1_section(data: dict) -> tuple[str, list[str], list[list]]:
    header = ["stage", "16-bit params GB", "16-bit grads GB", "optimizer GB", "total GB", "paper GB"]
    rows = [[r["name"], round(r["params_gb"], 3), round(r["grads_gb"], 3), round(r["optimizer_gb"], 3),
             r["formatted"], r["paper"]] for r in data["figure1"]]
    return "Figure 1: model states per device, Ψ = 7.5B, Nd = 64, K = 12", header, rows


def table1_section(data: dict) -> tuple[str, list[str], list[list]]:
    header = ["model", "stage"] + [f"DP {d}" for d in pn.DP_DEGREES] + ["paper (7.5B)"]
    rows = [[r["model"], r["stage"], *r["formatted"], " / ".join(r["paper"]) if r["paper"] else ""]
            for r in data["table1"]]
    return "Table 1: model-state GB per device", header, rows


def table2_section(data: dict) -> tuple[str, list[str], list[list]]:
    header = ["MP", "GPUs", "baseline", "Pos", "Pos+g", "Pos+g+p", "paper formula",
              "estimate baseline", "estimate Pos", "paper measured baseline / Pos"]
    rows = [[r["mp"], r["gpus"], *r["formula"], " / ".join(r["paper_formula"]), *r["estimate"],
             " / ".join(r["paper_measured"])] for r in data["table2"]]
    return "Table 2: largest model with Nd = 64 on 32 GB (formula, and estimate with activations "\
           "and buffers)", header, rows


def table3_section(data: dict) -> tuple[str, list[str], list[list]]:
    header = ["config", "stage", "Pa", "Pa+cpu", "layers (h 8192)", "largest model", "paper"]
    rows = [[r["config"], r["stage"], r["pa"], r["cpu"], r["layers"], r["formatted"], r["paper"]]
            for r in data["table3"]]
    return f"Table 3: largest model per ZeRO configuration, 400 GPUs, MP 16, batch " \
           f"{pn.TABLE3_BATCH} per replica", header, rows


RUN_COLUMNS = ["name", "gpus", "mp", "dp", "batch", "config", "params_b", "model_states_gb",
               "activations_gb", "buffers_gb", "total_gb", "fits_32gb", "tflops_per_gpu",
               "pflops", "step_s", "paper"]


def runs_section(data: dict, key: str, title: str) -> tuple[str, list[str], list[list]]:
    rows = [[r[c] for c in RUN_COLUMNS] for r in data[key]]
    return title, RUN_COLUMNS, rows


def predictions_section(data: dict) -> tuple[str, list[str], list[list]]:
    header = ["claim", "paper", "predicted", "ratio", "status", "reason"]
    rows = [[p["claim"], p["paper"], round(p["predicted"], 3), round(p["ratio"], 2), p["status"],
             p["reason"]] for p in data["predictions"]]
    return "Predictions vs the paper (tolerance 20%)", header, rows


def assumptions_section(data: dict) -> tuple[str, list[str], list[list]]:
    rows = [[k, v] for k, v in data["assumptions"].items()]
    return "Assumptions of the throughput model (hybrid.perf.hardware.Cluster, " \
           "hybrid.perf.throughput.ThroughputAssumptions)", ["name", "value"], rows


def predictions_intro(data: dict) -> str:
    preds = data["predictions"]
    ok = sum(p["status"] == "ok" for p in preds)
    return (f"{ok} of {len(preds)} of the paper's stated figures are reproduced by hybrid.perf's "
            f"models (within 20% for \"about X\"; strictly above for \"over X\" and \"more than X\", "
            f"which are bounds; not above for \"under X\"); the {len(preds) - ok} known misses "
            f"give the reason the model cannot reproduce them. The claims and reasons live in "
            f"`tools/paper_claims.py`; `tests/perf/test_throughput.py` asserts each claim's "
            f"documented status, so a model change that moves a claim in or out of tolerance fails. "
            f"The model's assumptions are listed in `tables.md`.")


SECTIONS = {"assumptions": assumptions_section, "figure1": figure1_section,
            "table1": table1_section, "table2": table2_section,
            "table3": table3_section,
            "table5": lambda d: runs_section(d, "table5", "Table 5 / Figure 2: every run, per GPU"),
            "table6": lambda d: runs_section(d, "table6", "Table 6 / Figure 3: 60B superlinear scaling"),
            "table10": lambda d: runs_section(d, "table10", "Table 10: ZeRO-DP only (MP 1), 128 GPUs"),
            "predictions": predictions_section}

NOTES = """Memory and throughput come from `hybrid/perf/` (pure functions); assumptions are the named
fields of `hybrid.perf.hardware.Cluster` and `hybrid.perf.throughput.ThroughputAssumptions`.
TFLOP/s count hardware FLOPs (Megatron's 96 B s l h² formula, recompute included). ZeRO rows run
Pos+g (stage 2) with the lightest ZeRO-R configuration that fits 32 GB (C3, C4 = +Pa, C5 = +Pa+cpu);
Megatron rows run plain DP with full recompute and a fused fp32 gradient buffer. The Table 2
estimate columns assume a GPT of width 1600 per MP rank, micro-batch 8, seq 1024, full recompute and
1 GB reserved per GPU. Regenerate with `python -m tools.paper_tables`."""


def write_all(out: Path, data: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written, parts = [], ["# The ZeRO paper's tables, predicted by hybrid.perf", "", NOTES]
    for key, section in SECTIONS.items():
        title, header, rows = section(data)
        parts += ["", f"## {title}", "", md_table(header, rows)]
        write_csv(out / f"{key}.csv", header, rows)
        written.append(out / f"{key}.csv")
    (out / "tables.md").write_text("\n".join(parts) + "\n")
    written.append(out / "tables.md")
    title, header, rows = predictions_section(data)
    (out / "predictions.md").write_text(f"# {title}\n\n{predictions_intro(data)}\n\n"
                                        + md_table(header, rows) + "\n")
    written.append(out / "predictions.md")
    from tools.paper_plots import write_plots   # matplotlib only when writing files
    written += write_plots(out, data)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead")
    args = parser.parse_args(argv)
    require(args.json or not args.out.exists() or args.out.is_dir(),
            f"--out {args.out} is a file; pass a directory for the tables and plots")
    data = collect()
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    for path in write_all(args.out, data):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
