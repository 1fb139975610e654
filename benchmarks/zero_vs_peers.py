"""Issue 3 benchmark: ZeRO stages of this project vs torch's data-parallel peers, same GPT.

GPT: 4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4 per rank, 2 gloo CPU ranks
(DP 2, TP 1), one thread each, fp32 and bf16. A step is forward + backward + AdamW update:

    ours stage 0/1/2/3   models.gpt.GPTModel + hybrid.zero (bf16: bf16 params/grads, fp32 master)
    DDP                  torch DistributedDataParallel + torch.optim.AdamW
    ZeRO-1 (torch)       DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    FSDP2 reshard=T/F    torch.distributed.fsdp.fully_shard(reshard_after_forward=True/False)

Peers run models.gpt.reference.ReferenceGPT (plain torch, same canonical initial weights). bf16 for
DDP / ZeroRedundancyOptimizer is torch.autocast (fp32 params and states, bf16 compute); for FSDP2 a
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 sharded params.

DeepSpeed ZeRO 1/2/3 (``--deepspeed``) runs only inside benchmarks/.venv-deepspeed, a virtual
environment this script creates (``pip install deepspeed`` with DS_BUILD_OPS=0; never a project
dependency), with DS_ACCELERATOR=cpu on gloo and torch.optim.AdamW as its client optimizer. Its
model-state bytes are every live tensor storage after the step (DeepSpeed's partitions are internal).

Reported per variant: median step time, wall and process CPU (a step ends when the slower rank
finishes; on a shared machine the CPU time is the meaningful one), model-state
bytes per rank (params, grads, fp32 master, Adam moments: real storages, deduplicated), peak RSS of
rank 0, and the loss (mean over ranks) at the last step.

Run:  python benchmarks/zero_vs_peers.py [--steps 6] [--only NAME ...]
      python benchmarks/zero_vs_peers.py --deepspeed        # DeepSpeed rows, merged into the JSON
Writes benchmarks/results/zero_vs_peers.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DS_VENV = ROOT / "benchmarks" / ".venv-deepspeed"
RESULTS = ROOT / "benchmarks" / "results" / "zero_vs_peers.json"

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO, SEED = 4, 256, 4, 128, 8192, 4, 0


def _config():
    from models.gpt.config import GPTConfig
    return GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                     attention_dropout=0.0)


def _batches(rank: int, steps: int):
    import torch
    g = torch.Generator().manual_seed(1000 + rank)   # each DP rank its own micro-batches
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
             torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)) for _ in range(steps)]


def _run_steps(one_step, batches):
    """Time ``one_step(tokens, labels) -> loss`` over ``batches``: (wall, process CPU) seconds per
    step without two warm-up steps, and the last loss."""
    times, losses = [], []
    for tokens, labels in batches:
        start, cpu = time.perf_counter(), time.process_time()
        losses.append(float(one_step(tokens, labels)))
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times[2:], losses[-1]


def _ours(rank, world, steps, stage, precision):
    import torch
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    from hybrid.zero import AdamWConfig, ZeroConfig, build_zero_optimizer
    from models.gpt import sharding
    from models.gpt.model import GPTModel
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world))
    config = _config()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = GPTModel(config, state, device="meta", dtype=dtype)
    options = {}
    if stage == 3:
        options["init_fn"] = lambda name: sharding.shard_tensor(
            config, name, sharding.canonical_init(config, name, SEED), 0, 1)
    else:
        model.init_weights(SEED)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision=precision,
                                                        bucket_size=1_000_000),
                               AdamWConfig(lr=1e-4), **options)

    def one_step(tokens, labels):
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        opt.backward(loss)
        opt.step()
        return loss.detach().float()

    times, loss = _run_steps(one_step, _batches(rank, steps))
    return times, loss, opt.memory_report().measured_model_states


def _peer_model():
    from models.gpt.reference import ReferenceGPT
    model = ReferenceGPT(_config())
    model.init_weights(SEED)
    return model


def _peer_state_bytes(model, optim_states) -> int:
    from hybrid.zero.report import measure_storages
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  DTensor shard
    params = list(model.parameters())
    moments = [local(t) for s in optim_states for t in s.values() if hasattr(t, "dim") and t.dim() > 0]
    sizes = measure_storages({"param16": [local(p) for p in params],
                              "grad16": [local(p.grad) for p in params if p.grad is not None],
                              "adam_moments": moments})
    return sum(sizes.values())


def _peer(rank, world, steps, kind, precision):
    import torch
    import torch.distributed as dist
    model = _peer_model()
    autocast = precision == "bf16" and kind in ("ddp", "zero1")
    if kind in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        if kind == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
            if precision == "bf16" else MixedPrecisionPolicy()
        reshard = kind == "fsdp2_reshard"
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def one_step(tokens, labels):
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels).mean()
        loss.backward()
        opt.step()
        return loss.detach().float()

    times, loss = _run_steps(one_step, _batches(rank, steps))
    states = (opt.optim.state if kind == "zero1" else opt.state).values()
    inner = model.module if kind in ("ddp", "zero1") else model
    nbytes = _peer_state_bytes(inner, states)
    total = torch.tensor([loss])
    dist.all_reduce(total)   # peers' own collective: the loss average is not part of the timing
    return times, total.item() / world, nbytes


def _deepspeed(rank, world, steps, stage, precision):
    import gc
    import torch
    import deepspeed
    model = _peer_model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 1_000_000,
                                    "allgather_bucket_size": 1_000_000},
              "bf16": {"enabled": precision == "bf16"}, "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                           dist_init_required=False)

    def one_step(tokens, labels):
        loss = engine(tokens, labels).mean()
        engine.backward(loss)
        engine.step()
        return loss.detach().float()

    times, loss = _run_steps(one_step, _batches(rank, steps))
    from hybrid.zero.report import measure_storages
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    nbytes = sum(measure_storages({"param16": live}).values())
    total = torch.tensor([loss])
    torch.distributed.all_reduce(total)
    return times, total.item() / world, nbytes


def _deepspeed_variants() -> dict:
    return {f"DeepSpeed ZeRO-{s} {p}": (_deepspeed, (s, p)) for p in ("fp32", "bf16") for s in (1, 2, 3)}


def _reexec_in_deepspeed_venv() -> None:
    """Create benchmarks/.venv-deepspeed (sees the system torch) with deepspeed, re-run in it."""
    python = DS_VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == DS_VENV.resolve():
        return
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(DS_VENV)],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "deepspeed"], check=True, env=env)
    os.execve(str(python), [str(python), *sys.argv], env)


VARIANTS = {
    **{f"ours stage {s} {p}": (_ours, (s, p)) for p in ("fp32", "bf16") for s in (0, 1, 2, 3)},
    **{f"{name} {p}": (_peer, (kind, p)) for p in ("fp32", "bf16")
       for name, kind in (("torch DDP", "ddp"), ("torch ZeroRedundancyOptimizer", "zero1"),
                          ("FSDP2 reshard=True", "fsdp2_reshard"),
                          ("FSDP2 reshard=False", "fsdp2_keep"))},
}


def _worker(rank, world, name, steps):
    import warnings
    warnings.filterwarnings("ignore")
    fn, args = {**VARIANTS, **_deepspeed_variants()}[name]
    if fn is _deepspeed:
        os.environ["DS_ACCELERATOR"] = "cpu"
    times, loss, nbytes = fn(rank, world, steps, *args)
    if fn is _ours:
        import torch
        from hybrid import comm
        from hybrid.comm import CommLedger, Group
        total = torch.tensor([loss])
        comm.all_reduce(total, Group("world", list(range(world)), rank, CommLedger(),
                                     torch.distributed.group.WORLD))
        loss = total.item() / world
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return times, loss, nbytes, peak_rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (+2 warm-up)")
    parser.add_argument("--only", nargs="*", choices=sorted({**VARIANTS, **_deepspeed_variants()}),
                        help="run a subset")
    parser.add_argument("--deepspeed", action="store_true",
                        help="run DeepSpeed ZeRO 1/2/3 in benchmarks/.venv-deepspeed instead")
    args = parser.parse_args()
    if args.deepspeed:
        _reexec_in_deepspeed_venv()
        VARIANTS.update(_deepspeed_variants())
    from tests.multirank import run_on_ranks
    rows = {}
    for name in args.only or (_deepspeed_variants() if args.deepspeed else VARIANTS):
        try:
            per_rank = run_on_ranks(_worker, 2, args=(name, args.steps + 2), timeout=3600)
        except Exception as err:  # one failing peer must not lose the others' numbers
            rows[name] = {"error": str(err).splitlines()[-1][:200]}
            print(f"{name:>40}: FAILED {rows[name]['error']}", flush=True)
            continue
        step_times = [max(t[0] for t in ts) for ts in zip(*(r[0] for r in per_rank))]
        cpu_times = [max(t[1] for t in ts) for ts in zip(*(r[0] for r in per_rank))]
        rows[name] = {"median_step_ms": 1e3 * statistics.median(step_times),
                      "median_step_cpu_ms": 1e3 * statistics.median(cpu_times),
                      "model_state_mib_per_rank": per_rank[0][2] / 2**20,
                      "peak_rss_mib_rank0": per_rank[0][3] / 2**20,
                      "loss_after_steps": per_rank[0][1]}
        r = rows[name]
        print(f"{name:>40}: {r['median_step_ms']:8.1f} ms/step {r['median_step_cpu_ms']:8.1f} ms CPU "
              f"{r['model_state_mib_per_rank']:7.1f} "
              f"MiB states {r['peak_rss_mib_rank0']:7.1f} MiB RSS  loss {r['loss_after_steps']:.4f}",
              flush=True)
    previous = json.loads(RESULTS.read_text())["results"] if RESULTS.exists() else {}
    rows = {**previous, **rows}   # later runs (e.g. --deepspeed) add or replace their rows
    print(_markdown(rows, args.steps + 2))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"config": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                                                  vocab=VOCAB, micro_batch_per_rank=MICRO, dp=2,
                                                  tp=1, threads_per_rank=1),
                                   "steps": args.steps, "results": rows}, indent=2))
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def _markdown(rows: dict, steps: int) -> str:
    lines = ["| variant | median step wall (ms) | median step CPU (ms) | model states / rank (MiB) | "
             f"peak RSS rank 0 (MiB) | loss after {steps} steps |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | |")
        else:
            lines.append(f"| {name} | {r['median_step_ms']:.0f} | {r['median_step_cpu_ms']:.0f} "
                         f"| {r['model_state_mib_per_rank']:.1f} "
                         f"| {r['peak_rss_mib_rank0']:.0f} | {r['loss_after_steps']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
