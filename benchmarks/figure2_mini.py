"""Figure 2 of the ZeRO paper in miniature, measured on a shaped network (ZeRO §10.2, Figure 2).

Figure 2's point: Megatron alone must stretch its tensor-parallel (TP) group across nodes once a
model outgrows one node, and its per-layer all-reduces of the b s h activations then run over the
slow inter-node links; ZeRO keeps TP inside a node and sends only its 2Ψ of DP traffic across.
Here the same small GPT (below) is trained with the same global batch on 2 "hosts" of 2 CPU ranks
(tools/netns_cluster.py: network namespaces whose NICs a token-bucket filter limits to a few tens of
Mbit/s, while ranks of one host talk over loopback at GB/s), started by launch/multinode.sh:

- (a) Megatron baseline: TP 4 spanning both hosts, DP 1, no ZeRO;
- (b) ZeRO-1 (Pos): TP 2 inside each host, DP 2 across the hosts.

Each layout runs at each bandwidth; the wall-clock seconds per iteration come from rank 0's
TensorBoard ``iteration-time`` (median after warm-up), and the bytes that crossed hosts per step
from the link-aware ledger (``comm/{tp,dp}-cross-host-bytes-per-step``).

Beside each measurement, the throughput model of hybrid/perf/throughput.py predicts the iteration
for the same shaped cluster, calibrated on this machine: the component rates at this model's shapes
measured with benchmarks/calibrate_perf_model.py's probes (GEMMs, attention core, elementwise ops,
AdamW, host overhead per layer; thread CPU time), gloo's intra-host bandwidth and latency from
docs/paper/calibration.json, and the inter-host link as gloo really gets it through the filter
(benchmarks/shaped_link_probe.py, on the test bed before each bandwidth's runs: a 2-rank all-reduce
alone, and two at once). The link is shared by the streams that cross it at once, counted from the
ring split of hybrid/perf/links.py: the TP 4 ring over hosts (0,0,1,1) crosses at 2 of its 4 hops,
one stream per host and direction; the two DP 2 groups of (b) both cross, two streams per host and
direction. The model's inter-node ring bandwidth is the probe's bandwidth per stream for that many
streams.

    python -m benchmarks.figure2_mini [--rates 25 50 100] [--iters 6] [--out docs/paper]
    python -m benchmarks.figure2_mini --render docs/paper/figure2_mini.json   # table + plot again

Writes figure2_mini.json, figure2_mini.md (the table) and figure2_mini.png (the plot) and prints the
table; needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybrid.perf.flops import pad_vocab
from hybrid.perf.hardware import Cluster
from hybrid.perf.links import cross_host_fraction, nodes_of
from hybrid.perf.throughput import ThroughputAssumptions, estimate_iteration
from hybrid.topology import Topology

HOSTS, RANKS_PER_HOST = 2, 2
MODEL = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64)
MICRO_BATCH, GLOBAL_BATCH = 4, 16
VOCAB_MULTIPLE = 8                    # --make-vocab-size-divisible-by
LAYOUTS = [  # (name, tp, dp, stage)
    ("Megatron TP4 across hosts", 4, 1, 0),
    ("ZeRO-1 TP2 in host, DP2 across", 2, 2, 1),
]
RATES_MBIT = (25.0, 50.0, 100.0)
TOLERANCE = 0.25
WARMUP = 2                            # iterations left out of the median
READING = """How to read it. ZeRO (b) trains the same model 1.9-2.5x faster than Megatron with its TP group
across hosts (a) at every bandwidth, the paper's Figure 2 effect: (a) sends half of its TP ring bytes
across hosts (2 of the 4 ring hops cross), 3.94 MB per rank per step, while (b) sends only its DP
bytes, 0.93 MB (Ψ/TP fp32 elements: one reduce-scatter and one all-gather over DP 2), and its TP
bytes stay inside the host. Both reach the same loss. The model predicts (a) within 5% at all three
bandwidths. It under-predicts (b) by 36-53%, beyond the 25% target: its DP term takes the link rate
gloo's ring all-reduce gets (the probe's, 95% of the filter's rate), but ZeRO's DP collectives on
gloo are hybrid.comm's point-to-point all-gather and all-to-all reduce-scatter, which send and
receive at once. On this link, two DP groups of 2 moving 1.86 MB per op took 0.52-0.54 s per
all-gather or reduce-scatter against 0.31 s for gloo's all-reduce or a one-way send of the same
bytes: the incoming streams' TCP ACKs queue behind 100 ms of outgoing data in the token bucket.
Giving bare ACKs a priority class (htb + a u32 filter) cut that to 0.39-0.44 s in the same probe,
but end to end at 50 Mbit/s it made (b) only 7% faster (0.549 s against 0.588 s) and (a) 33%
slower (1.847 s against 1.386 s), so the test bed keeps the plain token-bucket filter. At 100 Mbit/s compute matters too: 4 ranks share 2 busy cores while the
compute terms are CPU-time rates."""
CALIBRATION = Path(__file__).resolve().parent.parent / "docs" / "paper" / "calibration.json"
DEFAULT_OUT = CALIBRATION.parent


def train_args(corpus: dict, cache: Path, tb_dir: Path, tp: int, stage: int, iters: int,
               global_batch: int = GLOBAL_BATCH) -> list[str]:
    m = MODEL
    return ["--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
            "--num-attention-heads", str(m["num_attention_heads"]),
            "--seq-length", str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]),
            "--make-vocab-size-divisible-by", str(VOCAB_MULTIPLE),
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(global_batch),
            "--tensor-model-parallel-size", str(tp), "--allow-tp-across-nodes",
            "--zero-stage", str(stage), "--recompute", "none",
            "--train-iters", str(iters), "--eval-iters", "0", "--log-interval", "1",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-iters", str(iters), "--seed", "5",
            "--data-path", corpus["prefix"], "--tokenizer-model", corpus["tokenizer"],
            "--data-cache-dir", str(cache), "--tensorboard-dir", str(tb_dir)]


# ---- prediction ------------------------------------------------------------------------------
def streams_per_link(tp: int, dp: int) -> dict[str, float]:
    """Streams that cross one host's link in one direction at once, per group kind: the group's
    ring cross-host fraction x its ranks x the groups running together / the hosts."""
    topo = Topology(tp * dp, tp, RANKS_PER_HOST, allow_tp_across_nodes=True)
    out = {}
    for kind, groups in (("tp", topo.tp_groups()), ("dp", topo.dp_groups())):
        crossing = sum(cross_host_fraction("all_reduce", "ring", nodes_of(g, RANKS_PER_HOST)) * len(g)
                       for g in groups if len(g) > 1)
        out[kind] = crossing / HOSTS
    return out


def component_rates(tp: int, vocab: int) -> dict[str, float]:
    """This model's component rates on one thread (benchmarks/calibrate_perf_model.py's probes)."""
    from benchmarks.calibrate_perf_model import (adam_bandwidth, attention_core_rate, elementwise_bandwidth,
                                                 layer_gemm_rate, layer_overhead)
    torch.set_num_threads(1)
    t, h, heads = MICRO_BATCH * MODEL["seq_length"], MODEL["hidden_size"], MODEL["num_attention_heads"]
    return {"gemm_flops": layer_gemm_rate(t, h, pad_vocab(vocab, tp, VOCAB_MULTIPLE), tp),
            "elementwise_Bps": elementwise_bandwidth(t, h, tp),
            "attention_flops": attention_core_rate(MICRO_BATCH, heads // tp, MODEL["seq_length"],
                                                   h // heads),
            "adam_Bps": adam_bandwidth(), "layer_overhead_s": layer_overhead()}


def predict(tp: int, dp: int, stage: int, vocab: int, link: dict, rates: dict,
            calibration: dict) -> dict:
    """Seconds per iteration from hybrid.perf.throughput for the shaped cluster. A TP group that
    crosses hosts runs its rings at the link over its streams; so do the DP groups (the model has
    one inter-node ring bandwidth: the layout's crossing group sets it)."""
    machine = calibration["machine"]
    streams = streams_per_link(tp, dp)
    crossing = streams["tp"] if streams["tp"] else streams["dp"]
    per_stream = link["one_stream_Bps"] if crossing <= 1 else link["two_streams_Bps_each"]
    cluster = Cluster(name="shaped netns hosts", gpus_per_node=RANKS_PER_HOST,
                      peak_flops=rates["gemm_flops"], memory_bytes=8e9,
                      hbm_bandwidth=rates["adam_Bps"],
                      intra_node_bandwidth=machine["gloo_allreduce_GBps"] * 1e9,
                      intra_node_efficiency=1.0,
                      ib_link_bandwidth=per_stream * RANKS_PER_HOST, ib_links_per_node=1,
                      collective_latency=machine["gloo_latency_us"] * 1e-6,
                      elementwise_bandwidth=rates["elementwise_Bps"],
                      attention_core_flops=rates["attention_flops"],
                      layer_overhead_s=rates["layer_overhead_s"])
    a = ThroughputAssumptions(max_efficiency=1.0, half_efficiency_tokens=0.0,
                              half_efficiency_hidden=0.0, activation_bytes=4, grad_bytes=4,
                              zero_dp_overlap=0.0, baseline_dp_overlap=0.0,
                              elementwise_in_efficiency=False)
    m = MODEL
    est = estimate_iteration(layers=m["num_layers"], hidden=m["hidden_size"], seq=m["seq_length"],
                             vocab=pad_vocab(vocab, tp, VOCAB_MULTIPLE), micro_batch=MICRO_BATCH,
                             tp=tp, dp=dp, stage=stage,
                             grad_accumulation=GLOBAL_BATCH // (MICRO_BATCH * dp),
                             recompute="none", cluster=cluster, assumptions=a)
    return {"predicted_s": est.time_s, "compute_s": est.compute_s + est.memory_s + est.overhead_s,
            "tp_comm_s": est.tp_comm_s, "dp_comm_s": est.dp_comm_s, "optimizer_s": est.optimizer_s,
            "streams_per_link": streams}


# ---- measurement -----------------------------------------------------------------------------
def measure(cluster, corpus: dict, work: Path, tp: int, stage: int, iters: int, job: str,
            global_batch: int = GLOBAL_BATCH, extra_args: list[str] = ()) -> dict:
    """Train the layout on the test bed; seconds per iteration and cross-host bytes per step.
    ``extra_args``: more trainer flags (benchmarks/zeropp_options.py's variants)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tests.reliability_helpers import child_env
    tb_dir = work / f"tb_{job}"
    args = train_args(corpus, work / "cache", tb_dir, tp, stage, iters, global_batch) + list(extra_args)
    codes = cluster.run_job(args, work, job, timeout=600, env=child_env(PYTHON=sys.executable))
    if codes != [0] * cluster.hosts:
        log = (work / f"{job}_host0.log").read_text()[-3000:]
        raise RuntimeError(f"layout TP {tp} stage {stage} failed with exit codes {codes}:\n{log}")
    (run_dir,) = [d for d in tb_dir.iterdir() if d.is_dir()]
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()

    def last(tag: str) -> float:
        return acc.Scalars(tag)[-1].value
    times = [e.value for e in acc.Scalars("iteration-time")][WARMUP:]
    return {"measured_s": statistics.median(times), "iteration_times_s": times,
            "tp_bytes": last("comm/tp-bytes-per-step"),
            "tp_cross_host_bytes": last("comm/tp-cross-host-bytes-per-step"),
            "dp_bytes": last("comm/dp-bytes-per-step"),
            "dp_cross_host_bytes": last("comm/dp-cross-host-bytes-per-step"),
            "final_loss": last("lm loss")}


def run(rates_mbit, iters: int, work: Path) -> dict:
    from tests.reliability_helpers import build_corpus, child_env
    from tools.netns_cluster import NetnsCluster
    corpus = build_corpus(work / "corpus")
    calibration = json.loads(CALIBRATION.read_text())
    rates = {tp: component_rates(tp, corpus["vocab"]) for _, tp, _, _ in LAYOUTS}
    rows = []
    for rate in rates_mbit:
        with NetnsCluster(HOSTS, RANKS_PER_HOST, rate_mbit=rate) as cluster:
            link_mbit = cluster.measure_mbit(0, 1, int(rate * 1e6 / 8))
            probe = cluster.torchrun("benchmarks/shaped_link_probe.py", work, f"probe{int(rate)}",
                                     env=child_env())
            link = json.loads([line for line in probe[0].splitlines() if line.startswith("{")][-1])
            for name, tp, dp, stage in LAYOUTS:
                job = f"r{int(rate)}_tp{tp}"
                measured = measure(cluster, corpus, work, tp, stage, iters, job)
                predicted = predict(tp, dp, stage, corpus["vocab"], link, rates[tp], calibration)
                error = predicted["predicted_s"] / measured["measured_s"] - 1
                rows.append({"layout": name, "tp": tp, "dp": dp, "stage": stage,
                             "rate_mbit": rate, "link_measured_mbit": link_mbit,
                             "gloo_link_Bps": link,
                             **measured, **predicted, "relative_error": error,
                             "within_tolerance": abs(error) <= TOLERANCE,
                             "tokens_per_s": GLOBAL_BATCH * MODEL["seq_length"] / measured["measured_s"]})
                print(_row_line(rows[-1]), flush=True)
    return {"model": MODEL, "micro_batch": MICRO_BATCH, "global_batch": GLOBAL_BATCH,
            "hosts": HOSTS, "ranks_per_host": RANKS_PER_HOST, "vocab": corpus["vocab"],
            "tolerance": TOLERANCE, "component_rates": rates, "runs": rows}


def _row_line(r: dict) -> str:
    return (f"{r['rate_mbit']:6.0f} Mbit/s ({r['link_measured_mbit']:5.1f}) {r['layout']:32s} "
            f"measured {r['measured_s']:7.3f} s/it ({r['tokens_per_s']:7.0f} tok/s)  predicted "
            f"{r['predicted_s']:7.3f} s/it  error {r['relative_error']:+6.1%}  cross-host "
            f"{(r['tp_cross_host_bytes'] + r['dp_cross_host_bytes']) / 1e6:6.2f} MB/rank/step")


def table(result: dict) -> str:
    lines = ["| link | layout | measured s/it | tokens/s | predicted s/it | error | cross-host MB per rank per step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        lines.append(f"| {r['rate_mbit']:.0f} Mbit/s | {r['layout']} | {r['measured_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['predicted_s']:.3f} | {r['relative_error']:+.1%} | "
                     f"{(r['tp_cross_host_bytes'] + r['dp_cross_host_bytes']) / 1e6:.2f} |")
    return "\n".join(lines)


def write_outputs(result: dict, out: Path) -> None:
    """figure2_mini.json, .md (table) and .png (tokens/s per bandwidth, measured and predicted)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    (out / "figure2_mini.json").write_text(json.dumps(result, indent=1))
    (out / "figure2_mini.md").write_text(
        f"# Figure 2 in miniature, measured on a shaped network\n\nGenerated by "
        f"`python -m benchmarks.figure2_mini` (see its docstring): GPT {result['model']}, global batch "
        f"{result['global_batch']}, micro-batch {result['micro_batch']}, fp32, {result['hosts']} hosts x "
        f"{result['ranks_per_host']} CPU ranks; error = predicted / measured - 1 (target "
        f"{result['tolerance']:.0%}).\n\n{table(result)}\n\n![tokens per second](figure2_mini.png)\n\n"
        f"{READING}\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["layout"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["layout"] == name]
        rates = [r["rate_mbit"] for r in runs]
        line, = ax.plot(rates, [r["tokens_per_s"] for r in runs], "o-", label=f"{name}, measured")
        ax.plot(rates, [GLOBAL_BATCH * MODEL["seq_length"] / r["predicted_s"] for r in runs], "x--",
                color=line.get_color(), label=f"{name}, predicted")
    ax.set_xlabel("inter-host link, Mbit/s")
    ax.set_ylabel("tokens per second")
    ax.set_title("Figure 2 in miniature: Megatron TP across hosts vs ZeRO")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "figure2_mini.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES_MBIT),
                        help="inter-host bandwidths in Mbit/s")
    parser.add_argument("--iters", type=int, default=6, help=f"iterations per run ({WARMUP} warm-up)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", type=Path, help="redraw the table and plot of a results JSON")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        write_outputs(result, args.out)
        print(table(result))
        return 0
    if args.iters <= WARMUP:
        print(f"error: --iters must be more than the {WARMUP} warm-up iterations", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.rates, args.iters, Path(tmp))
    result["wall_s"] = time.time() - started
    write_outputs(result, args.out)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
