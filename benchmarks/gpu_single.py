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

Issue 36 adds the Llama family (Llama-3.2 1B and 3B as published: RoPE with Llama-3 scaling,
RMSNorm, SwiGLU, GQA with 8 key/value groups, tied embeddings) and runs the shapes users train:
``--configs llama3.2-3B@4096 llama3.2-1B@2048 ...`` (``--all-configs``: GPT-2 1.5B at 1024 and both
Llamas at 2048 and 4096). Each configuration is set up as a user would: ``--micro-batch-size auto``
takes the largest micro-batch the memory model (hybrid.perf.memory, with the model's architecture)
says fits, and ``--recompute auto`` the lightest recompute that fits one (none, then selective,
then full). A fifth row, ``ours fp8``, trains with ``--fp8-format hybrid`` where this framework has
that option (it prints "not available" where it does not). MFU counts model FLOPs; HFU counts what
the hardware ran (full recompute: one more forward of every layer; selective: the attention core's
forward once more). ``--profile`` writes a profiler summary beside the table: the top kernels by
device time, the GPU's idle fraction over the profiled steps and the host-bound part of it (gaps
that end with a kernel launched only after the previous kernel had finished: the GPU waited for the
host).

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


def _llama32(layers: int, hidden: int, heads: int) -> GPTConfig:
    """Llama-3.2 as published (1B, 3B): GQA with 8 key/value groups, SwiGLU width 8192, RMSNorm,
    RoPE base 500000 with Llama-3 scaling (factor 32 over 8192 positions), vocabulary 128256,
    TIED input and output embeddings, no biases, no dropout."""
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     ffn_hidden_size=8192, vocab_size=128256, seq_length=2048,
                     hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                     rotary_base=500000.0, use_rope_scaling=True, rope_scaling_factor=32.0,
                     normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                     group_query_attention=True, num_query_groups=8,
                     untie_embeddings_and_output_weights=False)


SIZES["llama3.2-1B"] = _llama32(16, 2048, 32)
SIZES["llama3.2-3B"] = _llama32(28, 3072, 24)
SIZES["tiny-llama"] = PRESETS["tiny-llama"]
GPT2_SIZES = [n for n in SIZES if n.startswith("gpt")]
# the shapes of issue 36: GPT-2 1.5B beside the Llama-3.2 models at the sequences users train
ALL_CONFIGS = ("gpt2-1.5B@1024", "llama3.2-1B@2048", "llama3.2-1B@4096", "llama3.2-3B@2048",
               "llama3.2-3B@4096")
