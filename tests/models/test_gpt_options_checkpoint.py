"""Checkpoints of the Llama-style GPT reshard (docs/design.md §8): an untied model with GQA and
SwiGLU trained 2 steps at TP 2 x DP 2 under ZeRO stage 3 (SP on) is saved, then resumed at TP 1 x DP 4
stage 1 and TP 4 x DP 1 stage 2 (the vocab, 101, pads to 104 / 104 / 112 rows: both vocab tables
cross padding); the 2 following steps give the losses of the uninterrupted run, and the exported
canonical weights equal the saved model's gathered ones. A checkpoint of another architecture is
refused with the option that differs."""

import pytest
import torch

from hybrid.checkpoint.format import CheckpointError
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from pretrain import resume
from pretrain.arguments import parse_args
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.sharding import unshard_state_dict
from models.gpt.weights import canonical_state_dict
from tests.models.test_gpt_options_zero import INIT_SEED, LlamaTask
from tests.training_helpers import tiny_args
from tests.zero.test_stages import train

SAVE = (2, 3)                  # (tp, zero stage)
RESUME = [(1, 1), (4, 2)]
TASK = dict(heads=8, groups=4)   # 4 query groups: split over TP 4 as well


def _engine(task, world, tp, stage):
    state = ParallelState.initialize(Topology(world, tp, gpus_per_node=world))
    cfg, _ = parse_args(tiny_args(tp=tp, zero=stage))
    model = task.model(state, materialize=stage < 3)
    options = dict(seed=INIT_SEED) if stage == 3 else {}
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, bucket_size=300), task.adamw,
                               **options)
    return state, cfg, model, opt


def _ranks(rank, world, ckpt):
    task = LlamaTask(untied=True, sequence_parallel=True, **TASK)
    data = task.data(steps=4)
    state, cfg, model, opt = _engine(task, world, *SAVE)
    train(task, state, opt, model, data[:2], 1)
    resume.save(ckpt, resume.TrainState(iteration=2), model, opt, state, cfg)
    gathered = opt.gathered_state_dict()   # collective over DP: every rank calls
    saved = {k: v.numpy() for k, v in gathered.items()} if state.dp_rank == 0 else None
    out = {"continued": train(task, state, opt, model, data[2:], 1)[0], "saved": saved}
    for tp, stage in RESUME:
        state, cfg, model, opt = _engine(task, world, tp, stage)
        resume.load(f"{ckpt}/iter_0000002", model, opt, state, cfg)
        out[(tp, stage)] = train(task, state, opt, model, data[2:], 1)[0]
    return out


@pytest.mark.slow   # CI budget: resharding is in the default set (tests/checkpoint/test_resharding.py)
def test_llama_checkpoint_reshards(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_on_ranks(_ranks, 4, args=(ckpt,), timeout=600)
    continued = results[0]["continued"]
    for r in results:
        for layout in RESUME:
            torch.testing.assert_close(torch.tensor(r[layout]), torch.tensor(continued), rtol=1e-5,
                                       atol=0, msg=lambda m: f"resumed at {layout}: {m}")
    exported, config = canonical_state_dict(f"{ckpt}/iter_0000002")
    task = LlamaTask(untied=True, **TASK)
    assert config == task.config.to_dict()
    shards = [r["saved"] for r in results if r["saved"] is not None]   # TP ranks 0, 1 of DP 0
    gathered = unshard_state_dict(task.config, [{k: torch.from_numpy(v) for k, v in s.items()}
                                                for s in shards])
    assert exported.keys() == gathered.keys()
    for name, value in exported.items():
        torch.testing.assert_close(value, gathered[name], rtol=0, atol=0, msg=name)


def test_other_architecture_is_refused():
    task = LlamaTask(untied=True)
    mine = task.config.to_dict()
    gpt2_like = {k: v for k, v in mine.items() if k not in ("swiglu", "normalization")}  # old file
    with pytest.raises(CheckpointError, match="swiglu: checkpoint False vs this run True"):
        resume.check_model_compatible(gpt2_like, mine)
    resume.check_model_compatible(dict(mine, rotary_base=20000.0), mine)   # rope base may change
