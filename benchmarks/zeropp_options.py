"""Topology-aware ZeRO options measured on the shaped test bed (issue 17 item 4; ZeRO++ hpZ, qwZ,
qgZ; FSDP2 HSDP / MiCS).

One invocation trains the same small GPT as benchmarks/figure2_mini.py (2 layers, hidden 128, seq
64, global batch 16, fp32) at ZeRO stage 3 on 2 network-namespace hosts of 2 CPU ranks each
(tools/netns_cluster.py, started with launch/multinode.sh), TP 1 so DP 4 = 2 hosts x 2, with the
inter-host links limited to the lowest bandwidth of figure2_mini (25 Mbit/s), once per variant.
A variant is a name and the trainer flags it adds:

    sudo python -m benchmarks.zeropp_options --variant plain= --variant hpz=--zero-hpz \\
        --variant hsdp=--zero-hybrid-shard [--rate 25] [--iters 8] [--out results.json]

(``--variant qwz=--zero-quantized-weights`` etc. once those options exist.) Per variant it prints
the DP bytes and the cross-host bytes per rank per step from the link-aware ledger (TensorBoard
``comm/dp-*bytes-per-step``), the median seconds per iteration after warm-up and the final loss.
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import figure2_mini as fig

STAGE, TP = 3, 1
DEFAULT_VARIANTS = ("plain=", "hpz=--zero-hpz", "hsdp=--zero-hybrid-shard")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--variant {text!r}: write NAME=FLAGS, e.g. hpz=--zero-hpz (plain= for none)")
    return name, shlex.split(flags)


def run(variants: list[tuple[str, list[str]]], rate: float, iters: int, work: Path) -> dict:
    from tests.reliability_helpers import build_corpus
    from tools.netns_cluster import NetnsCluster
    corpus = build_corpus(work / "corpus")
    rows = []
    with NetnsCluster(fig.HOSTS, fig.RANKS_PER_HOST, rate_mbit=rate) as cluster:
        for name, flags in variants:
            measured = fig.measure(cluster, corpus, work, TP, STAGE, iters, f"v_{name}",
                                   extra_args=flags)
            rows.append({"variant": name, "flags": " ".join(flags), **measured})
            print(_row_line(rows[-1]), flush=True)
    return {"model": fig.MODEL, "global_batch": fig.GLOBAL_BATCH, "stage": STAGE, "tp": TP,
            "hosts": fig.HOSTS, "ranks_per_host": fig.RANKS_PER_HOST, "rate_mbit": rate,
            "iters": iters, "warmup": fig.WARMUP, "runs": rows}


def _row_line(r: dict) -> str:
    return (f"{r['variant']:<10} cross-host {r['dp_cross_host_bytes'] / 1e6:6.3f} MB/step "
            f"(DP {r['dp_bytes'] / 1e6:6.3f} MB)  {r['measured_s']:6.3f} s/it  "
            f"final loss {r['final_loss']:.5f}")


def table(result: dict) -> str:
    base = result["runs"][0]
    lines = ["| variant | flags | cross-host MB/rank/step | DP MB/rank/step | median s/it | vs first | final loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        lines.append(f"| {r['variant']} | `{r['flags'] or '-'}` | {r['dp_cross_host_bytes'] / 1e6:.3f} | "
                     f"{r['dp_bytes'] / 1e6:.3f} | {r['measured_s']:.3f} | "
                     f"{r['measured_s'] / base['measured_s']:.2f}x | {r['final_loss']:.5f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME=FLAGS, repeatable; default: " + " ".join(DEFAULT_VARIANTS))
    parser.add_argument("--rate", type=float, default=min(fig.RATES_MBIT),
                        help="inter-host bandwidth in Mbit/s")
    parser.add_argument("--iters", type=int, default=8, help=f"iterations per run ({fig.WARMUP} warm-up)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.iters <= fig.WARMUP:
        print(f"error: --iters must be more than the {fig.WARMUP} warm-up iterations", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(variants, args.rate, args.iters, Path(tmp))
    result["wall_s"] = time.time() - started
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
