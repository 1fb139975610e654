"""Import a Megatron-LM / megatron-core GPT or Llama checkpoint as a checkpoint of this framework.

    python tools/import_megatron.py --load /path/to/megatron/save --save ckpt-imported
    python tools/generate.py --load ckpt-imported ...               # or --init-from-hf ckpt-imported

Reads either format Megatron writes (docs/checkpoints.md, From Megatron-LM): ``torch_dist``
(torch.distributed.checkpoint) or the legacy per-rank ``mp_rank_TT[_PPP]/model_optim_rng.pt``, at
any TP and PP degree, without unpickling arbitrary objects (hybrid/checkpoint/foreign_files.py; DCP's
``.metadata`` is parsed as data, never unpickled: hybrid/checkpoint/pickle_opcodes.py).
``--load`` is Megatron's --save directory (its ``latest_checkpointed_iteration.txt`` picks the
iteration) or one iteration directory. The model config comes from the checkpoint's stored args;
the model flags below (Megatron's names) fill in what a checkpoint without args lacks, or replace
stored values. ``--vocab-size`` (the tokenizer's size) drops Megatron's vocab padding rows.

Writes ``--save``/iter_N (N: Megatron's iteration) holding the model weights in fp32 at TP 1 (any
layout loads it) and ``latest``; a new or empty directory unless --overwrite, which replaces only
those two.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import get_args, get_type_hints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from hybrid.checkpoint.lock import new_run_id  # noqa: E402
from hybrid.checkpoint.state import save_state  # noqa: E402
from hybrid.parallel_state import ParallelState  # noqa: E402
from models.gpt.config import GPTConfig  # noqa: E402
from models.gpt.megatron import load_megatron  # noqa: E402
from models.gpt.weights import build_model  # noqa: E402
from tools._cli import ArgumentParser, check_output_dir, run_cli  # noqa: E402

_NOT_FLAGS = ("attention_softmax_in_fp32",)   # how we run it, not what Megatron trained


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (only where the checkpoint stores no args, or to "
                                      "replace a stored value)")
    hints = get_type_hints(GPTConfig)
    for f in dataclasses.fields(GPTConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f.metadata.get("help"))
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            if f.metadata.get("off_flag"):
                group.add_argument(f.metadata["off_flag"], action="store_false", dest=f.name,
                                   default=argparse.SUPPRESS, help=f"same as --no-{flag[2:]}")
        else:
            base = next(t for t in (*get_args(hint), hint) if t in (int, float, str))
            group.add_argument(flag, type=base, metavar=base.__name__.upper(), **kw)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="Megatron's --save directory or an iter_N directory")
    p.add_argument("--save", required=True, help="directory for the imported checkpoint")
    p.add_argument("--approximate-gelu", action="store_true",
                   help="import a model trained with the exact (erf) GELU although this GPT "
                        "computes the tanh approximation")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --save")
    _add_model_flags(p)
    args = p.parse_args(argv)
    load, save = Path(args.load), Path(args.save)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(GPTConfig)
                 if hasattr(args, f.name)}
    check_output_dir(save, flag="--save", inputs=[load], overwrite=args.overwrite,
                     writes=["latest", "iter_NNNNNNN (Megatron's iteration)"])
    state_dict, config, info = load_megatron(load, overrides, approximate_gelu=args.approximate_gelu)
    state = ParallelState.single_process("cpu")
    model = build_model(config, state, state_dict)
    iteration = info["iteration"] or 0
    written = save_state(save, iteration, model, model.checkpoint_layout(), state, extra={},
                         metadata={"model_config": config.to_dict(), "imported_from": info},
                         keep_last=0, run_id=new_run_id())
    print(f"imported {info['source']} into {written}: {config.num_layers} layers, hidden "
          f"{config.hidden_size}, {config.num_attention_heads} heads, vocab {config.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
