"""Megatron-core's side of tests/checkpoint/test_import_megatron.py: run inside the megatron-core environment
(tests/checkpoint/megatron_env.py puts the package on the path), never imported by the test process itself.

    python tests/checkpoint/megatron_writer.py OUT

Builds a tiny GPT (LayerNorm, GELU, learned positions, tied output) or Llama-style model (RMSNorm,
SwiGLU, grouped-query attention, rotary positions, untied output, no biases) with megatron-core's
local (Transformer-Engine-free) layer spec at TP 2 - two CPU ranks on gloo - and writes, for
KIND in gpt and llama:

    OUT/KIND/torch_dist/iter_0000007/...          megatron.core.dist_checkpointing.save of the sharded
    OUT/KIND/torch_dist/latest_checkpointed_iteration.txt   state dict, args / iteration in common.pt
    OUT/KIND/torch_dist_per_layer/...             the same with metadata singleton_local_shards:
                                                  one key per layer, SwiGLU halves as _w / _v keys
    OUT/KIND/legacy/iter_0000007/mp_rank_0R/model_optim_rng.pt   Megatron-LM's legacy per-rank file
    OUT/KIND/legacy/latest_checkpointed_iteration.txt
    OUT/KIND/held_rank_R.safetensors              each rank's local parameters, as megatron held them
    OUT/KIND/logits.safetensors                   tokens and megatron-core's full-vocab logits
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import save_file

warnings.filterwarnings("ignore")   # megatron-core's notes that apex / TE are absent

TP, ITERATION, SEQ, VOCAB = 2, 7, 8, 100
SHAPES = {   # tiny models: (layers, hidden, heads, query groups, ffn)
    "gpt": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                ffn_hidden_size=64),
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48),
}


def megatron_args(kind: str) -> argparse.Namespace:
    """The fields of Megatron-LM's training arguments a checkpoint's ``args`` holds for this model."""
    llama = kind == "llama"
    return argparse.Namespace(
        **SHAPES[kind], seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=2, tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        group_query_attention=llama, kv_channels=8,
        position_embedding_type="rope" if llama else "learned_absolute", rotary_base=10000,
        rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False,
        normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=1e-5, swiglu=llama,
        openai_gelu=not llama, squared_relu=False, add_bias_linear=not llama, add_qkv_bias=False,
        untie_embeddings_and_output_weights=llama, qk_layernorm=False, num_experts=None,
        apply_layernorm_1p=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, params_dtype=torch.float32, ckpt_format="torch_dist",
        transformer_impl="local")


def build(kind: str, args: argparse.Namespace):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, tensor_model_parallel_size=TP,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else openai_gelu,
        add_bias_linear=args.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=args.init_method_std)
    return GPTModel(config, get_gpt_layer_local_spec(normalization=args.normalization),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, parallel_output=False)


def randomize(model, rank: int) -> None:
    """Every parameter random (norm gains and biases too, so no value is a trivial 0 or 1); a
    replicated parameter gets the same values on every TP rank, a sharded one its own."""
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            sharded = param_is_not_tensor_parallel_duplicate(p) and getattr(p, "tensor_model_parallel", False)
            gen = torch.Generator().manual_seed(1000 * i + (rank if sharded else 0))
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def run_rank(rank: int, out: str, init_file: str) -> None:
    # megatron-core's torch_dist writer assumes CUDA: it calls torch.cuda.synchronize() before
    # copying the tensors it saves, and all-reduces its failure flags on torch.cuda.current_device().
    # On a CPU-only torch both raise; there is nothing to wait for, and gloo reduces on the CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=timedelta(seconds=300))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    # attention dropout runs inside the tracker's CUDA RNG stream (model_parallel_cuda_manual_seed
    # needs CUDA); dropout is off here, so the stream is not needed
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    for kind in SHAPES:
        write_model(rank, Path(out) / kind, kind)
    dist.destroy_process_group()


def write_model(rank: int, out: Path, kind: str) -> None:
    from megatron.core import dist_checkpointing

    args = megatron_args(kind)
    model = build(kind, args).eval()
    randomize(model, rank)
    if rank == 0:
        out.mkdir(parents=True)
    dist.barrier()
    held = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    save_file(held, str(out / f"held_rank_{rank}.safetensors"))

    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    for fmt, metadata in (("torch_dist", None), ("torch_dist_per_layer", {"singleton_local_shards": True})):
        dist_dir = out / fmt / f"iter_{ITERATION:07d}"
        if rank == 0:
            dist_dir.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save({**common, "model": model.sharded_state_dict(metadata=metadata)},
                                str(dist_dir))

    legacy_dir = out / "legacy" / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}"
    legacy_dir.mkdir(parents=True)
    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state()}]
    torch.save({**common, "model": model.state_dict_for_save_checkpoint(), "rng_state": rng_state},
               legacy_dir / "model_optim_rng.pt")

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]   # True: masked (future)
    with torch.no_grad():
        logits = model(tokens, positions, mask)                          # [b, s, V] (gathered)
    if rank == 0:
        save_file({"tokens": tokens, "logits": logits.contiguous()}, str(out / "logits.safetensors"))
        for fmt in ("torch_dist", "torch_dist_per_layer", "legacy"):
            (out / fmt / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()


def main() -> None:
    out = sys.argv[1]
    Path(out).mkdir(parents=True, exist_ok=True)
    init_file = str(Path(out) / ".gloo_init")
    mp.spawn(run_rank, args=(out, init_file), nprocs=TP, join=True)


if __name__ == "__main__":
    main()
