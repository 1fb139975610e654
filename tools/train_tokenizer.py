"""Train a tokenizer of the GPT data pipeline (hybrid/data/tokenizer.py).

    python -m tools.train_tokenizer --input corpus.jsonl --json-key text \\
        --vocab-size 8192 --output-prefix data/tokenizer [--type bpe]

--type sentencepiece (default): a sentencepiece BPE model with byte fallback (eod ``</s>``), written
as OUTPUT_PREFIX.model. --type bpe: a Hugging Face byte-level BPE (GPT-2 / Llama-3 style, eod
``<|endoftext|>``), written as OUTPUT_PREFIX.json (a tokenizer.json). Inputs: .jsonl/.json files
(one object per line, text under --json-key) or plain text files (each file one document). An
existing output is kept unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.data.preprocess import read_documents  # noqa: E402
from hybrid.data.tokenizer import TOKENIZER_TYPES, Tokenizer, train_tokenizer  # noqa: E402
from tools._cli import ArgumentParser, check_output_files, positive, require, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--json-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--type", choices=TOKENIZER_TYPES, default="sentencepiece",
                   help="sentencepiece (OUTPUT_PREFIX.model) or byte-level bpe (OUTPUT_PREFIX.json)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX.model (sentencepiece) or OUTPUT_PREFIX.json (bpe)")
    p.add_argument("--workers", type=positive, default=1,
                   help="sentencepiece trainer threads (the model is deterministic for a given "
                   "thread count, but differs between counts; bpe ignores it)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    require(args.vocab_size >= 300, f"--vocab-size {args.vocab_size} is too small: the 256 byte ids "
                                    f"plus specials need more; use at least 300")
    suffix = ".json" if args.type == "bpe" else ".model"
    check_output_files([Path(f"{args.output_prefix}{suffix}")], flag="--output-prefix",
                       inputs=[Path(p) for p in args.input], overwrite=args.overwrite)
    for path in map(Path, args.input):
        require(path.is_file(), f"--input {path} {'is not a file' if path.exists() else 'does not exist'}; "
                                f"pass text or JSONL files")
    t0 = time.perf_counter()
    path = train_tokenizer(read_documents(args.input, args.json_key), args.output_prefix,
                           args.vocab_size, num_threads=args.workers, kind=args.type)
    tok = Tokenizer(path)
    print(f"wrote {path}: vocab {tok.vocab_size}, eod id {tok.eod}, "
          f"{time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
