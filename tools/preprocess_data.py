"""Tokenize text / JSONL into Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx).

    python -m tools.preprocess_data --input corpus.jsonl --json-key text \\
        --tokenizer-model data/tokenizer.model --output-prefix data/corpus_text_document --workers 2

Megatron-LM's command line works as it is and means what it means there:

    python -m tools.preprocess_data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --json-keys text --append-eod --workers 2      # writes data/corpus_text_document.bin/.idx

With --tokenizer-type (Megatron's layout) every --json-keys KEY writes PREFIX_KEY_document.bin/.idx
and documents end with the end-of-document id only under --append-eod (Megatron's default is not to
append it). Without --tokenizer-type the tokenizer is --tokenizer-model's file (or --vocab-file +
--merge-file), the output is PREFIX.bin/.idx of one key, and the end-of-document id is appended unless
--no-append-eod. Tokens are uint16 when the vocabulary has fewer than 65500 entries, else int32. The
output is byte-identical for any --workers. Existing outputs are kept unless --overwrite is given
(which replaces those files only); an output that is one of the inputs is always refused.
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
from hybrid.data.tokenizer_types import MEGATRON_TOKENIZER_TYPES, TokenizerSpec  # noqa: E402
from tools._cli import (ArgumentParser, ToolError, check_output_files, positive,  # noqa: E402
                        run_cli)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--json-keys", "--json-key", nargs="+", default=["text"], dest="json_keys",
                   metavar="KEY", help="JSONL field(s) holding the document text (several: "
                                       "--tokenizer-type only, one dataset each)")
    p.add_argument("--tokenizer-type", choices=MEGATRON_TOKENIZER_TYPES, default=None,
                   help="Megatron's tokenizer name (and Megatron's output names and EOD default)")
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model, tokenizer.json, or a directory holding one")
    p.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json (GPT2BPETokenizer)")
    p.add_argument("--merge-file", default=None, help="GPT-2's merges.txt (GPT2BPETokenizer)")
    p.add_argument("--vocab-size", type=positive, default=None,
                   help="NullTokenizer's number of ids (end of document is the last)")
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX.bin/.idx (with --tokenizer-type: "
                        "OUTPUT_PREFIX_KEY_document.bin/.idx)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=None,
                   help="end every document with the end-of-document id (default: on, but off "
                        "with --tokenizer-type, as in Megatron)")
    p.add_argument("--workers", type=positive, default=1, help="tokenizer worker processes")
    p.add_argument("--dtype", default=None, choices=["uint16", "int32", "int64"],
                   help="token dtype (default: uint16 if the vocab fits, else int32)")
    p.add_argument("--log-interval", type=positive, default=10_000,
                   help="log progress every N documents")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing outputs (and only those)")
    return p.parse_args(argv)


def output_prefixes(args: argparse.Namespace) -> dict[str, str]:
    """``{json key: dataset prefix}``: Megatron's PREFIX_KEY_document under --tokenizer-type,
    else OUTPUT_PREFIX itself for the one key."""
    if args.tokenizer_type is not None:
        return {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    if len(args.json_keys) > 1:
        raise ToolError(f"--json-keys {' '.join(args.json_keys)} names several keys, but without "
                        f"--tokenizer-type the output is the single {args.output_prefix}.bin/.idx; "
                        f"pass one key, or --tokenizer-type for one PREFIX_KEY_document dataset a key")
    return {args.json_keys[0]: args.output_prefix}


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                         args.vocab_size)
    prefixes = output_prefixes(args)
    outputs = [Path(f(p)) for p in prefixes.values() for f in (data_path, index_path)]
    check_output_files(outputs, flag="--output-prefix", overwrite=args.overwrite,
                       inputs=[Path(p) for p in (*args.input, *spec.files())])
    spec.build()   # a readable tokenizer, before any output exists
    append_eod = args.append_eod if args.append_eod is not None else args.tokenizer_type is None
    if not append_eod:
        print("note: documents are not followed by the end-of-document id"
              + (" (Megatron's default)" if args.append_eod is None else "")
              + "; pass --append-eod to separate them for GPT pretraining", file=sys.stderr)
    outputs[0].parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for key, prefix in prefixes.items():
        stats = preprocess(args.input, prefix, spec, workers=args.workers, json_key=key,
                           append_eod=append_eod, token_dtype=args.dtype,
                           log_interval=args.log_interval)
        print(f"wrote {prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} {stats.dtype} "
              f"tokens in {stats.seconds:.1f}s (train on it with --data-path {prefix})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
