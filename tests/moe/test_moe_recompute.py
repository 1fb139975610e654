"""MoE GPT under activation recompute (issue 32 x hybrid/recompute): full recompute reruns every MoE
layer's forward in backward, so whatever the forward does besides computing must still happen once
per micro-batch. The first pass of :func:`hybrid.recompute.checkpoint` runs under ``no_grad``, and
the MoE block does its side effects only with autograd on: the metrics (``MoELayer._record``), the
router's ``pending_load`` (DeepSeek-V3's expert-bias update) and the aux / z loss attachment (its
gradient) happen in the recomputation only; the EP dispatchers' ``dispatch`` and ``combine`` pair
inside one forward (first pass or rerun), so a rerun never meets a stale saved state.

Checked: 3 AdamW steps (fp32, 2 layers, 4 experts, top-2 sigmoid with expert bias, aux + z loss,
a capacity factor that drops, a gated shared expert) under full recompute (Megatron's
``--recompute-method uniform`` with 1 and 2 layers per unit, ``block`` with 1 layer) and selective
recompute equal the run without recompute bit for bit: losses, gradient norms, every final
parameter, the logged MoE metrics of every step, the pending loads and the expert biases. (The bias
alone would not catch a doubled load: sign(mean - 2 load) = sign(mean - load).) EP 1 by default, and
full recompute at EP 2 with both dispatchers inside tests/moe/test_ep_parity.py's default worker;
every plan at EP 2 is marked slow, and so are CP 2 x EP 2 (ring and all-to-all attention) and a
trainer run at PP 2 (both layers MoE) with Megatron's full-recompute flags against the run without.
"""

import json

import pytest
import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.recompute import ModelDims, RecomputePlan, estimate, plan_from_cli
from hybrid.tensor_parallel import RNGTracker
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from tests.moe.test_moe_parity import ADAMW, BASE, BATCH, SEED, VARIANTS, data

STEPS = 3
PLANS = {   # name -> plan of the 2 layers (pretrain/recompute_method.py's uniform / block)
    "full": RecomputePlan.uniform("full", 2),                       # uniform, 1 layer per unit
    "full-uniform-2": RecomputePlan.uniform("full", 2, granularity=2),
    "full-block-1": RecomputePlan(("full", "none")),
    "selective": RecomputePlan.uniform("selective", 2),
}


def config_of(dispatcher: str = "alltoall") -> GPTConfig:
    return GPTConfig(2, 32, 4, **{**BASE, **VARIANTS["top2-sigmoid-bias-drop-shared-z"],
                                  "num_experts": 4, "moe_token_dispatcher_type": dispatcher})


def train(state, config, plan, batches):
    """STEPS AdamW steps of this rank's rows (gradients summed over their replicas, as
    tests/moe/test_ep_parity.py): per step the loss, the gradient norm of this rank's tensors, the
    MoE metrics, the pending loads before the bias update and the biases after it; the params."""
    rng = RNGTracker(17, state.tp_rank)
    rng.seed_all()
    model = GPTModel(config, state, rng=rng, recompute=plan)
    model.init_weights(SEED)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                            weight_decay=ADAMW.weight_decay)
    local = BATCH // state.dp_size
    rows = slice(state.dp_rank * local, (state.dp_rank + 1) * local)
    steps = []
    for tokens, labels in batches[:STEPS]:
        opt.zero_grad()
        loss = model(tokens[rows], labels[rows]).mean()
        loss.backward()
        for _, p in named:
            comm.all_reduce(p.grad, state.expert_dp if getattr(p, "expert_parallel", False)
                            else state.dp)
        norm = torch.stack([p.grad.norm() for _, p in named]).norm()
        opt.step()
        pending = [m.router.pending_load.clone() for m in model.moe_layers()]
        model.update_expert_biases(state.dp)
        steps.append(dict(loss=loss.detach(), norm=norm, metrics=model.pop_moe_metrics(),
                          pending=pending, bias=model.expert_biases()))
    return steps, {n: p.detach().clone() for n, p in named}


def _same(a, b, what) -> None:
    """Bit-equal nested structures of tensors."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    else:
        assert torch.equal(a, b), (what, a, b)


def check_plans(state, config, names) -> list[str]:
    batches = data()
    ref_steps, ref_params = train(state, config, None, batches)
    routes = BATCH // state.dp_size * config.seq_length * config.moe_router_topk
    for step in ref_steps:   # the reference counts each micro-batch once (and drops some routes)
        for layer in step["metrics"].values():
            assert layer["routes"] == routes and layer["micro_batches"] == 1
            assert 0 < layer["dropped"] < routes and layer["aux_loss"] > 0 and layer["z_loss"] > 0
        for pending, layer in zip(step["pending"], step["metrics"].values()):
            assert torch.equal(pending, layer["load"])   # one micro-batch per step
    checked = []
    for name in names:
        steps, params = train(state, config, PLANS[name], batches)
        what = f"{name} {config.moe_token_dispatcher_type} ep {state.ep_size}"
        _same(steps, ref_steps, what)
        _same(params, ref_params, f"{what} params")
        checked.append(what)
    return checked


def test_moe_recompute_matches_no_recompute_ep1():
    checked = check_plans(ParallelState.single_process(), config_of(), list(PLANS))
    assert len(checked) == len(PLANS)


def test_recompute_auto_plans_a_moe_config():
    """The planner's activation model counts the MoE MLP (hybrid/perf/architecture.py,
    saved_sharded_elements): it runs for a MoE config, and a budget between the peaks of 'full'
    and 'none' gives a plan that recomputes some layers and keeps others' activations."""
    config = config_of()
    dims = ModelDims.from_config(config, micro_batch=4, device="cpu")
    peak = {m: estimate(RecomputePlan.uniform(m, 2), dims).peak_bytes for m in ("none", "full")}
    assert peak["full"] < peak["none"]
    plan = plan_from_cli("auto", config, micro_batch=4, device="cpu",
                         memory_budget=(peak["full"] + peak["none"]) / 2)
    assert "none" in plan.modes and plan.modes != ("none", "none"), plan
    keep = plan_from_cli("auto", config, micro_batch=4, device="cpu", memory_budget=peak["none"])
    assert keep.modes == ("none", "none"), keep


