"""Issue 8 benchmark: optimizer offload (ZeRO-Offload / ZeRO-Infinity) step-time overhead beside
DeepSpeed's ZeRO-Offload, and the CPU Adam against torch.optim.AdamW and DeepSpeedCPUAdam.

One invocation measures everything, in one process. DeepSpeed lives only in
benchmarks/.venv-deepspeed (created on first use by :mod:`benchmarks.peer_env`: torch==2.13.0 from
this machine's CPU wheel first, then deepspeed under a constraint keeping that torch; never a
project dependency); the script re-runs itself there so our rows and DeepSpeed's are timed
interleaved in the same process. ``--no-deepspeed``, or a venv that cannot be made (the reason is
printed), runs our rows alone in the current interpreter. DeepSpeed's C++ ops (cpu_adam, async_io
for NVMe, which needs libaio-dev) are JIT-compiled on first use and cached (minutes, once).

Part 1, CPU Adam: one AdamW step over a flat fp32 partition of N elements (N = 1M and 8M):
hybrid.offload.CPUAdamW ``fused`` (torch's single-pass kernel, blocked), the same also writing the
updated values as bf16 (what offload sends back to the device), ``exact`` (the foreach sequence,
blocked), torch.optim.AdamW(foreach=True), torch.optim.AdamW(fused=True) and DeepSpeedCPUAdam
(adamw_mode) on one parameter of N elements. Interleaved round-robin, median process CPU seconds
(all threads: DeepSpeed's kernel uses OpenMP) and wall seconds of ``--reps`` steps.

Part 2, the GPT step (forward + backward + optimizer step), one rank, fp32: GPT 12 layers, hidden
256, 8 heads, seq 128, vocab 4096, micro-batch 2 (~10.6M parameters). Ours: models.gpt.GPTModel +
hybrid.zero stage 2 and stage 3 with ``--offload-optimizer none | cpu | nvme``, and stage 3 with
``--offload-optimizer nvme --offload-params nvme`` (row ``nvme+params``: the 16-bit partitions in
hybrid.offload.param_store too). No host-memory budget: nvme then uses the planner's largest
blocks (1M elements; a budget only shrinks them, and would fix glibc's mmap threshold for the
whole process, i.e. for every row). DeepSpeed: models.gpt.reference.ReferenceGPT (same canonical
initial weights, same data) under ``deepspeed.initialize`` with its AdamW, ZeRO stage 2 with
``offload_optimizer`` none / cpu, stage 3 with none / cpu / nvme and nvme+params
(``offload_param`` nvme beside ``offload_optimizer`` nvme); DeepSpeed's stages 1-2 treat ``nvme``
as ``cpu``, so that row would be a duplicate. A DeepSpeed variant that cannot run here (e.g. its
async_io op needs libaio) is reported as a row saying why instead of stopping the benchmark. NVMe
files go to a temporary directory (the page cache on this machine: a real NVMe device adds its
bandwidth limit to both). Every variant is built, stepped twice to warm up, then all advance
round-robin one step at a time (the order rotates every round) so the shared machine's load hits
all alike. Reported: median wall and process CPU seconds per step, overhead against the same
engine and stage without offload, resident state (every CPU tensor storage the variant's build
and first steps left alive: params, grads, master, moments, buffers; memory-mapped files
excluded) and the losses.

Run:  python benchmarks/offload.py [--reps 9] [--steps 11] [--no-deepspeed]
Prints markdown tables and writes benchmarks/results/offload.json. One thread
(torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.measure import bytes_grown_since, live_storages   # noqa: E402
from benchmarks.peer_env import PeerEnvError, reexec_in_venv   # noqa: E402

DS_VENV = ROOT / "benchmarks" / ".venv-deepspeed"
SIZES = (1 << 20, 1 << 23)
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO, SEED = 12, 256, 8, 128, 4096, 2, 1
WARMUP = 2
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def _timed_round_robin(fns: dict, reps: int, warmup: int) -> dict:
    """Call every function ``warmup + reps`` times, round-robin with a rotating start; per name
    the (wall, process CPU) seconds of the timed calls and the last return value."""
    names, out = list(fns), {n: dict(wall=[], cpu=[], results=[]) for n in fns}
    for r in range(warmup + reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            result = fns[name]()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            out[name]["results"].append(result)
            if r >= warmup:
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    return out


# ---- part 1: the CPU Adam ------------------------------------------------------------------
def _adamw_config():
    from hybrid.adamw_config import AdamWConfig
    return AdamWConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _ours_adam(kernel: str, master0, grad0, with_out: bool):
    """A CPUAdamW step over state laid out as HostOptimizerState holds it."""
    import torch
    from hybrid.offload import CPUAdamW
    n = master0.numel()
    adam, step, moments = CPUAdamW(_adamw_config(), kernel=kernel), [0], torch.zeros(2 * n)
    state = [master0.clone(), grad0.clone(), moments[:n], moments[n:]]
    out = torch.empty(n, dtype=torch.bfloat16) if with_out else None

    def run():
        step[0] += 1
        adam.step_(*state, [(0, n)], step=step[0], lr=LR, out=out)
    return run


def _param(master0, grad0):
    import torch
    p = torch.nn.Parameter(master0.clone())
    p.grad = grad0.clone()
    return p


def _torch_adam(kind: str, master0, grad0):
    import torch
    return torch.optim.AdamW([_param(master0, grad0)], lr=LR, betas=BETAS, eps=EPS,
                             weight_decay=WD, **{kind: True}).step


def _deepspeed_adam(master0, grad0):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam([_param(master0, grad0)], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            adamw_mode=True).step


def adam_rows(reps: int, deepspeed: bool) -> list[dict]:
    import torch
    rows = []
    for n in SIZES:
        g = torch.Generator().manual_seed(0)
        grad0, master0 = torch.randn(n, generator=g) * 1e-3, torch.randn(n, generator=g) * 0.02
        fns = {"hybrid CPUAdamW fused": _ours_adam("fused", master0, grad0, False),
               "hybrid CPUAdamW fused + bf16 out": _ours_adam("fused", master0, grad0, True),
               "hybrid CPUAdamW exact": _ours_adam("exact", master0, grad0, False),
               "torch.optim.AdamW foreach": _torch_adam("foreach", master0, grad0),
               "torch.optim.AdamW fused": _torch_adam("fused", master0, grad0)}
        if deepspeed:
            fns["DeepSpeedCPUAdam"] = _deepspeed_adam(master0, grad0)
        for name, st in _timed_round_robin(fns, reps, 1).items():
            rows.append(dict(impl=name, numel=n, cpu=statistics.median(st["cpu"]),
                             wall=statistics.median(st["wall"])))
    return rows


# ---- part 2: the GPT step ------------------------------------------------------------------
def _gpt_config():
    from models.gpt.config import GPTConfig
    return GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                     attention_dropout=0.0)


def _modes(mode: str) -> tuple[str, str]:
    """Variant mode -> (optimizer offload, parameter offload): ``nvme+params`` is both on NVMe."""
    return ("nvme", "nvme") if mode == "nvme+params" else (mode, "none")


def _ours(stage: int, mode: str, tmp: str):
    """models.gpt.GPTModel + hybrid.zero at ``stage`` with offload ``mode`` (see _modes)."""
    from hybrid.offload import OffloadConfig
    from hybrid.parallel_state import ParallelState
    from hybrid.zero import ZeroConfig, build_zero_optimizer
    from models.gpt import sharding
    from models.gpt.model import GPTModel
    config, state = _gpt_config(), ParallelState.single_process()
    model = GPTModel(config, state, device="meta")
    options = {}
    if stage == 3:
        options["init_fn"] = lambda name: sharding.shard_tensor(
            config, name, sharding.canonical_init(config, name, SEED), 0, 1)
    else:
        model.init_weights(SEED)
    optimizer, params = _modes(mode)
    offload = OffloadConfig(optimizer, os.path.join(tmp, f"ours{stage}{mode}"), params=params)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, bucket_size=4_000_000),
                               _adamw_config(), offload=offload, **options)

    def step(tokens, labels):
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        opt.backward(loss)
        opt.step()
        return loss.item()
    return step, opt.num_local_params


def _deepspeed(stage: int, mode: str, tmp: str):
    """ReferenceGPT under deepspeed.initialize, ZeRO ``stage``, offload ``mode`` (see _modes)."""
    import deepspeed
    optimizer, params_to = _modes(mode)
    if optimizer == "nvme":
        _check_async_io()
    from hybrid.adamw_config import uses_weight_decay
    from models.gpt.reference import ReferenceGPT
    model = ReferenceGPT(_gpt_config())
    model.init_weights(SEED)
    params = list(model.parameters())   # decay as ours does: matrices and embeddings only
    groups = [{"params": [p for p in params if uses_weight_decay(p)], "weight_decay": WD},
              {"params": [p for p in params if not uses_weight_decay(p)], "weight_decay": 0.0}]
    zero = {"stage": stage, "reduce_bucket_size": 4_000_000, "allgather_bucket_size": 4_000_000}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": os.path.join(tmp, "ds")}
    if params_to == "nvme":   # buffers of 2M elements: the largest parameter (embedding) is 1M
        zero["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(tmp, "ds"),
                                 "buffer_count": 5, "buffer_size": 2_000_000,
                                 "pin_memory": False}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS),
                                                        "eps": EPS, "weight_decay": WD}},
              "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config,
                                           dist_init_required=False)

    def step(tokens, labels):
        loss = engine(tokens, labels).mean()
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, sum(getattr(p, "ds_numel", p.numel()) for p in params)


def _check_async_io() -> None:
    """DeepSpeed's NVMe offload runs on its async_io op, which needs libaio: say so up front
    instead of failing minutes into a JIT build."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's async_io op cannot be built here (libaio missing: "
                           "apt-get install libaio-dev)")


