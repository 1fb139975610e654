"""One GPU, bf16: our GPT training step against plain PyTorch and torch.compile of the same model (issue 19).

Four variants train the same GPT-2-family model (same config, same initial weights, same data, same
activation recompute) for ``--steps`` timed steps after ``--warmup`` steps each:

* ``ours``: ``models/gpt`` GPTModel at TP 1 with ZeRO stage 0 (bf16 parameters and gradients, fp32
  master and moments, torch's fused AdamW kernel) and ``--recompute`` from ``hybrid/recompute``;
* ``torch``: the oracle ``models/gpt/reference.py`` with SDPA attention (``is_causal``) under
  ``torch.autocast(bfloat16)``, fp32 parameters and ``torch.optim.AdamW(fused=True)`` - the plain
  PyTorch recipe with the same 16 bytes of model state per parameter; with ``--recompute full``
  every block runs under ``torch.utils.checkpoint`` (non-reentrant);
* ``torch.compile``: that baseline model wrapped by ``torch.compile`` (default mode);
* ``ours compiled``: ``ours`` under the trainer's ``--compile`` (each transformer layer compiled by
  ``models/gpt/compile.py``, the AdamW update as one compiled pass, ``hybrid/zero/adamw_compiled.py``).

Reported per variant: ms/step (median of the timed steps, CUDA events), tokens/s, model TFLOP/s
(Megatron's 72 B s l h^2 (1 + s/6h + V/12lh), recompute not counted: hybrid.perf.flops), MFU against
the device's dense bf16 peak (table below, ``--peak-tflops`` overrides) and the peak memory the
allocator handed out. The target is ours >= 0.95x the plain-torch step rate.

``--size auto`` takes the largest size of ``SIZES`` whose estimated memory (hybrid.perf.memory,
stage 0, the chosen recompute) fits ``--memory-gib`` (default: 90% of the device's memory), and
falls back to the next smaller size if that still runs out of memory.
``--device cpu --size tiny`` is a smoke mode that runs the same code on CPU (fp32 autocast off) so
CI exercises it; without CUDA any other invocation exits with an ``error:`` line.

    python benchmarks/gpu_single.py                        # on a CUDA machine
    python benchmarks/gpu_single.py --device cpu --size tiny --steps 2 --warmup 0 --no-compile
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from hybrid.parallel_state import ParallelState   # noqa: E402
from hybrid.perf.flops import model_flops_per_iteration   # noqa: E402
from hybrid.perf.memory import device_memory   # noqa: E402
from hybrid.recompute import RecomputePlan   # noqa: E402
from hybrid.tensor_parallel import RNGTracker   # noqa: E402
from hybrid.adamw_config import AdamWConfig   # noqa: E402
from hybrid.zero.config import ZeroConfig   # noqa: E402
from hybrid.zero.factory import build_zero_optimizer   # noqa: E402
from models.gpt import reference   # noqa: E402
from models.gpt.compile import compile_layers   # noqa: E402
from models.gpt.config import GPTConfig   # noqa: E402
from models.gpt.model import GPTModel   # noqa: E402
from models.gpt.presets import PRESETS   # noqa: E402
from pretrain.device_peaks import peak_tflops_of   # noqa: E402

log = logging.getLogger("gpu_single")

# GPT-2 family by size (seq 1024, vocab 50257), smallest first; "gpt-1.3B" is GPT-3 XL's shape.
SIZES: dict[str, GPTConfig] = {
    "tiny": PRESETS["tiny"],
    "gpt2-small": PRESETS["gpt2-small"],
    "gpt2-medium": PRESETS["gpt2-medium"],
    "gpt2-large": PRESETS["gpt2-large"],
    "gpt-1.3B": GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16),
    "gpt2-1.5B": PRESETS["gpt2-1.5B"],
}
RESULTS = REPO / "benchmarks" / "results"
TARGET = 0.95   # ours / plain torch step rate


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 tensor-core peak of a GPU by name (the table is pretrain.device_peaks')."""
    return peak_tflops_of(device_name)


def pick_size(requested: str, memory_bytes: float, micro_batch: int, seq: int, recompute: str) -> str:
    """``requested`` itself, or for ``auto`` the largest GPT-2-family size that fits."""
    if requested != "auto":
        return requested
    fitting = [name for name, c in SIZES.items() if name != "tiny" and estimate_bytes(
        c, micro_batch, seq, recompute) <= memory_bytes]
    if not fitting:
        raise SystemExit(f"error: no GPT-2 size fits {memory_bytes / 2**30:.1f} GiB at micro-batch "
                         f"{micro_batch}, seq {seq}; lower --micro-batch-size or use --recompute full")
    return fitting[-1]


