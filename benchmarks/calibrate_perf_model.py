"""Calibrate hybrid.perf's throughput model on this machine (ZeRO §10's model, CPU in place of V100).

1. measure, on one thread in CPU time, each rate the model needs: the GEMM peak (1024^3, fp32 and
   bf16) and, between each run's steps, the FLOP-weighted rate of that run's own GEMM shapes, the
   causal attention core's rate (SDPA forward + backward) and the elementwise bandwidth (LayerNorm,
   add, GELU) at its sizes; once, the framework's AdamW rate and an empty layer's host overhead;
2. measure gloo all-reduce bandwidth and small-message latency between 2 local ranks;
3. plug them into :class:`hybrid.perf.hardware.Cluster` / :class:`ThroughputAssumptions` and predict
   the step time of small fp32 GPT runs at several layouts and ZeRO stages;
4. measure those steps with the real GPT model and the ZeRO optimizer (hybrid.zero) - or, when the
   ZeRO engine is not importable, torch AdamW with DP by hybrid.comm all-reduce (say so in the output).

    python -m benchmarks.calibrate_perf_model [--steps 4] [--out docs/paper]

Writes calibration.json and calibration.md. One thread per rank. The machine's cores are shared, so
rates and step times are measured in CPU time (thread time for GEMMs, process time - gloo's threads
included - for all-reduces and steps): what the run costs, not how long it waited for a core. Wall
times are reported beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.hardware import Cluster
from hybrid.perf.throughput import ThroughputAssumptions, estimate_iteration

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=2048, seq_length=128)
MICRO_BATCH = 4
LAYOUTS = [  # (name, tp, dp, stage)
    ("TP2", 2, 1, 0), ("DP2 stage 0", 1, 2, 0), ("DP2 stage 1", 1, 2, 1), ("DP2 stage 2", 1, 2, 2),
    ("DP2 stage 3", 1, 2, 3), ("TP2 DP2 stage 1", 2, 2, 1),
]
TOLERANCE = 0.25   # issue 4 item 5: predicted within 25% of measured ...
MIN_WITHIN = 4     # ... for at least four layouts / stages
READING = """How to read it: the V100 model (hybrid.perf.throughput) with this machine's numbers, every
term a measured rate, none fitted to the step times: GEMM FLOPs of Megatron's formula (attention core
excluded) at the FLOP-weighted rate of the run's own GEMM shapes (forward, input and weight
gradients); the attention core (12 b s^2 h / t) at the measured SDPA forward + backward rate; the
memory-bound passes counted from models/gpt/layer.py (ThroughputAssumptions.elementwise_passes_*,
x 3 for the backward, 6 passes over the logits) at the elementwise bandwidth measured on LayerNorm,
add and GELU at the run's sizes; one empty-layer forward + backward of host overhead per layer; TP
and DP ring volumes at the gloo bandwidth plus one small-message latency per collective call; the
AdamW step at 28 B/parameter over the measured rate of hybrid.zero's own AdamW. "Within 25%" means
|predicted - measured| <= 25% of measured. What the model still leaves out - and why
measured/predicted stays above 1: host work outside the layers (embedding, loss, the ZeRO engine's
bucket copies and hooks, zero_grad), the component micro-benchmarks running with warm caches in a
tight loop, and gloo's CPU time while a rank waits for its peer inside a collective (process time
counts it; on this loaded machine a descheduled peer makes the wait long). The ratio moves by
~0.1 between reruns under this load, so a layout at 1.2-1.25 can cross the 25% line. On the V100 the memory-bound and overhead
terms stay folded into max_efficiency (elementwise_in_efficiency=True, layer_overhead_s=0), so the
paper predictions are unchanged. Wall times are several times the CPU times because the cores are
shared with every other process on the machine (see the load average)."""
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "paper"


# ---- micro-measurements (main process, one thread) -------------------------------------------
def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 7) -> float:
    """FLOP/s of a [m, k] @ [k, n] matmul on one thread, timed in thread CPU time (median), so other
    processes competing for the cores do not count."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        torch.mm(a, b)
        times.append(time.thread_time() - t0)
    return 2 * m * k * n / max(statistics.median(times), 1e-9)


