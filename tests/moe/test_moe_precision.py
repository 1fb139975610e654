"""MoE under mixed precision (issue 32, "Composition: ... bf16/fp16"): the trainer's --bf16 and
--fp16 runs of a MoE GPT (2 layers, both MoE, 4 experts top-2, aux and z losses, ZeRO 1 at DP 2:
16-bit parameters, fp32 master, expert parameters in their own ZeRO class at EP 2) against the
fp32 run of the same seed and data.

Oracles (tolerances measured here first, docs/moe.md "Precision and compile"):

* fp32 EP 2 equals fp32 EP 1 (relative 1e-6, measured 9e-8: the same arithmetic, tokens reduced
  in another order), and EP 1 fp32 is the oracle-exact path of tests/moe/test_moe_parity.py.
* bf16 tracks fp32: every step's loss (8 steps, lr 1e-2) within 2e-3 relative (measured 4.1e-4:
  bf16 keeps 8 bits of mantissa, 2^-8 = 3.9e-3 per rounding, averaged over the tokens); bf16 EP 2
  equals bf16 EP 1 within 2e-4 (measured 3.5e-5: the same math, placement only changes the order
  of the fp32 sums before each bf16 rounding).
* The router computes in fp32 in a bf16 (and fp16) run whose router weight is 16-bit: its
  probabilities and aux / z losses are fp32.
* fp16 (dynamic loss scale 1024) tracks fp32 within 5e-4 (measured 9.4e-5: 11 bits of mantissa).
* An Inf in an expert gradient on EP rank 0 only (its experts are not on rank 1) makes BOTH ranks
  skip that step (no parameter of either class changes, the step counts as skipped) and halves
  the one loss scale the dense and expert classes share; the next steps train again.
* The aux and z losses' gradient carries the loss scale: a backward of ``S x loss`` gives exactly
  S times every gradient of a backward of ``loss``, the router's (whose aux-loss part reaches it
  only through :class:`models.gpt.moe.AuxLossScale`) included.

The last runs in one process by default (2 s); the trainer runs are slow (about 25 s and 40 s on
2 gloo ranks).
"""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from models.gpt.model import GPTModel
from tests.moe.test_moe_parity import config_of
from tests.pretrain.test_host_sync import _trainer
from tests.training_helpers import tiny_args

MOE = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--lr", "1e-2", "--min-lr", "1e-3"]      # a step size at which the precisions part
FP16 = ["--initial-loss-scale", "1024", "--hysteresis", "1"]
ITERS, POISONED = 8, 2       # the overflow run: an Inf expert gradient in step 3 (iteration 2)


class _RouterDtypes:
    """Forward hooks on every router: the dtypes of its weight and of what it computes."""

    def __init__(self, model):
        self.seen: set[tuple[str, ...]] = set()
        for module in model.modules():
            if type(module).__name__ == "Router":
                module.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        losses = [str(t.dtype) for t in (out.aux_loss, out.z_loss) if t is not None]
        self.seen.add((str(module.weight.dtype), str(args[0].dtype), str(out.probs.dtype), *losses))


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _poison_expert_gradient(trainer) -> None:
    """Rank 0 only: the first MoE layer's expert fc1 gradient is Inf in iteration ``POISONED``
    (rank 1 holds other experts and sees finite gradients)."""
    weight = next(p for n, p in trainer.model.named_parameters()
                  if n.endswith("experts.fc1.weight"))
    if trainer.state.rank == 0:
        weight.register_hook(lambda g: g * float("inf") if trainer.ts.iteration == POISONED else g)


def _run(rank, world, runs, iters):
    out = {}
    for name, ep, precision in runs:
        extra = MOE + ["--expert-model-parallel-size", str(ep), "--log-interval", str(iters)]
        trainer = _trainer(tiny_args(iters=iters, zero=1, precision=precision,
                                     extra=extra + (FP16 if precision == "fp16" else [])))
        routers = _RouterDtypes(trainer.model)
        snapshots, scales = [], []
        if name.endswith("overflow"):
            _poison_expert_gradient(trainer)
            step = trainer.train_step

            def recorded(loader, lr, _step=step):
                snapshots.append(_params(trainer.model))
                result = _step(loader, lr)
                scales.append(trainer.optimizer.scaler.scale)
                return result
            trainer.train_step = recorded
        trainer.train()
        changed = [sorted(n for n in a if not torch.equal(a[n], b[n]))
                   for a, b in zip(snapshots, snapshots[1:] + [_params(trainer.model)])]
        out[name] = dict(losses=trainer.losses, routers=routers.seen, changed=changed,
                         scales=scales, skipped=trainer.ts.skipped_iterations,
                         experts=sorted(n for n, p in trainer.model.named_parameters()
                                        if getattr(p, "expert_parallel", False)))
    return out


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