def _variants(deepspeed: bool) -> dict:
    out = {f"ours ZeRO-{s} {m}": (_ours, s, m) for s in (2, 3) for m in ("none", "cpu", "nvme")}
    out["ours ZeRO-3 nvme+params"] = (_ours, 3, "nvme+params")
    if deepspeed:
        out.update({f"DeepSpeed ZeRO-2 {m}": (_deepspeed, 2, m) for m in ("none", "cpu")})
        out.update({f"DeepSpeed ZeRO-3 {m}": (_deepspeed, 3, m)
                    for m in ("none", "cpu", "nvme", "nvme+params")})
    return out


def _init_deepspeed() -> None:
    import deepspeed
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)


def step_rows(steps: int, deepspeed: bool) -> list[dict]:
    """Build every variant (warming each up right away, so its lazily created state is counted),
    then advance them all round-robin."""
    import torch
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(WARMUP + steps)]
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as tmp:
        built, meta, failed = {}, {}, {}
        for name, (fn, stage, mode) in _variants(deepspeed).items():
            before = live_storages()
            try:
                step, psi = fn(stage, mode, tmp)
                torch.set_num_threads(1)   # a peer's initialisation must not change the threads
                warm = [step(t, torch.roll(t, -1, 1)) for t in batches[:WARMUP]]
            except Exception as err:   # noqa: BLE001 - a peer that cannot run here becomes a row
                if fn is not _deepspeed:
                    raise
                failed[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
                print(f"{name}: not run ({failed[name]})", file=sys.stderr)
                continue
            gc.collect()
            grown = bytes_grown_since(before)
            built[name], meta[name] = step, dict(psi=psi, resident=grown, warm=warm)
        calls = {name: _stepper(s, batches[WARMUP:]) for name, s in built.items()}
        stats = _timed_round_robin(calls, steps, 0)
    return _summaries(stats, meta) + [dict(variant=n, error=e) for n, e in failed.items()]


def _stepper(step, batches):
    """A call that runs ``step`` on the next of ``batches`` (every variant sees the same data)."""
    import torch
    feed = iter(batches)

    def call():
        tokens = next(feed)
        return step(tokens, torch.roll(tokens, -1, 1))
    return call


def _summaries(stats: dict, meta: dict) -> list[dict]:
    rows = []
    for name, st in stats.items():
        rows.append(dict(variant=name, psi=meta[name]["psi"], wall=statistics.median(st["wall"]),
                         cpu=statistics.median(st["cpu"]), resident=meta[name]["resident"],
                         losses=[round(x, 5) for x in meta[name]["warm"] + st["results"]]))
    base = {r["variant"].rsplit(" ", 1)[0]: r for r in rows if r["variant"].endswith(" none")}
    for r in rows:
        b = base.get(r["variant"].rsplit(" ", 1)[0])   # None: the baseline could not run
        r["overhead_wall"] = r["wall"] / b["wall"] - 1 if b else None
        r["overhead_cpu"] = r["cpu"] / b["cpu"] - 1 if b else None
    return rows


def print_tables(adam: list[dict], steps: list[dict], notes: list[str]) -> None:
    print("CPU AdamW, one step over a flat fp32 partition (median of interleaved steps)\n")
    print("| implementation | numel | CPU s | wall s | CPU ns/elem |")
    print("|---|---:|---:|---:|---:|")
    for r in adam:
        print(f"| {r['impl']} | {r['numel']:,} | {r['cpu']:.4f} | {r['wall']:.4f} | "
              f"{1e9 * r['cpu'] / r['numel']:.2f} |")
    print(f"\nGPT step with optimizer offload (psi = {steps[0]['psi']:,}, fp32, 1 rank)\n")
    print("| variant | step wall s | step CPU s | overhead wall | overhead CPU | resident MB | "
          "loss first / last |")
    print("|---|---:|---:|---:|---:|---:|---|")
    pct = lambda x: "n/a" if x is None else f"{100 * x:+.1f}%"   # noqa: E731
    for r in steps:
        if "error" in r:
            print(f"| {r['variant']} | not run: {r['error']} | | | | | |")
            continue
        print(f"| {r['variant']} | {r['wall']:.3f} | {r['cpu']:.3f} | "
              f"{pct(r['overhead_wall'])} | {pct(r['overhead_cpu'])} | "
              f"{r['resident'] / 2**20:.1f} | {r['losses'][0]:.5f} / {r['losses'][-1]:.5f} |")
    for note in notes:
        print(f"\n{note}")


def _deepspeed_ready(args) -> tuple[bool, list[str]]:
    """Re-run inside the DeepSpeed venv (made on first use); (usable, notes) once in it."""
    if args.no_deepspeed:
        return False, ["DeepSpeed rows skipped: --no-deepspeed"]
    try:
        reexec_in_venv(DS_VENV, {"deepspeed": "deepspeed", "einops": "einops"})
    except PeerEnvError as err:
        return False, [f"DeepSpeed rows skipped: {err}"]
    _init_deepspeed()
    return True, ["DeepSpeed ZeRO-2 nvme: not run, DeepSpeed's stages 1-2 treat offload_optimizer "
                  "device nvme as cpu (no swapping), so it would repeat the cpu row"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    import warnings
    warnings.filterwarnings("ignore")
    deepspeed, notes = _deepspeed_ready(args)
    import torch
    torch.set_num_threads(1)
    adam = adam_rows(args.reps, deepspeed)
    steps = step_rows(args.steps, deepspeed)
    print_tables(adam, steps, notes)
    out = ROOT / "benchmarks" / "results" / "offload.json"
    out.write_text(json.dumps(dict(adam=adam, steps=steps, notes=notes, command=" ".join(
        ["python", "benchmarks/offload.py", *sys.argv[1:]]), config=dict(
            layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ, vocab=VOCAB, micro_batch=MICRO)),
        indent=1) + "\n")


if __name__ == "__main__":
    main()
