"""Issue 16 benchmark: one PP=2 training step of the same GPT, this project vs torch.distributed.pipelining.

GPT: 8 layers, hidden 256, 4 heads, seq 128, vocab 8192, 4 micro-batches of 2 sequences, fp32, one
thread per rank, 2 gloo ranks. Every variant runs the same stage modules (models.gpt.GPTModel built
with ``layers=(start, stop)`` / ``pre_process`` / ``post_process``) on the same data; a step is the
pipeline schedule (forward + backward of every micro-batch) + torch.optim.AdamW on each stage:

    ours 1F1B                   hybrid.pipeline.PipelineRunner, schedule 1f1b
    ours interleaved (v=2)      hybrid.pipeline.PipelineRunner, interleaved 1F1B, 2 chunks per rank
    torch Schedule1F1B          torch.distributed.pipelining.PipelineStage + Schedule1F1B
    torch Interleaved1F1B (v=2) PipelineStage x 2 per rank + ScheduleInterleaved1F1B

Both sides compute the loss the same way: the last stage's GPTModel returns its per-token loss
(the model's own vocab-parallel cross-entropy on its logits [s, b, V]), averaged over the
micro-batch; torch's last PipelineStage gets each micro-batch's labels from the step, in the
order its schedule runs the forwards, and its ``loss_fn`` only takes that mean. So the comparison
is of the pipeline machinery, not of two loss implementations.

Ours also keeps the tied word embedding of the first and last stage in step (its gradient sent to
the first stage during the last stage's final backward, the updated weight sent back after the
optimizer step without waiting for it, landed when the next step starts: 2 x V h per step);
torch's variants leave the last stage's copy untrained (it has no tied-weight mechanism), which
spares them that traffic.

With ``--link-mbit R`` (root: network namespaces, tools/netns_cluster.py) the two ranks run on two
"hosts" joined by a link shaped to R Mbit/s, PP across a slow link as on real clusters, each round
started with torchrun across the hosts. The output layer is then untied on every variant
(``untie_embeddings_and_output_weights``), so ours sends no tied-embedding traffic that torch's
variants skip and every variant moves the same activation bytes over the link.

Run:  python benchmarks/pp_vs_torch.py [--steps 10] [--repeats 5] [--link-mbit R]
Each of the ``--repeats`` rounds starts two fresh ranks, builds every variant and steps them
round-robin; a round's figure per variant is its median step time (the slower rank's) and median CPU
time of a step (both ranks' processes, gloo's threads included: compute plus every overhead, without
the idle time, so less disturbed by other jobs on a shared machine). Prints and writes to
benchmarks/results/pp_vs_torch.json (pp_vs_torch-link<R>mbit.json with --link-mbit) the median over
rounds of those medians with their spread (min-max over rounds), and the first step's loss of each
variant (equal up to rounding: the same model, data and loss).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO, MICRO_BATCHES = 8, 256, 4, 128, 8192, 2, 4
WARMUP = 2
UNTIED = False    # --link-mbit: every variant with its own output layer (no tied-weight traffic)
WORKER_ENV = "PP_VS_TORCH_WORKER"   # set: this file runs as one rank under torchrun (--link-mbit)


def _config():
    from models.gpt.config import GPTConfig
    return GPTConfig(LAYERS, HIDDEN, HEADS, vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                     attention_dropout=0.0, untie_embeddings_and_output_weights=UNTIED)


def _chunks(state, pipeline):
    from models.gpt.model import GPTModel
    chunks = []
    for c in range(pipeline.num_model_chunks):
        chunk = GPTModel(_config(), state, device="meta", layers=pipeline.layer_range(state.pp_rank, c),
                         pre_process=pipeline.is_first(state.pp_rank, c),
                         post_process=pipeline.is_last(state.pp_rank, c))
        chunk.init_weights(0)
        chunks.append(chunk)
    return chunks


def _ours(state, schedule, v):
    from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks, TiedEmbedding
    pipeline = PipelineConfig(2, MICRO_BATCHES, LAYERS, schedule, v)
    chunks = _chunks(state, pipeline)
    tied = (None if UNTIED else
            TiedEmbedding(state, lambda: chunks[0].embedding.word.weight) if state.is_first_stage
            else TiedEmbedding(state, lambda: chunks[-1].output_weight))
    runner = PipelineRunner(state, pipeline, chunks, activation_shape=(SEQ, MICRO, HIDDEN), tied=tied)
    optimizer = torch.optim.AdamW(StageChunks(chunks).parameters(), lr=1e-4)

    def step(tokens, labels):
        mbs = list(zip(tokens.chunk(MICRO_BATCHES), labels.chunk(MICRO_BATCHES)))
        loss = runner.step(mbs).loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if tied is not None:
            tied.sync_weight(wait=False)   # lands at the start of the next step
        return loss
    return step


class TorchStage(nn.Module):
    """A GPTModel stage with the one-tensor interface torch's PipelineStage calls: tokens [b, s] in
    on the first stage, hidden states [s, b, h] between stages, the per-token loss [b, s] out of the
    last (the model's own loss path, as ours). The last stage takes each micro-batch's labels from
    ``labels``, an iterator the step sets in micro-batch order: the order torch's schedules run the
    forwards of a stage."""

    def __init__(self, chunk):
        super().__init__()
        self.gpt = chunk
        self.labels = None

    def forward(self, x):
        labels = next(self.labels) if self.gpt.post_process else None
        if self.gpt.pre_process:
            return self.gpt(x, labels)
        tokens = torch.zeros(x.size(1), x.size(0), dtype=torch.long)   # its shape only
        return self.gpt(tokens, labels, hidden_states=x)


def _torch(state, schedule, v):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleaved1F1B)
    from hybrid.pipeline import PipelineConfig, StageChunks
    pipeline = PipelineConfig(2, MICRO_BATCHES, LAYERS, schedule, v)
    chunks = _chunks(state, pipeline)
    modules = [TorchStage(chunk) for chunk in chunks]
    hidden = torch.empty(SEQ, MICRO, HIDDEN, requires_grad=True)   # static: no shape inference

    def example(chunk, first):
        if first:
            return torch.zeros(MICRO, SEQ, dtype=torch.long) if chunk.pre_process else hidden
        return torch.empty(MICRO, SEQ) if chunk.post_process else hidden
    stages = [PipelineStage(module, c * 2 + state.pp_rank, 2 * v, torch.device("cpu"),
                            input_args=example(module.gpt, True),
                            output_args=example(module.gpt, False))
              for c, module in enumerate(modules)]

    def loss_fn(per_token, target):  # the last stage's per-token loss [b, s]: its mean, as ours
        return per_token.mean()
    sched = (Schedule1F1B(stages[0], MICRO_BATCHES, loss_fn=loss_fn) if v == 1
             else ScheduleInterleaved1F1B(stages, MICRO_BATCHES, loss_fn=loss_fn))
    optimizer = torch.optim.AdamW(StageChunks(chunks).parameters(), lr=1e-4)

    def step(tokens, labels):
        losses = []
        for module in modules:
            module.labels = iter(labels.chunk(MICRO_BATCHES))
        if state.is_first_stage:
            sched.step(tokens)
        else:
            sched.step(target=labels, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return float(sum(losses) / len(losses)) if losses else None
    return step


VARIANTS = {"ours 1F1B": (_ours, "1f1b", 1), "ours interleaved (v=2)": (_ours, "interleaved", 2),
            "torch Schedule1F1B": (_torch, "1f1b", 1),
            "torch Interleaved1F1B (v=2)": (_torch, "interleaved", 2)}


def _worker(rank, world, names, steps):
    import warnings
    import torch.distributed as dist
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    warnings.filterwarnings("ignore")
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world, pipeline_parallel_size=2))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO * MICRO_BATCHES, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MICRO * MICRO_BATCHES, SEQ), generator=g)
    runs = {name: VARIANTS[name][0](state, *VARIANTS[name][1:]) for name in names}
    times, cpu, first_loss = {name: [] for name in names}, {name: [] for name in names}, {}
    for i in range(steps):
        for name, step in runs.items():   # round-robin: the shared machine's load hits all alike
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = step(tokens, labels)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            if i == 0:
                first_loss[name] = loss
    return {name: (times[name][WARMUP:], cpu[name][WARMUP:], first_loss[name]) for name in names}


def _round_on_shaped_hosts(names, steps, mbit, round_):
    """One round with each rank on its own network-namespace host, the link shaped to ``mbit``."""
    import tempfile
    from tools.netns_cluster import NetnsCluster
    env = dict(os.environ, **{WORKER_ENV: json.dumps({"names": names, "steps": steps}),
                              "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    with NetnsCluster(2, 1, rate_mbit=mbit) as cluster, tempfile.TemporaryDirectory() as logs:
        outputs = cluster.torchrun(str(Path(__file__).resolve()), Path(logs), f"pp{round_}",
                                   timeout=3600, env=env)
    per_rank = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("PP_VS_TORCH_RANK "):
                rank, result = json.loads(line.split(" ", 1)[1])
                per_rank[rank] = result
    return [per_rank[r] for r in sorted(per_rank)]


def _torchrun_worker() -> None:
    """One rank of a --link-mbit round: the variants stepped as in _worker, the result printed."""
    global UNTIED
    UNTIED = True
    job = json.loads(os.environ[WORKER_ENV])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = _worker(rank, world, job["names"], job["steps"])
    print("PP_VS_TORCH_RANK " + json.dumps([rank, result]), flush=True)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10,
                        help=f"timed steps per variant and round (+{WARMUP} warm-up)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds, each on two fresh ranks; figures are medians over rounds")
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="run a subset")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="each rank on its own netns host, the link shaped to this rate (root)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.link_mbit is not None and args.link_mbit <= 0:
        parser.error("--link-mbit must be positive")
    from hybrid.testing.multirank import run_on_ranks
    names = args.only or list(VARIANTS)
    step_ms, cpu_ms = {n: [] for n in names}, {n: [] for n in names}
    first_loss = {}
    for round_ in range(args.repeats):
        if args.link_mbit is None:
            per_rank = run_on_ranks(_worker, 2, args=(names, args.steps + WARMUP), timeout=3600)
        else:
            per_rank = _round_on_shaped_hosts(names, args.steps + WARMUP, args.link_mbit, round_)
        for name in names:
            step_times = [max(ts) for ts in zip(*(r[name][0] for r in per_rank))]
            cpu_times = [sum(ts) for ts in zip(*(r[name][1] for r in per_rank))]
            step_ms[name].append(1e3 * statistics.median(step_times))
            cpu_ms[name].append(1e3 * statistics.median(cpu_times))
            first_loss.setdefault(name, per_rank[-1][name][2])
        print(f"round {round_ + 1}/{args.repeats}: " + ", ".join(
            f"{name} {step_ms[name][-1]:.1f} ms" for name in names), flush=True)
    rows = {name: {"step_ms": _spread(step_ms[name]), "cpu_ms_both_ranks": _spread(cpu_ms[name]),
                   "first_step_loss": first_loss[name]} for name in names}
    for name, row in rows.items():
        t, c = row["step_ms"], row["cpu_ms_both_ranks"]
        print(f"{name:>28}: {t['median']:8.1f} ms/step ({t['min']:.1f}-{t['max']:.1f})  "
              f"{c['median']:8.1f} CPU ms/step ({c['min']:.1f}-{c['max']:.1f})   first-step loss "
              f"{row['first_step_loss']:.6f}", flush=True)
    for ours, peer in (("ours 1F1B", "torch Schedule1F1B"),
                       ("ours interleaved (v=2)", "torch Interleaved1F1B (v=2)")):
        if ours in rows and peer in rows:
            time_ratio = rows[peer]["step_ms"]["median"] / rows[ours]["step_ms"]["median"]
            cpu_ratio = (rows[peer]["cpu_ms_both_ranks"]["median"]
                         / rows[ours]["cpu_ms_both_ranks"]["median"])
            print(f"{peer} / {ours} step time: {time_ratio:.2f}x, CPU time: {cpu_ratio:.2f}x")
    suffix = "" if args.link_mbit is None else f"-link{args.link_mbit:g}mbit"
    out = ROOT / "benchmarks" / "results" / f"pp_vs_torch{suffix}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                                              vocab=VOCAB, micro_batch=MICRO,
                                              micro_batches=MICRO_BATCHES, pp=2, dtype="fp32",
                                              threads_per_rank=1, loss="GPTModel per-token loss",
                                              untied_output_layer=args.link_mbit is not None,
                                              link_mbit=args.link_mbit),
                               "steps": args.steps, "repeats": args.repeats,
                               "load_average": os.getloadavg(), "results": rows}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if WORKER_ENV in os.environ:
        _torchrun_worker()
    else:
        main()
