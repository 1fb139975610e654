"""Shared pieces of the training tests: a tiny config, a synthetic corpus whose samples carry their
own index (so a test can check the data stream continues without repeating or skipping), and a
trainer built on it with a loader that records which samples each micro-batch held."""

from __future__ import annotations

import numpy as np
import torch

from hybrid.data.loader import build_pretraining_loader
from pretrain.arguments import parse_args
from hybrid.launch_env import LaunchEnv
from pretrain.build import DataBundle, build_parallel_state
from pretrain.setup import build_trainer

VOCAB = 200          # padded to 224 at TP 1, 256 at TP 2 and 4: resharding crosses padding
SEQ = 16


class IndexedSamples:
    """Sample i: token 0 is i (the tag), the rest pseudo-random in [0, VOCAB) from seed i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(i)
        sample = rng.integers(0, VOCAB, SEQ + 1, dtype=np.int64)
        sample[0] = i % VOCAB
        return sample


def tiny_args(tp=1, zero=1, precision="fp32", iters=4, extra=()) -> list[str]:
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--clip-grad", "1.0",
            "--tensor-model-parallel-size", str(tp), "--zero-stage", str(zero),
            "--zero-bucket-size", "2000", "--eval-interval", "1000", "--eval-iters", "0",
            "--log-interval", "1000", "--gpus-per-node", "4", "--seed", "7"]
    if precision != "fp32":
        args.append(f"--{precision}")
    return args + list(extra)


def make_trainer(args: list[str], record: list | None = None):
    """Trainer on the synthetic corpus; ``record`` collects the sample tags of every micro-batch."""
    torch.set_num_threads(1)   # the CI machine has 2 shared cores: no intra-op oversubscription
    cfg, _ = parse_args(args)
    layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
    state = build_parallel_state(cfg, layout)
    data = DataBundle(IndexedSamples(4096), IndexedSamples(512), VOCAB, eod=-1)

    def make_loader(split, consumed):
        dataset = data.train if split == "train" else data.valid
        loader = build_pretraining_loader(dataset, consumed_samples=consumed,
                                          micro_batch_size=cfg.data.micro_batch_size,
                                          data_parallel_rank=state.dp_rank,
                                          data_parallel_size=state.dp_size)
        for batch in loader:
            if record is not None and split == "train":
                record.append(batch["tokens"][:, 0].tolist())
            yield batch

    return build_trainer(cfg, layout, state, data=data, make_loader=make_loader)
