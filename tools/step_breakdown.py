"""Where a training step's time goes: a few steps of a trainer config under torch.profiler, split
into GEMMs, the attention core, elementwise / norm / activation ops, casts, the optimizer step,
communication and framework overhead, beside the step's GEMM-bound fraction (hybrid.perf.roofline).

    python -m tools.step_breakdown --config tiny-cpu [trainer flags] [--steps 3] [--warmup 2]
    python -m tools.step_breakdown --config tiny-cpu --bf16 --zero-stage 3 --json

The config's ``world_size`` (TP x DP) ranks run on this machine as gloo processes, one thread each
(``--threads``); rank 0's profile is printed. Categories, from each profiled op's own (self) time:

- optimizer: everything under the optimizer's ``step`` (clip, AdamW, the ZeRO parameter copies);
- communication: inside hybrid.comm's collectives and their handles' ``wait`` (gloo or shared
  memory; a rank waiting for a slower peer counts here);
- GEMMs: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` ...;
- attention core: the fused attention kernels (``scaled_dot_product_*``, flash / efficient / math)
  and the CPU core of models/gpt/attention_core.py, with every op inside them; with ``--compile``
  (the core traced into the layer's graph) its batched products only, its softmax being part of
  inductor's kernels;
- casts: dtype conversions (``to`` / ``_to_copy`` and the copies inside them);
- elementwise / norm / activation: every other aten op that computes (LayerNorm, GELU, residual
  adds, softmax and the cross-entropy's reductions, embedding, gradient accumulation, fills), and
  with ``--compile`` the fused kernels inductor generated for the layers;
- framework overhead (rest): the step's wall time less all of the above - Python, autograd and
  dispatch, tensor metadata ops (views, ``empty``), and the profiler's own cost.

Profiling adds overhead of its own, so the step times here are longer than an unprofiled run's; the
GEMM-bound fraction is printed both for the profiled steps and for the same number of unprofiled
steps timed just before.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

CATEGORIES = ("GEMMs", "attention core", "elementwise/norm/activation", "casts", "optimizer",
              "communication", "framework overhead (rest)")
OPTIMIZER_RANGE = "breakdown::optimizer"
COMM_PREFIX = "breakdown::comm."
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::addmv",
            "aten::mv", "aten::_addmm_activation", "aten::_int_mm", "aten::dot"}
# SDPA's kernels, and the CPU core of models/gpt/attention_core.py (its autograd Functions' forward
# and backward ranges: "_Core", "_PackedCore", "..Backward")
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "_cudnn_attention",
                   "_Core", "_PackedCore")
# batched products: the attention core's (q k^T, P v and their gradients); the model's weight
# GEMMs are 2-D (mm / addmm). Under --compile the core is traced into the layer's graph and its
# ranges above are gone, so its products are recognised by name there
BATCHED_GEMM_OPS = {"aten::bmm", "aten::baddbmm"}
CAST_OPS = {"aten::to", "aten::_to_copy"}
# aten ops that only create or reshape tensor metadata: their self time is dispatch overhead
METADATA_OPS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view",
                "aten::as_strided", "aten::slice", "aten::select", "aten::transpose", "aten::t",
                "aten::permute", "aten::expand", "aten::reshape", "aten::_reshape_alias",
                "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::detach_", "aten::alias",
                "aten::narrow", "aten::split", "aten::unbind", "aten::chunk", "aten::lift_fresh",
                "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::flatten",
                "aten::contiguous", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
                "aten::result_type", "aten::set_", "aten::resize_", "aten::numpy_T",
                "aten::view_as", "aten::expand_as", "aten::squeeze_", "aten::unsqueeze_"}
COMPILED_GRAPH_MARK = "CompiledFxGraph"   # the profiler's range around a compiled graph's kernels
COMM_MARKS = ("gloo", "c10d::", "nccl", "record_param_comms")


@dataclass(frozen=True)
class ProfiledOp:
    """One profiled event: its name, its own (self) time and the names of the ranges around it."""

    name: str
    self_us: float
    ancestors: tuple[str, ...]


def categorize(op: ProfiledOp) -> str | None:
    """The category of ``op``'s self time; None for framework overhead."""
    around = op.ancestors
    if any(a == OPTIMIZER_RANGE for a in around) or op.name == OPTIMIZER_RANGE:
        return "optimizer"
    if any(a.startswith(COMM_PREFIX) for a in (*around, op.name)) or any(
            m in op.name for m in COMM_MARKS):
        return "communication"
    if any(m in name for name in (op.name, *around) for m in ATTENTION_MARKS):
        return "attention core"   # the fused kernel and whatever runs inside it
    if op.name in BATCHED_GEMM_OPS and any(COMPILED_GRAPH_MARK in a for a in around):
        return "attention core"   # its softmax is in inductor's kernels (elementwise)
    if op.name in GEMM_OPS:
        return "GEMMs"
    if op.name in CAST_OPS or (op.name == "aten::copy_" and any(a in CAST_OPS for a in around)):
        return "casts"
    if COMPILED_GRAPH_MARK in op.name:   # --compile: the self time of a compiled graph's call is
        return "elementwise/norm/activation"   # inductor's fused kernels (its GEMMs are aten ops)
    if op.name.startswith("aten::") and op.name not in METADATA_OPS:
        return "elementwise/norm/activation"
    return None


