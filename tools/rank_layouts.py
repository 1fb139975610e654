"""Rank 3D layouts (TP, PP, virtual stages, DP, ZeRO stage, recompute, micro-batch) of a GPT on a
cluster by predicted throughput under the device memory limit (hybrid/perf/pipeline.py).

    python tools/rank_layouts.py --preset zero-100b        # the ZeRO paper's 100B on 400 DGX-2 V100
    python tools/rank_layouts.py --preset zero-170b
    python tools/rank_layouts.py --preset gpt3-175b        # GPT-3 175B on 1024 A100 80GB (DGX A100)
    python tools/rank_layouts.py --layers 48 --hidden 1600 --heads 16 --gpus 64 --global-batch 512
    python tools/rank_layouts.py --all-presets --out docs/paper/rank_layouts.txt --overwrite
    python tools/rank_layouts.py --preset zero-100b --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
    python tools/rank_layouts.py --layers 32 --hidden 4096 --heads 32 --gpus 1024 \
        --global-batch 64 --seq-length 131072 --top 5     # long context: CP degrees enumerated

Long sequences (issue 31): from ``--seq-length`` 8192 on, context-parallel degrees C = 2, 4, ... are
enumerated with TP x C inside one node's GPUs or across nodes, as long as every rank keeps at least
1024 tokens, with the ring (p2p) and, where the heads split, all-to-all (a2a); a layout then reads
"TP t x CP C (p2p) x PP p x DP d". The activations counted are those of the attention core that
runs: ``--attention-core flash`` (SDPA's fused kernels, the default for a custom model) keeps no
[s, s] scores; the papers' presets use the explicit core of their time ("megatron").

Mixture of experts (issue 32): with ``--num-experts E`` every layer is a MoE layer of E SwiGLU
experts of width ``--moe-ffn-hidden-size``, top ``--moe-router-topk``; ``--preset mixtral-8x7b``
is Mixtral 8x7B on 64 A100 80GB. The ranking then models the MoE model (hybrid/perf/pipeline.py):
active-parameter FLOPs, model states with the dense parameters over DP x CP and the experts over
the expert-DP group DP x CP / EP, the exposed all-to-all token dispatch (hybrid/perf/moe_comm.py,
even routing) in the step time. EP is searched over the divisors of E that divide DP x CP unless
``--expert-model-parallel-size`` fixes it; a layout reads "... x DP d (EP e)". The expert lines
print each top layout's expert parameters and states per GPU and its all-to-all bytes per step.

    python tools/rank_layouts.py --preset mixtral-8x7b --top 5
    python tools/rank_layouts.py --layers 32 --hidden 4096 --heads 32 --gpus 64 --global-batch 512 \
        --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 14336 --expert-model-parallel-size 8

With 16-bit Adam moments (docs/optimizer-precision.md) the model states take K = 4 + 2 + 2 bytes a
parameter instead of 12, and the optimizer step reads and writes 12 + 2 (2 + 2) = 20 bytes a
parameter instead of 28 (16-bit gradient in, fp32 master and both moments in and out, 16-bit
parameter out).

Prints the top candidates with their memory and time breakdown, then the layout the published run
used: its predicted throughput and memory, whether it fits the memory limit under this memory model
(and by how much it misses when it does not), the rank it would take among the fitting layouts,
and the first rank of a fitting layout with its TP / PP / DP / v.

The throughput assumptions are calibrated on the V100 (ZeRO's Figure 2); the A100 cluster is its
data sheet only, so its absolute TFLOP/s are not a prediction, the ranking is the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.layout import LayoutError, RunLayout  # noqa: E402
from hybrid.perf import infinity  # noqa: E402
from hybrid.perf.activations import activation_bytes_per_layer  # noqa: E402
from hybrid.perf.architecture import GPT2, Architecture  # noqa: E402
from hybrid.perf.flops import expert_params_per_rank, model_flops_per_iteration, pad_vocab  # noqa: E402
from hybrid.perf.hardware import Cluster, dgx2_v100_cluster  # noqa: E402
from hybrid.perf.model_states import STATE_DTYPE_BYTES, optimizer_bytes_per_param  # noqa: E402
from hybrid.perf.pipeline import Layout, LayoutEstimate, estimate_layout  # noqa: E402
from hybrid.perf.throughput import ThroughputAssumptions  # noqa: E402
from hybrid.zero_policy import runnable_stages  # noqa: E402
from models.gpt.presets import GPT2_VOCAB_SIZE, PAPER_SEQ_LENGTH  # noqa: E402
from tools._cli import check_output_files  # noqa: E402

A100_80GB = Cluster(name="DGX A100 80GB", gpus_per_node=8, peak_flops=312e12, memory_bytes=80e9,
                    hbm_bandwidth=2039e9, intra_node_bandwidth=600e9, ib_link_bandwidth=25e9,
                    ib_links_per_node=8)


@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    gpus: int
    global_batch: int
    cluster: Cluster
    published: Layout | None
    source: str      # where the published layout and its measured throughput come from

    moments: tuple[str, str] = ("fp32", "fp32")   # storage dtypes of exp_avg, exp_avg_sq
    attention_core: str = "megatron"   # the core whose activations count (hybrid.perf.activations)
    arch: Architecture = GPT2          # the model's options; MoE layers when arch.num_experts

    def model(self) -> dict:
        """The keyword arguments :func:`hybrid.perf.pipeline.estimate_layout` takes besides the layout."""
        return dict(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq,
                    vocab=self.vocab, global_batch=self.global_batch, cluster=self.cluster,
                    attention_core=self.attention_core, arch=self.arch,
                    **optimizer_options(self.moments))


def optimizer_options(moments: tuple[str, str]) -> dict:
    """estimate_layout's K and optimizer-step traffic for these moment dtypes: K = 4 + m + v, the
    step moves 2 (gradient) + 8 (master in and out) + 2 (m + v) + 2 (parameter) bytes."""
    moment_bytes = sum(STATE_DTYPE_BYTES[d] for d in moments)
    return dict(optimizer_bytes_per_param=optimizer_bytes_per_param(exp_avg=moments[0],
                                                                    exp_avg_sq=moments[1]),
                assumptions=ThroughputAssumptions(optimizer_bytes_per_param=12.0 + 2 * moment_bytes))


# ZeRO's Pa partitions each checkpoint over the MP ranks as SP's shards do: modelled as SP.
PRESETS = {
    "zero-100b": Preset(125, 8192, 64, 1024, 50257, 400, 800, dgx2_v100_cluster(),
                        Layout(16, 1, 25, 1, 2, "full", 32, sequence_parallel=True),
                        "ZeRO Table 5: MP 16 x DP 25, batch 32 per replica, C4 (Pos+g, Pa); "
                        "measured over 38 TFLOP/s per GPU"),
    "zero-170b": Preset(212, 8192, 64, 1024, 50257, 400, 300, dgx2_v100_cluster(),
                        Layout(16, 1, 25, 1, 2, "full", 12, sequence_parallel=True),
                        "ZeRO Table 5: MP 16 x DP 25, batch 12 per replica, C5 (Pos+g, Pa+cpu: "
                        "checkpoints in host memory, not modelled here); no throughput stated"),
    "gpt3-175b": Preset(96, 12288, 96, 2048, 51200, 1024, 1536, A100_80GB,
                        Layout(8, 16, 8, 1, 0, "full", 1),
                        "Megatron-LM's GPT-3 175B script on 1024 A100: TP 8 x PP 16 x DP 8, b 1, "
                        "fp16, full recompute, 138 TFLOP/s per GPU; Narayanan et al. 2021 §5.1: "
                        "140 TFLOP/s per GPU at 1024 GPUs, batch 1536"),
}


def _mixtral_preset() -> Preset:
    from models.gpt.presets import MOE_PRESETS
    config = MOE_PRESETS["mixtral-8x7b"]
    return Preset(config.num_layers, config.hidden_size, config.num_attention_heads,
                  config.seq_length, config.vocab_size, 64, 256, A100_80GB, None,
                  "Mixtral 8x7B (46.7B parameters, 12.9B active) on 64 A100 80GB, global batch 256",
                  attention_core="flash", arch=config.perf_architecture())


MOE_PRESETS = {"mixtral-8x7b": _mixtral_preset()}   # not in --all-presets (the papers' runs)
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
LONG_SEQUENCE = 8192        # from here on context-parallel degrees are enumerated
MIN_TOKENS_PER_CP_RANK = 1024


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def cp_degrees(seq: int, gpus: int) -> list[int]:
    """CP degrees worth trying: 1, and for long sequences the powers of two that cut ``seq`` into
    ``2 C`` equal chunks of a rank's at least :data:`MIN_TOKENS_PER_CP_RANK` tokens."""
    if seq < LONG_SEQUENCE:
        return [1]
    return [1] + [c for c in (2, 4, 8, 16, 32, 64) if gpus % c == 0 and seq % (2 * c) == 0
                  and seq // c >= MIN_TOKENS_PER_CP_RANK]


def candidates(layers, hidden, heads, seq, gpus, global_batch, gpus_per_node):
    for tp in (k for k in _divisors(gpus_per_node) if hidden % k == 0 and heads % k == 0):
        for cp in cp_degrees(seq, gpus // tp):
            comm_types = ["p2p"] + (["a2a"] if cp > 1 and (heads // tp) % cp == 0 else [])
            yield from _pipelines(layers, seq, gpus, global_batch, tp, cp, comm_types)


def _pipelines(layers, seq, gpus, global_batch, tp, cp, comm_types):
    for pp in (k for k in _divisors(layers) if gpus % (tp * cp * k) == 0):
        for virtual in (v for v in (1, 2, 4) if layers % (pp * v) == 0 and (v == 1 or pp > 1)):
            for b in MICRO_BATCHES:
                try:   # the batch arithmetic of the t p d ranks of one CP slice
                    run = RunLayout.for_world(gpus // cp, tensor_parallel=tp, pipeline_parallel=pp,
                                              micro_batch_size=b, global_batch=global_batch,
                                              model_chunks=virtual, seq_length=seq)
                except LayoutError:   # the global batch does not split into b x DP
                    continue
                m, dp = run.micro_batches, run.data_parallel
                if virtual > 1 and (m < pp or m % pp):
                    continue
                for stage in runnable_stages(pp):   # the engine's, as hybrid.zero_policy says
                    for recompute in RECOMPUTE:
                        for comm in comm_types:
                            yield Layout(tp, pp, dp, virtual, stage, recompute, b, tp > 1, cp, comm)


def expert_degrees(arch: Architecture, dp_cp: int, fixed: int | None = None) -> list[int]:
    """EP degrees to try for a layout with DP x CP = ``dp_cp``: 1 for a dense model; ``fixed``
    alone when it divides both ``dp_cp`` and the experts (none otherwise); else every divisor of
    the number of experts that divides ``dp_cp``."""
    if not arch.is_moe:
        return [1]
    options = [fixed] if fixed is not None else _divisors(arch.num_experts)
    return [e for e in options if dp_cp % e == 0 and arch.num_experts % e == 0]


def rank(preset: Preset, ep: int | None = None) -> list[LayoutEstimate]:
    """Every candidate layout that fits the preset cluster's memory, fastest first; for a MoE
    model with each EP degree :func:`expert_degrees` allows (``ep`` fixes it)."""
    found = []
    for layout in candidates(preset.layers, preset.hidden, preset.heads, preset.seq, preset.gpus,
                             preset.global_batch, preset.cluster.gpus_per_node):
        for degree in expert_degrees(preset.arch, layout.dp * layout.cp, ep):
            try:
                est = estimate_layout(dataclasses.replace(layout, ep=degree), **preset.model())
            except ValueError:
                continue   # e.g. a recompute mode the memory model does not combine with the layout
            if est.memory_bytes <= preset.cluster.memory_bytes:
                found.append(est)
    return sorted(found, key=lambda e: e.time_s)


def table(found: list[LayoutEstimate], top: int) -> list[str]:
    with_cp = any(e.layout.cp > 1 for e in found[:top])
    with_ep = any(e.layout.ep > 1 for e in found[:top])
    width = (78 if with_cp else 62) + (8 if with_ep else 0)
    lines = [f"{'#':>3} {'layout':<{width}} {'TFLOP/s':>7} {'step s':>7} {'work':>6} {'bubble':>6} "
             f"{'p2p':>5} " + (f"{'CP':>5} " if with_cp else "") + (f"{'a2a':>5} " if with_ep else "")
             + f"{'DP':>5} {'opt':>5} {'mem GB':>6} {'act GB':>6} {'states':>6}"]
    for i, e in enumerate(found[:top], 1):
        lines.append(f"{i:>3} {e.layout.describe():<{width}} {e.tflops_per_gpu:7.1f} {e.time_s:7.2f} "
                     f"{e.compute_s:6.2f} {e.bubble_s:6.2f} {e.p2p_s:5.2f} "
                     + (f"{e.cp_s:5.2f} " if with_cp else "") + (f"{e.ep_s:5.2f} " if with_ep else "")
                     + f"{e.dp_s:5.2f} {e.optimizer_s:5.2f} {e.memory_bytes / 1e9:6.1f} "
                     f"{e.activation_bytes / 1e9:6.1f} {e.model_state_bytes / 1e9:6.1f}")
    return lines


def published_verdict(preset: Preset, found: list[LayoutEstimate]) -> list[str]:
    """Where the published layout stands: predicted throughput and memory, fit, rank."""
    target, limit = preset.published, preset.cluster.memory_bytes
    est = estimate_layout(target, **preset.model())
    other = est.memory_bytes - est.model_state_bytes - est.activation_bytes
    counted = ""
    if target.recompute == "full":   # Megatron-LM's published figures count it as work done
        hardware = model_flops_per_iteration(preset.global_batch, preset.seq, preset.layers,
                                             preset.hidden, preset.vocab, full_recompute=True)
        counted = (f" ({hardware / preset.gpus / est.time_s / 1e12:.1f} hardware TFLOP/s, the "
                   f"recompute forward counted)")
    lines = [f"published layout {target.describe()} ({preset.source})",
             f"  predicted {est.tflops_per_gpu:.1f} TFLOP/s per GPU{counted}, {est.time_s:.2f} s per step, "
             f"{est.memory_bytes / 1e9:.1f} GB per GPU (model states "
             f"{est.model_state_bytes / 1e9:.1f}, activations {est.activation_bytes / 1e9:.1f}, "
             f"buffers and reserve {other / 1e9:.1f})"]
    if est.memory_bytes > limit:
        lines.append(f"  it does NOT fit {limit / 1e9:.0f} GB under this memory model: "
                     f"{(est.memory_bytes - limit) / 1e9:.1f} GB over, so it is not ranked")
    else:
        faster = sum(e.time_s < est.time_s for e in found)
        lines.append(f"  it fits {limit / 1e9:.0f} GB and would rank #{faster + 1} of "
                     f"{len(found) + 1} by predicted step time")
    shape = (target.tp, target.pp, target.dp, target.virtual)
    match = [i for i, e in enumerate(found, 1)
             if (e.layout.tp, e.layout.pp, e.layout.dp, e.layout.virtual) == shape]
    lines.append(f"  a fitting layout with its TP / PP / DP / v first ranks #{match[0]}: "
                 f"{found[match[0] - 1].layout.describe()}" if match
                 else "  no layout with its TP / PP / DP / v fits the memory model")
    return lines


def working_memory_line(preset: Preset, layout: Layout, label: str) -> str:
    """ZeRO-Infinity §3 for a layout: the largest parameter of a TP rank gathered whole with its
    16-bit gradient (4 bytes per element; with --tile-factor T a linear's weight / T), and with full
    recompute the activations of one layer recomputed (hybrid.perf.activations)."""
    name, elements = infinity.gpt_largest_parameter(preset.hidden, pad_vocab(preset.vocab, layout.tp),
                                                    tp=layout.tp, heads=preset.heads)
    line = (f"  working memory of {label}: largest gathered parameter ({name}, "
            f"{elements / 1e6:,.1f}M elements per TP rank) with its gradient "
            f"{infinity.working_memory_bytes(elements) / 1e9:.2f} GB")
    if layout.recompute != "full":
        return line + f"; recompute {layout.recompute}: every layer's activations stay live"
    one = activation_bytes_per_layer(preset.seq, layout.micro_batch, preset.hidden, preset.heads,
                                     tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                     core=preset.attention_core, cp=layout.cp,
                                     cp_comm_type=layout.cp_comm_type)
    return line + f"; activation working memory (one layer recomputed) {one / 1e9:.2f} GB"


def offload_lines(preset: Preset, found: list[LayoutEstimate], top: int, where: str,
                  target: float) -> list[str]:
    """ZeRO-Infinity §4 for the top layouts with their optimizer states offloaded to ``where``
    (cpu | nvme): the bandwidth per GPU the step needs for ``target`` efficiency at the cluster's
    peak against the cluster's host or NVMe bandwidth (each GPU's ZeRO partition: 1/DP of the
    optimizer states)."""
    c = preset.cluster
    available = c.host_offload_bandwidth if where == "cpu" else c.nvme_offload_bandwidth
    lines = [f"optimizer states offloaded to {where}: bandwidth per GPU for {target:.0%} efficiency "
             f"at {c.peak_flops / 1e12:.0f} TFLOP/s (ZeRO-Infinity §4) vs the {c.name}'s "
             f"{available / 1e9:.2f} GB/s"]
    for i, e in enumerate(found[:top], 1):
        lay = e.layout
        if lay.stage == 0:
            lines.append(f"{i:>3} {lay.describe():<62} ZeRO 0 offloads nothing (the trainer's "
                         f"--offload-optimizer needs stage 1-3)")
            continue
        need, = infinity.offload_needs(micro_batch=lay.micro_batch, seq=preset.seq,
                                       hidden=preset.hidden, dp=lay.dp,
                                       peak_flops=c.peak_flops, target=target,
                                       optimizer_bandwidth=available)
        lines.append(f"{i:>3} {lay.describe():<62} needs {need.required / 1e9:9.2f} GB/s: "
                     f"{'enough' if need.sufficient else 'NOT enough'} "
                     f"({need.efficiency:.1%} efficient)")
    return lines


@dataclass(frozen=True)
class ExpertOptions:
    """The MoE options of the command line (module docstring); ``ep`` None: searched."""

    num_experts: int
    topk: int
    ffn: int
    ep: int | None = None

    def arch(self) -> Architecture:
        """A GPT-2 model whose every MLP is a MoE layer of SwiGLU experts."""
        return Architecture(swiglu=True, num_experts=self.num_experts, moe_topk=self.topk,
                            moe_ffn_hidden=self.ffn)


def expert_lines(preset: Preset, found: list[LayoutEstimate], top: int) -> list[str]:
    """Per top layout: expert parameters and their states per GPU, the all-to-all bytes per step."""
    from hybrid.perf.model_states import moe_model_state_bytes
    from hybrid.perf.moe_comm import dispatch_bytes
    from hybrid.perf.context_parallel import local_seq
    arch, k_bytes = preset.arch, preset.model()["optimizer_bytes_per_param"]
    width = arch.moe_ffn_hidden or arch.ffn(preset.hidden)
    lines = [f"experts: {arch.num_experts} per MoE layer (width {width}, top-{arch.moe_topk}); per "
             f"GPU, with the all-to-all bytes per step (even routing, 16-bit activations)"]
    for i, e in enumerate(found[:top], 1):
        lay = e.layout
        layers = preset.layers // lay.pp
        params = expert_params_per_rank(layers, preset.hidden, arch, tp=lay.tp, ep=lay.ep)
        state = moe_model_state_bytes(1.0, params * lay.ep, lay.stage, lay.dp * lay.cp, lay.ep,
                                      optimizer_bytes_per_param=k_bytes).expert.total
        per_layer = dispatch_bytes("alltoall", lay.micro_batch * local_seq(preset.seq, lay.cp),
                                   arch.moe_topk, preset.hidden, lay.ep, arch.num_experts, 2)
        a2a = per_layer.total * arch.moe_layers(layers) * e.micro_batches
        lines.append(f"{i:>3} {lay.describe():<70} {params / 1e9:6.2f} B expert params, "
                     f"{state / 1e9:7.1f} GB expert states (expert-DP "
                     f"{lay.dp * lay.cp // lay.ep}), all-to-all {a2a / 1e9:7.2f} GB/step")
    return lines


def report(preset: Preset, top: int, offload: str = "none",
           target: float = 0.9, ep: int | None = None) -> list[str] | None:
    """The ranking of one model and cluster (``ep`` fixes a MoE model's EP degree), with the
    published layout's verdict; None if nothing fits."""
    found = rank(preset, ep)
    if not found:
        return None
    lines = [f"{preset.layers} layers, hidden {preset.hidden}, {preset.heads} heads, seq {preset.seq}, "
             f"global batch {preset.global_batch} on {preset.gpus} GPUs ({preset.cluster.name}, "
             f"{preset.cluster.memory_bytes / 1e9:.0f} GB): {len(found)} layouts fit"]
    lines += table(found, top)
    lines.append(working_memory_line(preset, found[0].layout, "#1"))
    if offload != "none":
        lines += offload_lines(preset, found, top, offload, target)
    if preset.arch.is_moe:
        lines += expert_lines(preset, found, top)
    if preset.published is not None:
        lines += published_verdict(preset, found)
        lines.append(working_memory_line(preset, preset.published, "the published layout"))
    return lines


def render_presets(top: int = 10, moments: tuple[str, str] = ("fp32", "fp32")) -> str:
    """Every preset's report: the text of docs/paper/rank_layouts.txt."""
    out = ["Layouts ranked by tools/rank_layouts.py (hybrid/perf/pipeline.py) for the papers' runs;",
           "regenerate with: python tools/rank_layouts.py --all-presets --out "
           "docs/paper/rank_layouts.txt --overwrite",
           "TFLOP/s: model FLOPs (72 B s l h^2 (1 + s/6h + V/12lh), recompute not counted) per GPU and "
           "second; GB = 1e9 bytes per GPU;",
           "work: the slowest stage's compute, TP comm, memory-bound ops and overhead, bubble included; "
           "A100 rates are its data sheet, not calibrated.", ""]
    for name, preset in PRESETS.items():
        out += [f"== {name}"] + report(dataclasses.replace(preset, moments=moments), top) + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted({**PRESETS, **MOE_PRESETS}))
    parser.add_argument("--all-presets", action="store_true",
                        help="every preset, one report after the other")
    for name in ("layers", "hidden", "heads", "gpus", "global-batch"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--seq-length", type=int, default=PAPER_SEQ_LENGTH)
    parser.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                        help="also print the bandwidth per GPU each top layout needs with its "
                             "optimizer states offloaded there (ZeRO-Infinity §4)")
    parser.add_argument("--target-efficiency", type=float, default=0.9,
                        help="efficiency --offload asks the bandwidth for (default 0.9)")
    for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
        parser.add_argument(flag, choices=("fp32", "bf16"), default="fp32",
                            help="storage dtype of an Adam moment (model states and step traffic)")
    parser.add_argument("--attention-core", choices=("flash", "megatron"), default="flash",
                        help="for a custom model: the attention core whose activations count: "
                             "flash (SDPA's fused kernels, no [s, s] scores; default) or megatron "
                             "(the explicit core, 5 a s^2 b / t bytes a layer)")
    parser.add_argument("--num-experts", type=int,
                        help="MoE: experts per layer, every layer a MoE layer (ranked as such)")
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--moe-ffn-hidden-size", type=int, help="MoE: expert width (default 4h)")
    parser.add_argument("--expert-model-parallel-size", type=int,
                        help="MoE: fix the EP degree (default: searched over the divisors of the "
                             "number of experts that divide DP x CP)")
    parser.add_argument("--out", type=Path, help="with --all-presets: write the reports to this file")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    if not 0 < args.target_efficiency < 1:
        print(f"error: --target-efficiency must lie strictly between 0 and 1, got "
              f"{args.target_efficiency}", file=sys.stderr)
        return 2
    moments = (args.exp_avg_dtype, args.exp_avg_sq_dtype)
    if args.all_presets:
        text = render_presets(args.top, moments)
        if args.out is None:
            print(text, end="")
            return 0
        try:
            check_output_files([args.out], flag="--out", inputs=[], overwrite=args.overwrite)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        args.out.write_text(text)
        print(f"wrote {args.out}")
        return 0
    if args.out is not None:
        print("error: --out writes the --all-presets reports; add --all-presets", file=sys.stderr)
        return 2
    if args.preset:
        preset = dataclasses.replace({**PRESETS, **MOE_PRESETS}[args.preset], moments=moments)
    else:
        missing = [n for n in ("layers", "hidden", "heads", "gpus", "global_batch")
                   if getattr(args, n) is None]
        if missing:
            print(f"error: give --preset or all of --{', --'.join(m.replace('_', '-') for m in missing)}",
                  file=sys.stderr)
            return 2
        preset = Preset(args.layers, args.hidden, args.heads, args.seq_length, args.vocab_size,
                        args.gpus, args.global_batch, dgx2_v100_cluster(), None, "", moments,
                        args.attention_core)
    ep = args.expert_model_parallel_size
    if args.num_experts is not None:
        if args.num_experts < 1 or (ep is not None and ep < 1) or args.moe_router_topk < 1:
            print("error: --num-experts, --moe-router-topk and --expert-model-parallel-size must be "
                  "positive", file=sys.stderr)
            return 2
        moe = ExpertOptions(args.num_experts, args.moe_router_topk,
                            args.moe_ffn_hidden_size or 4 * preset.hidden, ep)
        preset = dataclasses.replace(preset, arch=moe.arch())
    if ep is not None and not preset.arch.is_moe:
        print("error: --expert-model-parallel-size needs a MoE model: add --num-experts or "
              "--preset mixtral-8x7b", file=sys.stderr)
        return 2
    if ep is not None and preset.arch.num_experts % ep:
        print(f"error: --expert-model-parallel-size {ep} does not divide the "
              f"{preset.arch.num_experts} experts", file=sys.stderr)
        return 2
    lines = report(preset, args.top, args.offload, args.target_efficiency, ep)
    if lines is None:
        print(f"error: no layout of this model fits {preset.cluster.memory_bytes / 1e9:.0f} GB per GPU "
              f"on {preset.gpus} GPUs; add GPUs or lower the global batch", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
