"""Issue 36 on the GPU: a training step that never waits on the host, and per-layer CUDA graphs.

* A trainer step (ZeRO stage 2, bf16, and fp16 with its device loss scaler) runs under
  ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call inside it (``.item()``, a
  device-to-host copy, a blocking host-to-device copy, ...) raises. The settle at the log interval
  is the one place allowed to read, outside the guarded region. CPU twin:
  tests/pretrain/test_host_sync.py (counts the reads).
* ``--enable-cuda-graph`` (scope ``full``): the layers are captured, and five training steps
  give the losses of the eager run (bf16 within 2e-2 relative: the graphs replay the same kernels,
  only the gradient-accumulation fusion is off for the captured layers).
"""

from __future__ import annotations

import pytest
import torch

from tests.training_helpers import DataBundle, IndexedSamples, VOCAB, tiny_args


def _trainer(args):
    from hybrid.launch_env import LaunchEnv
    from pretrain.arguments import parse_args
    from pretrain.build import build_parallel_state
    from pretrain.setup import build_trainer
    cfg, _ = parse_args(args)
    layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
    state = build_parallel_state(cfg, layout)
    assert state.device.type == "cuda"
    data = DataBundle(IndexedSamples(4096), IndexedSamples(512), VOCAB, eod=-1)
    return build_trainer(cfg, layout, state, data=data)


@pytest.fixture
def single_rank(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_step_never_syncs(single_rank, precision):
    trainer = _trainer(tiny_args(zero=2, precision=precision, iters=4,
                                 extra=["--log-interval", "4", "--eval-iters", "0"]))
    step = trainer.train_step
    guarded = []

    def checked(loader, lr):
        if trainer.ts.iteration == 0:       # the first step allocates and warms up
            return step(loader, lr)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(loader, lr)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            guarded.append(trainer.ts.iteration + 1)

    trainer.train_step = checked
    trainer.train()
    assert guarded == [2, 3, 4]
    assert len(trainer.losses) == 4 and all(x == x for x in trainer.losses)


def test_cuda_graph_layers_train_like_eager(single_rank):
    base = tiny_args(zero=1, precision="bf16", iters=5, extra=["--log-interval", "5",
                                                              "--eval-iters", "0"])
    torch.manual_seed(0)
    eager = _trainer(base)
    eager.train()
    torch.manual_seed(0)
    graphed = _trainer(base + ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "2"])
    graphed.train()
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses),
                               rtol=2e-2, atol=0)
