"""Build (or find in the cache) the embedded default corpus: the Python standard library's sources,
a BPE tokenizer trained on them and their Megatron indexed dataset. No download.

    python -m tools.build_default_corpus --cache-dir ./data-cache --vocab-size 8192

Prints the data prefix and tokenizer model path to pass as --data-path / --tokenizer-model.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.data.default_corpus import (  # noqa: E402
    DEFAULT_MAX_BYTES, default_cache_dir, ensure_default_dataset)
from tools._cli import ArgumentParser, positive, require, run_cli  # noqa: E402


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None, help=f"default $HYBRID_CACHE or {default_cache_dir()}")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-bytes", type=positive, default=DEFAULT_MAX_BYTES, help="cap on source bytes")
    p.add_argument("--workers", type=positive, default=1, help="tokenizer worker processes")
    args = p.parse_args(argv)
    require(args.vocab_size >= 300, f"--vocab-size {args.vocab_size} is too small: byte fallback "
                                    f"alone needs 256 ids plus specials; use at least 300")
    cache = Path(args.cache_dir) if args.cache_dir else None
    require(cache is None or not cache.exists() or cache.is_dir(),
            f"--cache-dir {cache} is a file; pass a directory")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    prefix, model = ensure_default_dataset(args.cache_dir, args.vocab_size,
                                           max_bytes=args.max_bytes, workers=args.workers)
    print(f"data prefix:     {prefix}\ntokenizer model: {model}\n({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
