"""Issue 2 benchmark: one TP=2 training step of the same GPT, this project vs the peers.

GPT: 4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4, fp32, one thread per rank.
A step is forward + backward + torch.optim.AdamW step for every variant (the optimizer is the same, so
the difference is the tensor-parallel layers and their communication):

    ours TP=2        models.gpt.GPTModel on 2 gloo ranks
    ours TP=1        the same model, an independent replica on each rank (no tensor parallelism)
    DTensor TP=2     torch.distributed.tensor.parallel.parallelize_module + loss_parallel
    mcore TP=2       megatron-core 0.16.1 ColumnParallel/RowParallel/VocabParallelEmbedding layers

Run:  python benchmarks/tp_vs_peers.py [--steps 20]
megatron-core is installed (--no-deps) into benchmarks/.venv-peers, never into the project.
Prints median step time and model-state bytes per rank, writes benchmarks/results/tp_vs_peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peer_env import reexec_in_peer_env  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 4, 256, 4, 128, 8192, 4


def _model_state_bytes(model, optimizer) -> int:
    from hybrid.zero.report import measure_storages
    moments = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    params = list(model.parameters())
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  DTensor -> shard
    sizes = measure_storages({"param16": map(local, params),
                              "grad16": (local(p.grad) for p in params if p.grad is not None),
                              "adam_moments": map(local, moments)})
    return sum(sizes.values())


def _variant_ours(world, tp):
    """Our GPT at TP degree ``tp``; TP=1 runs an independent replica on every rank."""
    import torch
    from hybrid.parallel_state import ParallelState
    from hybrid.tensor_parallel import RNGTracker
    from hybrid.topology import Topology
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    state = (ParallelState.initialize(Topology(world, world, gpus_per_node=world)) if tp > 1
             else ParallelState.single_process())
    config = GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ,
                       hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, state, device="meta", rng=RNGTracker(0, state.tp_rank, state.device))
    model.init_weights(0)
    return model, lambda tokens: model(tokens, tokens).mean().backward()


def _variant_dtensor(world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from benchmarks.peer_gpt import DTensorGPT, dtensor_loss, parallelize_dtensor_gpt
    torch.manual_seed(0)
    model = parallelize_dtensor_gpt(DTensorGPT(LAYERS, HIDDEN, HEADS, VOCAB, SEQ),
                                    init_device_mesh("cpu", (world,)))
    return model, lambda tokens: dtensor_loss(model, tokens)


def _variant_mcore(world):
    import torch
    from megatron.core import parallel_state
    from benchmarks.peer_gpt import McoreGPT
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    model = McoreGPT(LAYERS, HIDDEN, HEADS, VOCAB, SEQ, world)
    return model, lambda tokens: model.loss(tokens).backward()


VARIANTS = {"ours TP=2": lambda w: _variant_ours(w, 2), "ours TP=1": lambda w: _variant_ours(w, 1),
            "DTensor TP=2": _variant_dtensor, "megatron-core TP=2": _variant_mcore}


def _worker(rank, world, names, steps):
    """Build every variant in the same two ranks and interleave their steps round-robin, so the
    machine's load (shared, noisy) hits every variant alike."""
    import warnings
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name in names:
        model, step = VARIANTS[name](world)
        runs[name] = (model, step, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = {name: [] for name in names}
    for _ in range(steps):
        for name, (model, step, optimizer) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step(tokens)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            times[name].append(time.perf_counter() - start)
    return {name: (times[name][2:], _model_state_bytes(model, opt))  # 2 warm-up steps dropped
            for name, (model, _, opt) in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (+2 warm-up)")
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="run a subset")
    args = parser.parse_args()
    reexec_in_peer_env({"megatron.core": "megatron-core==0.16.1"})
    from hybrid.testing.multirank import run_on_ranks
    names = args.only or list(VARIANTS)
    per_rank = run_on_ranks(_worker, 2, args=(names, args.steps + 2), timeout=3600)
    rows = {}
    for name in names:
        # a step ends when the slowest rank finishes it
        step_times = [max(ts) for ts in zip(*(r[name][0] for r in per_rank))]
        rows[name] = {"median_step_ms": 1e3 * statistics.median(step_times),
                      "model_state_bytes_per_rank": per_rank[0][name][1]}
        print(f"{name:>20}: {rows[name]['median_step_ms']:8.1f} ms/step   "
              f"{rows[name]['model_state_bytes_per_rank'] / 2**20:7.1f} MiB model states/rank", flush=True)
    ours = rows.get("ours TP=2", {}).get("median_step_ms")
    if ours:
        for peer in ("DTensor TP=2", "megatron-core TP=2"):
            if peer in rows:
                print(f"{peer} / ours TP=2 step time: {rows[peer]['median_step_ms'] / ours:.2f}x")
    out = ROOT / "benchmarks" / "results" / "tp_vs_peers.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ, vocab=VOCAB,
                                              micro_batch=MICRO, dtype="fp32", threads_per_rank=1),
                               "steps": args.steps, "results": rows}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
