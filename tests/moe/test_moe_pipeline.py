"""MoE GPT under pipeline parallelism trains exactly like the single-device oracle (issue 32,
"PP 2 for one case"): 4 layers, every one a MoE layer, split over 2 stages (so both stages route),
top-2 sigmoid routing with a gated shared expert. fp32, rtol 1e-5 on the losses, the gradient norms
(spanning both stages) and every final parameter (the experts' EP slices): 1F1B (m 4) and
interleaved (v 2, m 2) at PP 2, and PP 2 x EP 2 (DP 2, m 2) on 4 ranks, ZeRO 1.

Variants: dropless without aux / z losses (5 steps); DeepSeek-V3's expert bias with a capacity
factor that drops (3 steps); dropless with softmax scores, the aux loss and the z-loss, and with
sigmoid scores and the per-sequence aux loss (5 steps). The aux / z-loss variants check the
gradient scale that the schedule gives the MoE layers of BOTH stages (models/gpt/moe.py): a stage
without the loss has no probe. The default case runs them with a loss scale of 2^10 (a dynamic
scaler on the fp32 engine: the power of two is exact) over m = 4 micro-batches, so a scale that
ignored the loss scale (2^-10 of the aux gradient) or the micro-batch count (4x) fails at rtol
1e-5; it also checks that every stage's MoE metrics reach every rank (pretrain.metrics.moe_metrics
over the PP group). (With sigmoid scores, the aux loss 0.1 and the z-loss 1e-2, the oracle's
rounding alone, seen from the single-stage layer, already reaches rtol 1e-5 in one embedding
element by step 5: the variants avoid that combination.)

The bias-drop variant runs fewer steps because it amplifies rounding: the oracle itself, run with
its micro-batch backwards in another order, drifts by ~2e-6 in the step-4 grad norm, and the
pipeline by ~2e-5 by step 5 (not a bias bug: that would be an lr-sized parameter error at step 2).

Routing and capacity are per micro-batch, so the oracle (tests/moe/test_moe_parity.py
``reference_run``) runs the global batch as the same dp x m micro-batches (rows in order); the
expert bias moves once per step from the loads of every micro-batch of every DP rank.
"""

import dataclasses

import pytest
import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks
from hybrid.testing.multirank import run_on_ranks
from hybrid.precision_config import LossScaleConfig
from hybrid.topology import Topology
from hybrid.zero import ZeroConfig, build_zero_optimizer
from hybrid.zero.loss_scaler import DynamicLossScaler
from models.gpt import sharding
from models.gpt.model import GPTModel
from models.gpt.sharding import expert_slice
from pretrain.metrics import moe_metrics
from tests.moe.test_moe_parity import ADAMW, BATCH, SEED, config_of, data, reference_run
from tests.pipeline.test_pipeline import _tied

NO_AUX = dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
DROPLESS = dict(moe_expert_capacity_factor=None, moe_router_enable_expert_bias=False)
VARIANTS = {   # on top of test_moe_parity's "top2-sigmoid-bias-drop-shared-z"
    "dropless": dict(**NO_AUX, **DROPLESS),
    "bias-drop": NO_AUX,
    "aux-z": dict(DROPLESS, moe_router_score_function="softmax", moe_aux_loss_coeff=0.1,
                  moe_z_loss_coeff=1e-2),   # GShard / Switch: softmax scores
    "seq-aux": dict(DROPLESS, moe_router_load_balancing_type="seq_aux_loss",
                    moe_aux_loss_coeff=0.1, moe_z_loss_coeff=None),
}


def _config(variant):
    return dataclasses.replace(config_of("top2-sigmoid-bias-drop-shared-z"), num_layers=4,
                               **VARIANTS[variant])


