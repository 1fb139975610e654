"""--enable-cuda-graph / --cuda-graph-scope (issue 36 item 3; Megatron's names): every combination
that cannot be captured is refused when the flags are read, with its reason and the way out
(pretrain/cuda_graphs.py), and a CPU device is refused at set-up. The capture itself runs on CUDA
only (tests/gpu/test_host_sync_cuda.py)."""

from __future__ import annotations

import pytest

from pretrain.arguments import parse_args
from pretrain.sections import TrainConfigError
from tests.training_helpers import tiny_args

GRAPH = ["--enable-cuda-graph"]


def test_accepted_with_megatron_default_scope():
    cfg, _ = parse_args(tiny_args(extra=GRAPH))
    assert cfg.training.enable_cuda_graph and cfg.training.cuda_graph_scope == "full"
    assert cfg.training.cuda_graph_warmup_steps == 3


REFUSALS = [   # (fields changed on a config that captures, what the refusal says)
    ({"training.cuda_graph_scope": "attn"}, "--cuda-graph-scope attn"),
    ({"training.cuda_graph_scope": "full_iteration"}, "full_iteration cannot capture"),
    ({"parallel.zero_stage": 3}, "ZeRO stage 3 gathers"),
    ({"parallel.offload_optimizer": "cpu"}, "optimizer offload"),
    ({"training.recompute": "full"}, "--recompute full reruns layers"),
    ({"model.hidden_dropout": 0.1}, "dropout (--hidden-dropout 0.1"),
    ({"training.compile": True}, "--compile and --enable-cuda-graph"),
    ({"parallel.pipeline_model_parallel_size": 2}, "pipeline parallelism"),
]


def test_combinations_that_cannot_be_captured_are_refused():
    """Each refusal from the config's own check (pretrain.cuda_graphs.cuda_graph_problems), and
    the parser turning one into a TrainConfigError."""
    import copy
    from pretrain.cuda_graphs import cuda_graph_problems
    cfg, _ = parse_args(tiny_args(extra=GRAPH))
    assert cuda_graph_problems(cfg) == []
    for changes, says in REFUSALS:
        changed = copy.deepcopy(cfg)
        for path, value in changes.items():
            section, field = path.split(".")
            object.__setattr__(getattr(changed, section), field, value)
        problems = cuda_graph_problems(changed)
        assert len(problems) == 1 and says in problems[0], (changes, problems)
    with pytest.raises(TrainConfigError, match="--enable-cuda-graph cannot capture this run: "
                                               "ZeRO stage 3 gathers"):
        parse_args(tiny_args(zero=3, extra=GRAPH))


def test_unknown_scope_and_warmup_are_refused():
    with pytest.raises(TrainConfigError, match="--cuda-graph-scope must be one of full, attn"):
        parse_args(tiny_args(extra=["--cuda-graph-scope", "layers"]))
    with pytest.raises(TrainConfigError, match="cuda_graph_warmup_steps|cuda-graph-warmup-steps"):
        parse_args(tiny_args(extra=GRAPH + ["--cuda-graph-warmup-steps", "0"]))


def test_cpu_device_is_refused_at_set_up():
    import torch
    from hybrid.parallel_state import ParallelState
    from pretrain.cuda_graphs import capture_layers
    cfg, _ = parse_args(tiny_args(extra=GRAPH))
    state = ParallelState.single_process("cpu")
    with pytest.raises(ValueError, match="--enable-cuda-graph needs a CUDA device; this rank trains "
                                         "on cpu"):
        capture_layers(cfg, [torch.nn.Linear(2, 2)], state, 2)
    cfg, _ = parse_args(tiny_args())
    assert capture_layers(cfg, [], state, 2) == 0   # without the flag: nothing