def breakdown(ops: list[ProfiledOp], wall_us: float) -> dict[str, float]:
    """Microseconds per category over ``wall_us``; the rest (wall less the categorised self
    times) is framework overhead."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for op in ops:
        category = categorize(op)
        if category is not None:
            out[category] += op.self_us
    out["framework overhead (rest)"] = max(0.0, wall_us - sum(out.values()))
    return out


def profiled_ops(prof) -> list[ProfiledOp]:
    """The CPU events of a finished ``torch.profiler.profile`` with their enclosing ranges."""
    out = []
    for event in prof.events():
        names, parent = [], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        out.append(ProfiledOp(event.name, float(event.self_cpu_time_total), tuple(names)))
    return out


@contextmanager
def labelled(optimizer):
    """``optimizer``'s step and hybrid.comm's collectives (and their handles' waits) inside named
    profiler ranges, for :func:`categorize`; undone on exit."""
    import torch
    from hybrid import comm
    originals = {name: getattr(comm, name) for name in ("all_reduce", "all_gather_into",
                                                         "reduce_scatter_into", "broadcast",
                                                         "p2p", "barrier")}

    def ranged(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(COMM_PREFIX + name):
                handle = fn(*args, **kwargs)
            return _RangedHandle(handle, name) if hasattr(handle, "wait") else handle
        return call

    step = optimizer.step

    def optimizer_step(*args, **kwargs):
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            return step(*args, **kwargs)

    for name, fn in originals.items():
        setattr(comm, name, ranged(name, fn))
    optimizer.step = optimizer_step
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
        del optimizer.step


class _RangedHandle:
    """An async collective's handle whose ``wait`` is a communication range."""

    def __init__(self, handle, name: str):
        self._handle, self._name = handle, name

    def wait(self, *args, **kwargs):
        import torch
        with torch.profiler.record_function(COMM_PREFIX + self._name + ".wait"):
            return self._handle.wait(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._handle, attr)


def profile_steps(step, optimizer, *, warmup: int, steps: int, barrier=lambda: None) -> dict:
    """``warmup`` calls of ``step()``, ``steps`` timed ones, then ``steps`` under the profiler with
    ``optimizer.step`` and hybrid.comm's collectives labelled: the mean profiled and unprofiled step
    seconds and the profiled steps' seconds per category. ``barrier`` lines the ranks up before
    each timed part."""
    import torch
    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    plain = (time.perf_counter() - start) / steps
    barrier()
    with labelled(optimizer), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        profiled = (time.perf_counter() - start) / steps
    parts = breakdown(profiled_ops(prof), profiled * steps * 1e6)
    return {"step_s": profiled, "unprofiled_step_s": plain,
            "parts_s": {k: v / steps / 1e6 for k, v in parts.items()}}


def _rank_main(rank, world, argv, steps, warmup, threads):
    import logging
    import torch
    from pretrain.arguments import parse_args
    from pretrain.build import build_parallel_state
    from pretrain.setup import build_trainer
    logging.disable(logging.INFO)
    torch.set_num_threads(threads)
    cfg, _ = parse_args(argv)
    cfg.logging.tensorboard_dir, cfg.checkpoint.save, cfg.training.eval_iters = None, None, 0
    layout = cfg.validate_for_world(world)
    state = build_parallel_state(cfg, layout)
    trainer = build_trainer(cfg, layout, state)
    loader = trainer.make_loader("train", 0)
    lr = trainer.schedule(0)
    result = profile_steps(lambda: trainer.train_step(loader, lr), trainer.optimizer,
                           warmup=warmup, steps=steps, barrier=lambda: comm_barrier(state))
    return {**result, "gemm_bound_s": trainer.throughput.gemm_bound_s,
            "precision": cfg.optimizer.precision, "world": world, "tp": state.tp_size,
            "dp": state.dp_size, "zero_stage": cfg.parallel.zero_stage}


def comm_barrier(state) -> None:
    from hybrid import comm
    comm.barrier(state.world)


def report(r: dict) -> str:
    step, bound = r["step_s"], r["gemm_bound_s"]
    lines = [f"step breakdown, rank 0 of {r['world']} (TP {r['tp']} x DP {r['dp']}, ZeRO stage "
             f"{r['zero_stage']}, {r['precision']}); mean of the profiled steps",
             f"{'category':<30} {'ms/step':>9} {'% of step':>10}"]
    for name, seconds in r["parts_s"].items():
        lines.append(f"{name:<30} {1e3 * seconds:>9.2f} {100 * seconds / step:>9.1f}%")
    lines.append(f"{'step (profiled)':<30} {1e3 * step:>9.2f} {100.0:>9.1f}%")
    if bound is not None:
        lines += [f"GEMM-bound time {1e3 * bound:.2f} ms/step: the profiled step is at "
                  f"{100 * bound / step:.1f}% of it, an unprofiled step ({1e3 * r['unprofiled_step_s']:.2f}"
                  f" ms) at {100 * bound / r['unprofiled_step_s']:.1f}%; the GEMMs measured in the "
                  f"step take {100 * r['parts_s']['GEMMs'] / bound:.0f}% of their GEMM-bound time"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools._cli import ArgumentParser
    parser = ArgumentParser(description=__doc__, add_help=True,
                            formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after as many timed)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before any timing")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    ours, trainer_argv = parser.parse_known_args(argv)
    for flag in ("steps", "threads"):
        if getattr(ours, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    from pretrain.arguments import parse_args
    cfg, _ = parse_args(trainer_argv)   # bad trainer flags fail here, before any rank starts
    world = cfg.parallel.world_size or cfg.parallel.tensor_model_parallel_size
    from hybrid.testing.multirank import run_on_ranks
    results = run_on_ranks(_rank_main, world, args=(trainer_argv, ours.steps, ours.warmup,
                                                    ours.threads), timeout=1800)
    print(json.dumps(results[0], indent=2) if ours.json else report(results[0]))
    return 0


if __name__ == "__main__":
    from tools._cli import run_cli
    sys.exit(run_cli(main))
