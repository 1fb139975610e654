"""Export a GPT checkpoint of any layout to a Hugging Face ``GPT2LMHeadModel`` directory (a
Llama-style model - rope, RMSNorm, SwiGLU - to a ``LlamaForCausalLM`` one, models/gpt/hf_llama.py;
a mixture-of-experts model, at any TP / EP degree it was trained at, to a ``MixtralForCausalLM`` or,
with a gated shared expert, a ``Qwen2MoeForCausalLM`` one, models/gpt/hf_moe.py and docs/moe.md).

    python tools/export_hf.py --load checkpoints/tiny --out exports/tiny-hf

Writes config.json, model.safetensors and generation_config.json, plus tokenizer.json and a
tokenizer_config.json that transformers' ``AutoTokenizer`` loads as a fast tokenizer without
sentencepiece installed (same ids, no BOS added, no prefix space; tested with transformers 5.x): a
byte-level BPE tokenizer.json is copied, a sentencepiece model converted (and copied as
tokenizer.model too).
Then ``GPT2LMHeadModel.from_pretrained(out)`` gives the same logits as our model (fp32, tested).
The tied ``lm_head`` is not stored (HF re-ties it); the vocab padding rows are dropped.

The output never clobbers: a non-empty --out is refused unless --overwrite is given, and then only
the files an export writes are replaced; --out may never overlap --load (tools/_cli.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

import torch  # noqa: E402

from hybrid.data.tokenizer import Tokenizer  # noqa: E402
from models.gpt.hf import (CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_JSON_FILE, WEIGHTS_FILE,  # noqa: E402
                           save_hf_directory)
from models.gpt.weights import load_canonical  # noqa: E402
from tools._cli import (ArgumentParser, check_output_dir, install_files, run_cli,  # noqa: E402
                        staging_dir)
from tools.generate import resolve_tokenizer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# every file save_hf_directory may write: what --overwrite replaces (a stale tokenizer included)
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, "generation_config.json", TOKENIZER_FILE,
                TOKENIZER_JSON_FILE, "tokenizer_config.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint dir (any layout) or canonical .safetensors")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--overwrite", action="store_true",
                   help="export into a non-empty --out, replacing only the files an export writes")
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model or tokenizer.json to ship (default: the training run's)")
    p.add_argument("--no-tokenizer", action="store_true", help="export the weights only")
    p.add_argument("--weights", choices=("master", "model"), default="master")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    sources = [Path(args.load)] + ([Path(args.tokenizer_model)] if args.tokenizer_model else [])
    check_output_dir(out, flag="--out", inputs=sources, overwrite=args.overwrite, writes=EXPORT_FILES)
    tokenizer = None if args.no_tokenizer else resolve_tokenizer(args.load, args.tokenizer_model)
    if tokenizer is None and not args.no_tokenizer:
        print("note: no tokenizer found; exporting weights only (pass --tokenizer-model)")
    if tokenizer is not None:
        Tokenizer(tokenizer)   # a readable tokenizer, or a one-line error before any work
    state_dict, config = load_canonical(args.load, args.weights)
    with staging_dir(out) as tmp:
        staged = save_hf_directory(tmp / "hf", config, state_dict, tokenizer_model=tokenizer,
                                   dtype=DTYPES[args.dtype])
        install_files(staged, out, EXPORT_FILES)
    print(f"wrote {out} ({config.num_layers} layers, hidden {config.hidden_size}, vocab "
          f"{config.vocab_size}{', tokenizer' if tokenizer else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