@pytest.mark.slow
def test_fp16_expert_overflow_on_one_ep_rank_skips_the_step_everywhere():
    results = run_on_ranks(_run, 2, args=([("fp16-ep2-overflow", 2, "fp16")], 4), timeout=300)
    for rank, r in enumerate(results):
        r = r["fp16-ep2-overflow"]
        assert r["skipped"] == 1, (rank, r["skipped"])
        assert r["scales"] == [1024.0, 1024.0, 512.0, 512.0], (rank, r["scales"])
        every = set(r["changed"][0])
        assert set(r["experts"]) < every and len(every) > len(r["experts"])   # both classes train
        assert [set(c) == every for c in r["changed"]] == [True, True, False, True], rank
        assert r["changed"][POISONED] == []                # the skipped step: nothing moved
        assert all(x == x and abs(x) < 100 for x in r["losses"]), r["losses"]
    assert results[0]["fp16-ep2-overflow"]["losses"] == results[1]["fp16-ep2-overflow"]["losses"]


@pytest.mark.slow
def test_bf16_and_fp16_track_fp32_and_ep2_equals_ep1():
    runs = [("fp32-ep1", 1, "fp32"), ("fp32-ep2", 2, "fp32"), ("bf16-ep1", 1, "bf16"),
            ("bf16-ep2", 2, "bf16"), ("fp16-ep2", 2, "fp16")]
    for r in run_on_ranks(_run, 2, args=(runs, ITERS), timeout=900):
        fp32 = r["fp32-ep1"]["losses"]
        assert len(fp32) == ITERS and r["fp32-ep1"]["skipped"] == 0
        assert _rel(r["fp32-ep2"]["losses"], fp32) < 1e-6
        assert _rel(r["bf16-ep1"]["losses"], fp32) < 2e-3       # measured 4.1e-4
        assert _rel(r["bf16-ep2"]["losses"], fp32) < 2e-3       # measured 3.8e-4
        assert _rel(r["bf16-ep2"]["losses"], r["bf16-ep1"]["losses"]) < 2e-4   # measured 3.5e-5
        assert _rel(r["fp16-ep2"]["losses"], fp32) < 5e-4       # measured 9.4e-5
        assert r["fp16-ep2"]["skipped"] == 0
        # the router computes in fp32 whatever the model's dtype (its weight is bf16 there)
        fp32_router = ("torch.float32", "torch.float32")
        for name, weight in (("bf16-ep2", "torch.bfloat16"), ("fp16-ep2", "torch.float16")):
            assert {s[0] for s in r[name]["routers"]} == {weight}, r[name]["routers"]
            assert {s[2:] for s in r[name]["routers"]} == {fp32_router + ("torch.float32",)}


def test_aux_loss_gradient_carries_the_loss_scale():
    """backward(S x loss) = S x backward(loss) for every parameter, exactly (S a power of 2), and
    the aux / z losses do reach the router: without them its gradient differs."""
    torch.manual_seed(0)
    tokens, labels = torch.randint(0, 101, (2, 8)), torch.randint(0, 101, (2, 8))

    def grads(config, scale):
        model = GPTModel(config, ParallelState.single_process(), device="meta")
        model.init_weights(11)
        (model(tokens, labels).mean() * scale).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    config = config_of("top2-aux-z")
    plain, scaled = grads(config, 1.0), grads(config, 1024.0)
    for name, g in plain.items():
        assert torch.equal(scaled[name], g * 1024), name
    router = "layers.0.mlp.router.weight"
    no_aux = grads(config.replace(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None), 1.0)
    assert router in plain and not torch.allclose(plain[router], no_aux[router], rtol=1e-3)
