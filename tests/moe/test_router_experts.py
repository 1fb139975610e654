"""The MoE pieces against closed forms and brute force (issue 32): the capacity rule, the
balancing losses, the expert-bias step, the dispatcher's permutation, the grouped GEMM against the
padded batched product (values and gradients), the config's refusals and the logged metrics."""

import math

import pytest
import torch

from hybrid.moe.dispatch import LocalDispatcher
from hybrid.moe.experts import GroupedSwiGLUExperts, grouped_mm_supported
from hybrid.moe.router import DROPPED, Router, capacity, drop_over_capacity
from hybrid.parallel_state import ParallelState
from models.gpt.config import ConfigError, GPTConfig
from pretrain.metrics import moe_metrics


def test_capacity_keeps_the_most_probable_routes_per_expert():
    g = torch.Generator().manual_seed(0)
    t, k, e, factor = 24, 2, 4, 0.6
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    probs = torch.rand(t, k, generator=g)
    probs[3, 0] = probs[5, 1] = probs[9, 0] = 0.5          # ties: token order decides
    kept_index, kept_probs, dropped = drop_over_capacity(index, probs, e, factor)
    cap = capacity(t, k, e, factor)
    assert cap == math.ceil(factor * t * k / e)
    for expert in range(e):   # brute force: sort this expert's routes by (-p, token, choice)
        routes = sorted(((-probs[i, j].item(), i, j) for i in range(t) for j in range(k)
                         if index[i, j] == expert))
        for rank, (_, i, j) in enumerate(routes):
            assert (kept_index[i, j] == expert) == (rank < cap)
            assert kept_probs[i, j] == (probs[i, j] if rank < cap else 0)
    assert int(dropped) == int((kept_index == DROPPED).sum()) > 0


def test_aux_loss_is_one_when_routing_is_uniform_and_z_loss_is_its_formula():
    """E sum_e f_e P_e = 1 when every expert gets T k / E routes and equal mean probability."""
    e, h = 4, 8
    router = Router(h, e, 1, aux_loss_coeff=1.0, z_loss_coeff=1.0)
    with torch.no_grad():
        router.weight.copy_(torch.eye(e, h) * 5)
    x = torch.eye(e, h).repeat(2, 1)                         # token i prefers expert i % 4
    routing = router(x)
    assert torch.allclose(routing.aux_loss, torch.tensor(1.0), atol=1e-6)
    logits = x @ router.weight.t()
    assert torch.allclose(routing.z_loss, torch.logsumexp(logits, -1).square().mean())
    assert routing.load.tolist() == [2, 2, 2, 2]


def test_expert_bias_moves_toward_the_mean_load_and_only_selects():
    e, h = 4, 8
    router = Router(h, e, 1, score_function="sigmoid", enable_expert_bias=True,
                    bias_update_rate=0.1)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 1.0                               # every token prefers expert 0
    x = torch.ones(6, h)
    router(x)
    router.update_expert_bias(None)
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert router.pending_load.sum() == 0
    router.expert_bias += torch.tensor([-10.0, 0.0, 0.0, 0.0])
    routing = router(x)                                      # selection moves away from expert 0
    assert (routing.expert_index != 0).all()
    assert routing.probs.tolist() == [[0.5]] * 6             # sigmoid(0): the bias only selects


def test_local_dispatcher_groups_by_expert_and_combines_with_probs():
    t, k, e, h = 6, 2, 3, 4
    hidden = torch.randn(t, h, requires_grad=True)
    index = torch.tensor([[0, 2], [1, 0], [2, DROPPED], [0, 1], [2, 1], [1, 2]])
    probs = torch.rand(t, k) * (index >= 0)
    d = LocalDispatcher(e)
    tokens, counts = d.dispatch(hidden, index, probs)
    counts = counts.tolist()
    assert counts == [3, 4, 4]
    experts = torch.cat([torch.full((c,), float(i + 1)) for i, c in enumerate(counts)])
    out = d.combine(tokens * experts[:, None])               # expert i multiplies by i + 1
    expected = torch.stack([sum(probs[i, j] * (index[i, j] + 1) * hidden[i]
                                for j in range(k) if index[i, j] >= 0) for i in range(t)])
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert hidden.grad is not None