def _run(rank, world_size, ep, cases):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=2,
                                              expert_model_parallel_size=ep), dp_transport="gloo")
    dp, b_local = state.dp_size, BATCH // state.dp_size
    checked = []
    for variant, schedule, v, m, steps, *loss_scale in cases:
        config, batches = _config(variant), data()[:steps]
        ref_losses, ref_norms, ref_params = reference_run(config, batches, dp * m)
        pipe = PipelineConfig(2, m, config.num_layers, schedule, v)
        chunks = []
        for c in range(v):
            start, stop = pipe.layer_range(state.pp_rank, c)
            chunk = GPTModel(config, state, device="meta", layers=(start, stop),
                             pre_process=pipe.is_first(state.pp_rank, c),
                             post_process=pipe.is_last(state.pp_rank, c))
            chunk.init_weights(SEED)
            chunks.append(chunk)
        assert all(chunk.moe_layers() for chunk in chunks)   # every stage routes
        engine = build_zero_optimizer(StageChunks(chunks), state,
                                      ZeroConfig(stage=1, bucket_size=300,
                                                 gradient_accumulation_steps=m * v), ADAMW)
        if loss_scale:   # fp16's scaler on the fp32 engine: backward x 2^k, step / 2^k, exact
            engine.scaler = DynamicLossScaler(LossScaleConfig(initial_scale=loss_scale[0]))
        tied = _tied(state, chunks)
        runner = PipelineRunner(state, pipe, chunks, engine=engine, tied=tied,
                                activation_shape=(config.seq_length, b_local // m,
                                                  config.hidden_size))
        losses, norms = [], []
        for tokens, labels in batches:
            lo = state.dp_rank * b_local
            mbs = [(tokens[lo + i * b_local // m: lo + (i + 1) * b_local // m],
                    labels[lo + i * b_local // m: lo + (i + 1) * b_local // m]) for i in range(m)]
            engine.zero_grad()
            out = runner.step(mbs)
            norms.append(engine.step().grad_norm)
            if tied is not None:
                tied.sync_weight()
            for chunk in chunks:
                chunk.update_expert_biases(state.dp)
            if out.loss is not None:
                total = torch.tensor([out.loss])
                comm.all_reduce(total, state.dp)
                losses.append(total.item() / dp)
        what = f"{variant} {steps} steps {schedule} v{v} m{m} pp2 ep{ep} dp{dp} {loss_scale}"
        if loss_scale:
            assert engine.scaler.scale == loss_scale[0], what   # no overflow, no growth
        if state.is_last_stage:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                       atol=1e-6, msg=lambda msg: f"{what} losses: {msg}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=lambda msg: f"{what} grad norms: {msg}")
        seen = 0
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                expected = sharding.shard_tensor(config, name, expert_slice(
                    name, ref_params[name], state.ep_rank, state.ep_size), 0, 1)
                torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda msg: f"{what} param {name}: {msg}")
                seen += "experts" in name
            if chunk.output_weight is not None:
                expected = sharding.shard_tensor(config, sharding.WORD_EMBEDDING,
                                                 ref_params[sharding.WORD_EMBEDDING], 0, 1)
                torch.testing.assert_close(chunk.output_weight.detach(), expected, rtol=1e-5,
                                           atol=1e-6)
            for index, bias in chunk.expert_biases().items():
                assert bias.abs().sum() > 0, (what, index)   # the bias moved
            assert bool(chunk.expert_biases()) == (variant == "bias-drop"), what
        assert seen > 0, what
        if variant in ("aux-z", "seq-aux"):
            _check_metrics(state, chunks, config, what)
        checked.append(what)
    return checked


def _check_metrics(state, chunks, config, what):
    """Every stage's MoE metrics reach every rank of the PP group (the writer is stage 0), each
    layer's row as its own stage computed it."""
    per_layer = {}
    for chunk in chunks:
        per_layer.update(chunk.pop_moe_metrics())
    own = moe_metrics(per_layer, state.dp)
    everything = moe_metrics(per_layer, state.dp, state.pp, range(config.num_layers),
                             config.num_experts, state.device)
    for i in range(config.num_layers):
        assert everything[f"moe/layer{i}/aux-loss"] > 0, (what, i)
        if i in per_layer:
            for key in ("aux-loss", "z-loss", "load-max-over-mean", "dropped-fraction"):
                assert everything[f"moe/layer{i}/{key}"] == own[f"moe/layer{i}/{key}"], (what, key)
    total = torch.tensor([everything["moe/aux-loss"], everything["moe/z-loss"]], dtype=torch.float64)
    summed = total.clone()
    comm.all_reduce(summed, state.pp)
    assert torch.equal(summed, 2 * total), what   # both stages report the same totals
    assert (total[1] > 0) == (config.moe_z_loss_coeff is not None), what


def test_moe_pp2_aux_and_z_losses_under_loss_scaling():
    """The default case: 1F1B, m 4, aux + z losses, loss scale 2^10 (module docstring)."""
    results = run_on_ranks(_run, 2, args=(1, [("aux-z", "1f1b", 1, 4, 2, 1024.0)]), timeout=300)
    assert all(len(r) == 1 for r in results)


@pytest.mark.slow
def test_moe_pp2_matches_the_oracle():
    cases = [("dropless", "1f1b", 1, 4, 5), ("dropless", "interleaved", 2, 2, 5),
             ("bias-drop", "1f1b", 1, 4, 3)]
    results = run_on_ranks(_run, 2, args=(1, cases), timeout=600)
    assert all(len(r) == len(cases) for r in results)


@pytest.mark.slow
def test_moe_pp2_aux_losses_match_the_oracle():
    cases = [("aux-z", "1f1b", 1, 4, 5, 1024.0), ("aux-z", "interleaved", 2, 2, 5),
             ("seq-aux", "1f1b", 1, 4, 5), ("seq-aux", "interleaved", 2, 2, 5, 256.0)]
    results = run_on_ranks(_run, 2, args=(1, cases), timeout=600)
    assert all(len(r) == len(cases) for r in results)


@pytest.mark.slow
def test_moe_pp2_ep2_matches_the_oracle():
    cases = [("dropless", "1f1b", 1, 2, 5), ("bias-drop", "1f1b", 1, 2, 3),
             ("aux-z", "1f1b", 1, 2, 5, 1024.0)]
    results = run_on_ranks(_run, 4, args=(2, cases), timeout=600)
    assert all(len(r) == len(cases) for r in results)


def test_masked_loss_weight_is_the_kept_fraction_autograd_gives():
    """The trainer's runner scales the aux losses by ``MaskedLoss.token_weight`` x loss scale / m:
    the weight is ``sum_t d(mean of MaskedLoss's output) / d(loss_t)``, by autograd, for a
    partial mask and a mask that keeps nothing; for a CP rank (a third row: the whole samples'
    kept tokens) it is the sum of every CP rank's share, as the probe's all-reduce over CP gives."""
    from pretrain.pipeline_stage import MaskedLoss
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    partial = (torch.rand(2, 6, generator=g) > 0.4).long()
    targets = [torch.stack([labels, partial]), torch.stack([labels, torch.zeros_like(labels)])]
    for target in targets:
        per_token = torch.rand(2, 6, generator=g, requires_grad=True)
        MaskedLoss(lambda tokens, lab, hidden_states=None: per_token)(labels, target).mean().backward()
        weight = MaskedLoss.token_weight((labels, target))
        torch.testing.assert_close(weight, per_token.grad.sum(), rtol=1e-6, atol=0)
    # CP 2: the two ranks hold the samples' halves; each rank's share is its kept / whole kept
    other = (torch.rand(2, 6, generator=g) > 0.4).long()
    whole = torch.full_like(labels, int(partial.sum() + other.sum()))
    shares = []
    for mask in (partial, other):
        per_token = torch.rand(2, 6, generator=g, requires_grad=True)
        loss = MaskedLoss(lambda tokens, lab, hidden_states=None: per_token)(
            labels, torch.stack([labels, mask, whole]))
        shares.append(float(torch.autograd.grad(loss.mean(), per_token)[0].sum()))
    weight = MaskedLoss.token_weight((labels, torch.stack([labels, partial, whole])))
    assert float(weight) == pytest.approx(sum(shares)) == pytest.approx(1.0)
