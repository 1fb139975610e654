"""The numbers behind the ZeRO paper's tables, computed from hybrid.perf's models (ZeRO §5 Figure 1,
Table 1, Table 2; §10 Table 5 / Figure 2, Table 6 / Figure 3, Table 10).

Every function returns plain rows (lists of dicts) so tools/paper_tables.py can write markdown, CSV,
plots and JSON from one source and the tests can check them. The Table 5/6 runs come from
models/gpt/presets.py (:data:`PAPER_RUNS`). ZeRO rows run stage 2 (Pos+g, the paper's ZeRO-100B)
with the lightest ZeRO-R configuration that fits 32 GB (C3 Pos+g, C4 +Pa, C5 +Pa+cpu; ZeRO Table 3);
baseline rows run Megatron: plain DP, full recompute, a fused fp32 gradient buffer.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from hybrid.perf.flops import gpt_param_count, pad_vocab
from hybrid.perf.memory import device_memory
from hybrid.perf.model_states import GB, STAGE_NAMES, model_state_bytes, paper_table2_params
from hybrid.perf.throughput import estimate_iteration
from hybrid.zero_policy import DEFAULT_BUCKET_ELEMENTS
from models.gpt.presets import PAPER_RUNS, PaperRun

DEVICE_BYTES = 32e9
DP_DEGREES = (1, 4, 16, 64, 256, 1024)
TABLE1_MODELS = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}
FIGURE1_PAPER = {0: "120", 1: "31.4", 2: "16.6", 3: "1.88"}
TABLE1_PAPER_7_5B = {1: ["120", "52.5", "35.6", "31.4", "30.4", "30.1"],
                     2: ["120", "41.3", "21.6", "16.6", "15.4", "15.1"],
                     3: ["120", "30", "7.5", "1.88", "0.47", "0.12"]}
TABLE2_PAPER = {1: ("2B", "7.6B", "14.4B", "128B", "1.3B", "6.2B"),
                2: ("4B", "15.2B", "28.8B", "256B", "2.5B", "12.5B"),
                4: ("8B", "30.4B", "57.6B", "0.5T", "5B", "25B"),
                8: ("16B", "60.8B", "115.2B", "1T", "10B", "50B"),
                16: ("32B", "121.6B", "230.4B", "2T", "20B", "100B")}
ZERO_R_CONFIGS = (("C3", False, False), ("C4", True, False), ("C5", True, True))
# ZeRO Table 3: configuration -> (stage, Pa, Pa+cpu, the paper's largest model on 400 GPUs, MP 16)
TABLE3 = {"C1": (1, False, False, 40e9), "C2": (1, True, False, 60e9), "C3": (2, False, False, None),
          "C4": (2, True, False, 140e9), "C5": (2, True, True, 150e9)}
TABLE3_BATCH = 16   # the paper fixes the batch but does not print it; 16 is Table 5's 140B batch


# ---- formatting as the paper prints ---------------------------------------------------------
def paper_round(value: float, decimals: int) -> str:
    """Half-up rounding with trailing zeros dropped (41.25 -> "41.3", 30.0 -> "30")."""
    q = Decimal(repr(value)).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)
    text = format(q, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_gb(value_gb: float) -> str:
    """Table 1 style: one decimal at 10 GB and above, two below."""
    return paper_round(value_gb, 1 if value_gb >= 10 else 2)


def format_params(psi: float) -> str:
    """Table 2 style: "7.6B", "115.2B", "0.5T" (T from 500B on, one decimal)."""
    if psi >= 500e9:
        return paper_round(psi / 1e12, 1) + "T"
    return paper_round(psi / 1e9, 1) + "B"


# ---- Figure 1, Table 1, Table 2 --------------------------------------------------------------
def figure1(psi: float = 7.5e9, dp: int = 64) -> list[dict]:
    rows = []
    for stage, name in STAGE_NAMES.items():
        s = model_state_bytes(psi, stage, dp)
        rows.append({"stage": stage, "name": name, "params_gb": s.params_16bit / GB,
                     "grads_gb": s.grads_16bit / GB, "optimizer_gb": s.optimizer / GB,
                     "total_gb": s.total / GB, "formatted": format_gb(s.total / GB),
                     "paper": FIGURE1_PAPER[stage]})
    return rows


def table1() -> list[dict]:
    rows = []
    for label, psi in TABLE1_MODELS.items():
        for stage in (1, 2, 3):
            values = [model_state_bytes(psi, stage, dp).total / GB for dp in DP_DEGREES]
            paper = TABLE1_PAPER_7_5B.get(stage) if label == "7.5B" else None
            rows.append({"model": label, "stage": STAGE_NAMES[stage], "gb": values,
                         "formatted": [format_gb(v) for v in values], "paper": paper})
    return rows


def table2(dp: int = 64, device_bytes: float = DEVICE_BYTES) -> list[dict]:
    rows = []
    for mp, paper in TABLE2_PAPER.items():
        formula = [format_params(paper_table2_params(device_bytes, stage, dp, mp)) for stage in range(4)]
        estimate = [_largest_with_overheads(stage, dp, mp, device_bytes) for stage in (0, 1)]
        rows.append({"mp": mp, "gpus": mp * dp, "formula": formula, "paper_formula": list(paper[:4]),
                     "estimate": [format_params(e) for e in estimate], "estimate_params": estimate,
                     "paper_measured": list(paper[4:])})
    return rows


def _largest_with_overheads(stage: int, dp: int, mp: int, device_bytes: float) -> float:
    """Largest Ψ that fits once activations and buffers are counted: a GPT of hidden 64 x MP x 25
    (h/t = 1600, the 1.5B model's width per rank), micro-batch 8, seq 1024, full recompute, the
    baseline's fused fp32 buffer or ZeRO's constant buffers; bisection on the layer count."""
    hidden, heads = 1600 * mp, 16 * mp
    lo, hi = 1, 4096
    while lo < hi:
        layers = (lo + hi + 1) // 2
        mem = device_memory(layers=layers, hidden=hidden, heads=heads, seq=1024, vocab=50257,
                            micro_batch=8, tp=mp, dp=dp, stage=stage,
                            bucket_elements=None if stage == 0 else DEFAULT_BUCKET_ELEMENTS)
        lo, hi = (layers, hi) if mem.fits(device_bytes) else (lo, layers - 1)
    return gpt_param_count(lo, hidden, pad_vocab(50257, mp), 1024)


def table3(batch: int = TABLE3_BATCH) -> list[dict]:
    """Largest GPT (hidden 8192, 64 heads, seq 1024) per ZeRO configuration on 400 GPUs with MP 16
    and ``batch`` sequences per replica, by bisection on the layer count (ZeRO Table 3 / Figure 6)."""
    rows = []
    for name, (stage, partition, cpu, paper) in TABLE3.items():
        def fits(layers: int) -> bool:
            return device_memory(layers=layers, hidden=8192, heads=64, seq=1024, vocab=50257,
                                 micro_batch=batch, tp=16, dp=25, stage=stage,
                                 partition_activations=partition, cpu_offload=cpu).fits(DEVICE_BYTES)
        lo, hi = 0, 2048
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        psi = gpt_param_count(lo, 8192, pad_vocab(50257, 16), 1024) if lo else 0.0
        rows.append({"config": name, "stage": STAGE_NAMES[stage], "pa": partition, "cpu": cpu,
                     "layers": lo, "params": psi, "formatted": format_params(psi),
                     "paper": format_params(paper) if paper else ""})
    return rows


# ---- Table 5 / Figure 2 and Table 6 / Figure 3 ------------------------------------------------
def run_memory(run: PaperRun, *, partition: bool, cpu: bool):
    c = run.config
    return device_memory(layers=c.num_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                         seq=c.seq_length, vocab=c.vocab_size, micro_batch=run.micro_batch, tp=run.tp,
                         dp=run.dp, stage=2 if run.zero else 0, partition_activations=partition,
                         cpu_offload=cpu, bucket_elements=DEFAULT_BUCKET_ELEMENTS if run.zero else None)


def run_layout(run: PaperRun, device_bytes: float = DEVICE_BYTES) -> tuple[str, bool, bool]:
    """(configuration name, Pa, Pa+cpu): the lightest ZeRO-R configuration that fits, or the
    Megatron baseline."""
    if not run.zero:
        return "baseline", False, False
    for name, partition, cpu in ZERO_R_CONFIGS:
        if run_memory(run, partition=partition, cpu=cpu).fits(device_bytes):
            return name, partition, cpu
    return "C5 (does not fit)", True, True


def run_row(run: PaperRun) -> dict:
    name, partition, cpu = run_layout(run)
    mem = run_memory(run, partition=partition, cpu=cpu)
    c = run.config
    est = estimate_iteration(layers=c.num_layers, hidden=c.hidden_size, seq=c.seq_length,
                             vocab=c.vocab_size, micro_batch=run.micro_batch, tp=run.tp, dp=run.dp,
                             stage=2 if run.zero else 0, partition_activations=partition)
    return {"name": run.name, "size": run.size_label, "system": "ZeRO" if run.zero else "Megatron",
            "gpus": run.gpus, "mp": run.tp, "dp": run.dp, "layers": c.num_layers,
            "hidden": c.hidden_size, "heads": c.num_attention_heads, "batch": run.micro_batch,
            "config": name, "params_b": c.num_parameters() / 1e9,
            "model_states_gb": mem.model_states.total / GB, "activations_gb": mem.activations / GB,
            "buffers_gb": mem.buffers / GB, "total_gb": mem.total / GB,
            "fits_32gb": mem.fits(DEVICE_BYTES), "tflops_per_gpu": est.tflops_per_gpu(),
            "model_tflops_per_gpu": est.tflops_per_gpu(hardware=False),
            "pflops": est.pflops_aggregate(), "step_s": est.time_s,
            "compute_s": est.compute_s, "tp_comm_s": est.tp_comm_s, "dp_comm_s": est.dp_comm_s,
            "paper": PAPER_STATED.get(run.name, "")}


PAPER_STATED = {"table5-zero-100B": ">38 TFLOP/s per GPU, >15 PFLOP/s",
                "table5-megatron-40B": "~5 TFLOP/s per GPU",
                "table5-zero-170B": "runs (8x Megatron's largest)"}


def table5() -> list[dict]:
    return [run_row(r) for r in PAPER_RUNS.values() if r.table == "table5"]


def table6() -> list[dict]:
    return [run_row(r) for r in PAPER_RUNS.values() if r.table == "table6"]


def table10() -> list[dict]:
    return [run_row(r) for r in PAPER_RUNS.values() if r.table == "table10"]
