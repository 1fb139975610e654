"""Muon under TP and ZeRO (hybrid/zero/muon.py, issue 33) against the single-device reference
Muon of models/gpt/reference.py (ReferenceMuon: whole canonical matrices, no owners, no
collectives).

* Newton-Schulz: ours equals the reference's spelling and is nearly orthogonal.
* Parity: the GPT model at TP 2 x DP 2 with ZeRO stages 1 and 3, fp32 Newton-Schulz, equals the
  reference over 5 steps to rtol 1e-5 (losses and every parameter); with the published bf16
  iteration the losses agree to 1e-4 relative (parameters 5e-3 absolute), the stated tolerance.
* Ledger: every step records exactly ``2 (dp - 1) R b + (tp - 1) R b`` bytes under the ``muon``
  category (R: the largest owner's Muon elements), and ZeRO's own records are unchanged.
* Owners: whole matrices, balanced by Newton-Schulz FLOPs.
"""

import pytest
import torch

from hybrid.muon_config import COMM_CATEGORY, MuonConfig, muon_comm_bytes, newton_schulz_flops
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.muon import MuonMatrix, assign_owners, newton_schulz
from models.gpt.reference import ReferenceMuon
from tests.zero.test_stages import GPTTask, MLPTask, TinyTPBlock, micro_batches, train

STEPS = 5
TASK = GPTTask()
FP32 = MuonConfig(ns_dtype="fp32")
BF16 = MuonConfig(ns_dtype="bf16")
BF16_RTOL = 1e-4   # bf16 Newton-Schulz vs the fp32 reference, 5 steps (losses; measured 7e-6)
BF16_ATOL = 5e-3   # parameters (measured 1.8e-3; a step moves a weight by ~2e-3)


def reference_muon_run(muon: MuonConfig, data):
    model = TASK.reference()
    a = TASK.adamw
    opt = ReferenceMuon(model, muon, a.lr, a.betas, a.eps, a.weight_decay)
    losses = []
    for batch in data:
        opt.zero_grad()
        loss = TASK.loss(model, batch)
        loss.backward()
        opt.step(a.lr)
        losses.append(loss.item())
    return losses, None, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_newton_schulz_matches_reference_spelling_and_orthogonalises():
    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    ref = ReferenceMuon(torch.nn.Linear(2, 2), FP32, 1e-3, (0.9, 0.95), 1e-8, 0.0)
    for m in (g, g.t()):
        ours = newton_schulz(m, 5, torch.float32)
        torch.testing.assert_close(ours, ref.orthogonalise(m), rtol=1e-5, atol=1e-6)
        s = torch.linalg.svdvals(ours)
        assert 0.6 < s.min() and s.max() < 1.25, s   # the quintic's band around 1
        bf16 = newton_schulz(m, 5, torch.bfloat16)
        assert (bf16 - ours).abs().max() < 0.05


def test_owners_are_whole_matrices_balanced_by_flops():
    mats = [MuonMatrix(f"layers.{i}.w", shape, -1, 1)
            for i, shape in enumerate([(96, 32), (32, 32), (128, 32), (32, 128)] * 2)]
    owners = assign_owners(mats, 2, 5)
    loads = [sum(newton_schulz_flops(*m.whole_shape, 5) for m, o in zip(mats, owners) if o == r)
             for r in range(2)]
    assert max(loads) - min(loads) <= max(newton_schulz_flops(*m.whole_shape, 5) for m in mats)
    assert assign_owners(mats, 2, 5) == owners   # deterministic: every rank computes the same


def test_ledger_formula():
    assert muon_comm_bytes(100, 2, 2, 4) == 2 * 1 * 100 * 4 + 1 * 100 * 4
    assert muon_comm_bytes(100, 1, 1, 2) == 0


