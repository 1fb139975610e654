"""Dry run of the paper's Table 5 runs at full size on the meta device (ZeRO §10; torchtitan-style
dry run), through the same path as ``launch/pretrain_gpt.py --dry-run``: every row's preset (from
pretrain/presets/) is checked by :func:`pretrain.dry_run.dry_run_report`, which builds the real
tensor-parallel GPT of one TP rank (nothing allocated), counts its parameters and estimates model
states, activations and buffers with hybrid.perf. This tool adds the comparison with the parameter
formulas, shows which TP groups of the 400-GPU (and 384/256-GPU baseline) layouts stay inside a
DGX-2 node, and splits each run's DP and TP traffic per GPU per step into the bytes that stay inside
a node and those on InfiniBand (hybrid.perf.links).

    python -m tools.dry_run > docs/paper/dry_run.txt   # table + traffic + topology summary
    python -m tools.dry_run --json
    python -m tools.dry_run --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16   # 16-bit Adam moments

With 16-bit moments (Megatron's precision-aware optimizer, docs/optimizer-precision.md) every row is
dry-run with them and the formula column uses K = 4 + 2 + 2 instead of the paper's 12.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybrid.perf.flops import gpt_param_count, megatron_param_count
from hybrid.perf.model_states import GB, model_state_bytes, optimizer_bytes_per_param
from hybrid.topology import Topology
from pretrain.arguments import parse_args
from pretrain.dry_run import dry_run_report, total_bytes
from models.gpt.presets import PAPER_RUNS, PaperRun
from tools._cli import ArgumentParser, run_cli

GPUS_PER_NODE = 16
DEVICE_BYTES = 32e9
# ZeRO Table 3: the ZeRO-R configuration a stage-2 preset's --recompute amounts to.
ZERO_R_CONFIG = {"full": "C3", "full-pa": "C4", "full-pa-cpu": "C5"}


def dry_run_row(run: PaperRun, moments: tuple[str, str] = ("fp32", "fp32")) -> dict:
    """One Table 5 row; ``moments``: the storage dtypes of Adam's exp_avg and exp_avg_sq."""
    c = run.config
    flags = ([] if moments == ("fp32", "fp32") else
             ["--use-precision-aware-optimizer", "--exp-avg-dtype", moments[0],
              "--exp-avg-sq-dtype", moments[1]])
    report = dry_run_report(parse_args(["--config", run.name, *flags])[0])
    k = optimizer_bytes_per_param(exp_avg=moments[0], exp_avg_sq=moments[1])
    counted = report["params_per_rank"]
    exact = gpt_param_count(c.num_layers, c.hidden_size, c.padded_vocab_size(run.tp),
                            c.max_position_embeddings, tp=run.tp)
    megatron = megatron_param_count(c.num_layers, c.hidden_size, c.vocab_size, c.seq_length) / run.tp
    stage = 2 if run.zero else 0
    total = total_bytes(report)
    return {"name": run.name, "gpus": run.gpus, "tp": run.tp, "dp": run.dp, "stage": stage,
            "config": ZERO_R_CONFIG.get(report["recompute"], "?") if run.zero else "baseline",
            "params_per_rank": counted, "formula_exact": exact,
            "megatron_formula_per_rank": megatron, "megatron_rel_diff": counted / megatron - 1,
            "model_states_gb": report["model_states_per_rank"]["total"] / GB,
            "formula_model_states_gb": model_state_bytes(megatron * run.tp, stage, run.dp,
                                                         mp=run.tp,
                                                         optimizer_bytes_per_param=k).total / GB,
            "optimizer_bytes_per_param": k,
            "total_gb": total / GB, "fits_32gb": total <= DEVICE_BYTES,
            "dp_traffic_gb": report["dp_bytes_per_step"] / GB,
            "dp_cross_node_gb": report["dp_cross_host_bytes_per_step"] / GB,
            "tp_traffic_gb": report["tp_bytes_per_step"] / GB,
            "tp_cross_node_gb": report["tp_cross_host_bytes_per_step"] / GB}


def topology_summary(gpus: int, tp: int) -> dict:
    topo = Topology(gpus, tp, GPUS_PER_NODE, allow_tp_across_nodes=True)
    groups = topo.tp_groups()
    inside = sum(len(topo.nodes_of(g)) == 1 for g in groups)
    dp_nodes = {len(topo.nodes_of(g)) for g in topo.dp_groups()}
    return {"gpus": gpus, "tp": tp, "describe": topo.describe(), "tp_groups": len(groups),
            "tp_groups_inside_a_node": inside, "nodes_per_tp_group": len(topo.nodes_of(groups[0])),
            "nodes_per_dp_group": sorted(dp_nodes)}


def rows(moments: tuple[str, str] = ("fp32", "fp32")) -> list[dict]:
    return [dry_run_row(r, moments) for r in PAPER_RUNS.values() if r.table == "table5"]


def layouts() -> list[dict]:
    seen = sorted({(r.gpus, r.tp) for r in PAPER_RUNS.values() if r.table == "table5"},
                  key=lambda gt: (-gt[0], gt[1]))
    return [topology_summary(g, t) for g, t in seen]


def render(table: list[dict], topo: list[dict]) -> str:
    """The table, the traffic per GPU and the layouts as text (docs/paper/dry_run.txt)."""
    lines = [f"{'run':24s} {'GPUs':>4s} {'TP':>3s} {'DP':>3s} st cfg  {'params/rank':>14s} "
             f"{'exact formula':>14s} {'vs Megatron':>11s} {'states GB':>9s} {'formula':>7s} "
             f"{'total GB':>8s} fits"]
    for r in table:
        lines.append(f"{r['name']:24s} {r['gpus']:4d} {r['tp']:3d} {r['dp']:3d} {r['stage']:2d} "
                     f"{r['config'][:4]:4s} {r['params_per_rank']:14,d} {r['formula_exact']:14,d} "
                     f"{r['megatron_rel_diff']:+11.2e} {r['model_states_gb']:9.2f} "
                     f"{r['formula_model_states_gb']:7.2f} {r['total_gb']:8.1f} "
                     f"{'yes' if r['fits_32gb'] else 'NO'}")
    lines.append(f"\nTraffic per GPU per step, GB (across nodes in brackets):\n{'run':24s} "
                 f"{'DP':>18s} {'TP':>20s}")
    for r in table:
        lines.append(f"{r['name']:24s} {r['dp_traffic_gb']:8.2f} ({r['dp_cross_node_gb']:7.2f}) "
                     f"{r['tp_traffic_gb']:9.2f} ({r['tp_cross_node_gb']:8.2f})")
    lines.append("\nLayouts (DGX-2: 16 GPUs per node, TP fastest):")
    for t in topo:
        lines.append(f"  {t['describe']}\n    TP groups inside one node: "
                     f"{t['tp_groups_inside_a_node']}/{t['tp_groups']} (each spans "
                     f"{t['nodes_per_tp_group']} node(s)); DP groups span "
                     f"{t['nodes_per_dp_group']} node(s)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
        parser.add_argument(flag, choices=("fp32", "bf16"), default="fp32",
                            help="storage dtype of an Adam moment in every row (K follows)")
    args = parser.parse_args(argv)
    table, topo = rows((args.exp_avg_dtype, args.exp_avg_sq_dtype)), layouts()
    if args.json:
        json.dump({"runs": table, "layouts": topo}, sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(render(table, topo))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
