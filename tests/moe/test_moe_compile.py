"""``--compile`` on a MoE GPT (issue 32, "Composition: ... --compile"; models/gpt/compile.py,
docs/compile.md): the trainer's regional compile of a 2-layer MoE GPT (both layers MoE, 4 experts
top-2, aux and z losses, ZeRO 1, DP 2) at EP 1 and EP 2 (alltoall) in fp32, and EP 2 in bf16,
trains like the eager trainer on the same ranks.

Oracles: the losses of 3 steps equal eager's within rtol 1e-5 in fp32 (measured: equal at EP 1,
1 ulp at EP 2) and 2e-2 in bf16 (docs/compile.md's 16-bit bound); the communication ledger of
the compiled run equals eager's record for record (the EP all-to-alls run eagerly, once each,
through hybrid.comm; in bf16 the same collectives in the same order, their sizes may differ: the
compiled layer rounds differently, which can flip a route, measured once in 3 steps); and the graph breaks are the expected ones and no others: at EP 2 around
the dispatcher's ``dispatch`` (and ``combine`` where dynamo reaches it; both communicate and
size their outputs by counts read on the host), and in fp32 around the grouped GEMM
(``_grouped_mm_eager``: torch 2.13's fake kernel of ``torch._grouped_mm`` takes bf16 only, so
fp32 runs it eagerly); bf16 traces it.

Slow only (compiling takes about a minute per run on the 2-core CI machine); one inductor cache
for all runs.
"""

from __future__ import annotations

import re

import pytest

from hybrid.testing.multirank import run_on_ranks
from tests.pretrain.test_host_sync import _trainer
from tests.training_helpers import tiny_args

ITERS = 3
MOE = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
CASES = {  # name: (EP, precision, functions a graph break names)
    "ep1-fp32": (1, "fp32", {"_grouped_mm_eager"}),
    "ep2-fp32": (2, "fp32", {"AllToAllDispatcher.dispatch", "_grouped_mm_eager"}),
    "ep2-bf16": (2, "bf16", {"AllToAllDispatcher.dispatch"}),
}
# disabled too, but dynamo may resume after the break before it without tracing up to it (measured
# at EP 2 fp32: no break reported there); it runs eagerly either way
MAY_BREAK = {"AllToAllDispatcher.combine"}


def _break_sites(reasons) -> set[str]:
    """The functions dynamo's graph-break reasons name (``torch.compiler.disable``d ones)."""
    return {m.group(1) for r in reasons
            for m in re.finditer(r"function [`<]*(?:function )?([\w.]+)", r)}


def _runs(rank, world, names, cache):
    import torch._inductor.config
    from torch._dynamo.utils import counters
    torch._inductor.config.compile_threads = 1
    out = {}
    for name in names:
        ep, precision, _ = CASES[name]
        for compiled in (False, True):
            extra = MOE + ["--expert-model-parallel-size", str(ep), "--log-interval", str(ITERS),
                           "--data-cache-dir", cache] + (["--compile"] if compiled else [])
            counters.clear()
            trainer = _trainer(tiny_args(iters=ITERS, zero=1, precision=precision, extra=extra))
            records, ledger = [], trainer.state.ledger

            def recorded(loader, lr, _step=trainer.train_step):
                mark = ledger.position
                result = _step(loader, lr)
                records.extend((r.group, r.op, r.numel) for r in ledger.since(mark))
                return result
            trainer.train_step = recorded
            trainer.train()
            out[name, compiled] = (trainer.losses, records, sorted(counters["graph_break"]))
    return out


@pytest.mark.slow
def test_compiled_moe_trains_like_eager(tmp_path):
    import torch
    results = run_on_ranks(_runs, 2, args=(list(CASES), str(tmp_path)), timeout=1500)
    for r in results:
        for name, (_, precision, sites) in CASES.items():
            (eager, eager_records, _), (compiled, records, breaks) = r[name, False], r[name, True]
            rtol = 1e-5 if precision == "fp32" else 2e-2
            torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=rtol,
                                       atol=0, msg=lambda m: f"{name} losses: {m}")
            assert len(eager) == ITERS
            if precision == "bf16":   # fused bf16 rounding may flip a route: sizes may differ
                records = [r[:2] for r in records]
                eager_records = [r[:2] for r in eager_records]
            assert records == eager_records, f"{name}: the collectives differ under compile"
            if name.startswith("ep2"):
                assert any(r[:2] == ("ep", "all_to_all_v") for r in records), name
            assert sites <= _break_sites(breaks) <= sites | MAY_BREAK, (name, breaks)
