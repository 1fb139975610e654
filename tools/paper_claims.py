"""Predictions of hybrid.perf's models beside the ZeRO paper's stated figures (ZeRO §3.2, §6, §10).

Each :class:`Claim` pairs a figure the paper states with the model's prediction. A claim is "ok"
when the prediction is within :data:`TOLERANCE` (20%) of the paper's figure ("about X"), strictly
above it (the paper's "over X" and "more than X" are bounds: "over 38" is not met by 37.9, nor by
35.3) or not above it ("under X"); otherwise it must be listed in :data:`KNOWN_MISSES` with the reason
the model cannot reproduce it - the test asserts each claim's documented status, so a model change
that silently moves a claim in or out of tolerance fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.perf import activations as act
from hybrid.perf.hardware import dgx2_v100_cluster
from hybrid.perf.model_states import GB, model_state_bytes
from hybrid.perf.throughput import estimate_iteration
from tools.paper_numbers import TABLE3_BATCH, table2, table3, table5, table6, table10

TOLERANCE = 0.20

KNOWN_MISSES = {
    "zero-100B-tflops":
        "A bound the model misses by 7%: its compute alone runs at 41.8 TFLOP/s (the efficiency "
        "curve gives 0.40 x 0.94 x 0.89 = 33% of the V100's 125 at b s = 32,768 tokens and h/t = 512 "
        "columns), then the 16-way TP all-reduces (5.5 s of the 47.8 s step at the node's NVSwitch "
        "share) and the exposed part of the DP traffic (1.9 s) bring it to 35.3. Over 38 needs under "
        "10% of the step in communication; we keep the documented link assumptions rather than fit "
        "them to this point.",
    "zero-100B-pflops":
        "The same step as zero-100B-tflops on 400 GPUs: 400 x 35.3 TFLOP/s = 14.1 PFLOP/s.",
    "table10-average-tflops":
        "Table 10's nine models range from 41.8 TFLOP/s (1.5B, batch 24) down to 16.9 (13B, batch "
        "2): the model's efficiency falls with the micro-batch (2,048 tokens halve it) while the 2Ψ "
        "of DP traffic per step grows with the model, so the average is 32.3; the paper's 'over 40' "
        "implies full efficiency at every batch size (see table10-13B-tflops).",
    "baseline-40B-tflops":
        "The model charges each GPU's whole TP ring volume (6 all-reduces of b s h per layer with "
        "recompute) to its 1/16 share of the node's 8 EDR links (6.25 GB/s), which puts the 2-node "
        "MP-32 baseline at ~3.9 TFLOP/s; the paper's ~5 implies ~8 GB/s. A 2-node ring has only two "
        "node-crossing edges, so the true rate lies between this share and the node's 100 GB/s; we "
        "keep the simple, documented assumption rather than fit it to one point.",
    "speedup-100B":
        "Same mechanism, larger effect: the MP-128 baseline over 8 nodes has 3.2x fewer FLOPs per GPU "
        "than the 40B one for the same TP volume per GPU, so the model predicts ~1.4 TFLOP/s per GPU "
        "and a ~26x speedup. The paper's 'up to 10x' implies its 8-node TP rings were ~2.5x faster "
        "per GPU than its 2-node ones, which a bandwidth-share model cannot produce.",
    "60B-128-to-256-doubling":
        "Table 6 keeps batch 48 per replica at 128 and 256 GPUs, so the model's per-GPU rate is "
        "unchanged and the DP ring factor (n-1)/n grows: aggregate scales 2.00x, not more. The "
        "model's superlinearity comes only from the larger per-GPU batch (64->128 and 256->400).",
    "table10-13B-tflops":
        "Table 10 runs the 13B model with batch 2 per GPU: 2048 tokens per micro-batch halves the "
        "model's sustained efficiency (0.2 of peak) and the 2Ψ = 51 GB of Pos+g DP traffic per step "
        "(8 s at 6.25 GB/s, half of it exposed) is amortised over little compute, so the model predicts "
        "~17 TFLOP/s. The paper's figure implies its small-batch kernels ran at full efficiency.",
    "selective-recompute-overhead-22B":
        "The model charges recompute as FLOPs at the GEMM-bound efficiency: rerunning the attention "
        "core adds 4 b s^2 h per layer, ~1.6% of the step. The measured +7% comes from the "
        "memory-bound softmax, masking and dropout over the a x s x s score matrices, which a FLOPs "
        "model does not see.",
    "table3-C2":
        "With Pa the model keeps 1/16 of the checkpoints, so beside the Pos model states (4Ψ/Nm + "
        "12Ψ/(Nm Nd), 16.8 GB at 60B) it charges only one layer's working activations, the logits "
        "and the constant buffers, and finds ~90B; at the paper's 60B it leaves ~10 GB per GPU "
        "free. We do not know what filled that memory in the paper's runs (candidates: temporary "
        "gradient buffers of the stage-1 reduction, allocator fragmentation); we do not invent a "
        "term for it.",
    "pa-example-checkpoints":
        "The paper's 33 GB equals b s h l = 32 x 1024 x 8192 x 125 = 33.5e9 checkpoint ELEMENTS; "
        "16-bit checkpoints take twice that, 67 GB (and 4.2 GB with Pa instead of ~2). The 16x "
        "reduction by Pa matches.",
    "pa-example-partitioned":
        "Same factor of 2 as the unpartitioned example (bytes vs elements).",
}


@dataclass(frozen=True)
class Claim:
    key: str
    text: str
    paper: float
    predicted: float
    unit: str
    kind: str = "about"   # about: within 20% | more_than: > (the paper's "over X") | under: <=

    @property
    def ratio(self) -> float:
        return self.predicted / self.paper

    @property
    def within_tolerance(self) -> bool:
        checks = {"about": abs(self.ratio - 1) <= TOLERANCE, "more_than": self.predicted > self.paper, "under": self.predicted <= self.paper}
        return checks[self.kind]

    @property
    def status(self) -> str:
        return "ok" if self.within_tolerance else "known miss"

    @property
    def documented_status(self) -> str:
        return "known miss" if self.key in KNOWN_MISSES else "ok"

    def as_dict(self) -> dict:
        return {"key": self.key, "claim": self.text, "paper": self.paper, "kind": self.kind,
                "predicted": self.predicted, "unit": self.unit, "ratio": self.ratio,
                "status": self.status, "documented_status": self.documented_status,
                "reason": KNOWN_MISSES.get(self.key, "")}


def claims() -> list[Claim]:
    return (_throughput_claims() + _scaling_claims() + _data_parallel_claims() + _table3_claims()
            + _recompute_claims() + _memory_claims())


def _throughput_claims() -> list[Claim]:
    rows = {r["name"]: r for r in table5()}
    zero100, base100 = rows["table5-zero-100B"], rows["table5-megatron-100B"]
    mid = [rows[f"table5-zero-{s}"]["pflops"] for s in ("8B", "40B", "60B", "80B", "100B")]
    return [
        Claim("zero-100B-tflops", "ZeRO 100B, TFLOP/s per GPU (over 38)", 38,
              zero100["tflops_per_gpu"], "TFLOP/s", kind="more_than"),
        Claim("zero-100B-pflops", "ZeRO 100B, aggregate PFLOP/s on 400 GPUs (over 15)", 15,
              zero100["pflops"], "PFLOP/s", kind="more_than"),
        Claim("zero-8B-100B-average", "ZeRO 8B-100B, average aggregate PFLOP/s", 15,
              sum(mid) / len(mid), "PFLOP/s"),
        Claim("baseline-40B-tflops", "Megatron 40B (MP 32, two DGX-2 nodes), TFLOP/s per GPU", 5,
              rows["table5-megatron-40B"]["tflops_per_gpu"], "TFLOP/s"),
        Claim("speedup-100B", "ZeRO over Megatron at 100B, aggregate throughput ratio (up to 10x)",
              10, zero100["pflops"] / base100["pflops"], "x"),
        Claim("zero-170B-fits", "ZeRO 170B fits 32 GB per GPU on 400 GPUs (1 = yes)", 1,
              float(rows["table5-zero-170B"]["fits_32gb"]), "bool"),
    ]


def _scaling_claims() -> list[Claim]:
    agg = {r["gpus"]: r["pflops"] for r in table6()}
    return [
        Claim("60B-64-to-128-doubling", "60B: aggregate 128 GPUs / 64 GPUs (more than 2)", 2,
              agg[128] / agg[64], "x", kind="more_than"),
        Claim("60B-128-to-256-doubling", "60B: aggregate 256 GPUs / 128 GPUs (more than 2)", 2,
              agg[256] / agg[128], "x", kind="more_than"),
        Claim("60B-superlinear-64-to-400", "60B: aggregate 400 / 64 GPUs (more than 6.25)", 6.25,
              agg[400] / agg[64], "x", kind="more_than"),
    ]


def _data_parallel_claims() -> list[Claim]:
    rows = {r["size"]: r for r in table10()}
    average = sum(r["tflops_per_gpu"] for r in rows.values()) / len(rows)
    return [
        Claim("table10-fits", "Table 10: every model up to 13B fits 32 GB with ZeRO-DP alone, MP 1 "
              "(1 = yes)", 1, float(all(r["fits_32gb"] for r in rows.values())), "bool"),
        Claim("table10-average-tflops", "Table 10: ZeRO-DP only on 128 GPUs, average TFLOP/s per GPU "
              "(over 40)", 40, average, "TFLOP/s", kind="more_than"),
        Claim("table10-13B-tflops", "Table 10: 13B with ZeRO-DP only, TFLOP/s per GPU (over 40)", 40,
              rows["13B"]["tflops_per_gpu"], "TFLOP/s", kind="more_than"),
        Claim("plain-dp-largest", "Plain data parallel (MP 1) tops out at 1.4B on 32 GB (largest "
              "with activations and buffers)", 1.4e9, table2()[0]["estimate_params"][0], "params"),
    ]


def _table3_claims() -> list[Claim]:
    return [Claim(f"table3-{r['config']}", f"Table 3 {r['config']} ({r['stage']}"
                  f"{' + Pa' if r['pa'] else ''}{'+cpu' if r['cpu'] else ''}): largest model on 400 "
                  f"GPUs, MP 16, batch {TABLE3_BATCH}", float(r["paper"].rstrip("B")) * 1e9,
                  r["params"], "params")
            for r in table3() if r["paper"]]


def _recompute_claims() -> list[Claim]:
    """Selective-recompute paper, 22B GPT (48 layers, h 6144, 64 heads, s 2048, TP 8): time overhead
    of recompute over none. Their runs are on A100s; the ratio is modelled on our DGX-2 cluster."""
    dims = dict(layers=48, hidden=6144, seq=2048, vocab=51200, micro_batch=4, tp=8, dp=1, stage=0)
    base = estimate_iteration(**dims, recompute="none").time_s
    overhead = {m: estimate_iteration(**dims, recompute=m).time_s / base - 1
                for m in ("full", "selective")}
    return [
        Claim("full-recompute-overhead-22B", "22B, TP 8: full recompute time overhead (+39%)", 0.39,
              overhead["full"], "fraction"),
        Claim("selective-recompute-overhead-22B", "22B, TP 8: selective recompute time overhead (+7%)",
              0.07, overhead["selective"], "fraction"),
    ]


def _memory_claims() -> list[Claim]:
    gpt2 = dict(hidden=1600, batch=32, seq=1024, layers=48)
    full = act.zero_paper_activation_bytes(**gpt2) / GB
    ckpt = (act.checkpoint_bytes(1024, 32, 1600, 48)
            + act.activation_bytes_per_layer(1024, 32, 1600, 16)) / GB
    pa = dict(seq=1024, micro_batch=32, hidden=8192, layers=125, mp=16)
    return [
        Claim("gpt2-1.5B-activations", "1.5B GPT-2, seq 1K, batch 32: activations (GB)", 60, full, "GB"),
        Claim("gpt2-1.5B-checkpointed", "... with activation checkpointing (GB): checkpoints + one "
              "recomputed layer", 8, ckpt, "GB"),
        Claim("pa-example-checkpoints", "100B, MP 16, batch 32: checkpoints per GPU (GB)", 33,
              act.checkpoint_bytes(**pa) / GB, "GB"),
        Claim("pa-example-partitioned", "... with Pa (GB)", 2,
              act.checkpoint_bytes(**pa, partitioned=True) / GB, "GB"),
        Claim("pa-comm-overhead", "Pa's extra all-gather vs Megatron's TP traffic (under 10%)", 0.1,
              _pa_overhead(), "fraction", kind="under"),
        Claim("1T-on-1024", "1T parameters, Pos+g+p on 1024 GPUs: GB per GPU", 16,
              model_state_bytes(1e12, 3, 1024).total / GB, "GB"),
    ]


def _pa_overhead() -> float:
    """Extra TP-link time of Pa's checkpoint all-gather on the ZeRO-100B run (latency excluded)."""
    dims = dict(layers=125, hidden=8192, seq=1024, vocab=50257, micro_batch=32, tp=16, dp=25,
                stage=2, cluster=dgx2_v100_cluster().with_changes(collective_latency=0.0))
    with_pa = estimate_iteration(**dims, partition_activations=True).tp_comm_s
    return with_pa / estimate_iteration(**dims).tp_comm_s - 1
