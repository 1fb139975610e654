"""Issue 31 benchmark: context-parallel attention at CP 2, ours (ring p2p, all-to-all a2a) against
torch's ``torch.distributed.tensor.experimental.context_parallel`` on the same shapes, CPU gloo ranks.

One step = forward + backward of the attention core alone (q, k, v [b, heads, S / CP, d] per rank,
causal, or causal + document mask), fp32, one thread per rank, 2 gloo ranks. Every variant runs in the
same two ranks and their steps are interleaved round-robin (the shared machine's load hits each alike);
a step's time is the slower rank's; median over ``--steps`` after 2 warm-up steps.

torch's ``context_parallel`` is tried first on every case; on CPU it cannot run (its ring dispatches
only the CUDA SDPA kernels: flash, memory-efficient, cuDNN), so the exception it raises is recorded
and the peer is the all-gather-KV baseline (``--cp-comm-type allgather``, :mod:`hybrid.context_parallel.
allgather`), the scheme Llama 3 trained with. For scale: ``CP 1`` is our blocked kernel over the whole
sequence on one rank (both ranks run one at once, so the machine's load is the same).

Run:  python benchmarks/context_parallel.py [--seq 2048 4096] [--steps 8]
Prints a table and writes benchmarks/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, HEADS, GROUPS, HEAD_DIM, WARMUP = 1, 8, 8, 64, 2


def _documents(seq: int, batch: int):
    """Document ids of packed samples of documents of 1/8 of the sequence on average (seeded)."""
    import torch
    g = torch.Generator().manual_seed(seq)
    eod = torch.rand(batch, seq, generator=g) < 8.0 / seq
    return torch.cumsum(eod.long(), dim=1) - eod.long()


def _torch_peer(mesh, q, k, v):
    """One step of torch's context_parallel on the whole-sequence tensors; returns the step
    function, or the exception text if torch's cannot run here."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    buffers = [x.detach().clone() for x in (q, k, v)]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            leaves = [b.detach().requires_grad_() for b in buffers]
            F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
    except Exception as error:  # noqa: BLE001 - recorded, it is the result
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        cause = error.__context__
        if cause is not None:
            last = traceback.format_exception_only(type(cause), cause)[-1].strip()
        return None, last
    return (lambda: None), "ran"   # not reached on CPU in torch 2.13 (see the recorded error)


def _rank(rank, world, seqs, steps):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid import comm
    from hybrid.comm import CommLedger, Group
    from hybrid.context_parallel.attention import context_parallel_attention
    from hybrid.context_parallel.layout import local_positions, split_sequence

    ledger = CommLedger()
    group = Group("cp", list(range(world)), rank, ledger, pg=dist.group.WORLD)
    single = Group("cp", [rank], 0, CommLedger())
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for seq in seqs:
        g = torch.Generator().manual_seed(seq)
        full = [torch.randn(BATCH, h, seq, HEAD_DIM, generator=g)
                for h in (HEADS, GROUPS, GROUPS, HEADS)]
        _, peer_status = _torch_peer(mesh, *full[:3])
        for masked in (False, True):
            docs = _documents(seq, BATCH) if masked else None
            q, k, v, dout = (split_sequence(x, 2, rank, world) for x in full)
            index = local_positions(seq, rank, world)
            local_docs = split_sequence(docs, 1, rank, world) if masked else None
            variants = {}
            for comm_type in ("p2p", "a2a", "allgather"):
                variants[comm_type] = (q, k, v, dout, group, comm_type, index, local_docs)
            variants["cp1"] = (*full, single, "p2p", torch.arange(seq), docs)
            times = {name: [] for name in variants}
            sent = {}
            for step in range(WARMUP + steps):
                for name, (q_, k_, v_, dout_, grp, comm_type, idx, dc) in variants.items():
                    leaves = [x.clone().requires_grad_() for x in (q_, k_, v_)]
                    with comm.unrecorded(group):
                        dist.barrier()
                    mark = ledger.position
                    start = time.perf_counter()
                    out = context_parallel_attention(*leaves, group=grp, comm_type=comm_type,
                                                     token_index=idx, document_ids=dc)
                    out.backward(dout_)
                    elapsed = torch.tensor([time.perf_counter() - start])
                    sent[name] = sum(r.bytes_per_rank for r in ledger.since(mark)
                                     if r.op != "recv")
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # the slower rank's time
                    if step >= WARMUP:
                        times[name].append(float(elapsed))
            for name, ts in times.items():
                rows.append({"seq": seq, "document_mask": masked, "variant": name,
                             "median_step_ms": 1e3 * statistics.median(ts),
                             "cp_bytes_per_step": sent[name], "torch_context_parallel": peer_status})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    from hybrid.testing.multirank import run_on_ranks
    rows = run_on_ranks(_rank, 2, args=(args.seq, args.steps), timeout=3600)[0]
    names = {"p2p": "ours p2p (ring) CP 2", "a2a": "ours a2a (Ulysses) CP 2",
             "allgather": "all-gather-KV baseline CP 2", "cp1": "ours CP 1 (whole sequence)"}
    print(f"torch context_parallel on CPU: {rows[0]['torch_context_parallel']}")
    print(f"{'seq':>6} {'mask':>9} {'variant':<30} {'ms/step':>9} {'vs baseline':>12} "
          f"{'CP MiB/step':>12}")
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["variant"] == "allgather"
                    and r["document_mask"] == row["document_mask"])
        row["speedup_vs_allgather"] = base["median_step_ms"] / row["median_step_ms"]
        print(f"{row['seq']:>6} {'document' if row['document_mask'] else 'causal':>9} "
              f"{names[row['variant']]:<30} {row['median_step_ms']:>9.1f} "
              f"{row['speedup_vs_allgather']:>11.2f}x {row['cp_bytes_per_step'] / 2**20:>12.2f}")
    out = ROOT / "benchmarks" / "results" / "context_parallel.json"
    out.write_text(json.dumps({"config": dict(batch=BATCH, heads=HEADS, kv_heads=GROUPS,
                                              head_dim=HEAD_DIM, cp=2, dtype="float32",
                                              threads_per_rank=1, steps=args.steps,
                                              warmup=WARMUP),
                               "results": rows}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
