"""Calibrate hybrid.perf's throughput model on this machine (ZeRO §10's model, CPU in place of V100).

1. measure the single-thread GEMM rate (fp32 and bf16) - the "peak" - and the rate at each run's own
   MLP GEMM shape - the sustained efficiency;
2. measure gloo all-reduce bandwidth and latency between 2 local ranks - the "NVSwitch" of a 2-rank
   node - and the memory bandwidth that bounds the optimizer step;
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
    ("DP2 stage 3", 1, 2, 3),
]
READING = """How to read it: the model charges only the GEMM FLOPs of Megatron's formula, at the rate
measured at the run's MLP GEMM shape, plus ring volumes at the measured gloo bandwidth and the Adam
step at memory bandwidth. The measured steps also run softmax, LayerNorm, GELU, the vocab-parallel
loss and Python/autograd dispatch, none of which are FLOPs in the formula; on a model this small
(h = 256) they are a visible share, larger under TP (each rank halves its GEMMs but not its
replicated LayerNorms, residuals and embedding work), so measured/predicted > 1 is expected and its
spread across layouts is the model's error. On a V100 these costs are what `max_efficiency` and the
half-efficiency sizes of `ThroughputAssumptions` stand for. Wall times are many times the CPU times
because the cores are shared with every other process on the machine (see the load average)."""
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


def memory_bandwidth(numel: int = 8_000_000, repeats: int = 5) -> float:
    """Bytes/s of a streaming a += b on fp32 (reads 2, writes 1)."""
    a, b = torch.zeros(numel), torch.ones(numel)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        a.add_(b)
        times.append(time.thread_time() - t0)
    return 3 * 4 * numel / max(statistics.median(times), 1e-9)


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
    h = config.hidden_size
    cpu, wall, rate = _time_steps(model, optimizer, tokens, steps, (MICRO_BATCH * config.seq_length,
                                                                     h, 4 * h // tp))
    return cpu, wall, engine, rate


def _time_steps(model, optimizer, tokens, steps, gemm_shape):
    """Median process-CPU and wall seconds per training step after 2 warm-ups, and the median rate of
    the run's MLP GEMM timed between steps (so it sees the same load as the steps)."""
    cpu, wall, rates = [], [], []
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
        rates.append(gemm_rate(*gemm_shape, torch.float32, repeats=5))
    return (statistics.median(cpu[2:]), statistics.median(wall[2:]), statistics.median(rates[2:]))


def _optimizer(model, state, config, stage):
    """The ZeRO engine of ``stage``, or the fallback (torch AdamW, DP by hybrid.comm all-reduce)."""
    try:
        from hybrid.zero import AdamWConfig, ZeroConfig
        from hybrid.zero.optimizer import build_zero_optimizer
    except ImportError:
        from hybrid.training.fallback_optimizer import ReplicatedAdamW
        return ReplicatedAdamW(model, state, lr=1e-4), "fallback torch AdamW + hybrid.comm all-reduce"
    zcfg, acfg = ZeroConfig(stage=stage, precision="fp32"), AdamWConfig(lr=1e-4)
    if stage == 3:
        from hybrid.zero.stage3 import Stage3Optimizer
        from models.gpt.sharding import canonical_init, shard_tensor

        def init_fn(name):
            return shard_tensor(config, name, canonical_init(config, name, 1), state.tp_rank,
                                state.tp_size)
        return Stage3Optimizer(model, state, zcfg, acfg, init_fn=init_fn), "hybrid.zero stage 3"
    return build_zero_optimizer(model, state, zcfg, acfg), f"hybrid.zero stage {stage}"


def _available(layouts):
    """Stage 3 only when its engine exists in this checkout."""
    import importlib.util
    has_stage3 = importlib.util.find_spec("hybrid.zero.stage3") is not None
    return [lay for lay in layouts if lay[3] < 3 or has_stage3]


# ---- prediction ------------------------------------------------------------------------------
def cpu_cluster(peak: float, allreduce_bw: float, latency: float, mem_bw: float) -> Cluster:
    """This machine as a 2-rank "node": GEMM peak, gloo ring bandwidth (no duplex factor)."""
    return Cluster(name="this CPU (1 thread per rank)", gpus_per_node=2, peak_flops=peak,
                   memory_bytes=8e9, hbm_bandwidth=mem_bw, intra_node_bandwidth=allreduce_bw,
                   intra_node_efficiency=1.0, collective_latency=latency)


