"""Issue 8 benchmark: optimizer offload (ZeRO-Offload / ZeRO-Infinity) step-time overhead, and the
CPU Adam against torch.optim.AdamW on the same flat sizes.

Part 1, CPU Adam: one AdamW step over a flat fp32 partition of N elements (N = 1M and 8M), per
implementation: hybrid.offload.CPUAdamW ``fused`` (torch's single-pass kernel, blocked), the same
with the updated values also written as bf16 in the same pass (what offload sends back to the
device), ``exact`` (the engine's foreach sequence, blocked), torch.optim.AdamW(foreach=True) and
torch.optim.AdamW(fused=True) on one parameter of N elements. Median thread CPU seconds of
``--reps`` steps, the implementations interleaved round-robin (wall time on a machine shared by many
jobs mostly measures the others). Our state is laid out as HostOptimizerState holds it (master
alone, both moments in one allocation).

Part 2, step time: a GPT (12 layers, hidden 256, 8 heads, seq 128, vocab 4096, micro-batch 2, fp32,
~11M parameters) on one rank, ZeRO stage 0, forward + backward + optimizer step, with
``--offload-optimizer none | cpu | nvme`` (nvme under a 2 GiB budget, files in a temporary dir).
The three runs advance round-robin so they share the machine's load; median wall and process CPU
seconds (the NVMe I/O thread included) of ``--steps`` steps after one warm-up; overhead vs ``none``. Losses of
the three runs are printed too (equal to ~1e-6: offload changes where the state lives, not the math).

DeepSpeed (``--deepspeed``): DeepSpeedCPUAdam on the same flat sizes, run in a private venv
(benchmarks/.venv-deepspeed, the pattern of benchmarks/peer_env.py; never a project dependency); its
C++ op is JIT-compiled, so each stage gets ``--deepspeed-timeout`` seconds and the table says when it
did not build in time.

Run:  python benchmarks/offload.py [--reps 9] [--steps 5] [--deepspeed]
Prints markdown tables and writes benchmarks/results/offload.json. One thread (torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybrid.offload import CPUAdamW, OffloadConfig   # noqa: E402
from hybrid.zero.config import AdamWConfig            # noqa: E402

SIZES = (1 << 20, 1 << 23)
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 12, 256, 8, 128, 4096, 2
ADAMW = AdamWConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _interleaved_medians(fns: dict, reps: int) -> dict:
    """Median thread CPU seconds per call of each function, calls interleaved round-robin so every
    implementation sees the same machine load (wall time on a shared machine mostly measures the
    other jobs)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()   # warm-up: allocations, first touch of the moments
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _ours(kernel: str, master0, grad0, with_out: bool):
    """A CPUAdamW step over state laid out as HostOptimizerState holds it: master alone, both
    moments in one allocation."""
    n = master0.numel()
    adam, step, moments = CPUAdamW(ADAMW, kernel=kernel), [0], torch.zeros(2 * n)
    state = [master0.clone(), grad0.clone(), moments[:n], moments[n:]]
    out = torch.empty(n, dtype=torch.bfloat16) if with_out else None

    def run():
        step[0] += 1
        adam.step_(*state, [(0, n)], step=step[0], lr=ADAMW.lr, out=out)
    return run


def _torch(kind: str, master0, grad0):
    p = torch.nn.Parameter(master0.clone())
    p.grad = grad0.clone()
    return torch.optim.AdamW([p], lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                             weight_decay=ADAMW.weight_decay, **{kind: True}).step


def adam_rows(reps: int) -> list[dict]:
    rows = []
    for n in SIZES:
        g = torch.Generator().manual_seed(0)
        grad0, master0 = torch.randn(n, generator=g) * 1e-3, torch.randn(n, generator=g) * 0.02
        fns = {"hybrid CPUAdamW fused": _ours("fused", master0, grad0, False),
               "hybrid CPUAdamW fused + bf16 out": _ours("fused", master0, grad0, True),
               "hybrid CPUAdamW exact": _ours("exact", master0, grad0, False),
               "torch.optim.AdamW foreach": _torch("foreach", master0, grad0),
               "torch.optim.AdamW fused": _torch("fused", master0, grad0)}
        for name, seconds in _interleaved_medians(fns, reps).items():
            rows.append(dict(impl=name, numel=n, seconds=seconds))
    return rows


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _build(mode: str, tmp: str):
    from hybrid.parallel_state import ParallelState
    from hybrid.zero import ZeroConfig, build_zero_optimizer
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel

    config = GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ,
                       hidden_dropout=0.0, attention_dropout=0.0)
    state = ParallelState.single_process()
    model = GPTModel(config, state, device="meta")
    model.init_weights(1)
    offload = OffloadConfig(mode, tmp, "2GiB" if mode == "nvme" else None)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=0, bucket_size=4_000_000), ADAMW,
                               offload=offload)
    return model, opt


