"""Import a Hugging Face GPT-2 or Llama directory as a canonical safetensors file our tools and models load.

    python tools/import_hf.py --hf-dir path/to/gpt2 --out gpt2.safetensors
    python tools/generate.py --load gpt2.safetensors ...      # or --load path/to/gpt2 directly

Every loader here (:func:`models.gpt.weights.load_model`, tools/generate.py, tools/evaluate.py)
already accepts an HF directory; this tool writes the converted tensors once, with the GPTConfig in
the file's metadata. To start training from HF weights, pass ``--init-from-hf hf_dir`` to
launch/pretrain_gpt.py: it builds the model at any TP degree and calls
``models.gpt.weights.init_from_pretrained(model, hf_dir)`` before the optimizer is created (ZeRO
stages 0-2), or passes ``init_fn=pretrained_init_fn(hf_dir, model)`` to the stage-3 optimizer of the
meta-built model.
Reads model.safetensors or the shards of model.safetensors.index.json (never a pickled ``.bin``).
An existing --out is kept unless --overwrite is given; --out inside --hf-dir is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from models.gpt.hf import load_hf_directory  # noqa: E402
from models.gpt.weights import save_canonical  # noqa: E402
from tools._cli import ArgumentParser, check_output_files, positive, require, run_cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", required=True, help="directory with config.json + model.safetensors")
    p.add_argument("--out", required=True, help="canonical .safetensors file to write")
    p.add_argument("--make-vocab-size-divisible-by", type=positive, default=128)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    out, hf_dir = Path(args.out), Path(args.hf_dir)
    require(out.suffix == ".safetensors", f"--out {out} must end in .safetensors")
    require(hf_dir.is_dir(), f"--hf-dir {hf_dir} is not a directory; pass the directory holding "
                             f"config.json and model.safetensors")
    require(hf_dir.resolve() not in out.resolve().parents,
            f"--out {out} is inside --hf-dir {hf_dir}; write the converted file elsewhere")
    check_output_files([out], flag="--out", inputs=[], overwrite=args.overwrite)
    state_dict, config = load_hf_directory(hf_dir,
                                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_canonical(out, state_dict, config)
    print(f"wrote {out}: {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} heads, vocab {config.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
