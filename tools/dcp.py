"""Export a training checkpoint to torch.distributed.checkpoint (DCP) in torchtitan's Llama layout,
or import one (issue 34; models/gpt/dcp.py; docs/checkpoints.md, DCP interop).

    python tools/dcp.py export --load checkpoints/run --out dcp/step-100
    python tools/dcp.py import --dcp-dir dcp/step-100 --save checkpoints/imported \\
        --config tiny-llama-cpu                          # or the model flags: --num-layers ...
    python launch/pretrain_gpt.py --config tiny-llama-cpu --load checkpoints/imported ...

``export`` reads the checkpoint at whatever TP/PP/DP layout and ZeRO stage wrote it (a save directory
or one iter_N directory) and writes the model (fp32 master weights), the Adam moments and step in
torch's flattened optimizer state dict, and the iteration, under torchtitan's names; ``--no-optimizer``
writes the model only. ``--naming qkv_linear`` writes torchtitan 0.3's names (``attention.qkv_linear.wq``, ``lm_head``);
``import`` reads either naming. ``import`` reads a DCP directory in that layout (torchtitan's checkpointer, or
``dcp.save`` of a plain model's state dict; any number of ranks wrote it) and writes a checkpoint
here that any layout resumes with ``--load``. The model dims come from the training flags given
after ``import``'s own (``--config`` or ``--num-layers`` ...; the vocab size, when not given, from
the checkpoint's ``tok_embeddings``), and must match the DCP shapes. DCP's ``.metadata`` pickle is
read with an allow-list unpickler, the tensors with torch's weights-only one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from tools._cli import ArgumentParser, check_output_dir, require, run_cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="our checkpoint -> DCP directory (torchtitan Llama layout)")
    e.add_argument("--load", required=True, help="checkpoint: a --save directory or an iter_N one")
    e.add_argument("--out", required=True, help="DCP directory to write")
    e.add_argument("--no-optimizer", action="store_true", help="write the model only")
    e.add_argument("--naming", choices=("classic", "qkv_linear"), default="classic",
                   help="torchtitan's parameter names: classic (attention.wq, output; default) or "
                        "torchtitan 0.3's (attention.qkv_linear.wq, lm_head)")
    e.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    i = sub.add_parser("import", help="DCP directory -> our checkpoint; model flags follow")
    i.add_argument("--dcp-dir", required=True, help="DCP directory (holding .metadata)")
    i.add_argument("--save", required=True, help="directory to write the checkpoint into")
    i.add_argument("--overwrite", action="store_true", help="write into a non-empty --save")
    i.epilog = ("model flags, as launch/pretrain_gpt.py takes them: --config PRESET_OR_FILE, "
                "--num-layers, --hidden-size, --num-attention-heads, --num-query-groups, "
                "--ffn-hidden-size, --vocab-size (default: the rows of tok_embeddings) ...")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = e.format_help() + "\n" + i.format_help()   # every flag in one --help
    args, model_flags = p.parse_known_args(argv)
    if args.command == "export":
        require(not model_flags, f"unknown flags for export: {' '.join(model_flags)}")
        from models.gpt.dcp import export_dcp
        out = Path(args.out)
        check_output_dir(out, flag="--out", inputs=[Path(args.load)], overwrite=args.overwrite,
                         writes=[".metadata", "__*.distcp"])
        export_dcp(args.load, out, optimizer=not args.no_optimizer, naming=args.naming)
        print(f"wrote DCP checkpoint {out}")
        return 0
    from models.gpt.dcp import import_dcp
    save = Path(args.save)
    check_output_dir(save, flag="--save", inputs=[Path(args.dcp_dir)], overwrite=args.overwrite,
                     writes=["iter_*", "latest"])
    final = import_dcp(args.dcp_dir, save, model_config(args.dcp_dir, model_flags))
    print(f"wrote checkpoint {final}; resume it with --load {save}")
    return 0


def model_config(dcp_dir: str, flags: list[str]):
    """The GPTConfig of the training flags ``flags``; the vocab size from the DCP checkpoint's
    ``tok_embeddings`` when the flags leave it to the tokenizer."""
    from hybrid.checkpoint.dcp_reader import DCPReader
    from pretrain.arguments import parse_args
    cfg, _ = parse_args(flags)
    model = cfg.model
    if model.vocab_size is None:
        shapes = DCPReader(dcp_dir).tensor_shapes()
        require("tok_embeddings.weight" in shapes, f"{dcp_dir} has no tok_embeddings.weight; is it "
                                                   f"a torchtitan Llama checkpoint?")
        model = dataclasses.replace(model, vocab_size=shapes["tok_embeddings.weight"][0])
    return model


if __name__ == "__main__":
    sys.exit(run_cli(main))