def check_params(state, model, opt, losses, ref, rtol, atol, what):
    """Losses and every TP-local parameter against the reference's shard (stage 3: gathered, as
    its parameters hold no storage outside forward and backward)."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=rtol, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    params = (opt.gathered_state_dict() if hasattr(opt, "gathered_state_dict")
              else {n: p.detach() for n, p in model.named_parameters()})
    shapes = {n: p for n, p in model.named_parameters()}
    for name, value in params.items():
        expected = TASK.shard(name, ref[2][name], shapes[name], state)
        torch.testing.assert_close(value.float().view_as(expected), expected, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} param {name}: {m}")


def _parity(rank, world_size, stages, muon, rtol, atol):
    data = TASK.data(STEPS)
    ref = reference_muon_run(muon, data)
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    out = []
    for stage in stages:
        model = TASK.model(state)
        cfg = ZeroConfig(stage=stage, bucket_size=300, muon=muon)
        opt = build_zero_optimizer(model, state, cfg, TASK.adamw,   # stage 3: GPTTask's seed
                                   **({"seed": 11} if stage == 3 else {}))
        per_step, losses = [], []
        for step in range(STEPS):   # one step at a time: each step's ledger records
            losses += train(TASK, state, opt, model, data[step:step + 1], 1)[0]
            muon_bytes = sum(r.bytes_per_rank for r in opt._last_step_records
                             if r.category == COMM_CATEGORY)
            per_step.append(muon_bytes)
        what = f"muon stage {stage} tp 2 dp {state.dp_size} ns {muon.ns_dtype}"
        check_params(state, model, opt, losses, ref, rtol, atol, what)
        expected = opt.optimizer_state.expected_comm_bytes()
        assert per_step == [expected] * STEPS, (per_step, expected)
        plan = opt.optimizer_state.plan
        assert expected == muon_comm_bytes(plan.region, 2, 2, muon.ns_itemsize) > 0
        out.append((stage, expected, plan.region, sum(m.numel for m in plan.matrices)))
    return out


@pytest.mark.slow   # 4 ranks x the GPT: minutes on the shared CI machine (ran: passed)
@pytest.mark.parametrize("stage", [1, 3])
def test_muon_tp2_dp2_zero_equals_reference_fp32_ns(stage):
    results = run_on_ranks(_parity, 4, args=([stage], FP32, 1e-5, 1e-6), timeout=300)
    stage, expected, region, total = results[0][0]
    assert region * 2 >= total   # the owners' regions hold every matrix (TP-local elements)


@pytest.mark.slow
def test_muon_bf16_ns_within_stated_tolerance():
    run_on_ranks(_parity, 4, args=([1], BF16, BF16_RTOL, BF16_ATOL), timeout=300)


class LayeredMLP(torch.nn.Module):
    """Two TP MLP blocks under ``layers.`` (so their weights are Muon matrices: fc1 column-,
    fc2 row-parallel) and the blocks' norms and biases (AdamW)."""

    def __init__(self, group):
        super().__init__()
        self.layers = torch.nn.ModuleList(TinyTPBlock(group) for _ in range(2))

    def forward(self, x, target):
        return self.layers[0](x, target) + self.layers[1](x, target)


class LayeredMLPTask(MLPTask):
    def model(self, state):
        return LayeredMLP(state.tp)

    def reference(self):
        return LayeredMLP(ParallelState.single_process().tp)


def _mlp_parity(rank, world_size):
    task = LayeredMLPTask()
    data = task.data(3)
    ref_model = task.reference()
    a = task.adamw
    ref_opt = ReferenceMuon(ref_model, FP32, a.lr, a.betas, a.eps, a.weight_decay)
    for batch in data:
        ref_opt.zero_grad()
        task.loss(ref_model, batch).backward()
        ref_opt.step(a.lr)
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    checked = []
    for stage in (0, 1, 2):
        model = task.model(state)
        opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, bucket_size=150,
                                                            muon=FP32), a)
        for batch in data:
            opt.zero_grad()
            for mb in micro_batches(task, batch, state, 1):
                opt.backward(task.loss(model, mb))
            opt.step()
            muon = sum(r.bytes_per_rank for r in opt._last_step_records
                       if r.category == COMM_CATEGORY)
            assert muon == opt.optimizer_state.expected_comm_bytes(), (stage, muon)
        ref = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            expected = task.shard(name, ref[name].detach(), p, state)
            torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} {name}: {m}")
        plan = opt.optimizer_state.plan
        checked.append((stage, plan.region, muon))
    return checked


def test_muon_tp2_dp2_mlp_stages_0_1_2_equal_reference_and_ledger():
    """The fast default check: TP 2 x DP 2, stages 0-2 (buckets of 150 elements cut the 16 x 32
    matrices mid-way), 3 steps against ReferenceMuon, and each step's ledger bytes = formula."""
    checked = run_on_ranks(_mlp_parity, 4)[0]
    (s0, r0, b0), (s1, r1, b1), (s2, r2, b2) = checked
    assert b0 == muon_comm_bytes(r0, 1, 2, 4) and r0 == 4 * 16 * 32 // 2   # no DP traffic
    assert b1 == b2 == muon_comm_bytes(r1, 2, 2, 4) and r1 == r0 // 2      # 2 matrices each


def test_checkpoint_of_another_optimizer_is_refused():
    """Muon's momentum sits in the exp_avg slot: an AdamW checkpoint's first moment is not one."""
    state = ParallelState.single_process()
    model = LayeredMLPTask().model(state)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=1, muon=FP32), MLPTask.adamw)
    counters = opt.checkpoint_counters()
    assert counters["optimizer"] == "muon"
    with pytest.raises(ValueError, match="--optimizer adamw"):
        opt.load_checkpoint_pieces(opt.checkpoint_pieces(), {**counters, "optimizer": "adamw"})
    opt.load_checkpoint_pieces(opt.checkpoint_pieces(), counters)   # its own loads