def estimate_bytes(c: GPTConfig, micro_batch: int, seq: int, recompute: str) -> float:
    """One GPU, stage 0, bf16 + fp32 master/moments (16 B/param) plus activations (hybrid.perf)."""
    return device_memory(layers=c.num_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                         seq=seq, vocab=c.vocab_size, micro_batch=micro_batch, tp=1, dp=1, stage=0,
                         recompute=recompute, bucket_elements=None).total


# ---- the plain-torch baseline -----------------------------------------------------------------
class SdpaAttention(reference.Attention):
    """The oracle's attention with torch's fused SDPA kernel instead of the spelled-out softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)                                   # 3 x [b, s, h]
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [b, a, s, d]
        p = self.dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)    # [b, a, s, d]
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Checkpointed(nn.Module):
    """A block recomputed in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def build_torch_baseline(config: GPTConfig, device: torch.device, recompute: str, seed: int):
    model = reference.ReferenceGPT(config)
    model.init_weights(seed)
    for block in model.layers:
        block.attn.__class__ = SdpaAttention
    if recompute == "full":
        model.layers = nn.ModuleList(Checkpointed(b) for b in model.layers)
    model.to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    return model, opt


def torch_step(model, opt, tokens, labels, bf16: bool) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(tokens, labels).mean()
    loss.backward()
    opt.step()
    return loss.detach()


# ---- ours -------------------------------------------------------------------------------------
def build_ours(config: GPTConfig, device: torch.device, recompute: str, seed: int, bf16: bool,
               compiled: bool = False):
    """Our model at TP 1, ZeRO stage 0; ``compiled``: the trainer's ``--compile`` (each layer
    compiled, the AdamW update as one compiled pass)."""
    state = ParallelState.single_process(device)
    rng = RNGTracker(seed, 0, state.device)
    rng.seed_all()
    plan = RecomputePlan.uniform(recompute, config.num_layers) if recompute != "none" else None
    model = GPTModel(config, state, device="meta", rng=rng, recompute=plan)
    model.init_weights(seed)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=0, precision="bf16" if bf16 else "fp32"),
                               AdamWConfig(lr=1e-4, weight_decay=0.01,
                                           kernel="compiled" if compiled else "fused"))
    if compiled:
        compile_layers(model)
    return model, opt


def ours_step(model, opt, tokens, labels) -> torch.Tensor:
    opt.zero_grad()
    loss = model(tokens, labels).mean()
    opt.backward(loss)
    opt.step()
    return loss.detach()


# ---- timing -----------------------------------------------------------------------------------
def time_steps(step, device: torch.device, warmup: int, steps: int) -> tuple[list[float], float]:
    """Milliseconds of each timed step (CUDA events; wall clock on CPU) and the last loss."""
    loss = None
    for _ in range(warmup):
        loss = step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, float(loss)