def step_rows(steps: int) -> list[dict]:
    """The three runs advance round-robin (none, cpu, nvme, none, ...) so each sees the same
    machine load; step 0 is a warm-up."""
    modes = ("none", "cpu", "nvme")
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as tmp:
        runs = {m: _build(m, tmp) for m in modes}
        g = torch.Generator().manual_seed(2)
        batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(steps + 1)]
        stats = {m: dict(wall=[], cpu=[], losses=[]) for m in modes}
        for i, tokens in enumerate(batches):
            for mode, (model, opt) in runs.items():
                t0, c0 = time.perf_counter(), _cpu_seconds()
                opt.zero_grad()
                loss = model(tokens, torch.roll(tokens, -1, 1)).mean()
                opt.backward(loss)
                opt.step()
                if i:
                    stats[mode]["wall"].append(time.perf_counter() - t0)
                    stats[mode]["cpu"].append(_cpu_seconds() - c0)
                stats[mode]["losses"].append(round(loss.item(), 5))
        rows = []
        for mode, (model, opt) in runs.items():
            st = stats[mode]
            rows.append(dict(mode=mode, psi=opt.num_local_params, wall=statistics.median(st["wall"]),
                             cpu=statistics.median(st["cpu"]), losses=st["losses"],
                             resident_model_states=opt.memory_report().measured_model_states))
            if mode != "none":
                opt.adam.close()
    for r in rows:
        r["overhead_wall"] = r["wall"] / rows[0]["wall"] - 1
        r["overhead_cpu"] = r["cpu"] / rows[0]["cpu"] - 1
    return rows


DS_SNIPPET = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from deepspeed.ops.adam import DeepSpeedCPUAdam
rows = []
for n in %r:
    p = torch.nn.Parameter(torch.randn(n) * 0.02); p.grad = torch.randn(n) * 1e-3
    opt = DeepSpeedCPUAdam([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                           adamw_mode=True)
    opt.step(); ts = []
    for _ in range(%d):
        t0 = time.perf_counter(); opt.step(); ts.append(time.perf_counter() - t0)
    rows.append(dict(impl="DeepSpeedCPUAdam", numel=n, seconds=statistics.median(ts)))
print(json.dumps(rows))
"""


def deepspeed_rows(reps: int, timeout: float) -> tuple[list[dict], str]:
    """DeepSpeedCPUAdam in the private venv, or ([], reason) when it cannot run in time."""
    venv = ROOT / "benchmarks" / ".venv-deepspeed"   # shared with benchmarks/zero_vs_peers.py
    python = venv / "bin" / "python"
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                           check=True, timeout=timeout)
        if subprocess.run([str(python), "-c", "import deepspeed"], env=env,
                          capture_output=True).returncode != 0:
            # sdist only: --no-build-isolation builds against the installed CPU torch (an
            # isolated build would download a CUDA torch); ops are JIT-compiled on first use
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation",
                            "deepspeed"], check=True, timeout=timeout, capture_output=True, env=env)
        t0 = time.perf_counter()
        out = subprocess.run([str(python), "-c", DS_SNIPPET % (SIZES, reps)], check=True,
                             timeout=timeout, capture_output=True, text=True, env=env)
        return (json.loads(out.stdout.strip().splitlines()[-1]),
                f"ok (JIT build + run {time.perf_counter() - t0:.0f} s)")
    except subprocess.TimeoutExpired:
        return [], f"DeepSpeed did not install and build its CPU Adam op within {timeout:.0f} s"
    except subprocess.CalledProcessError as err:
        tail = str(err.stderr or err)[-300:].strip()
        return [], f"DeepSpeed unavailable: {tail.splitlines()[-1] if tail else err}"


def print_tables(adam: list[dict], steps: list[dict], ds_note: str | None) -> None:
    print("CPU AdamW, one step over a flat fp32 partition (median thread CPU s; ns per element)\n")
    print("| implementation | numel | seconds | ns/elem |")
    print("|---|---:|---:|---:|")
    for r in adam:
        print(f"| {r['impl']} | {r['numel']:,} | {r['seconds']:.4f} | "
              f"{1e9 * r['seconds'] / r['numel']:.2f} |")
    if ds_note:
        print(f"\nDeepSpeedCPUAdam: {ds_note}")
    print(f"\nGPT step with optimizer offload (psi = {steps[0]['psi']:,}, stage 0, 1 rank)\n")
    print("| offload | step wall s | step CPU s | overhead wall | overhead CPU | "
          "resident model states MB | losses |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in steps:
        print(f"| {r['mode']} | {r['wall']:.3f} | {r['cpu']:.3f} | {100 * r['overhead_wall']:+.1f}% | "
              f"{100 * r['overhead_cpu']:+.1f}% | {r['resident_model_states'] / 2**20:.1f} | "
              f"{' '.join(f'{x:.5f}' for x in r['losses'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed-timeout", type=float, default=300.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    adam = adam_rows(args.reps)
    ds_note = None
    if args.deepspeed:
        ds, ds_note = deepspeed_rows(args.reps, args.deepspeed_timeout)
        adam += ds
    steps = step_rows(args.steps)
    print_tables(adam, steps, ds_note)
    out = ROOT / "benchmarks" / "results" / "offload.json"
    out.write_text(json.dumps(dict(adam=adam, steps=steps, deepspeed=ds_note,
                                   config=dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                                               vocab=VOCAB, micro_batch=MICRO)), indent=1) + "\n")


if __name__ == "__main__":
    main()
