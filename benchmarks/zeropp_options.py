"""Topology-aware ZeRO options measured on the shaped test bed (issue 17 item 4; ZeRO++ hpZ, qwZ,
qgZ; FSDP2 HSDP / MiCS).

One invocation trains the same small GPT as benchmarks/figure2_mini.py (2 layers, hidden 128, seq
64, global batch 16; fp32, or bf16 with fp32 masters under ``--bf16``) at ZeRO stage 3 on 2
network-namespace hosts of 2 CPU ranks each (tools/netns_cluster.py, started with
launch/multinode.sh), TP 1 so DP 4 = 2 hosts x 2, with the inter-host links limited to the lowest
bandwidth of figure2_mini (25 Mbit/s), once per variant. A variant is a name and the trainer flags
it adds:

    sudo python -m benchmarks.zeropp_options --variant plain= --variant hpz=--zero-hpz \\
        --variant hsdp=--zero-hybrid-shard [--bf16] [--rate 25] [--iters 8] [--out results.json]

Per variant it prints the DP bytes and the cross-host bytes per rank per step from the link-aware
ledger (TensorBoard ``comm/dp-*bytes-per-step``) beside the same two from the option's formula
(:func:`formula_bytes`, computed from the engine's sharding units of this model), the cross-host
bytes relative to the first variant, the median seconds per iteration after warm-up, the load
average while it ran and the final loss. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import figure2_mini as fig
from hybrid.zero.quantize import packed_numel   # bytes of one int8 row with its scales

STAGE, TP = 3, 1
DEFAULT_VARIANTS = ("plain=", "hpz=--zero-hpz", "hsdp=--zero-hybrid-shard")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--variant {text!r}: write NAME=FLAGS, e.g. hpz=--zero-hpz (plain= for none)")
    return name, shlex.split(flags)


# ---- the formulas ----------------------------------------------------------------------------
def formula_bytes(unit_numels: list[int], *, param_bytes: int, alignment: int, dp: int, per_host: int,
                  hpz: bool = False, quantized_weights: bool = False,
                  quantized_gradients: bool = False, hybrid_shard: bool = False) -> dict[str, float]:
    """DP bytes one rank sends per stage-3 step (one micro-batch) and the part that crosses hosts,
    as the ledger counts gloo's direct collectives: an all-gather or reduce-scatter over m ranks
    sends its chunk to each of the m - 1 peers, (peers on other hosts) of them cross; an all-reduce
    over k ranks sends 2 (k-1)/k of the tensor. n = ``dp`` ranks, h = ``per_host``, k = n / h hosts.

    Each sharding unit of m elements is padded to a multiple of ``alignment`` x (ranks it is
    sharded over) and split into chunks c; b = ``param_bytes``; q(x) = x + 4 ceil(x / 256) the
    bytes of an int8 row of x elements with its scales. Per unit:

    plain         two all-gathers and a reduce-scatter over n:  3 (n-1) c b, (n-h) c b of each across
    hpZ           the backward's all-gather from the host's secondary partition (padded / h each):
                  (h-1) padded/h b, none across
    qwZ           the all-gathers from the primary partition send q(c) instead of c b
    qgZ           the reduce-scatter in two int8 hops: a row of k chunks to each of the host's
                  h - 1 peers, q(k c), then one chunk to each of the k - 1 other hosts, q(c), across
    hybrid shard  stage 3 over the host's h (c = padded / h, nothing crosses), then the all-reduce
                  of the c-element gradient shard over the k replicas: 2 (k-1)/k c b, all across
    """
    n, h = dp, per_host
    k = n // h
    total = cross = 0.0

    def add(sent: float, across: float) -> None:
        nonlocal total, cross
        total, cross = total + sent, cross + across
    for m in unit_numels:
        shards = h if hybrid_shard else n
        quantum = alignment * shards
        padded = -(-m // quantum) * quantum
        c = padded // shards
        if hybrid_shard:
            add(3 * (h - 1) * c * param_bytes, 0)
            add(2 * (k - 1) / k * c * param_bytes, 2 * (k - 1) / k * c * param_bytes)
            continue
        gather = packed_numel(c) if quantized_weights else c * param_bytes
        add((n - 1) * gather, (n - h) * gather)                        # forward all-gather
        if hpz:
            add((h - 1) * padded // h * param_bytes, 0)                 # backward, in the host
        else:
            add((n - 1) * gather, (n - h) * gather)
        if quantized_gradients:
            add((h - 1) * packed_numel(k * c), 0)
            add((k - 1) * packed_numel(c), (k - 1) * packed_numel(c))
        else:
            add((n - 1) * c * param_bytes, (n - h) * c * param_bytes)
    return {"dp_bytes": total, "dp_cross_host_bytes": cross}


def expected_bytes(train_argv: list[str], vocab: int) -> dict[str, float]:
    """:func:`formula_bytes` for the run the trainer flags ``train_argv`` describe: its model's
    sharding units (the engine's own assignment, built on meta), precision and options."""
    from hybrid.parallel_state import ParallelState
    from pretrain.arguments import parse_args
    from pretrain.build import gpt_config
    from hybrid.zero.config import ZeroConfig
    from hybrid.zero.stage3_build import assign_units
    from models.gpt.model import GPTModel
    cfg = parse_args(train_argv)[0]
    options = cfg.parallel.zero_config_options()
    zero = ZeroConfig(stage=STAGE, precision=cfg.optimizer.precision, **options)
    model = GPTModel(gpt_config(cfg, vocab), ParallelState.single_process(), device="meta")
    units, persistent = assign_units(model, list(model.sharding_units()),
                                     zero.stage3_param_persistence_threshold)
    if persistent:
        raise ValueError("the formulas assume no persistent parameters (threshold 0, the trainer's)")
    numels = [sum(p.numel() for _, p in unit) for unit in units if unit]
    param_bytes = 4 if zero.precision == "fp32" else 2
    return formula_bytes(numels, param_bytes=param_bytes, alignment=zero.alignment_elements,
                         dp=fig.HOSTS * fig.RANKS_PER_HOST // TP, per_host=fig.RANKS_PER_HOST // TP,
                         **options)


# ---- measurement -----------------------------------------------------------------------------
def run(variants: list[tuple[str, list[str]]], rate: float, iters: int, work: Path,
        bf16: bool = False) -> dict:
    from hybrid.testing.corpus import build_corpus
    from tools.netns_cluster import NetnsCluster
    corpus = build_corpus(work / "corpus")
    precision = ["--bf16"] if bf16 else []
    rows = []
    with NetnsCluster(fig.HOSTS, fig.RANKS_PER_HOST, rate_mbit=rate) as cluster:
        for name, flags in variants:
            flags = precision + flags
            formula = expected_bytes(fig.train_args(corpus, work / "cache", work / "tb", TP, STAGE,
                                                    iters) + flags, corpus["vocab"])
            load_before = os.getloadavg()[0]
            measured = fig.measure(cluster, corpus, work, TP, STAGE, iters, f"v_{name}",
                                   extra_args=flags)
            rows.append({"variant": name, "flags": " ".join(flags), **measured,
                         "formula_dp_bytes": formula["dp_bytes"],
                         "formula_dp_cross_host_bytes": formula["dp_cross_host_bytes"],
                         "load_average": [load_before, os.getloadavg()[0]]})
            rows[-1]["cross_host_vs_first"] = (rows[-1]["dp_cross_host_bytes"]
                                               / rows[0]["dp_cross_host_bytes"])
            print(_row_line(rows[-1]), flush=True)
    return {"model": fig.MODEL, "global_batch": fig.GLOBAL_BATCH, "stage": STAGE, "tp": TP,
            "precision": "bf16" if bf16 else "fp32", "hosts": fig.HOSTS,
            "ranks_per_host": fig.RANKS_PER_HOST, "rate_mbit": rate, "iters": iters,
            "warmup": fig.WARMUP, "runs": rows}


def _row_line(r: dict) -> str:
    return (f"{r['variant']:<10} cross-host {r['dp_cross_host_bytes'] / 1e6:6.3f} MB/step "
            f"(formula {r['formula_dp_cross_host_bytes'] / 1e6:6.3f}, {r['cross_host_vs_first']:.3f}x "
            f"the first) DP {r['dp_bytes'] / 1e6:6.3f} MB (formula {r['formula_dp_bytes'] / 1e6:6.3f})  "
            f"{r['measured_s']:6.3f} s/it  load {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f}  "
            f"final loss {r['final_loss']:.5f}")


def table(result: dict) -> str:
    base = result["runs"][0]
    lines = ["| variant | flags | cross-host MB/rank/step, ledger | formula | vs first | "
             "DP MB/rank/step, ledger | formula | median s/it | vs first | load average | final loss |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in result["runs"]:
        lines.append(f"| {r['variant']} | `{r['flags'] or '-'}` | {r['dp_cross_host_bytes'] / 1e6:.3f} | "
                     f"{r['formula_dp_cross_host_bytes'] / 1e6:.3f} | "
                     f"{r['dp_cross_host_bytes'] / base['dp_cross_host_bytes']:.3f}x | "
                     f"{r['dp_bytes'] / 1e6:.3f} | {r['formula_dp_bytes'] / 1e6:.3f} | "
                     f"{r['measured_s']:.3f} | {r['measured_s'] / base['measured_s']:.2f}x | "
                     f"{r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} | {r['final_loss']:.5f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME=FLAGS, repeatable; default: " + " ".join(DEFAULT_VARIANTS))
    parser.add_argument("--bf16", action="store_true",
                        help="16-bit parameters and gradients (bf16, fp32 masters) in every variant")
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
        result = run(variants, args.rate, args.iters, Path(tmp), bf16=args.bf16)
    result["wall_s"] = time.time() - started
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
