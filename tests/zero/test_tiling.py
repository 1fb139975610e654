"""Memory-centric tiling under ZeRO-3 (ZeRO-Infinity; issue 35 part 1, hybrid/zero/tiling.py).

* parity: a GPT whose linear weights are split into --tile-factor row tiles, each its own
  sharding unit, trains exactly as the untiled ZeRO-3 model (itself checked against the
  single-device reference in test_stage3.py): fp32, 5 steps, losses and final parameters at
  rtol 1e-5, at DP 2 (T = 2 and 4; T = 2 with the parameters and optimizer state on NVMe) and at
  TP 2 x DP 2 (T = 2, also with full-layer recompute);
* working memory: the largest number of parameter bytes held gathered by the engine's unit
  buffers (their storages' bytes, sampled at every gather) falls from the whole layer to one tile
  of its largest weight (by at least T), as the memory report says;
* a unit over --max-working-memory is refused without tiling, naming the tile factor that fits,
  and trains with it;
* checkpoints: saved tiled and loaded untiled (and the reverse), training continues identically.

One spawn per world size (2 and 4) runs every case of that size.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from hybrid.checkpoint.state import load_state, save_state
from hybrid.offload.budget import OffloadConfig
from hybrid.parallel_state import ParallelState
from hybrid.perf.tiling import gpt_layer_working_memory
from hybrid.recompute import RecomputePlan
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.stage3 import ParameterPartitioning
from hybrid.zero.stage3_unit import ShardedUnit
from hybrid.adamw_config import AdamWConfig
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.sharding import canonical_init, shard_tensor
from tests.zero.test_stage3 import ADAMW, SEED, data, train_step

# hidden 32, MLP 8h, vocab 40: a layer's weights dominate every other unit (the embedding's 1536
# elements); per layer the norms and biases are 544 elements, the MLP weights 8192 each
CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=40, seq_length=8,
                   ffn_hidden_size=256, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                   attention_dropout=0.0)
STEPS = 5


def build(state: ParallelState, zero_config: ZeroConfig, offload=None, recompute=None):
    model = GPTModel(CONFIG, state, device="meta", dtype=zero_config.param_dtype,
                     recompute=recompute)

    def init_fn(name: str) -> torch.Tensor:
        return shard_tensor(CONFIG, name, canonical_init(CONFIG, name, SEED), state.tp_rank,
                            state.tp_size)

    return model, ParameterPartitioning(model, state, zero_config, AdamWConfig(**ADAMW),
                                        init_fn=init_fn, offload=offload)


def _batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(99)
    shape = (steps, 8, CONFIG.seq_length)
    return (torch.randint(0, CONFIG.vocab_size, shape, generator=g),
            torch.randint(0, CONFIG.vocab_size, shape, generator=g))


def _train(state, zero_config, steps=STEPS, **build_options) -> dict:
    model, opt = build(state, zero_config, **build_options)
    tokens, labels = _batches(steps)
    losses = [train_step(model, opt, state, tokens[i], labels[i], 1)[0] for i in range(steps)]
    return {"losses": losses, "params": {k: v.numpy() for k, v in opt.gathered_state_dict().items()}}


def _peak_gathered(state: ParallelState, zero_config: ZeroConfig) -> dict:
    """Largest bytes of gathered unit buffers at any gather of one training step."""
    model, opt = build(state, zero_config)
    peak = [0]
    original = ShardedUnit.gather

    def gather(unit, async_op=True):
        original(unit, async_op)
        peak[0] = max(peak[0], opt.gathered_bytes())
    ShardedUnit.gather = gather
    try:
        tokens, labels = _batches(1)
        train_step(model, opt, state, tokens[0], labels[0], 1)
    finally:
        ShardedUnit.gather = original
    return {"peak": peak[0], "report": opt.working_memory(), "text": str(opt.memory_report()),
            "after_step": opt.gathered_bytes()}


def _checkpoint_switch(state: ParallelState, save_factor: int, load_factor: int) -> dict:
    """3 steps at ``save_factor``, save, load at ``load_factor`` into a fresh engine, 2 more steps;
    against 5 uninterrupted steps at ``save_factor``."""
    tokens, labels = _batches(5)
    model, opt = build(state, ZeroConfig(stage=3, tile_factor=save_factor))
    for i in range(3):
        train_step(model, opt, state, tokens[i], labels[i], 1)
    directory = [tempfile.mkdtemp() if state.rank == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    path = save_state(directory[0], 3, opt, model.checkpoint_layout(), state, extra={},
                      metadata={}, keep_last=1)
    model2, opt2 = build(state, ZeroConfig(stage=3, tile_factor=load_factor))
    load_state(path, opt2, model2.checkpoint_layout(), state)
    losses, resumed = [], []
    for i in range(3, 5):
        losses.append(train_step(model, opt, state, tokens[i], labels[i], 1)[0])
        resumed.append(train_step(model2, opt2, state, tokens[i], labels[i], 1)[0])
    a, b = opt.gathered_state_dict(), opt2.gathered_state_dict()
    return {"losses": losses, "resumed": resumed, "keys_equal": sorted(a) == sorted(b),
            "max_diff": max(float((a[k] - b[k]).abs().max()) for k in a)}


def _rank_main(rank: int, world: int, nvme_dir: str, full: bool) -> dict:
    """Every case of this world size; ``full``: the slow ones too (more tile factors, NVMe,
    prefetch, recompute, the second checkpoint direction)."""
    out = {}
    if world == 2:
        state = ParallelState.initialize(Topology(2, 1, gpus_per_node=2))
        for t in ((1, 2, 4) if full else (1, 2)):
            out[("dp2", t)] = _train(state, ZeroConfig(stage=3, tile_factor=t))
        for t in (1, 4):
            for prefetch in ((False, True) if full else (False,)):
                out[("memory", t, prefetch)] = _peak_gathered(
                    state, ZeroConfig(stage=3, tile_factor=t, stage3_prefetch=prefetch))
        out["ckpt 2->1"] = _checkpoint_switch(state, 2, 1)
        if full:
            nvme = OffloadConfig("nvme", f"{nvme_dir}/r{rank}", kernel="exact", params="nvme")
            out[("dp2-nvme", 2)] = _train(state, ZeroConfig(stage=3, tile_factor=2), offload=nvme)
            out["ckpt 1->4"] = _checkpoint_switch(state, 1, 4)
    else:
        state = ParallelState.initialize(Topology(4, 2, gpus_per_node=4))
        for t in (1, 2):
            out[("tp2dp2", t)] = _train(state, ZeroConfig(stage=3, tile_factor=t))
        out[("tp2dp2-recompute", 2)] = _train(state, ZeroConfig(stage=3, tile_factor=2),
                                              recompute=RecomputePlan.uniform("full", 2))
    return out


@functools.lru_cache(maxsize=None)
def world_results(world: int, full: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        return run_on_ranks(_rank_main, world, args=(d, full), timeout=900)


def _same(a: dict, b: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5,
                               atol=0, msg=lambda m: f"{what} losses: {m}")
    assert sorted(a["params"]) == sorted(b["params"])
    for name in a["params"]:
        torch.testing.assert_close(torch.from_numpy(a["params"][name]),
                                   torch.from_numpy(b["params"][name]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {name}: {m}")


def test_tiled_training_equals_untiled_at_dp2():
    results = world_results(2)
    for rank in results:
        _same(rank[("dp2", 2)], rank[("dp2", 1)], "DP 2, T 2")
    # the comparison can fail: training moved the parameters
    assert results[0][("dp2", 1)]["losses"][0] != results[0][("dp2", 1)]["losses"][-1]


@pytest.mark.slow
def test_tiled_training_equals_untiled_at_dp2_t4_and_with_nvme_parameters():
    for rank in world_results(2, True):
        _same(rank[("dp2", 4)], rank[("dp2", 1)], "DP 2, T 4")
        _same(rank[("dp2-nvme", 2)], rank[("dp2", 1)], "DP 2, T 2, parameters on NVMe")


@pytest.mark.slow
def test_tiled_training_equals_untiled_at_tp2_dp2_with_and_without_recompute():
    for rank in world_results(4, True):
        _same(rank[("tp2dp2", 2)], rank[("tp2dp2", 1)], "TP 2 x DP 2, T 2")
        _same(rank[("tp2dp2-recompute", 2)], rank[("tp2dp2", 1)], "TP 2 x DP 2, T 2, recompute")


def _check_working_memory(results: list[dict], prefetches) -> None:
    h, f = CONFIG.hidden_size, CONFIG.ffn_hidden_size
    for rank in results:
        for prefetch in prefetches:
            whole, tiled = rank[("memory", 1, prefetch)], rank[("memory", 4, prefetch)]
            assert tiled["after_step"] == 0 and whole["after_step"] == 0
            # untiled: a layer's four weights at once; tiled: a quarter of an MLP weight
            assert whole["peak"] >= 4 * (3 * h * h + h * h + 2 * f * h)
            assert tiled["peak"] >= 4 * f * h // 4
            assert tiled["peak"] * 4 <= whole["peak"], (prefetch, tiled["peak"], whole["peak"])
        measured = rank[("memory", 4, False)]
        # without look-ahead the peak is exactly what the report calls the tiled working memory
        assert measured["peak"] == measured["report"]["tiled"]
        assert rank[("memory", 1, False)]["peak"] == rank[("memory", 1, False)]["report"]["untiled"]
        assert measured["report"]["untiled"] == rank[("memory", 1, False)]["report"]["untiled"]
        assert "with --tile-factor 4" in measured["text"] and "untiled" in measured["text"]


def test_gathered_working_memory_falls_by_the_tile_factor():
    _check_working_memory(world_results(2), (False,))


@pytest.mark.slow
def test_gathered_working_memory_falls_by_the_tile_factor_with_prefetch():
    _check_working_memory(world_results(2, True), (False, True))


def _check_switch(results: list[dict], switch: str) -> None:
    for rank in results:
        case = rank[switch]
        assert case["keys_equal"]
        torch.testing.assert_close(torch.tensor(case["resumed"]), torch.tensor(case["losses"]),
                                   rtol=1e-5, atol=0)
        assert case["max_diff"] < 1e-6


def test_checkpoint_saved_tiled_resumes_untiled():
    _check_switch(world_results(2), "ckpt 2->1")


@pytest.mark.slow
def test_checkpoint_saved_untiled_resumes_tiled():
    _check_switch(world_results(2, True), "ckpt 1->4")


def test_working_memory_budget_refuses_untiled_and_trains_tiled():
    state = ParallelState.single_process()
    h = CONFIG.hidden_size
    # bytes (fp32): a layer's 544 norm and bias elements and a quarter of an MLP weight fit,
    # half of one does not; T = 3 divides no weight's rows
    budget = 4 * (544 + 2048 + 8)
    with pytest.raises(ValueError, match=r"--max-working-memory.*--tile-factor 4 \(or more\)"):
        build(state, ZeroConfig(stage=3, max_working_memory=budget))
    with pytest.raises(ValueError, match=r"with --tile-factor 2, over.*--tile-factor 4"):
        build(state, ZeroConfig(stage=3, tile_factor=2, max_working_memory=budget))
    model, opt = build(state, ZeroConfig(stage=3, tile_factor=4, max_working_memory=budget))
    assert opt.working_memory()["tiled"] <= budget < opt.working_memory()["untiled"]
    # the pure formula the dry run can use gives the built engine's figures
    assert opt.working_memory() == gpt_layer_working_memory(
        h, CONFIG.ffn_hidden_size, CONFIG.qkv_size, tile_factor=4, param_bytes=4)
    tokens, labels = _batches(1)
    loss, _ = train_step(model, opt, state, tokens[0], labels[0], 1)
    assert loss == loss   # trained a step
    with pytest.raises(ValueError, match="no linear weight to tile"):   # the embedding unit
        build(state, ZeroConfig(stage=3, tile_factor=4, max_working_memory=4 * 8 * h))


def test_tile_factor_misuse_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="--zero-stage 3"):
        ZeroConfig(stage=2, tile_factor=2)
    with pytest.raises(ValueError, match=r"do not divide by 5; use one of"):
        build(ParallelState.single_process(), ZeroConfig(stage=3, tile_factor=5))


def test_trainer_flags_train_tiled_and_refuse_the_untiled_layer():
    """--tile-factor / --max-working-memory through the trainer (tiny GPT: a layer gathers
    0.048 MiB whole, its MLP weights 128 x 32 are the largest)."""
    from tests.training_helpers import make_trainer, tiny_args
    trainer = make_trainer(tiny_args(zero=3, iters=2, extra=["--tile-factor", "2",
                                                             "--max-working-memory", "40KiB"]))
    trainer.train()
    memory = trainer.optimizer.working_memory()
    assert memory["tiled"] <= 40 * 1024 < memory["untiled"]
    with pytest.raises(ValueError, match=r"layers\.0.*use --tile-factor 2 \(or more\)"):
        make_trainer(tiny_args(zero=3, iters=2, extra=["--max-working-memory", "40KiB"]))