def _ep2(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              expert_model_parallel_size=2), dp_transport="gloo")
    return [w for d in ("alltoall", "allgather")
            for w in check_plans(state, config_of(d), list(PLANS))]


@pytest.mark.slow
def test_moe_recompute_matches_no_recompute_ep2():
    checked = run_on_ranks(_ep2, 2, timeout=600)
    assert checked[0] == checked[1] and len(checked[0]) == 2 * len(PLANS)


def _trainer(rank, world_size, work, extra):
    from tests.moe.test_moe_metrics import MOE
    from tests.training_helpers import make_trainer, tiny_args
    log = f"{work}/log.jsonl"
    make_trainer(tiny_args(iters=3, extra=MOE + ["--moe-layer-freq", "1", "1", "--jsonl-log", log]
                           + extra)).train()
    rows = [json.loads(line) for line in open(log) if line.strip()] if rank == 0 else []
    return [{k: v for k, v in r["metrics"].items()
             if k.startswith("moe/") or k in ("lm loss", "grad-norm")}
            for r in rows if "lm loss" in r.get("metrics", {})]


@pytest.mark.slow
def test_trainer_pp2_full_recompute_logs_the_same(tmp_path):
    """The trainer at PP 2, both layers MoE (so the first stage's aux-loss scale comes from the
    schedule), with Megatron's --recompute-granularity full --recompute-method uniform: the logged
    losses, grad norms and MoE metrics of 3 steps equal those of the run without (~25 s)."""
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    logs = [run_on_ranks(_trainer, 2, args=(str(tmp_path / name),
                                            ["--pipeline-model-parallel-size", "2"] + extra),
                         timeout=600)[0] for name, extra in (("none", []), ("full", full))]
    assert len(logs[0]) == 3 and "moe/layer0/tokens-per-expert/0" in logs[0][0]
    assert logs[1] == logs[0]


def _train_cp(state, config, plan, comm_type):
    """tests/moe/test_ep_cp_parity.py's step (masked loss, the trainer's CP split, ZeRO 1) under
    ``plan``: per step the loss, grad norm, MoE metrics and pending loads; the params."""
    from hybrid.zero.config import ZeroConfig
    from hybrid.zero.factory import build_zero_optimizer
    from pretrain.token_split import model_loss, split_micro_batch
    from tests.moe import test_ep_cp_parity as cp_test
    model = GPTModel(config, state, recompute=plan)
    model.init_weights(SEED)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=1, bucket_size=300), cp_test.ADAMW)
    steps = []
    for batch in cp_test._data()[:STEPS]:
        opt.zero_grad()
        mine = {k: v[cp_test._rows(state.dp_size, state.dp_rank)] for k, v in batch.items()}
        loss = model_loss(model, split_micro_batch(mine, state, comm_type))
        opt.backward(loss)
        norm = torch.tensor(opt.step().grad_norm)
        pending = [m.router.pending_load.clone() for m in model.moe_layers()]
        model.update_expert_biases(state.dp_cp)
        steps.append(dict(loss=loss.detach(), norm=norm, metrics=model.pop_moe_metrics(),
                          pending=pending, bias=model.expert_biases()))
    return steps, {n: p.detach().clone() for n, p in model.named_parameters()}


def _cp2_ep2(rank, world_size):
    from tests.moe.test_ep_cp_parity import _config
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size, cp=2,
                                              expert_model_parallel_size=2))
    checked = []
    for variant in ("top2-sigmoid-bias-drop-shared-z", "top2-sigmoid-bias-seqaux"):
        for comm_type in ("p2p", "a2a"):
            ref = _train_cp(state, _config(variant), None, comm_type)
            for name in ("full", "selective"):
                what = f"{variant} CP 2 EP 2 {comm_type} {name}"
                _same(_train_cp(state, _config(variant), PLANS[name], comm_type), ref, what)
                checked.append(what)
    return checked


@pytest.mark.slow
def test_moe_recompute_matches_no_recompute_cp2_ep2():
    """CP 2 = EP 2 (the router's statistics and capacity all-reduced / all-gathered over CP, ring
    and all-to-all attention), expert bias with drops and with seq-aux: full and selective
    recompute equal the run without, bit for bit (~15 s)."""
    checked = run_on_ranks(_cp2_ep2, 2, timeout=600)
    assert checked[0] == checked[1] and len(checked[0]) == 8
