"""ZeRO stages 0-2 x TP x DP x gradient accumulation against a single-device torch.optim.AdamW
reference: the same model unsharded, trained on the same global batch (fp32: rtol 1e-5).

Two tasks: a TP MLP block (fast, used for the wide sweep) and the GPT model (models/gpt GPTModel vs
ReferenceGPT, mapped with models/gpt/sharding.py). Also: clipping by the global norm across DP and
TP, and optimizer-state fragments saved under one stage and loaded under another.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid import comm
from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.results import Fragment
from models.gpt import sharding
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT

STEPS = 5
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class TinyTPBlock(nn.Module):
    """MLP block from the TP layers: sharded (fc1, fc2 weights) and TP-replicated (fc2 bias, norm)
    parameters. Input/target [s, b, h]; returns the mean-squared error."""

    def __init__(self, group, hidden=16, ffn=32, dtype=torch.float32):
        super().__init__()
        self.hidden = hidden
        self.fc1 = ColumnParallelLinear(hidden, ffn, group, dtype=dtype)
        self.fc2 = RowParallelLinear(ffn, hidden, group, dtype=dtype)
        self.norm = LayerNorm(hidden, group, dtype=dtype)
        for name in ("fc1", "fc2"):
            getattr(self, name).init_weights(7, std=0.3, prefix=name + ".")

    def forward(self, x, target):
        x = x.to(self.fc1.weight.dtype)          # bf16/fp16 runs compute in the parameter dtype
        y = self.norm(x + self.fc2(F.gelu(self.fc1(x))))
        return F.mse_loss(y.float(), target)


class MLPTask:
    """Batches [s, b, h] split along dim 1 over DP ranks and micro-batches."""

    batch_dim, batch, adamw = 1, 8, ADAMW

    def __init__(self, hidden=16, ffn=32, seq=4):
        self.hidden, self.ffn, self.seq = hidden, ffn, seq

    def data(self, steps=STEPS, seed=3):
        g = torch.Generator().manual_seed(seed)
        shape = (self.seq, self.batch, self.hidden)
        return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
                for _ in range(steps)]

    def model(self, state):
        return TinyTPBlock(state.tp, self.hidden, self.ffn)

    def reference(self):
        return TinyTPBlock(ParallelState.single_process().tp, self.hidden, self.ffn)

    def loss(self, model, batch):
        return model(*batch)

    def shard(self, name, full, param, state):
        return tp_init.shard(full, param.partition_dim, state.tp_rank, state.tp_size)


class GPTTask:
    """GPTModel vs ReferenceGPT on token batches [b, s] split along dim 0; mean per-token loss."""

    # The attention key bias has an exactly-zero gradient (softmax is shift invariant), so its
    # computed gradient is rounding noise that AdamW with eps 1e-8 would turn into +-lr steps of
    # random sign; eps 1e-4 keeps such noise (~1e-10) from being amplified past the 1e-5 check.
    batch_dim, batch = 0, 8
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)
    config = GPTConfig(2, 32, 4, vocab_size=101, seq_length=8, hidden_dropout=0.0,
                       attention_dropout=0.0, make_vocab_size_divisible_by=4)

    def __init__(self, sequence_parallel=False):
        self.sequence_parallel = sequence_parallel

    def data(self, steps=STEPS, seed=5):
        g = torch.Generator().manual_seed(seed)
        shape = (self.batch, self.config.seq_length)
        return [(torch.randint(0, self.config.vocab_size, shape, generator=g),
                 torch.randint(0, self.config.vocab_size, shape, generator=g)) for _ in range(steps)]

    def model(self, state):
        model = GPTModel(self.config, state, device="meta", sequence_parallel=self.sequence_parallel)
        model.init_weights(11)
        return model

    def reference(self):
        model = ReferenceGPT(self.config)
        model.init_weights(11)
        return model

    def loss(self, model, batch):
        return model(*batch).mean()

    def shard(self, name, full, param, state):
        return sharding.shard_tensor(self.config, name, full, state.tp_rank, state.tp_size)


def reference_run(task, data, clip=0.0):
    """Unsharded model, torch.optim.AdamW (no decay on ndim < 2), full global batch per step."""
    model = task.reference()
    params = list(model.parameters())
    cfg = task.adamw
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    losses, norms = [], []
    for batch in data:
        opt.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def micro_batches(task, batch, state, accum):
    """This DP rank's slice of the global batch, cut into ``accum`` micro-batches."""
    local = task.batch // state.dp_size
    for m in range(accum):
        lo = state.dp_rank * local + m * local // accum
        hi = state.dp_rank * local + (m + 1) * local // accum
        yield tuple(t.narrow(task.batch_dim, lo, hi - lo) for t in batch)


def train(task, state, opt, model, data, accum, inject=None):
    """Steps of ``data``; returns global losses and StepResults. ``inject(step)`` may return a
    factor to multiply this rank's loss by (inf to force an overflow)."""
    losses, results = [], []
    for step, batch in enumerate(data):
        opt.zero_grad()
        total = torch.zeros(1)
        for mb in micro_batches(task, batch, state, accum):
            loss = task.loss(model, mb) / accum
            factor = inject(step) if inject else 1.0
            opt.backward(loss * factor if factor != 1.0 else loss)
            total += loss.detach().float()
        results.append(opt.step())
        state.ledger.enabled = False     # the loss average is not part of the optimizer's traffic
        comm.all_reduce(total, state.dp)
        state.ledger.enabled = True
        losses.append(total.item() / state.dp_size)
    return losses, results


