"""Issue 31: --reset-position-ids / --reset-attention-mask through the trainer. On a corpus with
EODs inside the samples, the flags change the training losses (they reach the model), and a
pipeline-parallel run (PP 2, the micro-batch's TokenLayout handed to both stages) trains with the
losses of the PP 1 run, fp32, rtol 1e-5. Oracle for the masking itself:
tests/models/test_document_masking.py (packed = separate documents)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import SEQ, VOCAB, tiny_args

EOD = 3
FLAGS = ["--reset-position-ids", "--reset-attention-mask"]


class PackedSamples:
    """Sample i: pseudo-random tokens from seed i with EODs at a few fixed places (documents of
    1, 4 and more tokens; every fourth sample has none)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(i)
        sample = rng.integers(4, VOCAB, SEQ + 1, dtype=np.int64)
        if i % 4:
            sample[[0, 1, 5, 11 + i % 3]] = EOD
        return sample


def _losses(rank, world_size, args):
    from hybrid.data.loader import build_pretraining_loader
    from hybrid.launch_env import LaunchEnv
    from pretrain.arguments import parse_args
    from pretrain.build import DataBundle, build_parallel_state
    from pretrain.setup import build_trainer
    torch.set_num_threads(1)
    cfg, _ = parse_args(args)
    layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
    state = build_parallel_state(cfg, layout)
    data = DataBundle(PackedSamples(4096), PackedSamples(512), VOCAB, eod=EOD)

    def make_loader(split, consumed):
        return build_pretraining_loader(data.train, consumed_samples=consumed,
                                        micro_batch_size=cfg.data.micro_batch_size,
                                        data_parallel_rank=state.dp_rank,
                                        data_parallel_size=state.dp_size, eod=EOD,
                                        reset_position_ids=cfg.data.reset_position_ids,
                                        reset_attention_mask=cfg.data.reset_attention_mask)

    trainer = build_trainer(cfg, layout, state, data=data, make_loader=make_loader)
    trainer.train()
    return trainer.losses


@pytest.mark.slow
def test_flags_reach_the_model_and_pipeline_stages_agree():
    decay, pp = ["--lr-decay-iters", "4"], ["--pipeline-model-parallel-size", "2"]
    plain = run_on_ranks(_losses, 1, args=(tiny_args(iters=3, extra=decay),), timeout=600)[0]
    packed = run_on_ranks(_losses, 1, args=(tiny_args(iters=3, extra=decay + FLAGS),),
                          timeout=600)[0]
    piped = run_on_ranks(_losses, 2, args=(tiny_args(iters=3, extra=decay + FLAGS + pp),),
                         timeout=600)
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain, packed))
    # the DP-mean loss is the same on every rank (PP 2 has DP 1)
    for losses in piped:
        np.testing.assert_allclose(losses, packed, rtol=1e-5)