def predict(tp: int, dp: int, stage: int, cluster: Cluster, shape_rate: float):
    """Step time the throughput model predicts: efficiency = GEMM rate at the run's shape / peak,
    fp32 on the wire, no overlap (one core per rank does both compute and gloo)."""
    cluster = cluster.with_changes(peak_flops=max(cluster.peak_flops, shape_rate))
    a = ThroughputAssumptions(max_efficiency=shape_rate / cluster.peak_flops,
                              half_efficiency_tokens=0.0, half_efficiency_hidden=0.0,
                              activation_bytes=4, grad_bytes=4, zero_dp_overlap=0.0,
                              baseline_dp_overlap=0.0, optimizer_bytes_per_param=28.0)
    m = MODEL
    return estimate_iteration(layers=m["num_layers"], hidden=m["hidden_size"], seq=m["seq_length"],
                              vocab=m["vocab_size"], micro_batch=MICRO_BATCH, tp=tp, dp=dp,
                              stage=stage, recompute="none", cluster=cluster, assumptions=a)


def main(argv: list[str] | None = None) -> int:
    from tests.multirank import run_on_ranks
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    peak32, peak16 = gemm_rate(1024, 1024, 1024, torch.float32), gemm_rate(1024, 1024, 1024, torch.bfloat16)
    mem_bw = memory_bandwidth()
    bw, bw_wall, lat = run_on_ranks(_allreduce_probe, 2, args=(4_000_000, 5))[0]
    cluster = cpu_cluster(peak32, bw, lat, mem_bw)
    rows = []
    for name, tp, dp, stage in _available(LAYOUTS):
        measured, wall, engine, shape_rate = run_on_ranks(_step_probe, 2, args=(tp, stage, args.steps),
                                                          timeout=600)[0]
        est = predict(tp, dp, stage, cluster, shape_rate)
        predicted = est.time_s
        flops = model_flops_per_iteration(MICRO_BATCH * dp, MODEL["seq_length"], MODEL["num_layers"],
                                          MODEL["hidden_size"], MODEL["vocab_size"])
        rows.append({"layout": name, "tp": tp, "dp": dp, "stage": stage, "engine": engine,
                     "predicted_s": predicted, "measured_s": measured, "wall_s": wall,
                     "ratio": measured / predicted,
                     "gemm_gflops_at_shape": shape_rate / 1e9, "compute_s": est.compute_s,
                     "tp_comm_s": est.tp_comm_s, "dp_comm_s": est.dp_comm_s,
                     "optimizer_s": est.optimizer_s, "gflops_per_rank": flops / 2 / measured / 1e9})
        print(f"{name:12s} predicted {predicted * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
              f"measured/predicted {measured / predicted:5.2f}  wall {wall * 1e3:8.1f} ms  [{engine}]",
              flush=True)
    machine = {"gemm_fp32_gflops": peak32 / 1e9, "gemm_bf16_gflops": peak16 / 1e9,
               "gloo_allreduce_GBps": bw / 1e9, "gloo_allreduce_wall_GBps": bw_wall / 1e9,
               "load_average": os.getloadavg()[0], "gloo_latency_us": lat * 1e6,
               "memory_GBps": mem_bw / 1e9, "model": MODEL, "micro_batch": MICRO_BATCH}
    _write(args.out, machine, rows)
    return 0


def _write(out: Path, machine: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps({"machine": machine, "runs": rows}, indent=1) + "\n")
    lines = ["# Throughput model calibrated on this CPU", "",
             f"GEMM 1024^3 one thread: fp32 {machine['gemm_fp32_gflops']:.1f} GFLOP/s, bf16 "
             f"{machine['gemm_bf16_gflops']:.1f} GFLOP/s; gloo all-reduce (2 ranks, 16 MB) "
             f"{machine['gloo_allreduce_GBps']:.2f} GB/s ring bandwidth, latency "
             f"{machine['gloo_latency_us']:.0f} us; memory {machine['memory_GBps']:.1f} GB/s "
             f"(all in CPU time; gloo in wall time {machine['gloo_allreduce_wall_GBps']:.2f} GB/s). "
             f"Load average during the run: {machine['load_average']:.1f} on this shared machine.",
             f"Model {machine['model']}, micro-batch {machine['micro_batch']}, fp32, no recompute.", "",
             "| layout | TP | DP | stage | optimizer | GEMM GFLOP/s at shape | predicted ms "
             "(compute + TP + DP + optimizer) | measured CPU ms | measured/predicted | wall ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['layout']} | {r['tp']} | {r['dp']} | {r['stage']} | {r['engine']} | "
              f"{r['gemm_gflops_at_shape']:.1f} | {r['predicted_s'] * 1e3:.0f} ({r['compute_s'] * 1e3:.0f}"
              f" + {r['tp_comm_s'] * 1e3:.0f} + {r['dp_comm_s'] * 1e3:.0f} + "
              f"{r['optimizer_s'] * 1e3:.0f}) | {r['measured_s'] * 1e3:.0f} | {r['ratio']:.2f} | "
              f"{r['wall_s'] * 1e3:.0f} |"
              for r in rows]
    (out / "calibration.md").write_text("\n".join(lines) + "\n\n" + READING + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
