"""ZeRO stage 3 (Pos+g+p) numerics: a meta-built GPT trained with parameters, gradients and optimizer
states partitioned over DP (and sharded over TP) equals the single-device ReferenceGPT with
torch.optim.AdamW on the same global batch: 5 steps of losses and the final parameters, fp32,
TP in {1, 2} x DP in {1, 2, 4} x gradient accumulation in {1, 2}.

One spawn per world size runs every layout of that size, plus the memory / communication / prefetch
measurements that tests/zero/test_stage3_memory.py checks (``world_results`` caches them per process).

AdamW eps is 1e-6 on both sides: the key part of the QKV bias has an exactly zero true gradient, and
with eps 1e-8 Adam would blow its rounding noise (1e-10) up to lr-sized, layout-dependent steps.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.stage3 import ParameterPartitioning
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from models.gpt.sharding import canonical_init, shard_tensor, unshard_state_dict
from hybrid.recompute.checkpoint import checkpoint
from hybrid.tensor_parallel import vocab_parallel_cross_entropy

CONFIG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=50, seq_length=8,
                   make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
ADAMW = dict(lr=1e-3, eps=1e-6, weight_decay=0.01)
STEPS, GLOBAL_BATCH, SEED = 5, 8, 1
CLIP = 0.05   # below the gradient norms of this model (about 1): every step is clipped
# (tp, accumulation, clip_grad) layouts per world size; DP = world / tp
PARITY_CASES = {1: [(1, 1, 0.0), (1, 2, 0.0), (1, 1, CLIP)],
                2: [(1, 1, 0.0), (1, 2, 0.0), (2, 1, 0.0), (2, 2, 0.0), (2, 1, CLIP)],
                4: [(1, 1, 0.0), (1, 2, 0.0), (2, 1, 0.0), (2, 2, 0.0), (2, 2, CLIP)],
                8: [(2, 2, 0.0)]}


def data(steps: int = STEPS, batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    shape = (steps, batch, CONFIG.seq_length)
    return (torch.randint(0, CONFIG.vocab_size, shape, generator=g),
            torch.randint(0, CONFIG.vocab_size, shape, generator=g))


def build(state: ParallelState, zero_config: ZeroConfig, config: GPTConfig = CONFIG,
          model_class: type = GPTModel):
    """A GPT built on meta and partitioned by stage 3 from the canonical per-parameter init."""
    model = model_class(config, state, device="meta", dtype=zero_config.param_dtype)

    def init_fn(name: str) -> torch.Tensor:
        return shard_tensor(config, name, canonical_init(config, name, SEED), state.tp_rank,
                            state.tp_size)

    return model, ParameterPartitioning(model, state, zero_config, AdamWConfig(**ADAMW), init_fn=init_fn)


def train_step(model, opt, state, tokens, labels, accum: int) -> tuple[float, float]:
    """One optimizer step on this DP rank's rows of the global batch: (its mean loss, grad norm)."""
    rows = tokens.size(0) // state.dp_size
    mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
    total = 0.0
    for t, l in zip(tokens[mine].chunk(accum), labels[mine].chunk(accum)):
        loss = model(t, l).mean() / accum
        opt.backward(loss)
        total += loss.item()
    return total, opt.step().grad_norm


def parity_case(state: ParallelState, accum: int, clip: float) -> dict:
    model, opt = build(state, ZeroConfig(stage=3, clip_grad=clip, gradient_accumulation_steps=accum))
    tokens, labels = data()
    steps = [train_step(model, opt, state, tokens[i], labels[i], accum) for i in range(STEPS)]
    return {"tp_rank": state.tp_rank, "dp_rank": state.dp_rank, "losses": [s[0] for s in steps],
            "norms": [s[1] for s in steps],
            # numpy: torch tensors would cross the result queue as shared memory of a dead process
            "params": {k: v.numpy() for k, v in opt.gathered_state_dict().items()}}


def _rank_main(rank: int, world: int) -> dict:
    from tests.zero.test_stage3_memory import measurements   # same spawn, no extra start-up
    out = {"parity": {}}
    for tp, accum, clip in PARITY_CASES[world]:
        state = ParallelState.initialize(Topology(world, tp, gpus_per_node=world))
        out["parity"][(tp, accum, clip)] = parity_case(state, accum, clip)
    out["measure"] = measurements(world)
    return out


@functools.lru_cache(maxsize=None)
def world_results(world: int) -> list[dict]:
    if world == 1:
        state = ParallelState.single_process()
        from tests.zero.test_stage3_memory import measurements
        return [{"parity": {(1, a, c): parity_case(state, a, c) for _, a, c in PARITY_CASES[1]},
                 "measure": measurements(1)}]
    return run_on_ranks(_rank_main, world, timeout=600)


