"""Issue 5 benchmark: activation memory and step time of every recompute mode, side by side with
torch.utils.checkpoint applied to the same layers.

GPT: 4 layers, hidden 256, 8 heads, seq 256, vocab 4096, micro-batch 4, dropout 0.1, fp32, one thread
per rank. One step = forward + backward (no optimizer: it is the same for every row). Rows:

    none / selective / full / full-pa / full-pa-cpu / full + MD     hybrid.recompute on GPTModel
    torch.utils.checkpoint                                          each layer wrapped (non-reentrant)

at TP 1 (one process) and TP 2 (two gloo ranks; Pa partitions the checkpoint only there). Memory is
measured with saved-tensor hooks (hybrid.recompute.ActivationMeter): bytes alive after the forward
per tier (device / host) and the peak over forward + backward (not measurable this way for
torch.utils.checkpoint, whose recomputed tensors hide behind its own hooks). Time: median wall and
CPU (process) seconds per step; on a shared machine CPU seconds are the steadier comparison. Every
row starts from the same seeds, so the first losses agree (a recompute that changed a dropout mask
would show here). torch.utils.checkpoint restores only
torch's default generator, not the TP-region stream of RNGTracker, so its rows run at TP 1 with the
model's rng=None (dropout on the default stream) and ours do the same there for a fair comparison.

Run:  python benchmarks/recompute_modes.py [--steps 6]
Prints a markdown table and writes benchmarks/results/recompute_modes.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 4, 256, 8, 256, 4096, 4
ROWS = [("none", {}), ("selective", {}), ("full", {}), ("full-pa", {}), ("full-pa-cpu", {}),
        ("full", dict(arena_chunk_bytes=8 << 20))]


def _config():
    from models.gpt.config import GPTConfig
    return GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.1,
                     attention_dropout=0.1)


class TorchCheckpointed(nn.Module):
    """A layer run through torch.utils.checkpoint (non-reentrant) by the model's own loop."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inner = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _measure(build, steps: int, hooks_see_recompute: bool = True) -> dict:
    """Median wall and CPU seconds of a forward + backward and the saved bytes of the last step.
    Every variant starts from the same seeds, so its first loss must equal the others'."""
    from hybrid.recompute import ActivationMeter
    torch.manual_seed(1234)
    model = build()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    arenas = model.recomputer.arenas() if model.recomputer is not None else []
    wall, cpu, losses = [], [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        with ActivationMeter(exclude=model.parameters(), arenas=arenas) as meter:
            loss = model(tokens, labels).mean()
            after_forward = dict(meter.live)
            loss.backward()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(loss.item())
        model.zero_grad(set_to_none=True)
    # torch.utils.checkpoint stores its recomputed tensors behind its own saved-tensor hooks,
    # invisible to the meter: its backward peak is not measurable this way
    peak = meter.peak_total if hooks_see_recompute else None
    return dict(wall_s=statistics.median(wall[1:]), cpu_s=statistics.median(cpu[1:]),
                device=after_forward.get("device", 0), host=after_forward.get("host", 0),
                peak=peak, first_loss=losses[0])


def _rows(state, tp: int, steps: int) -> list[dict]:
    from hybrid.recompute import RecomputePlan
    from hybrid.tensor_parallel import RNGTracker
    from models.gpt.model import GPTModel
    torch.set_num_threads(1)
    config = _config()

    def ours(mode, kw):
        plan = None if mode == "none" else RecomputePlan.uniform(mode, LAYERS, **kw)
        rng = RNGTracker(3, state.tp_rank) if tp > 1 else None   # see the module docstring
        return lambda: GPTModel(config, state, rng=rng, recompute=plan)

    out = []
    for mode, kw in ROWS:
        name = f"{mode} + MD" if kw.get("arena_chunk_bytes") else mode
        out.append(dict(tp=tp, variant=name, **_measure(ours(mode, kw), steps)))
    if tp == 1:
        def torch_ckpt():
            model = GPTModel(config, state, rng=None)
            model.layers = nn.ModuleList(TorchCheckpointed(layer) for layer in model.layers)
            return model
        out.append(dict(tp=tp, variant="torch.utils.checkpoint",
                        **_measure(torch_ckpt, steps, hooks_see_recompute=False)))
    return out


def _tp_ranks(rank, world, steps):
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    state = ParallelState.initialize(Topology(world, world, gpus_per_node=world))
    return _rows(state, world, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from hybrid.parallel_state import ParallelState
    from hybrid.testing.multirank import run_on_ranks
    rows = _rows(ParallelState.single_process(), 1, args.steps)
    rows += run_on_ranks(_tp_ranks, 2, args=(args.steps,), timeout=1800)[0]
    print("| TP | variant | kept after forward: device (MiB) | host tier (MiB) | peak over fwd+bwd (MiB) "
          "| step wall (s) | step CPU (s) | first loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        peak = "n/a" if r["peak"] is None else f"{r['peak'] / 2**20:.2f}"
        print(f"| {r['tp']} | {r['variant']} | {r['device'] / 2**20:.2f} | {r['host'] / 2**20:.2f} | "
              f"{peak} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['first_loss']:.6f} |")
    out = ROOT / "benchmarks" / "results" / "recompute_modes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(config=dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                                               vocab=VOCAB, micro_batch=MICRO), rows=rows), indent=1))


if __name__ == "__main__":
    main()