def assert_matches_reference(task, state, model, losses, ref, rtol, atol, what):
    ref_losses, _, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} losses: {m}")
    for name, p in model.named_parameters():
        expected = task.shard(name, ref_params[name], p, state)
        torch.testing.assert_close(p.detach().float(), expected, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} param {name}: {m}")


def _parity(rank, world_size, task, tps, stages, accums, clip=0.0, overlap=True):
    data = task.data()
    ref = reference_run(task, data, clip)
    checked = []
    for tp in tps:
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
        for stage in stages:
            for accum in accums:
                cfg = ZeroConfig(stage=stage, bucket_size=300, gradient_accumulation_steps=accum,
                                 clip_grad=clip, overlap_communication=overlap)
                model = task.model(state)
                opt = build_zero_optimizer(model, state, cfg, task.adamw)
                losses, results = train(task, state, opt, model, data, accum)
                what = f"{type(task).__name__} stage {stage} tp {tp} dp {state.dp_size} accum {accum}"
                assert_matches_reference(task, state, model, losses, ref, 1e-5, 1e-6, what)
                torch.testing.assert_close(torch.tensor([r.grad_norm for r in results]),
                                           torch.tensor(ref[1]), rtol=1e-5, atol=0)
                checked.append(what)
    return checked


def test_fp32_stages_match_reference_single_rank():
    checked = run_on_ranks(_parity, 1, args=(MLPTask(), [1], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 6


def test_fp32_stages_match_reference_two_ranks():
    checked = run_on_ranks(_parity, 2, args=(MLPTask(), [1, 2], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 12


def test_fp32_stages_match_reference_four_ranks():
    """Odd sizes (hidden 10, ffn 22): buckets get padding, chunks split parameters mid-way."""
    checked = run_on_ranks(_parity, 4, args=(MLPTask(hidden=10, ffn=22), [1, 2], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 12


def test_fp32_stages_without_overlap_match_reference():
    """overlap_communication=False: every bucket is reduced at step() instead of in the hooks."""
    checked = run_on_ranks(_parity, 2, args=(MLPTask(), [1], [0, 1, 2], [2]),
                           kwargs={"overlap": False})
    assert len(checked[0]) == 3


def test_fp32_gpt_stages_match_reference_four_ranks():
    """GPTModel (tied vocab-parallel embedding, padded vocab) at TP 1 x DP 4 and TP 2 x DP 2."""
    checked = run_on_ranks(_parity, 4, args=(GPTTask(), [1, 2], [0, 1, 2], [1, 2]))
    assert len(checked[0]) == 12


def test_clipping_by_global_norm_across_dp_and_tp():
    """A max norm below the gradient norm: clipped updates and reported norms match
    torch.nn.utils.clip_grad_norm_ on the reference (TP-replicated parameters counted once)."""
    checked = run_on_ranks(_parity, 4, args=(MLPTask(), [2], [0, 1, 2], [1]), kwargs={"clip": 0.05})
    assert len(checked[0]) == 3


def test_clipping_gpt_with_sequence_parallel():
    """SP: LayerNorm and row-parallel biases see sequence shards and get their gradients summed
    over TP by autograd; they are TP-replicated and must count once in the global norm."""
    checked = run_on_ranks(_parity, 4, args=(GPTTask(sequence_parallel=True), [2], [1, 2], [1]),
                           kwargs={"clip": 0.5})
    assert len(checked[0]) == 2


@pytest.mark.slow
def test_fp32_stages_match_reference_eight_ranks():
    checked = run_on_ranks(_parity, 8, args=(MLPTask(), [2], [0, 1, 2], [1, 2]), timeout=400)
    assert len(checked[0]) == 6


def _full_fragments(opt, state):
    """Reassemble every parameter's full (TP-local) optimizer state from the owned fragments of all
    DP ranks, as a checkpoint loader would: zeros + own pieces, summed over DP when partitioned."""
    sizes = {}
    for f in opt.owned_fragments():
        sizes[f.param_name] = max(sizes.get(f.param_name, 0), f.end)
    names = dict(zip(opt.names, opt.params))
    full = {(n, k): torch.zeros(names[n].numel()) for n in names
            for k in ("master", "exp_avg", "exp_avg_sq")}
    for f in opt.owned_fragments():
        full[(f.param_name, f.kind)][f.offset:f.end] = f.tensor
    if opt.config.stage >= 1:
        for t in full.values():
            comm.all_reduce(t, state.dp)
    return [Fragment(n, k, 0, t) for (n, k), t in full.items()]


def _resume(rank, world_size, tp, save_stage, load_stage):
    task = MLPTask()
    data = task.data()
    ref = reference_run(task, data)
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    model = task.model(state)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=save_stage, bucket_size=200), ADAMW)
    first, _ = train(task, state, opt, model, data[:3], 1)
    saved, step = _full_fragments(opt, state), opt.step_count
    fresh = task.model(state)   # initial weights: everything must come from the fragments
    opt2 = build_zero_optimizer(fresh, state, ZeroConfig(stage=load_stage, bucket_size=120), ADAMW)
    opt2.load_fragments(saved)
    opt2.step_count = step
    rest, _ = train(task, state, opt2, fresh, data[3:], 1)
    assert_matches_reference(task, state, fresh, first + rest, ref, 1e-5, 1e-6,
                             f"resume {save_stage}->{load_stage}")
    return True


def test_fragments_resume_across_stages_and_buckets():
    assert all(run_on_ranks(_resume, 4, args=(2, 1, 2)))
    assert all(run_on_ranks(_resume, 2, args=(1, 2, 0)))
