"""Memory and throughput estimate of one GPT training configuration before launching it (ZeRO §3
memory accounting, §5 ZeRO-DP, §6 ZeRO-R; the DGX-2 throughput model of hybrid.perf.throughput).

Flag names follow Megatron's. Example - the ZeRO-100B run of Table 5:

    python -m tools.perf_estimate --num-layers 125 --hidden-size 8192 --num-attention-heads 64 \\
        --micro-batch-size 32 --tensor-model-parallel-size 16 --data-parallel-size 25 \\
        --zero-stage 2 --partition-activations
"""

from __future__ import annotations

import argparse
import json
import sys

from hybrid.perf.memory import device_memory
from hybrid.perf.model_states import GB
from hybrid.perf.throughput import estimate_iteration
from hybrid.zero_policy import DEFAULT_BUCKET_ELEMENTS
from models.gpt.config import GPTConfig
from models.gpt.presets import GPT2_VOCAB_SIZE, PAPER_SEQ_LENGTH
from tools._cli import ArgumentParser, require, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for flag, default in (("--num-layers", None), ("--hidden-size", None),
                          ("--num-attention-heads", None), ("--seq-length", PAPER_SEQ_LENGTH),
                          ("--vocab-size", GPT2_VOCAB_SIZE), ("--micro-batch-size", 1),
                          ("--tensor-model-parallel-size", 1), ("--data-parallel-size", 1),
                          ("--gradient-accumulation-steps", 1), ("--zero-stage", 0)):
        p.add_argument(flag, type=int, default=default, required=default is None)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="full")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--partition-activations", action="store_true", help="ZeRO-R Pa")
    p.add_argument("--cpu-offload-activations", action="store_true", help="ZeRO-R Pa+cpu")
    p.add_argument("--fused-gradient-buffer", action="store_true",
                   help="baseline fp32 fused gradient buffer instead of ZeRO-R constant buffers")
    p.add_argument("--json", action="store_true")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The model dims through GPTConfig's own checks, then the layout: one error line each."""
    config = GPTConfig(args.num_layers, args.hidden_size, args.num_attention_heads,
                       vocab_size=args.vocab_size, seq_length=args.seq_length)
    for flag in ("micro_batch_size", "tensor_model_parallel_size", "data_parallel_size",
                 "gradient_accumulation_steps"):
        value = getattr(args, flag)
        require(value >= 1, f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    require(args.zero_stage in (0, 1, 2, 3), f"--zero-stage must be 0, 1, 2 or 3, got {args.zero_stage}")
    config.validate_for_tp(args.tensor_model_parallel_size)


def estimate(args: argparse.Namespace) -> dict:
    dims = dict(layers=args.num_layers, hidden=args.hidden_size, seq=args.seq_length,
                vocab=args.vocab_size, micro_batch=args.micro_batch_size,
                tp=args.tensor_model_parallel_size, dp=args.data_parallel_size, stage=args.zero_stage)
    mem = device_memory(**dims, heads=args.num_attention_heads, recompute=args.recompute,
                        sequence_parallel=args.sequence_parallel,
                        partition_activations=args.partition_activations,
                        cpu_offload=args.cpu_offload_activations,
                        bucket_elements=None if args.fused_gradient_buffer else DEFAULT_BUCKET_ELEMENTS)
    it = estimate_iteration(**dims, grad_accumulation=args.gradient_accumulation_steps,
                            recompute=args.recompute,
                            partition_activations=args.partition_activations)
    return {"memory_gb": {**{k: v / GB for k, v in mem.model_states.as_dict().items()
                             if k != "total"},
                          "model_states": mem.model_states.total / GB,
                          "checkpoints": mem.checkpoints / GB, "working_activations": mem.working / GB,
                          "logits": mem.logits / GB, "buffers": mem.buffers / GB,
                          "reserved": mem.reserved / GB, "total": mem.total / GB},
            "fits_32gb_v100": mem.fits(32e9),
            "iteration": {"seconds": it.time_s, "compute_s": it.compute_s, "tp_comm_s": it.tp_comm_s,
                          "dp_comm_exposed_s": it.dp_comm_s, "optimizer_s": it.optimizer_s,
                          "tflops_per_gpu": it.tflops_per_gpu(), "pflops": it.pflops_aggregate(),
                          "tp_crosses_nodes": it.details["tp_crosses_nodes"]}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    result = estimate(args)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    print("memory per GPU (GB):")
    for name, value in result["memory_gb"].items():
        print(f"  {name:20s} {value:8.2f}")
    print(f"  fits a 32 GB V100:   {'yes' if result['fits_32gb_v100'] else 'NO'}")
    print("iteration on DGX-2 V100 nodes (hybrid.perf.throughput):")
    for name, value in result["iteration"].items():
        print(f"  {name:20s} {value if isinstance(value, bool) else round(value, 3)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
