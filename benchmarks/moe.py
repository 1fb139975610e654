"""Issue 32 benchmark: one MoE layer's training step at expert-parallel size 2, ours and two peers',
side by side in one invocation (docs/moe.md, "Benchmark").

MoE layer: hidden 256, 8 SwiGLU experts of width 512, top-2 router (softmax over the two chosen
logits), no balancing loss, no token dropped, fp32, micro-batch 4 x sequence 128 = 512 tokens per
rank, one thread per rank, 2 gloo ranks. A step is forward + backward (loss = <output, fixed random
tensor>) + torch.optim.AdamW over the layer's parameters on this rank (no data-parallel gradient
reduction in any variant: the router's gradient is not averaged by anyone):

    ours EP=2 alltoall    models.gpt.moe.MoELayer, 4 experts per rank, variable-size all-to-all
    ours EP=2 allgather   the same layer with the all-gather dispatcher
    ours EP=1             every rank holds all 8 experts (no expert parallelism, no traffic)
    DeepSpeed-MoE EP=2    deepspeed.moe.layer.MoE(ep_size=2, k=2), our SwiGLU expert as its expert
                          module; drop_tokens=False (capacity = the largest expert load over the
                          EP group, so no token is dropped, every expert padded to that capacity),
                          no second-expert sampling noise, no random token selection
    megatron-core EP=2    megatron-core 0.16.1's MoELayer (alltoall dispatcher, SequentialMLP of
                          SwiGLU experts, dropless), CUDA-only calls redirected (_megatron_on_cpu)

Both peers live in benchmarks/.venv-deepspeed (the env benchmarks/zero_vs_peers.py uses; made by
benchmarks.peer_env, DS_BUILD_OPS=0, DS_ACCELERATOR=cpu), megatron-core added ``--no-deps``.
DeepSpeed's shared-memory communication op (a C++ op its comm backend JIT-compiles on first use)
is built once in the parent process before the ranks start, so the ranks load the cached build
instead of both waiting on its build lock.

Run:  python benchmarks/moe.py [--steps 20] [--only NAME ...]
Prints the median step time (the slower rank's wall clock) and tokens/s of each variant, and the
median CPU time of a step (the slower rank's process CPU time: on a shared machine it counts what
the variant computes, not the time it waits for a core or for the other rank), writes
benchmarks/results/moe.json (``--out`` elsewhere).
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

HIDDEN, EXPERTS, FFN, TOPK, SEQ, MICRO = 256, 8, 512, 2, 128, 4
PEER_VENV = ROOT / "benchmarks" / ".venv-deepspeed"
PEERS = ({"deepspeed": "deepspeed", "einops": "einops"}, False), \
        ({"megatron.core": "megatron-core==0.16.1"}, True)   # (modules, --no-deps)


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
    return layer, lambda x: layer(x), [n for n, _ in layer.named_parameters() if "router" in n]


class SwiGLUExpert:
    """The expert module handed to DeepSpeed-MoE (it deep-copies it per local expert): the same
    bias-free SwiGLU as ours, fc2(silu(x W_gate) * (x W_up)), [tokens, h] -> [tokens, h]."""

    def __new__(cls):
        import torch
        import torch.nn.functional as F

        class _SwiGLU(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)   # rows [gate; up]
                self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False)

            def forward(self, x):
                gate, up = self.fc1(x).chunk(2, dim=-1)
                return self.fc2(F.silu(gate) * up)
        return _SwiGLU()


def _variant_deepspeed(world: int):
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    torch.manual_seed(0)
    layer = MoE(HIDDEN, SwiGLUExpert(), num_experts=EXPERTS, ep_size=world, k=TOPK,
                drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                noisy_gate_policy=None)
    layer.set_deepspeed_parallelism()   # what deepspeed.initialize does for every MoE layer
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer, lambda x: layer(x)[0], [n for n, _ in layer.named_parameters() if ".gate." in n]


def _megatron_on_cpu() -> None:
    """Redirect the CUDA-only calls megatron-core 0.16.1's MoE layer makes, to what they do when
    every tensor is already on the host. None of them does work ours skips:

    * ``torch.cuda.Stream`` / ``current_stream`` / ``stream``: the all-to-all dispatcher's side
      stream for copying the split sizes device-to-host (and the event it synchronises on): a
      stream object whose ``wait_stream`` / ``record_event`` / ``synchronize`` do nothing, a null
      context;
    * ``moe_utils.maybe_move_tensor_to_cpu``: on CUDA it copies a GPU tensor to the host (as a
      numpy array when asked); on CPU it returns the tensor, so the split sizes stay tensors that
      ``all_to_all_single`` refuses: here it returns the host values, numpy when asked;
    * ``torch.cuda.current_device``: the router moves its weight there when it is on the CPU:
      "cpu", a no-op move;
    * ``moe_utils.te_general_gemm``: a name imported only with Transformer Engine, yet read
      unconditionally by the router's gating GEMM: None, megatron's own torch.matmul path."""
    import contextlib
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    class Event:
        def synchronize(self):
            return None

    class Stream:
        def wait_stream(self, other):
            return None

        def record_event(self, event=None):
            return Event()

    side = Stream()
    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda device=None: side
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = (
        lambda t, as_numpy=False, record_stream=False:
        t.numpy() if as_numpy and torch.is_tensor(t) else t)


def _variant_mcore(world: int):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    _megatron_on_cpu()
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
    return layer, lambda x: layer(x)[0], [n for n, _ in layer.named_parameters() if "router" in n]


VARIANTS = {"ours EP=2 alltoall": lambda w: _variant_ours(w, 2, "alltoall"),
            "ours EP=2 allgather": lambda w: _variant_ours(w, 2, "allgather"),
            "ours EP=1": lambda w: _variant_ours(w, 1, "alltoall"),
            "DeepSpeed-MoE EP=2": _variant_deepspeed,   # before megatron: its CPU redirections
            "megatron-core EP=2": _variant_mcore}       # are process-wide


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
    runs, failed, shape = {}, {}, {}
    for name in names:
        try:
            layer, forward, router = VARIANTS[name](world)
            params = sum(p.numel() for p in layer.parameters())
            routers = sum(p.numel() for n, p in layer.named_parameters() if n in router)
            shape[name] = {"params_per_rank": params, "expert_params_per_rank": params - routers,
                           "output_shape": list(forward(x).shape),
                           "threads": torch.get_num_threads()}
            runs[name] = (layer, forward, torch.optim.AdamW(layer.parameters(), lr=1e-4))
        except Exception as err:   # the peer's own error, reported as its result
            failed[name] = f"{type(err).__name__}: {err}"
    times = {name: [] for name in runs}
    for _ in range(steps):
        for name, (layer, forward, optimizer) in runs.items():
            try:
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                (forward(x) * target).sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                times[name].append((time.perf_counter() - start, time.process_time() - cpu))
            except Exception as err:
                failed[name] = f"{type(err).__name__}: {err}"
        runs = {n: r for n, r in runs.items() if n not in failed}
    return {name: times[name][2:] for name in runs}, failed, shape


def _peer_env(names: list[str]) -> str | None:
    """Re-run this script in benchmarks/.venv-deepspeed when a peer is asked for and not
    importable here; returns why the peers cannot run (their rows then say so), or None."""
    from benchmarks.peer_env import PEER_ENV, PeerEnvError, _importable, ensure_venv
    if not any(not n.startswith("ours") for n in names):
        return None
    modules = [m for group, _ in PEERS for m in group]
    if _importable(modules):
        os.environ.update(PEER_ENV)
        return None
    if Path(sys.prefix).resolve() == PEER_VENV.resolve():
        return f"{PEER_VENV} lacks one of {modules}; delete it and rerun"
    try:
        for group, no_deps in PEERS:
            python = ensure_venv(PEER_VENV, group, no_deps=no_deps)
    except PeerEnvError as err:
        return str(err)
    os.execve(str(python), [str(python), *sys.argv], {**os.environ, **PEER_ENV})


def _prebuild_deepspeed_op() -> str:
    """Build (or load from the torch extensions cache) DeepSpeed's shared-memory comm op once,
    here, before the ranks start; returns what happened, for the JSON."""
    start = time.perf_counter()
    try:
        from deepspeed.comm.torch import build_shm_op
        op = build_shm_op()
    except Exception as err:   # the ranks would hit the same: DeepSpeed's row reports it
        return f"shm op build failed: {type(err).__name__}: {err}"
    return (f"shm op {'ready' if op is not None else 'not compatible, skipped'} in "
            f"{time.perf_counter() - start:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (+2 warm-up)")
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="run a subset")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe.json")
    args = parser.parse_args()
    names = args.only or list(VARIANTS)
    why_not = _peer_env(names)
    peers = [n for n in names if not n.startswith("ours")]
    failures = {n: f"peer environment: {why_not}" for n in peers} if why_not else {}
    built = _prebuild_deepspeed_op() if "DeepSpeed-MoE EP=2" in names and not why_not else None
    from hybrid.testing.multirank import run_on_ranks
    runnable = [n for n in names if n not in failures]
    per_rank = run_on_ranks(_worker, 2, args=(runnable, args.steps + 2), timeout=3600)
    tokens = 2 * SEQ * MICRO
    rows = {}
    for name in names:
        reasons = [r[1][name] for r in per_rank if name in r[1]] or ([failures[name]]
                                                                     if name in failures else [])
        if reasons:
            failures[name] = reasons[0]
            print(f"{name:>20}: cannot run here: {reasons[0][:300]}", flush=True)
            continue
        steps = list(zip(*(r[0][name] for r in per_rank)))        # per step: each rank's
        median = statistics.median(max(wall for wall, _ in ranks) for ranks in steps)
        cpu = statistics.median(max(c for _, c in ranks) for ranks in steps)
        rows[name] = {"median_step_ms": 1e3 * median, "tokens_per_s": tokens / median,
                      "median_step_cpu_ms": 1e3 * cpu, **per_rank[0][2][name]}
        print(f"{name:>20}: {rows[name]['median_step_ms']:8.1f} ms/step  "
              f"{rows[name]['tokens_per_s']:9.0f} tokens/s  {1e3 * cpu:6.1f} CPU ms/step  "
              f"({rows[name]['expert_params_per_rank']:,} expert params per rank, output "
              f"{rows[name]['output_shape']}, {rows[name]['threads']} thread)", flush=True)
    at_ep2 = {rows[n]["expert_params_per_rank"] for n in rows if "EP=2" in n}
    if len(at_ep2) > 1:
        print(f"WARNING: the EP=2 variants hold different expert parameter counts: {at_ep2}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": dict(hidden=HIDDEN, experts=EXPERTS, ffn=FFN, topk=TOPK,
                                                   seq=SEQ, micro_batch=MICRO, ranks=2, dtype="fp32",
                                                   threads_per_rank=1),
                                    "steps": args.steps, "deepspeed_op": built, "results": rows,
                                    "cannot_run": failures}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
