"""Sample text from a GPT checkpoint with temperature / top-k / top-p, on one process or TP ranks.

    python tools/generate.py --load checkpoints/tiny --prompt "def main(" --max-new-tokens 64
    torchrun --standalone --nproc-per-node 2 tools/generate.py --load checkpoints/tiny \\
        --tensor-model-parallel-size 2 --prompt "import os" --temperature 0.8 --top-p 0.9

``--load`` takes a training checkpoint of any layout (save dir or iter_N dir), a Hugging Face GPT-2
directory (tools/export_hf.py output) or a canonical .safetensors file. The model is sharded for the
TP degree of this job; the sampling loop is :func:`hybrid.generation.generate`. The tokenizer is
``--tokenizer-model``, else the one stored with the weights (HF directory) or the one the training
run used (checkpoint config: its tokenizer file, or Megatron's --tokenizer-type flags). Rank 0 prints
the completions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

import torch  # noqa: E402

from hybrid.generation import SamplingParams, generate  # noqa: E402
from hybrid.launch_env import LaunchEnv, LaunchEnvError  # noqa: E402
from hybrid.parallel_state import ParallelState  # noqa: E402
from models.gpt.weights import load_model  # noqa: E402
from tools._cli import ArgumentParser, ToolError, require, run_cli  # noqa: E402


def parallel_state_from_env(tp: int | None) -> ParallelState:
    """One process (no torchrun) or the torchrun job's TP x DP groups; ``tp`` defaults to the
    world size (all ranks in one TP group)."""
    try:
        env = LaunchEnv.from_environ()
    except LaunchEnvError as err:
        raise SystemExit(f"error: {err}") from None
    world = env.world_size
    tp = tp or world
    if world % tp:
        raise SystemExit(f"--tensor-model-parallel-size {tp} does not divide the {world} ranks of "
                         f"this job; launch tp x dp ranks")
    # generation accepts a TP group across nodes (slower, still right)
    return ParallelState.from_launch_env(env, tensor_parallel_size=tp, allow_tp_across_nodes=True)


def training_run_config(load: str) -> dict | None:
    """The resolved TrainConfig dict stored in a training checkpoint (None for other sources)."""
    path = Path(load)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    from hybrid.checkpoint import CheckpointReader
    return CheckpointReader(path).metadata.get("config")   # hash-checked against the manifest


def default_corpus(run: dict) -> tuple[str, str]:
    """``(data prefix, tokenizer)`` of the embedded corpus a run without --data-path trained on
    (built with the requested vocab, as pretrain.build does; cached, so normally a lookup)."""
    from hybrid.data import ensure_default_dataset
    return ensure_default_dataset(run["data"].get("data_cache_dir"), run["model"].get("vocab_size") or 4096)


def resolve_tokenizer(load: str, explicit: str | None) -> str | None:
    """The tokenizer for ``load``: explicit, the HF directory's, or the training run's."""
    if explicit:
        return explicit
    for name in ("tokenizer.json", "tokenizer.model"):
        if (Path(load) / name).is_file():
            return str(Path(load) / name)
    run = training_run_config(load)
    if run is None:
        return None
    return run["data"].get("tokenizer_model") or (None if run["data"].get("data_path")
                                                  else default_corpus(run)[1])


def load_tokenizer(load: str, explicit: str | None):
    """The tokenizer for ``load`` (:func:`resolve_tokenizer`'s file, else the one the training run
    built from Megatron's --tokenizer-type / --vocab-file / --merge-file), or None."""
    from hybrid.data import Tokenizer, build_tokenizer
    path = resolve_tokenizer(load, explicit)
    if path is not None:
        return Tokenizer(path)
    run = training_run_config(load)
    d = run["data"] if run else {}
    if not (d.get("tokenizer_type") or d.get("vocab_file")):
        return None
    return build_tokenizer(d["tokenizer_type"], vocab_file=d.get("vocab_file"),
                           merge_file=d.get("merge_file"), vocab_size=run["model"].get("vocab_size"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint dir, HF GPT-2 dir or canonical .safetensors")
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model or tokenizer.json (default: see above)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", default=None, help="JSON list of token-id lists instead of text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tensor-model-parallel-size", type=int, default=None)
    p.add_argument("--weights", choices=("master", "model"), default="master",
                   help="checkpoint tensors to use: fp32 master or 16-bit model weights")
    p.add_argument("--no-stop-at-eod", action="store_true", help="keep going after end-of-document")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = p.parse_args(argv)
    require(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    require(args.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    require(args.top_k >= 0, f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    require(0 < args.top_p <= 1, f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    require(args.prompt_ids is None or not args.prompt,
            "--prompt and --prompt-ids are exclusive; pass one of them")
    return args


def parse_prompt_ids(text: str, vocab_size: int) -> list[list[int]]:
    """--prompt-ids: a JSON list of token-id lists, every id in ``[0, vocab_size)``."""
    example = "e.g. --prompt-ids '[[5, 17, 2], [9]]'"
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError as err:
        raise ToolError(f"--prompt-ids is not valid JSON ({err.msg}); {example}") from None
    require(isinstance(prompts, list) and all(isinstance(ids, list) for ids in prompts),
            f"--prompt-ids must be a list of token-id lists, got {text!r}; {example}")
    for ids in prompts:
        for t in ids:
            require(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size,
                    f"--prompt-ids holds {t!r}, not a token id of this model (0 .. {vocab_size - 1})")
    return prompts


def run(args: argparse.Namespace, state: ParallelState) -> list[dict]:
    """Generate for every prompt; returns ``[{"prompt", "ids", "text"}]`` (same on every rank)."""
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    model = load_model(args.load, state, kind=args.weights)
    tokenizer = load_tokenizer(args.load, args.tokenizer_model)
    if args.prompt_ids is not None:
        prompts = parse_prompt_ids(args.prompt_ids, model.config.vocab_size)
    elif tokenizer is None:
        raise ToolError("no tokenizer found for text prompts; pass --tokenizer-model or --prompt-ids")
    else:
        prompts = [tokenizer.encode(text) for text in args.prompt or [""]]
    eod = None if args.no_stop_at_eod or tokenizer is None else tokenizer.eod
    out = []
    for i, ids in enumerate(prompts):
        ids = ids or ([tokenizer.eod] if tokenizer is not None else [0])   # empty: start a document
        seeded = dataclasses.replace(params, seed=params.seed + i)   # prompt i: its own stream
        seq = generate(model, torch.tensor([ids]), args.max_new_tokens, seeded, eod=eod)[0].tolist()
        new = seq[len(ids):]
        text = tokenizer.decode([t for t in new if t != eod]) if tokenizer is not None else None
        out.append({"prompt": ids, "ids": new, "text": text})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state = parallel_state_from_env(args.tensor_model_parallel_size)
    results = run(args, state)
    if state.rank == 0:
        for r in results:
            print(json.dumps(r) if args.json else (r["text"] if r["text"] is not None else r["ids"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
