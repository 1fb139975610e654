"""Issue 32 benchmark: one MoE layer's training step at expert-parallel size 2, ours and a peer's,
side by side in one invocation (docs/moe.md, "Benchmark").

MoE layer: hidden 256, 8 SwiGLU experts of width 512, top-2 softmax router, no balancing loss,
dropless, fp32, micro-batch 4 x sequence 128 = 512 tokens per rank, one thread per rank, 2 gloo
ranks. A step is forward + backward (loss = <output, fixed random tensor>) + torch.optim.AdamW:

    ours EP=2 alltoall    models.gpt.moe.MoELayer, 4 experts per rank, variable-size all-to-all
    ours EP=2 allgather   the same layer with the all-gather dispatcher
    ours EP=1             every rank holds all 8 experts (no expert parallelism, no traffic)
    megatron-core EP=2    megatron-core 0.16.1's MoELayer (alltoall dispatcher), if it runs here

megatron-core's MoE layer needs CUDA on this CPU-only torch (its router moves its weight to
``torch.cuda.current_device()``; its all-to-all dispatcher creates a ``torch.cuda.Stream`` when
built), so on a CPU machine the benchmark prints the exact error it raises instead of a time.
DeepSpeed-MoE is not run: on a CPU accelerator ``deepspeed.init_distributed`` JIT-compiles a C++
shared-memory communication op first (docs/moe.md says what happened here).

Run:  python benchmarks/moe.py [--steps 20]
megatron-core is installed (--no-deps) into benchmarks/.venv-peers, never into the project.
Prints the median step time and tokens/s of each variant, writes benchmarks/results/moe.json.
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

HIDDEN, EXPERTS, FFN, TOPK, SEQ, MICRO = 256, 8, 512, 2, 128, 4


def _variant_ours(world: int, ep: int, dispatcher: str):
    import torch
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    from models.gpt.config import GPTConfig
    from models.gpt.moe import MoELayer
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world,
                                              expert_model_parallel_size=ep), dp_transport="gloo")
    config = GPTConfig(1, HIDDEN, 4, vocab_size=128, seq_length=SEQ, swiglu=True, num_experts=EXPERTS,
                       moe_ffn_hidden_size=FFN, moe_router_topk=TOPK, add_bias_linear=False,
                       moe_router_load_balancing_type="none", moe_token_dispatcher_type=dispatcher)
    layer = MoELayer(config, state.tp, ep=state.ep)
    torch.manual_seed(state.ep_rank)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer, lambda x: layer(x)


def _variant_mcore(world: int):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                               ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
                               num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                               moe_token_dispatcher_type="alltoall",
                               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                               expert_model_parallel_size=world, add_bias_linear=False,
                               gated_linear_unit=True, activation_func=F.silu,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules.mlp.submodules)
    return layer, lambda x: layer(x)[0]


VARIANTS = {"ours EP=2 alltoall": lambda w: _variant_ours(w, 2, "alltoall"),
            "ours EP=2 allgather": lambda w: _variant_ours(w, 2, "allgather"),
            "ours EP=1": lambda w: _variant_ours(w, 1, "alltoall"),
            "megatron-core EP=2": _variant_mcore}


def _worker(rank, world, names, steps):
    """Build every variant in the same two ranks (a peer that cannot be built reports why) and
    interleave their steps round-robin, so the shared machine's load hits every variant alike."""
    import warnings
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(SEQ, MICRO, HIDDEN, generator=g)
    target = torch.randn(SEQ, MICRO, HIDDEN, generator=g)
    runs, failed = {}, {}
    for name in names:
        try:
            layer, forward = VARIANTS[name](world)
            runs[name] = (layer, forward, torch.optim.AdamW(layer.parameters(), lr=1e-4))
        except Exception as err:   # the peer's own error, reported as its result
            failed[name] = f"{type(err).__name__}: {err}"
    times = {name: [] for name in runs}
    for _ in range(steps):
        for name, (layer, forward, optimizer) in runs.items():
            try:
                dist.barrier()
                start = time.perf_counter()
                (forward(x) * target).sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                times[name].append(time.perf_counter() - start)
            except Exception as err:
                failed[name] = f"{type(err).__name__}: {err}"
        runs = {n: r for n, r in runs.items() if n not in failed}
    return {name: times[name][2:] for name in runs}, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (+2 warm-up)")
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="run a subset")
    args = parser.parse_args()
    reexec_in_peer_env({"megatron.core": "megatron-core==0.16.1"})
    from hybrid.testing.multirank import run_on_ranks
    names = args.only or list(VARIANTS)
    per_rank = run_on_ranks(_worker, 2, args=(names, args.steps + 2), timeout=3600)
    tokens = 2 * SEQ * MICRO
    rows, failures = {}, {}
    for name in names:
        reasons = [r[1][name] for r in per_rank if name in r[1]]
        if reasons:
            failures[name] = reasons[0]
            print(f"{name:>20}: cannot run here: {reasons[0][:300]}", flush=True)
            continue
        step_times = [max(ts) for ts in zip(*(r[0][name] for r in per_rank))]   # slowest rank
        median = statistics.median(step_times)
        rows[name] = {"median_step_ms": 1e3 * median, "tokens_per_s": tokens / median}
        print(f"{name:>20}: {rows[name]['median_step_ms']:8.1f} ms/step  "
              f"{rows[name]['tokens_per_s']:9.0f} tokens/s", flush=True)
    out = ROOT / "benchmarks" / "results" / "moe.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": dict(hidden=HIDDEN, experts=EXPERTS, ffn=FFN, topk=TOPK,
                                              seq=SEQ, micro_batch=MICRO, ranks=2, dtype="fp32",
                                              threads_per_rank=1),
                               "steps": args.steps, "results": rows, "cannot_run": failures},
                              indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