def layer_gemm_rate(tokens: int, hidden: int, vocab: int, tp: int, repeats: int = 3) -> float:
    """FLOP/s over the run's own GEMM shapes on one TP rank, FLOP-weighted: QKV, projection, MLP in
    and out and the output layer, each as forward [m, k] @ [k, n], input gradient [m, n] @ [n, k]
    and weight gradient [k, m] @ [m, n] (thread CPU time, median)."""
    h, t = hidden, tokens
    layer = [(t, h, 3 * h // tp), (t, h // tp, h), (t, h, 4 * h // tp), (t, 4 * h // tp, h),
             (t, h, vocab // tp)]
    shapes = [s for m, k, n in layer for s in ((m, k, n), (m, n, k), (k, m, n))]
    pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes]
    ops = [lambda a=a, b=b: torch.mm(a, b) for a, b in pairs]
    return _median_rate(ops, sum(2.0 * m * k * n for m, k, n in shapes), repeats)


def memory_bandwidth(numel: int = 8_000_000, repeats: int = 5) -> float:
    """Bytes/s of a streaming a += b on fp32 (reads 2, writes 1)."""
    a, b = torch.zeros(numel), torch.ones(numel)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        a.add_(b)
        times.append(time.thread_time() - t0)
    return 3 * 4 * numel / max(statistics.median(times), 1e-9)


def elementwise_bandwidth(tokens: int, hidden: int, tp: int, repeats: int = 7) -> float:
    """Bytes/s of the layer's memory-bound ops at the run's own sizes (one thread, thread CPU time,
    dispatch included): LayerNorm and a residual add on [tokens, h], GELU on [tokens, 4h/tp], counted
    as read + write passes the way ThroughputAssumptions counts them (2, 3 and 2 x 4/tp)."""
    import torch.nn.functional as F
    x, y = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    w, b, u = torch.ones(hidden), torch.zeros(hidden), torch.randn(tokens, 4 * hidden // tp)
    ops = [lambda: F.layer_norm(x, (hidden,), w, b), lambda: x + y, lambda: F.gelu(u)]
    elements = (2 + 3) * tokens * hidden + 2 * u.numel()
    return _median_rate(ops, elements * 4, repeats)


def attention_core_rate(micro_batch: int, heads: int, seq: int, head_dim: int, repeats: int = 5) -> float:
    """FLOP/s of the causal attention core (torch SDPA, forward + backward) at the run's per-rank
    shape [b, a/tp, s, d], counted as Megatron's formula does: 12 b s^2 (a/tp) d."""
    import torch.nn.functional as F
    q, k, v = (torch.randn(micro_batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    grad = torch.randn(micro_batch, heads, seq, head_dim)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    return _median_rate([step], 12.0 * micro_batch * seq * seq * heads * head_dim, repeats)


def adam_bandwidth(numel: int = 2_000_000, repeats: int = 5) -> float:
    """Bytes/s of the framework's own AdamW step (hybrid.zero.adamw) on one flat fp32 shard of
    ``numel`` parameters, counted at ThroughputAssumptions' 28 bytes per parameter - what the
    optimizer term divides by. Falls back to torch AdamW when the ZeRO package is absent."""
    p, g = torch.zeros(numel), torch.full((numel,), 1e-3)
    m, v = torch.zeros(numel), torch.zeros(numel)
    try:
        from hybrid.adamw_config import AdamWConfig
        from hybrid.zero.adamw import adamw_step
        config, counter = AdamWConfig(lr=1e-4), [0]

        def step():
            counter[0] += 1
            adamw_step([p], [g], [m], [v], [p], step=counter[0], config=config)
    except ImportError:
        p.grad = g
        opt = torch.optim.AdamW([p], lr=1e-4)
        step = opt.step
    return _median_rate([step], 28.0 * numel, repeats)


def layer_overhead(repeats: int = 7) -> float:
    """Seconds of host work per transformer layer forward + backward: the framework's own layer
    (models/gpt/layer.py) on a tiny input (1 token, h = 8), where arithmetic is negligible and what
    remains is Python, module and autograd dispatch."""
    from hybrid.parallel_state import ParallelState
    from models.gpt.config import GPTConfig
    from models.gpt.layer import TransformerLayer
    config = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=16,
                       seq_length=1, hidden_dropout=0.0, attention_dropout=0.0)
    layer = TransformerLayer(config, ParallelState.single_process().tp)
    x = torch.randn(1, 1, 8, requires_grad=True)

    def step():
        layer(x).sum().backward()
    return 1.0 / _median_rate([step], 1.0, repeats)


def _median_rate(ops, work: float, repeats: int) -> float:
    """work / median thread-CPU seconds of one pass through ``ops`` (after one warm-up)."""
    for op in ops:
        op()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for op in ops:
            op()
        times.append(time.thread_time() - t0)
    return work / max(statistics.median(times), 1e-9)


# ---- multi-rank measurements -----------------------------------------------------------------
def _allreduce_probe(rank, world_size, numel, repeats):
    """Ring bandwidth and small-message latency of gloo, in process CPU time (gloo's threads
    included) and in wall time."""
    import torch.distributed as dist
    x, small = torch.ones(numel), torch.ones(1)
    dist.barrier()
    cpu, wall, lat = [], [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        dist.all_reduce(x)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        c0 = time.process_time()
        dist.all_reduce(small)
        lat.append(time.process_time() - c0)
    ring_bytes = 2 * (world_size - 1) / world_size * numel * 4
    return (ring_bytes / max(statistics.median(cpu), 1e-9), ring_bytes / statistics.median(wall),
            statistics.median(lat))


def _step_probe(rank, world_size, tp, stage, steps):
    from hybrid.parallel_state import ParallelState
    from hybrid.tensor_parallel import RNGTracker
    from hybrid.topology import Topology
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    config = GPTConfig(**MODEL, hidden_dropout=0.0, attention_dropout=0.0)
    rng = RNGTracker(1, state.tp_rank, state.device)
    meta = stage == 3
    model = GPTModel(config, state, device="meta" if meta else "cpu", rng=rng)
    if not meta:
        model.init_weights(1)
    optimizer, engine = _optimizer(model, state, config, stage)
    gen = torch.Generator().manual_seed(100 + state.dp_rank)
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, config.seq_length + 1), generator=gen)
    probes = _rate_probes(config, tp)
    cpu, wall, rates = _time_steps(model, optimizer, tokens, steps, probes)
    return cpu, wall, engine, rates


def _rate_probes(config, tp):
    """The component rates at this run's own per-rank shapes, measured between steps."""
    t, h = MICRO_BATCH * config.seq_length, config.hidden_size
    heads = config.num_attention_heads // tp
    return {"gemm_flops": lambda: layer_gemm_rate(t, h, config.vocab_size, tp),
            "elementwise_Bps": lambda: elementwise_bandwidth(t, h, tp, repeats=3),
            "attention_flops": lambda: attention_core_rate(MICRO_BATCH, heads, config.seq_length,
                                                           h // config.num_attention_heads, repeats=3)}


def _time_steps(model, optimizer, tokens, steps, probes):
    """Median process-CPU and wall seconds per training step after 2 warm-ups, and the median of
    each component rate, timed between steps (so they see the same load as the steps)."""
    cpu, wall, rates = [], [], {k: [] for k in probes}
    for _ in range(steps + 2):
        torch.distributed.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        cpu.append(time.process_time() - c0)
        torch.distributed.barrier()
        wall.append(time.perf_counter() - w0)
        for key, probe in probes.items():
            rates[key].append(probe())
    return (statistics.median(cpu[2:]), statistics.median(wall[2:]),
            {k: statistics.median(v[2:]) for k, v in rates.items()})


def _optimizer(model, state, config, stage):
    """The ZeRO engine of ``stage``, or the fallback (torch AdamW, DP by hybrid.comm all-reduce)."""
    try:
        from hybrid.zero import AdamWConfig, ZeroConfig
        from hybrid.zero.factory import build_zero_optimizer
    except ImportError:
        from pretrain.fallback_optimizer import ReplicatedAdamW
        return ReplicatedAdamW(model, state, lr=1e-4), "fallback torch AdamW + hybrid.comm all-reduce"
    zcfg, acfg = ZeroConfig(stage=stage, precision="fp32"), AdamWConfig(lr=1e-4)
    if stage == 3:
        from hybrid.zero.stage3 import ParameterPartitioning
        from models.gpt.sharding import canonical_init, shard_tensor

        def init_fn(name):
            return shard_tensor(config, name, canonical_init(config, name, 1), state.tp_rank,
                                state.tp_size)
        return ParameterPartitioning(model, state, zcfg, acfg, init_fn=init_fn), "hybrid.zero stage 3"
    return build_zero_optimizer(model, state, zcfg, acfg), f"hybrid.zero stage {stage}"


def _available(layouts):
    """Stage 3 only when its engine exists in this checkout."""
    import importlib.util
    has_stage3 = importlib.util.find_spec("hybrid.zero.stage3") is not None
    return [lay for lay in layouts if lay[3] < 3 or has_stage3]


# ---- prediction ------------------------------------------------------------------------------
def cpu_cluster(peak: float, allreduce_bw: float, latency: float, adam_bw: float,
                layer_overhead_s: float = 0.0) -> Cluster:
    """This machine as one 4-rank "node": GEMM peak, gloo ring bandwidth (no duplex factor) and
    small-message latency, the measured AdamW rate (optimizer term), host overhead per layer."""
    return Cluster(name="this CPU (1 thread per rank)", gpus_per_node=4, peak_flops=peak,
                   memory_bytes=8e9, hbm_bandwidth=adam_bw, intra_node_bandwidth=allreduce_bw,
                   intra_node_efficiency=1.0, collective_latency=latency,
                   layer_overhead_s=layer_overhead_s)


def predict(tp: int, dp: int, stage: int, cluster: Cluster, rates: dict):
    """Step time the throughput model predicts from the run's measured component rates: GEMMs at
    ``rates["gemm_flops"]`` (efficiency = it / peak, no saturation curve), the attention core at
    ``rates["attention_flops"]``, memory-bound ops at ``rates["elementwise_Bps"]`` (not folded into
    the efficiency: a pure GEMM rate has none of them), fp32 on the wire, no overlap (one core per
    rank does both compute and gloo)."""
    gemm = rates["gemm_flops"]
    cluster = cluster.with_changes(peak_flops=max(cluster.peak_flops, gemm),
                                   attention_core_flops=rates["attention_flops"],
                                   elementwise_bandwidth=rates["elementwise_Bps"])
    a = ThroughputAssumptions(max_efficiency=gemm / cluster.peak_flops,
                              half_efficiency_tokens=0.0, half_efficiency_hidden=0.0,
                              activation_bytes=4, grad_bytes=4, zero_dp_overlap=0.0,
                              baseline_dp_overlap=0.0, optimizer_bytes_per_param=28.0,
                              elementwise_in_efficiency=False)
    m = MODEL
    return estimate_iteration(layers=m["num_layers"], hidden=m["hidden_size"], seq=m["seq_length"],
                              vocab=m["vocab_size"], micro_batch=MICRO_BATCH, tp=tp, dp=dp,
                              stage=stage, recompute="none", cluster=cluster, assumptions=a)


def calibration_status(result: dict) -> dict:
    """How many stored runs have |predicted - measured| <= tolerance x measured (pure: reads the
    calibration.json contents, measures nothing)."""
    tol = result["machine"].get("tolerance", TOLERANCE)
    within = [r["layout"] for r in result["runs"]
              if abs(r["predicted_s"] - r["measured_s"]) <= tol * r["measured_s"]]
    return {"within": len(within), "total": len(result["runs"]), "layouts_within": within,
            "passed": len(within) >= MIN_WITHIN}


def main(argv: list[str] | None = None) -> int:
    from hybrid.testing.multirank import run_on_ranks
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    peak32, peak16 = gemm_rate(1024, 1024, 1024, torch.float32), gemm_rate(1024, 1024, 1024, torch.bfloat16)
    mem_bw, adam_bw, overhead = memory_bandwidth(), adam_bandwidth(), layer_overhead()
    bw, bw_wall, lat = run_on_ranks(_allreduce_probe, 2, args=(4_000_000, 5))[0]
    cluster = cpu_cluster(peak32, bw, lat, adam_bw, overhead)
    rows = []
    for name, tp, dp, stage in _available(LAYOUTS):
        measured, wall, engine, rates = run_on_ranks(_step_probe, tp * dp, args=(tp, stage, args.steps),
                                                     timeout=900)[0]
        est = predict(tp, dp, stage, cluster, rates)
        predicted = est.time_s
        flops = model_flops_per_iteration(MICRO_BATCH * dp, MODEL["seq_length"], MODEL["num_layers"],
                                          MODEL["hidden_size"], MODEL["vocab_size"])
        rows.append({"layout": name, "tp": tp, "dp": dp, "stage": stage, "engine": engine,
                     "predicted_s": predicted, "measured_s": measured, "wall_s": wall,
                     "ratio": measured / predicted, "gemm_gflops_at_shape": rates["gemm_flops"] / 1e9,
                     "attention_gflops": rates["attention_flops"] / 1e9,
                     "elementwise_GBps": rates["elementwise_Bps"] / 1e9, "compute_s": est.compute_s,
                     "memory_s": est.memory_s, "overhead_s": est.overhead_s,
                     "tp_comm_s": est.tp_comm_s, "dp_comm_s": est.dp_comm_s,
                     "optimizer_s": est.optimizer_s, "gflops_per_rank": flops / 2 / measured / 1e9})
        print(f"{name:12s} predicted {predicted * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
              f"measured/predicted {measured / predicted:5.2f}  wall {wall * 1e3:8.1f} ms  [{engine}]",
              flush=True)
    machine = {"gemm_fp32_gflops": peak32 / 1e9, "gemm_bf16_gflops": peak16 / 1e9,
               "gloo_allreduce_GBps": bw / 1e9, "gloo_allreduce_wall_GBps": bw_wall / 1e9,
               "load_average": os.getloadavg()[0], "gloo_latency_us": lat * 1e6,
               "memory_GBps": mem_bw / 1e9, "adam_GBps": adam_bw / 1e9,
               "layer_overhead_ms": overhead * 1e3,
               "model": MODEL, "micro_batch": MICRO_BATCH, "tolerance": TOLERANCE}
    _write(args.out, machine, rows)
    return 0


def _write(out: Path, machine: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps({"machine": machine, "runs": rows}, indent=1) + "\n")
    status = calibration_status({"machine": machine, "runs": rows})
    lines = ["# Throughput model calibrated on this CPU", "",
             f"GEMM 1024^3 one thread: fp32 {machine['gemm_fp32_gflops']:.1f} GFLOP/s, bf16 "
             f"{machine['gemm_bf16_gflops']:.1f} GFLOP/s; gloo all-reduce (2 ranks, 16 MB) "
             f"{machine['gloo_allreduce_GBps']:.2f} GB/s ring bandwidth, small-message latency "
             f"{machine['gloo_latency_us']:.0f} us; streaming memory {machine['memory_GBps']:.1f} GB/s, "
             f"AdamW step {machine['adam_GBps']:.1f} GB/s at 28 B/parameter; "
             f"empty-layer forward + backward {machine['layer_overhead_ms']:.2f} ms "
             f"(all in CPU time; gloo in wall time {machine['gloo_allreduce_wall_GBps']:.2f} GB/s). "
             f"Load average during the run: {machine['load_average']:.1f} on this shared machine.",
             f"Model {machine['model']}, micro-batch {machine['micro_batch']} per replica, fp32, no "
             f"recompute. Per-run rates measured between that run's steps at its own per-rank shapes.",
             "", f"**Status: {status['within']} of {status['total']} layouts predicted within "
             f"{machine['tolerance']:.0%} of measured ({'PASS' if status['passed'] else 'FAIL'}: "
             f"needs {MIN_WITHIN}).**", "",
             "| layout | TP | DP | stage | optimizer | GEMM / attention GFLOP/s, elementwise GB/s "
             "| predicted ms (GEMM+attn + mem-bound + overhead + TP + DP + optimizer) "
             "| measured CPU ms | measured/predicted | wall ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['layout']} | {r['tp']} | {r['dp']} | {r['stage']} | {r['engine']} | "
              f"{r['gemm_gflops_at_shape']:.0f} / {r['attention_gflops']:.0f}, "
              f"{r['elementwise_GBps']:.1f} | {r['predicted_s'] * 1e3:.0f} ({r['compute_s'] * 1e3:.0f}"
              f" + {r['memory_s'] * 1e3:.0f} + {r['overhead_s'] * 1e3:.0f} + {r['tp_comm_s'] * 1e3:.0f}"
              f" + {r['dp_comm_s'] * 1e3:.0f} + {r['optimizer_s'] * 1e3:.0f}) | "
              f"{r['measured_s'] * 1e3:.0f} | {r['ratio']:.2f} | {r['wall_s'] * 1e3:.0f} |"
              for r in rows]
    (out / "calibration.md").write_text("\n".join(lines) + "\n\n" + READING + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
