"""KV-cache generation benchmark: tokens per second with and without the key/value cache
(models/gpt/kv_cache.py through hybrid.generation.generate) at 256 new tokens, one CPU process.

Model: the tiny-llama preset (4 layers, hidden 128, rope, RMSNorm, SwiGLU, GQA, untied) with 512
positions, fp32, batch 1, a 16-token prompt, greedy. Without the cache every step runs the whole
context (quadratic in the generated length); with it, the prompt runs once and each step one token.
The two outputs are checked equal. Median wall seconds of ``--reps`` runs each, interleaved.

    python benchmarks/kv_cache_generation.py [--new-tokens 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

import torch  # noqa: E402

from hybrid.generation import SamplingParams, generate  # noqa: E402
from hybrid.parallel_state import ParallelState  # noqa: E402
from models.gpt.model import GPTModel  # noqa: E402
from models.gpt.presets import get_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = get_config("tiny-llama").replace(seq_length=512)
    model = GPTModel(config, ParallelState.single_process()).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    times = {True: [], False: []}
    outputs = {}
    for _ in range(args.reps):
        for use_cache in (True, False):
            start = time.perf_counter()
            outputs[use_cache] = generate(model, prompt, args.new_tokens, greedy, use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - start)
    assert torch.equal(outputs[True], outputs[False]), "cached and uncached generations differ"
    for use_cache in (True, False):
        seconds = statistics.median(times[use_cache])
        print(f"{'with' if use_cache else 'without'} KV cache: {args.new_tokens / seconds:8.1f} tokens/s "
              f"({seconds:.2f} s for {args.new_tokens} tokens, median of {args.reps})")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"speed-up: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
