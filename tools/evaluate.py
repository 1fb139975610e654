"""Perplexity of a GPT checkpoint on an indexed dataset, at any TP x DP layout.

    python tools/evaluate.py --load checkpoints/tiny --data-path data/text_document \\
        --tokenizer-model data/tokenizer.model --eval-samples 256
    torchrun --standalone --nproc-per-node 4 tools/evaluate.py --load checkpoints/tiny \\
        --tensor-model-parallel-size 2 ...          # TP 2 x DP 2

Perplexity = exp(mean per-token cross-entropy) over the first ``--eval-samples`` samples of one
split of ``hybrid.data.build_gpt_datasets`` (Megatron's document/shuffle indices, so the samples are
the ones the training run's validation saw for the same --split/--seed/--seq-length). The loss is
the model's vocab-parallel cross-entropy (identical on every TP rank); micro-batches are dealt to DP
ranks round-robin and the (sum, count) pair is all-reduced over DP in fp64, so every layout gives
the same number up to fp32 rounding of the forward pass.

--eval-samples beyond what one pass over the split's documents gives would repeat documents (the
dataset cycles its epochs); the tool then says so on stderr and evaluates every distinct sample once
(the JSON reports the number used).

For a training checkpoint, --data-path, --split, --seed and --data-cache-dir default to the run's own
(its resolved config is in the checkpoint), so the embedded-corpus run of README's first command is
evaluated on the same validation samples with no data flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hybrid import comm  # noqa: E402
from hybrid.data.documents import document_tensors  # noqa: E402
from hybrid.parallel_state import ParallelState  # noqa: E402
from models.gpt.token_layout import TokenLayout  # noqa: E402
from models.gpt.weights import load_model  # noqa: E402
from tools._cli import ArgumentParser, ToolError, require, run_cli  # noqa: E402
from tools.generate import (default_corpus, load_tokenizer, parallel_state_from_env,  # noqa: E402
                            training_run_config)

SPLITS = {"train": 0, "valid": 1, "test": 2}


@dataclass(frozen=True)
class EvalResult:
    loss: float          # mean per-token cross-entropy (nats)
    perplexity: float    # exp(loss)
    tokens: int          # tokens that counted
    samples: int

    def to_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens,
                "samples": self.samples}


@torch.no_grad()
def evaluate_perplexity(model, dataset, state: ParallelState, *, num_samples: int,
                        micro_batch_size: int = 4, eod_mask: int | None = None,
                        documents: tuple[int, bool, bool] | None = None) -> EvalResult:
    """Perplexity over samples ``0 .. num_samples-1`` of ``dataset`` (``ds[i]`` = ``s + 1`` ids).
    Every rank must call; ``eod_mask`` (an id) excludes positions whose input is that token;
    ``documents``: (EOD id, reset positions, reset attention mask), the packed-document layout of
    ``--reset-position-ids`` / ``--reset-attention-mask`` (issue 31)."""
    if num_samples < 1 or num_samples > len(dataset):
        raise ValueError(f"--eval-samples {num_samples} must be in [1, {len(dataset)}] (the split's "
                         f"samples)")
    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)     # [sum of losses, tokens]
    starts = range(0, num_samples, micro_batch_size)
    for j, start in enumerate(starts):
        if j % state.dp_size != state.dp_rank:
            continue
        ids = np.stack([dataset[i] for i in range(start, min(start + micro_batch_size, num_samples))])
        batch = torch.from_numpy(ids.astype(np.int64)).to(device)   # [b, s + 1]
        tokens, labels = batch[:, :-1], batch[:, 1:]
        layout = None
        if documents is not None:   # ids from the host copy, then to the device
            eod, positions, attention = documents
            ids = document_tensors(torch.from_numpy(ids[:, :-1].astype(np.int64)), eod,
                                   reset_positions=positions, reset_attention=attention)
            layout = TokenLayout(**{k: v.to(device) for k, v in ids.items()})
        loss = model(tokens, labels, layout=layout).double()        # [b, s]
        mask = torch.ones_like(loss) if eod_mask is None else (tokens != eod_mask).double()
        totals += torch.stack([(loss * mask).sum(), mask.sum()])
    comm.all_reduce(totals, state.dp)
    total, count = totals.tolist()
    if count == 0:
        raise ValueError("no token counted (every input is the end-of-document token?)")
    mean = total / count
    return EvalResult(mean, math.exp(mean), int(count), num_samples)


def build_eval_dataset(data_path: list[str], split: str, which: str, seq_length: int,
                       num_samples: int, seed: int, vocab_size: int, cache_dir: str | None):
    from hybrid.data import build_gpt_datasets
    counts = [0, 0, 0]
    counts[SPLITS[which]] = num_samples
    dataset = build_gpt_datasets(data_path, split, seq_length, counts, seed, vocab_size=vocab_size,
                                 cache_dir=cache_dir)[SPLITS[which]]
    if dataset is None:
        raise ToolError(f"--split {split} gives the {which} split no documents; choose another "
                        f"--eval-split or --split")
    return dataset


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint dir, HF GPT-2 dir or canonical .safetensors")
    p.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es), Megatron-style (default: the training run's)")
    p.add_argument("--split", default=None, help="default: the training run's, else 969,30,1")
    p.add_argument("--eval-split", choices=tuple(SPLITS), default="valid")
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=None, help="default: the model's")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=None,
                   help="dataset shuffle seed (default: the training run's, else 1234)")
    p.add_argument("--data-cache-dir", default=None, help="default: the training run's")
    p.add_argument("--tokenizer-model", default=None, help="for --eod-mask-loss and the default corpus")
    p.add_argument("--eod-mask-loss", action="store_true", help="skip positions whose input is eod")
    p.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart after each eod (as the run trained; needs the tokenizer)")
    p.add_argument("--reset-attention-mask", action="store_true",
                   help="no attention across documents (as the run trained; needs the tokenizer)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None)
    p.add_argument("--weights", choices=("master", "model"), default="master")
    args = p.parse_args(argv)
    for flag in ("eval_samples", "micro_batch_size", "seq_length"):
        value = getattr(args, flag)
        require(value is None or value >= 1,
                f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    return args


def data_settings(args: argparse.Namespace, state: ParallelState) -> tuple[list[str], str, int, str | None]:
    """``(data_path, split, seed, cache_dir)``: flags, else the training run's (a checkpoint stores
    its config), else defaults. A run on the embedded corpus is evaluated on it again."""
    run = training_run_config(args.load) or {"data": {}, "training": {}, "model": {}}
    data, training = run["data"], run["training"]
    cache_dir = args.data_cache_dir or data.get("data_cache_dir")
    split = args.split or data.get("split") or "969,30,1"
    seed = args.seed if args.seed is not None else training.get("seed", 1234)
    data_path = args.data_path or data.get("data_path")
    if not data_path:
        if not run["data"]:
            raise ToolError(f"{args.load} does not say what data it saw; pass --data-path")
        if state.rank == 0:        # build the embedded corpus once, the others wait
            default_corpus(run)
        comm.barrier(state.world)
        data_path = [default_corpus(run)[0]]
    return list(data_path), split, seed, cache_dir


def run(args: argparse.Namespace, state: ParallelState) -> EvalResult:
    model = load_model(args.load, state, kind=args.weights)
    config = model.config
    seq = args.seq_length or config.seq_length
    require(seq <= config.max_position_embeddings,
            f"--seq-length {seq} exceeds the model's {config.max_position_embeddings} positions; "
            f"pass --seq-length {config.max_position_embeddings} or less")
    data_path, split, seed, cache_dir = data_settings(args, state)
    eod = documents = None
    resets = args.reset_position_ids or args.reset_attention_mask
    if args.eod_mask_loss or resets:
        tok = load_tokenizer(args.load, args.tokenizer_model)
        if tok is None:
            raise ToolError("--eod-mask-loss / --reset-position-ids / --reset-attention-mask need "
                            "the tokenizer: pass --tokenizer-model")
        eod = tok.eod if args.eod_mask_loss else None
        if resets:
            documents = (tok.eod, args.reset_position_ids, args.reset_attention_mask)
    dataset, num_samples = eval_dataset(args, state, data_path, split, seq, seed, config.vocab_size,
                                        cache_dir)
    return evaluate_perplexity(model, dataset, state, num_samples=num_samples,
                               micro_batch_size=args.micro_batch_size, eod_mask=eod,
                               documents=documents)


def eval_dataset(args: argparse.Namespace, state: ParallelState, data_path: list[str], split: str,
                 seq: int, seed: int, vocab_size: int, cache_dir: str | None):
    """``(dataset, samples to evaluate)``: --eval-samples, or every distinct sample of the split
    once when it has fewer (with a warning) - a perplexity over repeated samples would mislead."""
    from hybrid.data.builder import distinct_samples

    def build(num_samples: int):
        args_ = (data_path, split, args.eval_split, seq, num_samples, seed, vocab_size, cache_dir)
        if state.rank == 0:   # build (and cache) the sample index once, like the trainer
            build_eval_dataset(*args_)
        comm.barrier(state.world)
        return build_eval_dataset(*args_)

    requested = args.eval_samples
    dataset = build(requested)
    distinct = distinct_samples(dataset)
    if requested <= distinct:
        return dataset, requested
    require(distinct > 0, f"the {args.eval_split} split holds fewer than {seq + 1} tokens, not one "
                          f"sample; pass a shorter --seq-length or give the split more documents")
    if state.rank == 0:
        print(f"warning: the {args.eval_split} split has only {distinct} distinct samples of "
              f"{seq}+1 tokens; evaluating those {distinct} once instead of --eval-samples "
              f"{requested} (more would repeat documents)", file=sys.stderr, flush=True)
    dataset = build(distinct)
    return dataset, min(distinct, distinct_samples(dataset))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state = parallel_state_from_env(args.tensor_model_parallel_size)
    result = run(args, state)
    if state.rank == 0:
        print(json.dumps({**result.to_dict(), "tensor_model_parallel_size": state.tp_size,
                          "data_parallel_size": state.dp_size}))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
