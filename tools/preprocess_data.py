"""Tokenize text / JSONL into Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx).

    python -m tools.preprocess_data --input corpus.jsonl --json-key text \\
        --tokenizer-model data/tokenizer.model --output-prefix data/corpus_text_document --workers 2

Each document is followed by the end-of-document id; tokens are uint16 when the vocabulary has
fewer than 65500 entries, else int32. The output is byte-identical for any --workers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.data.preprocess import preprocess  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--json-key", "--json-keys", default="text",
                   help="JSONL field holding the document text")
    p.add_argument("--tokenizer-model", required=True, help="sentencepiece .model file")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    p.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    p.add_argument("--dtype", default=None, choices=["uint16", "int32", "int64"],
                   help="token dtype (default: uint16 if the vocab fits, else int32)")
    p.add_argument("--log-interval", type=int, default=10_000, help="log progress every N documents")
    p.add_argument("--no-append-eod", action="store_true", help="do not end documents with eod")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stats = preprocess(args.input, args.output_prefix, args.tokenizer_model, workers=args.workers,
                       json_key=args.json_key, append_eod=not args.no_append_eod,
                       token_dtype=args.dtype, log_interval=args.log_interval)
    print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} "
          f"{stats.dtype} tokens in {stats.seconds:.1f}s")


if __name__ == "__main__":
    main()
