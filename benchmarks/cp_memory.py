"""Issue 31 "what it must show", memory: at a fixed activation budget the longest trainable sequence
grows about linearly with the context-parallel degree, and the memory model predicts each
measurement within 10%.

The model: a GPT of 2 layers, hidden 1024, 2 heads, vocab 512, learned positions, fp32, no dropout,
micro-batch 1, whose activations are the per-token terms the memory model counts (chosen so that at
CP 1 the CPU core's causal probabilities are a few percent of them, as SDPA's flash kernels make them
on a GPU). CP 1 runs one process (the blocked CPU core); CP 2 and 4 run one gloo CPU rank per CP rank
with ring attention (``--cp-comm-type p2p``): every rank holds its two chunks of ``s / C`` tokens
(hybrid/context_parallel/layout.py) and runs the model's forward with a
:class:`~models.gpt.token_layout.TokenLayout` over the CP group.

Measured: the bytes autograd keeps for backward after one forward
(:class:`hybrid.recompute.ActivationMeter`, parameters excluded), the largest over the CP ranks.
Model: :func:`hybrid.recompute.planner.layer_activation_bytes` of
``ModelDims.from_config(config, device="cpu", cp=C)`` times the layers plus its ``other_bytes``
(embedding output, final norm, logits shard).

The budget is the model's bytes at CP 1 and ``--base-seq`` tokens; for each CP degree the longest
sequence the model says fits it is measured (a multiple of 64 tokens at CP 1, whole causal blocks
of the CPU core; of ``16 C`` under CP), and so is about half of it.

Run:  python benchmarks/cp_memory.py [--base-seq 1024]
Writes benchmarks/results/cp_memory.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
LAYERS, HIDDEN, HEADS, VOCAB, SEED = 2, 1024, 2, 512, 0
CP_DEGREES = (1, 2, 4)


def config(seq: int):
    from models.gpt.config import GPTConfig
    return GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=seq,
                     max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0)


def model_bytes(seq: int, cp: int, comm_type: str = "p2p") -> float:
    """The memory model's activation bytes per rank (no recompute)."""
    from hybrid.recompute.planner import ModelDims, layer_activation_bytes
    d = ModelDims.from_config(config(seq), micro_batch=1, device="cpu", cp=cp,
                              cp_comm_type=comm_type)
    return d.num_layers * layer_activation_bytes(d, "none") + d.other_bytes


def longest_seq(budget: float, cp: int, comm_type: str = "p2p") -> int:
    """The longest sequence whose modelled bytes per rank fit ``budget``: a multiple of 64 tokens at
    CP 1 (whole causal blocks of the CPU core), of ``16 C`` under CP (16 tokens a chunk)."""
    grain, seq = (64 if cp == 1 else 16 * cp), 0
    while model_bytes(seq + grain, cp, comm_type) <= budget:
        seq += grain
    return seq


def measure(state, seq: int, comm_type: str = "p2p") -> dict:
    """One forward of ``seq`` tokens over ``state``'s CP group: bytes kept for backward on this rank
    (all, and those first saved inside the transformer layers)."""
    import torch
    from hybrid.context_parallel.layout import local_positions
    from hybrid.recompute import ActivationMeter
    from models.gpt.model import GPTModel
    from models.gpt.token_layout import TokenLayout
    torch.manual_seed(SEED)
    model = GPTModel(config(seq), state)
    model.init_weights(SEED)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (1, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (1, seq), generator=gen)
    cp, layout = getattr(state, "cp_size", 1), None
    if cp > 1:
        index = local_positions(seq, state.cp_rank, cp)
        tokens, labels = tokens[:, index], labels[:, index]
        layout = TokenLayout(token_index=index, cp_group=state.cp, cp_comm_type=comm_type)
    with ActivationMeter(exclude=model.parameters()) as meter:
        meter.track_modules({f"layer{i}": layer for i, layer in enumerate(model.layers)})
        loss = model(tokens, labels, layout=layout)
        kept = meter.total()
        layers = sum(v for k, v in meter.by_scope.items() if k.startswith("layer"))
    del loss
    return {"kept": kept, "layers": layers}


def _cp_ranks(rank: int, world: int, seqs: list[int], comm_type: str) -> list[dict]:
    import torch
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    torch.set_num_threads(1)
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world, cp=world))
    return [measure(state, seq, comm_type) for seq in seqs]


def measure_all(seqs: list[int], cp: int, comm_type: str = "p2p") -> list[dict]:
    """Per sequence of ``seqs``: the largest bytes kept over the ``cp`` ranks."""
    if cp == 1:
        import torch
        from hybrid.parallel_state import ParallelState
        torch.set_num_threads(1)
        return [measure(ParallelState.single_process(), seq) for seq in seqs]
    from hybrid.testing.multirank import run_on_ranks
    ranks = run_on_ranks(_cp_ranks, cp, args=(seqs, comm_type), timeout=1800)
    return [max((r[i] for r in ranks), key=lambda m: m["kept"]) for i in range(len(seqs))]


def run(base_seq: int = 1024, comm_type: str = "p2p") -> dict:
    budget = model_bytes(base_seq, 1)
    rows = []
    for cp in CP_DEGREES:
        longest = longest_seq(budget, cp, comm_type)
        half = longest // 2 // 64 * 64
        seqs = [s for s in (half, longest) if s > 0]
        for seq, got in zip(seqs, measure_all(seqs, cp, comm_type)):
            want = model_bytes(seq, cp, comm_type)
            rows.append({"cp": cp, "seq": seq, "longest": seq == longest, "measured": got["kept"],
                         "measured_layers": got["layers"], "model": want,
                         "error": got["kept"] / want - 1, "fits": got["kept"] <= budget})
    return {"budget": budget, "base_seq": base_seq, "comm_type": comm_type, "rows": rows,
            "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB}}


def table(result: dict) -> str:
    budget, rows = result["budget"], result["rows"]
    base = next(r["seq"] for r in rows if r["cp"] == 1 and r["longest"])
    lines = [f"budget {budget / 1e6:.1f} MB of activations per rank ({result['comm_type']}; "
             f"the model's bytes at CP 1, seq {result['base_seq']})", "",
             "| CP | seq | longest at budget | x CP 1 | measured MB | model MB | model error |",
             "|---:|---:|:---:|---:|---:|---:|---:|"]
    for r in rows:
        grow = f"{r['seq'] / base:.2f}" if r["longest"] else ""
        lines.append(f"| {r['cp']} | {r['seq']} | {'yes' if r['longest'] else ''} | {grow} | "
                     f"{r['measured'] / 1e6:.2f} | {r['model'] / 1e6:.2f} | {r['error']:+.2%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-seq", type=int, default=1024,
                        help="the CP-1 sequence whose modelled bytes are the budget (default 1024)")
    parser.add_argument("--cp-comm-type", choices=("p2p", "a2a", "allgather"), default="p2p")
    args = parser.parse_args(argv)
    if args.base_seq < 256 or args.base_seq % 256:
        print("error: --base-seq must be a positive multiple of 256", file=sys.stderr)
        return 2
    result = run(args.base_seq, args.cp_comm_type)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cp_memory.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