RECOMPUTE_ORDER = ("none", "selective", "full")   # --recompute auto: the first that fits
RESULTS = REPO / "benchmarks" / "results"
TARGET = 0.95   # ours / plain torch step rate


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 tensor-core peak of a GPU by name (the table is pretrain.device_peaks')."""
    return peak_tflops_of(device_name)


def pick_size(requested: str, memory_bytes: float, micro_batch: int, seq: int, recompute: str) -> str:
    """``requested`` itself, or for ``auto`` the largest GPT-2-family size that fits."""
    if requested != "auto":
        return requested
    fitting = [name for name in GPT2_SIZES if estimate_bytes(
        SIZES[name], micro_batch, seq, recompute) <= memory_bytes]
    if not fitting:
        raise SystemExit(f"error: no GPT-2 size fits {memory_bytes / 2**30:.1f} GiB at micro-batch "
                         f"{micro_batch}, seq {seq}; lower --micro-batch-size or use --recompute full")
    return fitting[-1]


def estimate_bytes(c: GPTConfig, micro_batch: int, seq: int, recompute: str) -> float:
    """One GPU, stage 0, bf16 + fp32 master/moments (16 B/param) plus activations (hybrid.perf),
    with the model's architecture (GQA, SwiGLU, RMSNorm, tied or not) and the attention core that
    runs on the GPU (SDPA's fused kernels: no [s, s] scores kept, issue 31)."""
    return device_memory(layers=c.num_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                         seq=seq, vocab=c.vocab_size, micro_batch=micro_batch, tp=1, dp=1, stage=0,
                         recompute=recompute, bucket_elements=None,
                         arch=c.perf_architecture(), attention_core="flash",
                         attention_dropout=c.attention_dropout > 0).total


def choose_setup(c: GPTConfig, seq: int, memory_bytes: float, micro_batch: int | None,
                 recompute: str, max_micro_batch: int = 64) -> tuple[int, str] | None:
    """(micro-batch, recompute) as a user would pick them: with ``recompute`` "auto" the first of
    none, selective, full at which some micro-batch fits; with ``micro_batch`` None the largest
    micro-batch that fits at that recompute (memory model). None: nothing fits."""
    modes = RECOMPUTE_ORDER if recompute == "auto" else (recompute,)
    for mode in modes:
        if micro_batch is not None:
            if estimate_bytes(c, micro_batch, seq, mode) <= memory_bytes or len(modes) == 1:
                return micro_batch, mode
            continue
        fits = [b for b in range(1, max_micro_batch + 1)
                if estimate_bytes(c, b, seq, mode) <= memory_bytes]
        if fits:
            return max(fits), mode
    if micro_batch is not None:   # the user's micro-batch: the heaviest recompute, let it try
        return micro_batch, modes[-1]
    return None


# ---- the plain-torch baseline -----------------------------------------------------------------
class SdpaAttention(reference.Attention):
    """The oracle's attention with torch's fused SDPA kernel instead of the spelled-out softmax;
    RoPE as a precomputed cos/sin table (what a plain-PyTorch Llama does) and GQA through SDPA's
    ``enable_gqa`` (no repeated K/V)."""

    def _rotary(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = getattr(self, "_cos_sin", None)
        if cached is None or cached[0].size(0) != s or cached[0].device != device:
            angles = (torch.arange(s, dtype=torch.float64)[:, None]
                      * reference.rotary_frequencies(self.config)[None, :])     # [s, d/2]
            cached = (angles.cos().float().to(device), angles.sin().float().to(device))
            self._cos_sin = cached
        return cached

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pairs (i, i + d/2) of x [b, heads, s, d] turned by their angles (the oracle's rotation)."""
        d = x.size(-1)
        x1, x2 = x[..., :d // 2].float(), x[..., d // 2:].float()
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        kv = self.groups * self.config.head_dim
        q, k, v = self.qkv(x).split([h, kv, kv], dim=2)
        q = q.view(b, s, self.heads, -1).transpose(1, 2)                        # [b, a, s, d]
        k, v = (t.view(b, s, self.groups, -1).transpose(1, 2) for t in (k, v))  # [b, g, s, d]
        if self.config.position_embedding_type == "rope":
            cos, sin = self._rotary(s, x.device)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        p = self.dropout.p if self.training else 0.0
        gqa = {"enable_gqa": True} if self.groups != self.heads else {}
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, **gqa)  # [b, a, s, d]
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
    elif recompute == "selective":   # the attention block recomputed in backward (ours
        # recomputes only its core, so the baseline does a little more work: HFU counts ours)
        for block in model.layers:
            block.attn = Checkpointed(block.attn)
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
    compiled, the AdamW update as one compiled pass). ``config`` may carry FP8 options
    (:func:`fp8_options`)."""
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


def fp8_options(fmt: str = "hybrid") -> tuple[dict | None, str]:
    """The model-config fields that ``--fp8-format <fmt>`` sets in this framework, and why not
    where it cannot: (None, reason) while the option does not exist (issue 36 item 4 adds it) or
    is not a model option the benchmark can build with."""
    from pretrain.arguments import parse_args as train_args
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "256", "--bf16"]
    try:
        plain, _ = train_args(base)
        fp8, _ = train_args(base + ["--fp8-format", fmt])
    except (Exception, SystemExit) as err:   # refused or unknown: argparse exits, the catalogue raises
        return None, f"--fp8-format {fmt} is not available here ({str(err).splitlines()[0][:120]})"
    changed = {k: v for k, v in fp8.model.to_dict().items() if plain.model.to_dict().get(k) != v}
    if not changed:
        return None, (f"--fp8-format {fmt} is accepted but sets no model option this benchmark can "
                      f"build with")
    return changed, ""


def run_variant(name: str, args, config: GPTConfig, device: torch.device) -> dict:
    bf16 = device.type == "cuda"
    if name == "ours fp8":
        options, why = fp8_options()
        if options is None:
            log.info("ours fp8: not available: %s", why)
            return {"variant": name, "available": False, "why": why}
        config = GPTConfig(**{**config.to_dict(), **options})
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.micro_batch_size, config.seq_length)
    tokens = torch.randint(0, config.vocab_size, shape, generator=gen).to(device)
    labels = torch.randint(0, config.vocab_size, shape, generator=gen).to(device)
    _reset_memory(device)
    if name.startswith("ours"):
        model, opt = build_ours(config, device, args.recompute, args.seed, bf16,
                                compiled=name in ("ours compiled", "ours fp8"))
        step = lambda: ours_step(model, opt, tokens, labels)   # noqa: E731
    else:
        model, opt = build_torch_baseline(config, device, args.recompute, args.seed)
        run = torch.compile(model) if name == "torch.compile" else model
        step = lambda: torch_step(run, opt, tokens, labels, bf16)   # noqa: E731
    times, loss = time_steps(step, device, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    profile = None
    if getattr(args, "profile_variant", None) == name:
        profile = profile_steps(step, device, steps=2)
    del model, opt, step
    _reset_memory(device)
    ms = statistics.median(times)
    b, s = args.micro_batch_size, config.seq_length
    model_flops, hardware_flops = step_flops(config, b, s, args.recompute)
    tflops, hw_tflops = model_flops / (ms / 1e3) / 1e12, hardware_flops / (ms / 1e3) / 1e12
    out = {"variant": name, "available": True, "ms_per_step": ms, "ms_all": times,
           "tokens_per_s": b * s / (ms / 1e3), "tflops": tflops, "hw_tflops": hw_tflops,
           "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
           "hfu": hw_tflops / args.peak_tflops if args.peak_tflops else None,
           "peak_memory_bytes": peak, "last_loss": loss}
    if profile is not None:
        out["profile"] = profile
    return out


def step_flops(config: GPTConfig, b: int, s: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step: hybrid.perf.flops with the model's
    architecture; full recompute adds one forward of every layer, selective the attention core's
    forward (4 b s^2 h per layer: QK^T and PV) once more."""
    arch, heads = config.perf_architecture(), config.num_attention_heads
    args = (b, s, config.num_layers, config.hidden_size, config.vocab_size)
    model = model_flops_per_iteration(*args, heads=heads, arch=arch)
    if recompute == "full":
        return model, model_flops_per_iteration(*args, heads=heads, arch=arch, full_recompute=True)
    if recompute == "selective":
        return model, model + config.num_layers * 4 * b * s * s * config.hidden_size
    return model, model


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- report -----------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    rows = ["| variant | ms/step | tokens/s | TFLOP/s | MFU | HFU | peak memory (GiB) | vs torch |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = next((r for r in result["variants"] if r["variant"] == "torch"), None)
    for r in result["variants"]:
        if not r.get("available", True):
            rows.append(f"| {r['variant']} | not available | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        hfu = f"{100 * r['hfu']:.1f}%" if r.get("hfu") is not None else "n/a"
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r["peak_memory_bytes"] else "n/a"
        ratio = f"{base['ms_per_step'] / r['ms_per_step']:.3f}x" if base else "n/a"
        rows.append(f"| {r['variant']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['tflops']:.1f} | {mfu} | {hfu} | {mem} | {ratio} |")
    return "\n".join(rows)


def title(result: dict) -> str:
    return (f"{result['size']} on {result['device']}: seq {result['config']['seq_length']}, "
            f"micro-batch {result['micro_batch']}, recompute {result['recompute']}, peak "
            f"{result['peak_tflops']} TFLOP/s (bf16 dense)")


# ---- profile ----------------------------------------------------------------------------------
def profile_steps(step, device: torch.device, steps: int = 2, top: int = 15) -> dict:
    """torch.profiler over ``steps`` steps: the top kernels (CUDA) or ops (CPU) by device time,
    and on CUDA the GPU's idle fraction of the profiled span and the host-bound part of it."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out = {"steps": steps, "top": [], "gpu_idle_fraction": None, "host_bound_fraction": None}
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    averages = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    total = sum(getattr(e, "self_" + key, 0.0) for e in averages) or 1.0
    for e in averages[:top]:
        out["top"].append({"name": e.key[:90], "calls": e.count, "ms": getattr(e, key, 0.0) / 1e3,
                           "share": getattr(e, "self_" + key, 0.0) / total})
    if device.type == "cuda":
        try:
            out.update(gpu_timeline(prof))
        except Exception as err:   # the kineto event API differs between torch builds
            out["timeline_error"] = f"{type(err).__name__}: {err}"
    return out


def gpu_timeline(prof) -> dict:
    """Idle and host-bound fractions from the kernel timeline: kernels sorted by start; a gap
    between the end of the kernels so far and the next kernel is idle, and host-bound when that
    kernel's launch call began after the previous kernels had ended (the GPU waited for it)."""
    events = prof.profiler.kineto_results.events()
    launches, kernels = {}, []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.correlation_id()))
        elif e.name().startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpyAsync")):
            launches[e.correlation_id()] = e.start_ns()
    if not kernels:
        return {"gpu_idle_fraction": None, "host_bound_fraction": None}
    kernels.sort()
    span = kernels[-1][1] - kernels[0][0]
    busy_end, idle, host_bound = kernels[0][1], 0, 0
    for start, end, corr in kernels[1:]:
        if start > busy_end:
            gap = start - busy_end
            idle += gap
            if launches.get(corr, 0) >= busy_end:
                host_bound += gap
        busy_end = max(busy_end, end)
    return {"gpu_idle_fraction": idle / span if span else 0.0,
            "host_bound_fraction": host_bound / span if span else 0.0}


def profile_markdown(result: dict) -> str:
    lines = [f"# Profile: {title(result)}", ""]
    for r in result["variants"]:
        p = r.get("profile")
        if p is None:
            continue
        idle = p.get("gpu_idle_fraction")
        bound = p.get("host_bound_fraction")
        lines += [f"## {r['variant']} ({p['steps']} steps)", "",
                  f"GPU idle: {'n/a' if idle is None else f'{100 * idle:.1f}%'} of the profiled span; "
                  f"host-bound (the GPU waited for a launch): "
                  f"{'n/a' if bound is None else f'{100 * bound:.1f}%'}"
                  + (f" ({p['timeline_error']})" if p.get("timeline_error") else ""), "",
                  "| kernel / op | calls | ms | share |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{t['name']}` | {t['calls']} | {t['ms']:.2f} | {100 * t['share']:.1f}% |"
                  for t in p["top"]]
        lines.append("")
    return "\n".join(lines)


def run_size(size: str, args, device: torch.device, device_name: str, memory: float) -> dict:
    """Every variant on ``size`` (a key of SIZES) at ``args.seq_length`` (default: the size's),
    ``args.micro_batch_size`` and ``args.recompute`` (resolved by :func:`choose_setup` when
    "auto"): the result without the comparison."""
    base = SIZES[size]
    seq = args.seq_length or base.seq_length
    config = GPTConfig(**{**base.to_dict(), "seq_length": seq, "max_position_embeddings": None})
    chosen = choose_setup(config, seq, memory, args.micro_batch_size, args.recompute)
    if chosen is None:
        raise torch.cuda.OutOfMemoryError(f"{size} at seq {seq} fits no micro-batch in "
                                          f"{memory / 2**30:.1f} GiB")
    run_args = argparse.Namespace(**{**vars(args), "micro_batch_size": chosen[0],
                                     "recompute": chosen[1]})
    log.info("%s on %s: %d layers, hidden %d, micro-batch %d, seq %d, recompute %s, peak %s TFLOP/s",
             size, device_name, config.num_layers, config.hidden_size, chosen[0], seq, chosen[1],
             args.peak_tflops)
    variants = ["torch", *([] if args.no_compile else ["torch.compile"]), "ours",
                *([] if args.no_compile else ["ours compiled"]), *(["ours fp8"] if args.fp8 else [])]
    return {"device": device_name, "size": size, "memory_stated_gib": memory / 2**30,
            "config": config.to_dict(), "micro_batch": chosen[0],
            "recompute": chosen[1], "peak_tflops": args.peak_tflops, "torch": torch.__version__,
            "variants": [run_variant(v, run_args, config, device) for v in variants]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the benchmark) or cpu (smoke mode, --size tiny)")
    p.add_argument("--size", default="auto", choices=["auto", *SIZES],
                   help="model size; auto = the largest that fits --memory-gib")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory the size must fit (default: 90%% of the device's)")
    p.add_argument("--micro-batch-size", default="auto",
                   help="an integer, or auto: the largest the memory model says fits")
    p.add_argument("--seq-length", type=int, default=None, help="default: the size's (1024)")
    p.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"],
                   help="activation recompute of every variant; auto: none, then selective, then "
                        "full - the first at which a micro-batch fits")
    p.add_argument("--configs", nargs="+", default=None, metavar="SIZE@SEQ",
                   help="run these configurations one after the other (e.g. llama3.2-3B@4096)")
    p.add_argument("--all-configs", action="store_true",
                   help=f"run {', '.join(ALL_CONFIGS)}")
    p.add_argument("--no-fp8", dest="fp8", action="store_false",
                   help="skip the 'ours fp8' row (--fp8-format hybrid)")
    p.add_argument("--profile", default=None, metavar="VARIANT",
                   help="profile 2 steps of this variant (e.g. 'ours compiled') and write the "
                        "summary beside the JSON (<out>.profile.md)")
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
    if args.micro_batch_size == "auto":
        args.micro_batch_size = None
    else:
        try:
            args.micro_batch_size = int(args.micro_batch_size)
        except ValueError:
            return f"--micro-batch-size must be an integer or auto, got {args.micro_batch_size!r}"
    if args.all_configs:
        args.configs = list(ALL_CONFIGS)
    for item in args.configs or ():
        size, _, seq = item.partition("@")
        if size not in SIZES or (seq and not seq.isdigit()):
            return (f"--configs {item}: expected SIZE@SEQ with SIZE one of {', '.join(SIZES)}")
    if args.steps < 1 or args.warmup < 0 or (args.micro_batch_size is not None
                                             and args.micro_batch_size < 1):
        return "--steps and --micro-batch-size must be >= 1 and --warmup >= 0"
    if args.device == "cuda" and not torch.cuda.is_available():
        return ("this benchmark needs CUDA (torch.cuda.is_available() is False); on a CPU machine "
                "run the smoke mode: --device cpu --size tiny")
    if args.device == "cpu" and (args.size not in ("tiny", "tiny-llama") or args.configs):
        return "--device cpu is a smoke mode for --size tiny or tiny-llama only"
    return None


def run_fitting(args, device: torch.device, name: str, memory: float) -> dict | None:
    """The chosen size; with ``--size auto`` the next smaller one after an out-of-memory error
    (the memory estimate is a model, not a measurement). None: nothing fitted."""
    seq = args.seq_length or SIZES["gpt2-small"].seq_length
    size = pick_size(args.size, memory, args.micro_batch_size or 4, seq,
                     "full" if args.recompute == "auto" else args.recompute)
    while True:
        try:
            return run_size(size, args, device, name, memory)
        except torch.cuda.OutOfMemoryError:
            smaller = GPT2_SIZES[GPT2_SIZES.index(size) - 1] if size in GPT2_SIZES[1:] else "tiny"
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
    memory = args.memory_gib * 2**30 if args.memory_gib else (0.9 * total if cuda else float("inf"))
    if args.peak_tflops is None and cuda:
        args.peak_tflops = peak_tflops(name)
    args.profile_variant = args.profile
    if args.configs:
        return run_configs(args, device, name, memory)
    result = run_fitting(args, device, name, memory)
    if result is None:
        print(f"error: out of GPU memory at micro-batch {args.micro_batch_size}; lower "
              f"--micro-batch-size or choose a smaller --size", file=sys.stderr)
        return 1
    size = result["size"]
    _compare(result)
    out = Path(args.out) if args.out else RESULTS / f"gpu_single-{size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(title(result))
    print(markdown(result))
    print(f"\nours / plain torch step rate: {result['ours_vs_torch']:.3f}x (target >= {TARGET}x: "
          f"{'met' if result['target_met'] else 'NOT met'}); results in {out}")
    _write_profile(args, out, [result])
    return 0


def _compare(result: dict) -> None:
    rows = {r["variant"]: r for r in result["variants"] if r.get("available", True)}
    result["ours_vs_torch"] = rows["torch"]["ms_per_step"] / rows["ours"]["ms_per_step"]
    result["target_met"] = result["ours_vs_torch"] >= TARGET
    if "ours compiled" in rows and "torch.compile" in rows:   # issue 36: >= 1.1x
        result["compiled_vs_torch_compiled"] = (rows["torch.compile"]["ms_per_step"]
                                                / rows["ours compiled"]["ms_per_step"])


def _write_profile(args, out: Path, results: list[dict]) -> None:
    if not args.profile:
        return
    path = out.with_suffix(".profile.md")
    path.write_text("\n\n".join(profile_markdown(r) for r in results) + "\n")
    print(f"profile summary: {path}")


def run_configs(args, device: torch.device, name: str, memory: float) -> int:
    """Each SIZE@SEQ of ``args.configs`` in turn; one JSON {"runs": [...]} and one table each."""
    results, failed = [], []
    for item in args.configs:
        size, _, seq = item.partition("@")
        run = argparse.Namespace(**{**vars(args), "size": size,
                                    "seq_length": int(seq) if seq else args.seq_length})
        try:
            result = run_size(size, run, device, name, memory)
        except torch.cuda.OutOfMemoryError as err:
            log.warning("%s: out of memory (%s)", item, str(err).splitlines()[0][:200])
            failed.append(item)
            _reset_memory(device)
            continue
        _compare(result)
        results.append(result)
        print(f"\n{title(result)}\n{markdown(result)}", flush=True)
    out = Path(args.out) if args.out else RESULTS / "gpu_single-configs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": results, "out_of_memory": failed}, indent=1) + "\n")
    print(f"\nresults in {out}" + (f"; out of memory: {', '.join(failed)}" if failed else ""))
    _write_profile(args, out, results)
    return 0 if results and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