def test_grouped_gemm_matches_the_padded_batched_product():
    group = ParallelState.single_process().tp
    experts = GroupedSwiGLUExperts(4, 16, 8, group)
    with torch.no_grad():
        experts.fc1.weight.normal_()
        experts.fc2.weight.normal_()
    counts = [3, 0, 5, 2]                                    # one expert without tokens
    x = torch.randn(sum(counts), 16)
    assert grouped_mm_supported(x, experts.fc1.weight.transpose(1, 2))
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        y.sum().backward()                                   # an expanded gradient
        results.append((y, xi.grad, experts.fc1.weight.grad.clone(), experts.fc2.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert results[0][2][1].abs().sum() == 0                 # the idle expert gets no gradient
    # a loop over experts, the definition
    w1, w2 = experts.fc1.weight, experts.fc2.weight
    rows = torch.split(x, counts)
    loop = []
    for e, r in enumerate(rows):
        gate, up = (r @ w1[e].t()).view(len(r), w1.size(1) // 2, 2).unbind(-1)
        loop.append((torch.nn.functional.silu(gate) * up) @ w2[e].t())
    torch.testing.assert_close(results[0][0], torch.cat(loop), rtol=1e-5, atol=1e-5)
    for grouped in (True, False):   # no tokens at all (every route dropped, or an idle EP rank)
        experts.use_grouped_mm = grouped
        assert experts(torch.zeros(0, 16), [0, 0, 0, 0]).shape == (0, 16)


MOE = dict(vocab_size=64, seq_length=8, swiglu=True, num_experts=4)


@pytest.mark.parametrize("changes, words", [
    (dict(moe_router_topk=5), "exceeds the 4 experts"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor must be a positive"),
    (dict(moe_router_enable_expert_bias=True), "add --moe-router-score-function sigmoid"),
    (dict(moe_router_pre_softmax=True, moe_router_score_function="sigmoid"), "only the softmax"),
    (dict(moe_layer_freq=(1, 0, 1)), r"one 0 \(dense\) or 1 \(MoE\) per layer, 2 values"),
    (dict(moe_layer_freq=(0, 0)), "marks no layer as MoE"),
    (dict(moe_shared_expert_gate=True), "there is none"),
    (dict(swiglu=False), "add --swiglu"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "aux_loss, seq_aux_loss, none"),
    (dict(moe_token_dispatcher_type="flex"), "alltoall, allgather"),
])
def test_config_refuses_with_one_clear_error(changes, words):
    with pytest.raises(ConfigError, match=words):
        GPTConfig(2, 32, 4, **{**MOE, **changes})


def test_layer_pattern_and_parameter_count():
    config = GPTConfig(4, 32, 4, **MOE, moe_layer_freq=2, moe_ffn_hidden_size=16,
                       moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                       add_bias_linear=False, normalization="RMSNorm")
    assert [config.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert GPTConfig(2, 32, 4, **MOE, moe_layer_freq=[0, 1]).moe_layer_freq == (0, 1)
    dense = GPTConfig(4, 32, 4, vocab_size=64, seq_length=8, swiglu=True, add_bias_linear=False,
                      normalization="RMSNorm", ffn_hidden_size=config.ffn_hidden_size)
    h, f = 32, config.ffn_hidden_size
    per_moe = 4 * h + 4 * 3 * h * 16 + 3 * h * 8 + h - 3 * h * f   # router, experts, shared, gate
    assert config.num_parameters() == dense.num_parameters() + 2 * per_moe
    assert config.num_parameters_per_rank(2) == (dense.num_parameters_per_rank(2)
                                                 + 2 * (4 * h + h + (4 * 3 * h * 16 + 3 * h * 8
                                                                     - 3 * h * f) // 2))


def test_metrics_of_an_interval():
    per_layer = {1: dict(load=torch.tensor([6.0, 2.0, 0.0, 0.0]), dropped=torch.tensor(2.0),
                         routes=torch.tensor(8.0), aux_loss=torch.tensor(0.4),
                         z_loss=torch.tensor(0.2), micro_batches=torch.tensor(2.0))}
    m = moe_metrics(per_layer, None)
    assert m["moe/layer1/load-max-over-mean"] == pytest.approx(3.0)
    assert m["moe/layer1/tokens-per-expert/0"] == 3.0
    assert m["moe/aux-loss"] == pytest.approx(0.2) and m["moe/z-loss"] == pytest.approx(0.1)
    assert m["moe/dropped-fraction"] == 0.25 and m["moe/load-max-over-mean"] == pytest.approx(3.0)
    assert moe_metrics({}, None) == {}


def test_aux_and_z_losses_are_accepted_under_pipeline_parallelism():
    from pretrain.arguments import parse_args
    moe = ["--num-experts", "4", "--swiglu", "--pipeline-model-parallel-size", "2"]
    for extra in (["--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"],
                  ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]):
        cfg, _ = parse_args(moe + extra)   # the schedule scales them on every stage
        assert cfg.parallel.pipeline_model_parallel_size == 2 and cfg.model.moe_aux_loss_coeff == 0.01


def test_dropless_dispatch_is_static_and_counts_on_the_device():
    """LocalDispatcher(dropless=True) (no capacity: static shapes, no host read) gives the rows,
    counts and combine of the general path; count_routes equals torch.bincount."""
    from hybrid.moe.router import count_routes
    t, k, e, h = 7, 2, 4, 3
    hidden = torch.randn(t, h)
    index = torch.stack([torch.randperm(e)[:k] for _ in range(t)])        # distinct per token
    index[0] = torch.tensor([3, 1])                                          # expert 2 may be idle
    probs = torch.rand(t, k)
    general, static = LocalDispatcher(e), LocalDispatcher(e, dropless=True)
    rows, counts = general.dispatch(hidden, index, probs)
    rows_s, counts_s = static.dispatch(hidden, index, probs)
    assert counts_s.device == hidden.device and counts_s.dtype == torch.int64
    assert torch.equal(counts_s, torch.bincount(index.reshape(-1), minlength=e))
    assert torch.equal(count_routes(index, e), counts_s) and torch.equal(counts, counts_s)
    assert torch.equal(rows_s, rows) and rows_s.shape == (t * k, h)
    out = rows * 2
    torch.testing.assert_close(static.combine(out), general.combine(out), rtol=0, atol=0)


def test_fp32_grouped_gemm_traces_under_compile():
    """torch 2.13's fake kernel of torch._grouped_mm takes bf16 only: dynamo failed on the fp32
    experts ("Expected inputs of BF16 type"); the fp32 product now runs eagerly between compiled
    regions. aot_eager traces with fake tensors as inductor does (no C++ build: fast)."""
    torch._dynamo.reset()
    group = ParallelState.single_process().tp
    experts = GroupedSwiGLUExperts(4, 16, 8, group)
    with torch.no_grad():
        experts.fc1.weight.normal_()
        experts.fc2.weight.normal_()
    x = torch.randn(10, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])
    eager = experts(x, counts)
    (gx,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=False)(x, counts)
    (cgx,) = torch.autograd.grad(compiled.square().sum(), x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cgx, gx, rtol=1e-6, atol=1e-6)