@functools.lru_cache(maxsize=None)
def reference(clip: float = 0.0) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms (torch.nn.utils.clip_grad_norm_) and final parameters."""
    torch.manual_seed(0)
    model = ReferenceGPT(CONFIG)
    model.init_weights(SEED)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], **ADAMW)
    tokens, labels = data()
    losses, norms = [], []
    for i in range(STEPS):
        loss = model(tokens[i], labels[i]).mean()
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_parity(results: list[dict], world: int) -> None:
    for (tp, accum, clip) in PARITY_CASES[world]:
        ref_losses, ref_norms, ref_params = reference(clip)
        dp = world // tp
        cases = [r["parity"][(tp, accum, clip)] for r in results]
        losses = torch.tensor([c["losses"] for c in cases if c["tp_rank"] == 0]).sum(0) / dp
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"TP {tp} DP {dp} accum {accum}: {m}")
        for c in cases:   # every rank reports the global norm
            torch.testing.assert_close(torch.tensor(c["norms"]), torch.tensor(ref_norms),
                                       rtol=1e-5, atol=0)
        for d in range(dp):   # every DP rank gathers the same (TP-local) model
            shards = sorted((c for c in cases if c["dp_rank"] == d), key=lambda c: c["tp_rank"])
            params = unshard_state_dict(CONFIG, [{k: torch.from_numpy(v) for k, v in c["params"].items()}
                                                 for c in shards])
            for name, want in ref_params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"TP {tp} DP {dp} {name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_parity_with_single_device_reference(world):
    check_parity(world_results(world), world)


@pytest.mark.slow
def test_fp32_parity_tp2_dp4():
    check_parity(world_results(8), 8)


def test_reference_is_sensitive_to_one_wrong_step():
    """The oracle can fail: one extra AdamW step moves the parameters far beyond the tolerance."""
    _, _, ref_params = reference()
    state = ParallelState.single_process()
    model, opt = build(state, ZeroConfig(stage=3))
    tokens, labels = data(STEPS + 1)
    for i in range(STEPS + 1):
        train_step(model, opt, state, tokens[i], labels[i], 1)
    params = unshard_state_dict(CONFIG, [opt.gathered_state_dict()])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(params["layers.0.mlp.fc1.weight"],
                                   ref_params["layers.0.mlp.fc1.weight"], rtol=1e-5, atol=1e-6)


def test_stage3_rejects_misuse_with_actionable_errors():
    state = ParallelState.single_process()
    model = GPTModel(CONFIG, state, device="meta")
    with pytest.raises(ValueError, match="stage 3"):
        ParameterPartitioning(model, state, ZeroConfig(stage=2), AdamWConfig())
    bare = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"))  # meta, no init_parameter
    bare.sharding_units = lambda: list(bare)
    with pytest.raises(ValueError, match="meta device and there is no initialiser"):
        ParameterPartitioning(bare, state, ZeroConfig(stage=3), AdamWConfig())
    with pytest.raises(TypeError, match="sharding_units"):
        ParameterPartitioning(torch.nn.Linear(2, 2), state, ZeroConfig(stage=3), AdamWConfig())
    model, opt = build(state, ZeroConfig(stage=3, gradient_accumulation_steps=2))
    tokens, labels = data(steps=1)
    opt.backward(model(tokens[0], labels[0]).mean())
    with pytest.raises(RuntimeError, match="after 1 backward"):
        opt.step()


class RecomputedGPT(GPTModel):
    """The same GPT with every transformer layer under activation recompute (ZeRO-R's checkpoint):
    layers run again inside backward, where stage 3 must gather without releasing."""

    def forward(self, tokens, labels):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x)
        logits = self._output_logits(self.final_norm(x))
        return vocab_parallel_cross_entropy(logits, labels.t(), self.group,
                                            vocab_size=self.config.vocab_size).t()


class InPlaceGPT(GPTModel):
    """The same GPT updating each layer's output in place (legal for autograd here): stage 3's
    backward hooks on unit outputs must survive it."""

    def forward(self, tokens, labels):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x).mul_(1.0)
        logits = self._output_logits(self.final_norm(x))
        return vocab_parallel_cross_entropy(logits, labels.t(), self.group,
                                            vocab_size=self.config.vocab_size).t()


@pytest.mark.parametrize("model_class", [RecomputedGPT, InPlaceGPT])
def test_recompute_and_in_place_outputs_inside_stage3_match_reference(model_class):
    ref_losses, _, ref_params = reference()
    state = ParallelState.single_process()
    model, opt = build(state, ZeroConfig(stage=3), model_class=model_class)
    tokens, labels = data()
    losses = [train_step(model, opt, state, tokens[i], labels[i], 1)[0] for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    params = unshard_state_dict(CONFIG, [opt.gathered_state_dict()])
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6)


def test_evaluation_forward_releases_every_unit_and_matches_reference():
    state = ParallelState.single_process()
    model, opt = build(state, ZeroConfig(stage=3))
    ref = ReferenceGPT(CONFIG)
    ref.init_weights(SEED)
    tokens, _ = data(steps=1)
    with torch.no_grad():
        logits = model(tokens[0])[..., :CONFIG.vocab_size]
        want = ref(tokens[0])
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
    assert all(u.held_bytes() == 0 for u in opt.units if u is not None)


def test_build_zero_optimizer_dispatches_a_materialised_model_without_overlap():
    """The engine entry point hands stage 3 to ParameterPartitioning; a model built on a real device is
    partitioned from its current values; synchronous communication gives the same numbers."""
    from hybrid.zero.factory import build_zero_optimizer
    state = ParallelState.single_process()
    model = GPTModel(CONFIG, state)                    # materialised with seed 0
    zero = ZeroConfig(stage=3, overlap_communication=False, stage3_prefetch=False)
    opt = build_zero_optimizer(model, state, zero, AdamWConfig(**ADAMW))
    assert isinstance(opt, ParameterPartitioning)
    ref = ReferenceGPT(CONFIG)
    ref.init_weights(0)
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.ndim >= 2]},
                                 {"params": [p for p in ref.parameters() if p.ndim < 2],
                                  "weight_decay": 0.0}], **ADAMW)
    tokens, labels = data(steps=2)
    for i in range(2):
        loss, _ = train_step(model, opt, state, tokens[i], labels[i], 1)
        ref_loss = ref(tokens[i], labels[i]).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
