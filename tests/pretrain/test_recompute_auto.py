"""`--recompute auto --memory-budget`: the trainer asks the ZeRO-R planner for a per-layer plan that
fits the budget, prints it, and trains with it; misuse is refused with the fix."""

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute.plan import MODES
from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.build import build_model, gpt_config, recompute_plan

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--world-size", "1"]


@pytest.mark.parametrize("flags, message", [
    (["--recompute", "auto"], "needs --memory-budget"),
    (["--recompute", "full", "--memory-budget", "1GiB"], "applies only to --recompute auto"),
    (["--recompute", "auto", "--memory-budget", "lots"], "cannot read memory size"),
    (["--recompute", "most"], "must be one of"),
])
def test_recompute_flags_are_checked(flags, message):
    with pytest.raises(TrainConfigError, match=message):
        parse_args(TINY + flags)


def _plan(budget: str):
    cfg, _ = parse_args(TINY + ["--recompute", "auto", "--memory-budget", budget])
    state = ParallelState.single_process()
    return recompute_plan(cfg, gpt_config(cfg, 512), state), cfg, state


def test_auto_plan_tightens_with_the_budget_and_trains():
    roomy, _, _ = _plan("1GiB")
    assert set(roomy.modes) == {"none"}                      # everything fits: recompute nothing
    tight, cfg, state = _plan("1MiB")                        # none needs 1.77 MB, full 0.67 MB
    assert len(tight.modes) == 4 and set(tight.modes) <= set(MODES) and set(tight.modes) != {"none"}
    assert "planned for 1,048,576 B" in str(tight)           # what the trainer prints
    with pytest.raises(ValueError, match="no recompute plan fits"):
        _plan("1KiB")
    model = build_model(cfg, None, state, 512).model
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