def run_variant(name: str, args, config: GPTConfig, device: torch.device) -> dict:
    bf16 = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.micro_batch_size, config.seq_length)
    tokens = torch.randint(0, config.vocab_size, shape, generator=gen).to(device)
    labels = torch.randint(0, config.vocab_size, shape, generator=gen).to(device)
    _reset_memory(device)
    if name.startswith("ours"):
        model, opt = build_ours(config, device, args.recompute, args.seed, bf16,
                                compiled=name == "ours compiled")
        step = lambda: ours_step(model, opt, tokens, labels)   # noqa: E731
    else:
        model, opt = build_torch_baseline(config, device, args.recompute, args.seed)
        run = torch.compile(model) if name == "torch.compile" else model
        step = lambda: torch_step(run, opt, tokens, labels, bf16)   # noqa: E731
    times, loss = time_steps(step, device, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, opt, step
    _reset_memory(device)
    ms = statistics.median(times)
    b, s = args.micro_batch_size, config.seq_length
    tflops = model_flops_per_iteration(b, s, config.num_layers, config.hidden_size,
                                       config.vocab_size) / (ms / 1e3) / 1e12
    return {"variant": name, "ms_per_step": ms, "ms_all": times, "tokens_per_s": b * s / (ms / 1e3),
            "tflops": tflops, "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
            "peak_memory_bytes": peak, "last_loss": loss}


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- report -----------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    rows = ["| variant | ms/step | tokens/s | TFLOP/s | MFU | peak memory (GiB) | vs torch |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = next((r for r in result["variants"] if r["variant"] == "torch"), None)
    for r in result["variants"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r["peak_memory_bytes"] else "n/a"
        ratio = f"{base['ms_per_step'] / r['ms_per_step']:.3f}x" if base else "n/a"
        rows.append(f"| {r['variant']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['tflops']:.1f} | {mfu} | {mem} | {ratio} |")
    return "\n".join(rows)


def run_size(size: str, args, device: torch.device, device_name: str, memory: float) -> dict:
    """Every variant on ``size`` (a key of SIZES): the result without the comparison."""
    base = SIZES[size]
    seq = args.seq_length or base.seq_length
    config = GPTConfig(**{**base.to_dict(), "seq_length": seq, "max_position_embeddings": None})
    log.info("%s on %s: %d layers, hidden %d, micro-batch %d, seq %d, recompute %s, peak %s TFLOP/s",
             size, device_name, config.num_layers, config.hidden_size, args.micro_batch_size, seq,
             args.recompute, args.peak_tflops)
    variants = ["torch", *([] if args.no_compile else ["torch.compile"]), "ours",
                *([] if args.no_compile else ["ours compiled"])]
    return {"device": device_name, "size": size, "memory_stated_gib": memory / 2**30,
            "config": config.to_dict(), "micro_batch": args.micro_batch_size,
            "recompute": args.recompute, "peak_tflops": args.peak_tflops, "torch": torch.__version__,
            "variants": [run_variant(v, args, config, device) for v in variants]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the benchmark) or cpu (smoke mode, --size tiny)")
    p.add_argument("--size", default="auto", choices=["auto", *SIZES],
                   help="model size; auto = the largest that fits --memory-gib")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory the size must fit (default: 90%% of the device's)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=None, help="default: the size's (1024)")
    p.add_argument("--recompute", default="full", choices=["none", "full"],
                   help="activation recompute of every variant")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation too)")
    p.add_argument("--no-compile", action="store_true", help="skip the two compiled variants")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the device for MFU (default: from the device name)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/gpu_single-<size>.json)")
    return p.parse_args(argv)


def argument_error(args) -> str | None:
    if args.steps < 1 or args.warmup < 0 or args.micro_batch_size < 1:
        return "--steps and --micro-batch-size must be >= 1 and --warmup >= 0"
    if args.device == "cuda" and not torch.cuda.is_available():
        return ("this benchmark needs CUDA (torch.cuda.is_available() is False); on a CPU machine "
                "run the smoke mode: --device cpu --size tiny")
    if args.device == "cpu" and args.size != "tiny":
        return "--device cpu is a smoke mode for --size tiny only"
    return None


def run_fitting(args, device: torch.device, name: str, memory: float) -> dict | None:
    """The chosen size; with ``--size auto`` the next smaller one after an out-of-memory error
    (the memory estimate is a model, not a measurement). None: nothing fitted."""
    seq = args.seq_length or SIZES["gpt2-small"].seq_length
    size = pick_size(args.size, memory, args.micro_batch_size, seq, args.recompute)
    while True:
        try:
            return run_size(size, args, device, name, memory)
        except torch.cuda.OutOfMemoryError:
            smaller = list(SIZES)[list(SIZES).index(size) - 1]
            if args.size != "auto" or smaller == "tiny":
                return None
            log.warning("%s ran out of GPU memory; falling back to %s", size, smaller)
            size = smaller
            _reset_memory(device)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    problem = argument_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    memory = args.memory_gib * 2**30 if args.memory_gib else 0.9 * total
    if args.peak_tflops is None and cuda:
        args.peak_tflops = peak_tflops(name)
    result = run_fitting(args, device, name, memory)
    if result is None:
        print(f"error: out of GPU memory at micro-batch {args.micro_batch_size}; lower "
              f"--micro-batch-size or choose a smaller --size", file=sys.stderr)
        return 1
    size = result["size"]
    ours = next(r for r in result["variants"] if r["variant"] == "ours")
    torch_run = next(r for r in result["variants"] if r["variant"] == "torch")
    result["ours_vs_torch"] = torch_run["ms_per_step"] / ours["ms_per_step"]
    result["target_met"] = result["ours_vs_torch"] >= TARGET
    out = Path(args.out) if args.out else RESULTS / f"gpu_single-{size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"\nours / plain torch step rate: {result['ours_vs_torch']:.3f}x (target >= {TARGET}x: "
          f"{'met' if result['target_met'] else 'NOT met'}); results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
