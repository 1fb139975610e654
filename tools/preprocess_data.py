"""Tokenize text / JSONL into Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx).

    python -m tools.preprocess_data --input corpus.jsonl --json-key text \\
        --tokenizer-model data/tokenizer.model --output-prefix data/corpus_text_document --workers 2

Each document is followed by the end-of-document id; tokens are uint16 when the vocabulary has
fewer than 65500 entries, else int32. The output is byte-identical for any --workers.
Existing PREFIX.bin/.idx are kept unless --overwrite is given (which replaces those two files only);
an output that is one of the inputs is always refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.data.indexed_dataset import data_path, index_path  # noqa: E402
from hybrid.data.preprocess import preprocess  # noqa: E402
from hybrid.data.tokenizer import Tokenizer  # noqa: E402
from tools._cli import ArgumentParser, check_output_files, positive, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--json-key", "--json-keys", default="text",
                   help="JSONL field holding the document text")
    p.add_argument("--tokenizer-model", required=True,
                   help="sentencepiece .model, tokenizer.json, or a directory holding one")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    p.add_argument("--workers", type=positive, default=1, help="tokenizer worker processes")
    p.add_argument("--dtype", default=None, choices=["uint16", "int32", "int64"],
                   help="token dtype (default: uint16 if the vocab fits, else int32)")
    p.add_argument("--log-interval", type=positive, default=10_000,
                   help="log progress every N documents")
    p.add_argument("--no-append-eod", action="store_true", help="do not end documents with eod")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUTPUT_PREFIX.bin/.idx (and only those)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    outputs = [Path(data_path(args.output_prefix)), Path(index_path(args.output_prefix))]
    check_output_files(outputs, flag="--output-prefix", overwrite=args.overwrite,
                       inputs=[Path(p) for p in (*args.input, args.tokenizer_model)])
    Tokenizer(args.tokenizer_model)   # a readable tokenizer, before any output exists
    outputs[0].parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stats = preprocess(args.input, args.output_prefix, args.tokenizer_model, workers=args.workers,
                       json_key=args.json_key, append_eod=not args.no_append_eod,
                       token_dtype=args.dtype, log_interval=args.log_interval)
    print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} "
          f"{stats.dtype} tokens in {stats.seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
