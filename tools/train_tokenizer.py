"""Train the sentencepiece BPE tokenizer of the GPT data pipeline (byte fallback, eod = ``</s>``).

    python -m tools.train_tokenizer --input corpus.jsonl --json-key text \\
        --vocab-size 8192 --output-prefix data/tokenizer

Inputs: .jsonl/.json files (one object per line, text under --json-key) or plain text files (each
file one document). Writes OUTPUT_PREFIX.model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.data.preprocess import read_documents  # noqa: E402
from hybrid.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--json-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.model")
    p.add_argument("--workers", type=int, default=1,
                   help="sentencepiece trainer threads (the model is deterministic for a given "
                   "thread count, but differs between counts)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    path = train_tokenizer(read_documents(args.input, args.json_key), args.output_prefix,
                           args.vocab_size, num_threads=args.workers)
    tok = Tokenizer(path)
    print(f"wrote {path}: vocab {tok.vocab_size}, eod id {tok.eod}, "
          f"{time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
