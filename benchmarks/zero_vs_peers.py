"""Issue 3 benchmark: ZeRO stages of this project vs torch's data-parallel peers, same GPT.

GPT: 4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4 per rank, 2 gloo CPU ranks
(DP 2, TP 1), one thread each, fp32 and bf16. A step is forward + backward + AdamW update:

    ours stage 0/1/2/3   models.gpt.GPTModel + hybrid.zero (bf16: bf16 params/grads, fp32 master)
    DDP                  torch DistributedDataParallel + torch.optim.AdamW
    ZeRO-1 (torch)       DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    FSDP2 reshard=T/F    torch.distributed.fsdp.fully_shard(reshard_after_forward=True/False)

Peers run models.gpt.reference.ReferenceGPT (plain torch, same canonical initial weights). bf16 for
DDP / ZeroRedundancyOptimizer is torch.autocast (fp32 params and states, bf16 compute); for FSDP2 a
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 sharded params. DeepSpeed is not
run (see benchmarks/README.md).

Reported per variant: median step time (a step ends when the slower rank finishes), model-state
bytes per rank (params, grads, fp32 master, Adam moments: real storages, deduplicated), peak RSS of
rank 0, and the loss (mean over ranks) at the last step.

Run:  python benchmarks/zero_vs_peers.py [--steps 6] [--only NAME ...]
Writes benchmarks/results/zero_vs_peers.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    """Time ``one_step(tokens, labels) -> loss`` over ``batches``; drop two warm-up steps."""
    times, losses = [], []
    for tokens, labels in batches:
        start = time.perf_counter()
        losses.append(float(one_step(tokens, labels)))
        times.append(time.perf_counter() - start)
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
    fn, args = VARIANTS[name]
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
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="run a subset")
    args = parser.parse_args()
    from tests.multirank import run_on_ranks
    rows = {}
    for name in args.only or VARIANTS:
        try:
            per_rank = run_on_ranks(_worker, 2, args=(name, args.steps + 2), timeout=3600)
        except Exception as err:  # one failing peer must not lose the others' numbers
            rows[name] = {"error": str(err).splitlines()[-1][:200]}
            print(f"{name:>40}: FAILED {rows[name]['error']}", flush=True)
            continue
        step_times = [max(ts) for ts in zip(*(r[0] for r in per_rank))]
        rows[name] = {"median_step_ms": 1e3 * statistics.median(step_times),
                      "model_state_mib_per_rank": per_rank[0][2] / 2**20,
                      "peak_rss_mib_rank0": per_rank[0][3] / 2**20,
                      "loss_after_steps": per_rank[0][1]}
        r = rows[name]
        print(f"{name:>40}: {r['median_step_ms']:8.1f} ms/step {r['model_state_mib_per_rank']:7.1f} "
              f"MiB states {r['peak_rss_mib_rank0']:7.1f} MiB RSS  loss {r['loss_after_steps']:.4f}",
              flush=True)
    print(_markdown(rows, args.steps + 2))
    out = ROOT / "benchmarks" / "results" / "zero_vs_peers.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                                              vocab=VOCAB, micro_batch_per_rank=MICRO, dp=2, tp=1,
                                              threads_per_rank=1),
                               "steps": args.steps, "results": rows}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


def _markdown(rows: dict, steps: int) -> str:
    lines = ["| variant | median step (ms) | model states / rank (MiB) | peak RSS rank 0 (MiB) | "
             f"loss after {steps} steps |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
        else:
            lines.append(f"| {name} | {r['median_step_ms']:.0f} | {r['model_state_mib_per_rank']:.1f} "
                         f"| {r['peak_rss_mib_rank0']:.0f} | {r['loss_after_steps']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
