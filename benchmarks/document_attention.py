"""Issue 31 benchmark: the document-masked attention core at CP 1 on CPU (models/gpt/document_attention.py)
beside the plain causal core it replaces and the dense-mask SDPA fallback.

One thread, forward + backward of one attention core, q [1, 8, s, 64] (8 query heads, 2 key/value
groups), fp32, packed samples of documents of ``--doc`` tokens. Variants:

* ``causal``: :func:`models.gpt.attention_core.attention_core` (no document mask: what a packed
  sample paid before, attending across documents);
* ``blocked``: the variable-length document core (keys left of each block's document skipped);
* ``dense``: SDPA with a dense boolean ``[s, s]`` mask (the small-shape fallback).

All variants run round-robin (order rotating each round) so the shared machine's load hits each
alike; the median of ``--steps`` rounds after one warm-up. Beside the times: the share of the causal
core's (query, key) products the blocked core multiplies.

Run:  python benchmarks/document_attention.py [--seqs 1024 4096] [--doc 256] [--steps 5]
Writes benchmarks/results/document_attention.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
HEADS, GROUPS, HEAD_DIM = 8, 2, 64


def _variants(s: int, doc: int):
    import torch
    from models.gpt.attention_core import attention_core
    from models.gpt.document_attention import document_attention, plan_blocks
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, s, HEAD_DIM, generator=gen).requires_grad_()
    k = torch.randn(1, GROUPS, s, HEAD_DIM, generator=gen).requires_grad_()
    v = torch.randn(1, GROUPS, s, HEAD_DIM, generator=gen).requires_grad_()
    documents = (torch.arange(s) // doc)[None]
    grad = torch.randn(1, HEADS, s, HEAD_DIM, generator=gen)

    def run(fn):
        def step():
            torch.autograd.backward(fn(), grad)
        return step

    plan = plan_blocks(documents, torch.float32)
    share = (sum((hi - lo) * (hi - klo) for lo, hi, klo in plan)
             / sum((hi - lo) * hi for lo, hi, _ in plan))
    return {
        "causal": run(lambda: attention_core(q, k, v)),
        "blocked": run(lambda: document_attention(q, k, v, documents, backend="blocked")),
        "dense": run(lambda: document_attention(q, k, v, documents, backend="dense")),
    }, share


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--doc", type=int, default=256, help="tokens per document")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for s in args.seqs:
        variants, share = _variants(s, args.doc)
        times = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.steps + 1):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                variants[name]()
                if r:   # round 0 warms up
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append(dict(seq=s, doc=args.doc, ms=med, products_vs_causal=share))
    print(f"| seq | doc | causal ms | blocked ms | dense-mask SDPA ms | blocked products / causal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m = r["ms"]
        print(f"| {r['seq']} | {r['doc']} | {m['causal']:.1f} | {m['blocked']:.1f} | {m['dense']:.1f} "
              f"| {r['products_vs_causal']:.2f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "document_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
