"""The benchmark GPT rebuilt from the peers' tensor-parallel building blocks.

Same architecture and arithmetic as models/gpt (GPT-2, pre-LN, fused attention through SDPA, GELU
4h MLP, learned positions), so step times compare like with like:
- ``DTensorGPT``: plain torch modules ([b, s, h]) to be parallelised with torch's
  ``parallelize_module`` (separate q/k/v projections so column sharding splits whole heads; an untied
  output head, because ``parallelize_module`` cannot shard one weight for two uses).
- ``McoreGPT``: megatron-core's ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding and
  vocab-parallel cross-entropy in Megatron's [s, b, h] layout, tied output as in Megatron.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _DTensorBlock(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        # after column sharding each projection yields this rank's heads: [b, s, h/tp]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(y), self.k(y), self.v(y)))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # [b, a/tp, s, d]
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class DTensorGPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(_DTensorBlock(h, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe.weight[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                        # [b, s, V] (sharded)


def parallelize_dtensor_gpt(model: DTensorGPT, mesh) -> DTensorGPT:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("proj", "fc2")})
    return parallelize_module(model, mesh, plan)


def dtensor_loss(model: DTensorGPT, tokens: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel
    logits = model(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    return loss


class _McoreBlock(nn.Module):
    def __init__(self, h: int, heads: int, tp: int, cfg):
        super().__init__()
        from megatron.core import tensor_parallel as mtp
        init = nn.init.xavier_normal_
        self.local_heads, self.head_dim = heads // tp, h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = mtp.ColumnParallelLinear(h, 3 * h, config=cfg, init_method=init, bias=True, gather_output=False)
        self.proj = mtp.RowParallelLinear(h, h, config=cfg, init_method=init, bias=True,
                                          input_is_parallel=True, skip_bias_add=False)
        self.fc1 = mtp.ColumnParallelLinear(h, 4 * h, config=cfg, init_method=init, bias=True, gather_output=False)
        self.fc2 = mtp.RowParallelLinear(4 * h, h, config=cfg, init_method=init, bias=True,
                                         input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv, _ = self.qkv(self.ln1(x))                                        # [s, b, 3h/tp]
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).unbind(3)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))                  # [b, a/tp, s, d]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out, _ = self.proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))
        x = x + out
        h1, _ = self.fc1(self.ln2(x))
        out, _ = self.fc2(F.gelu(h1, approximate="tanh"))
        return x + out


class McoreGPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int, tp: int):
        super().__init__()
        from megatron.core import tensor_parallel as mtp
        from megatron.core.model_parallel_config import ModelParallelConfig
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                  params_dtype=torch.float32)
        self.wte = mtp.VocabParallelEmbedding(vocab, h, init_method=nn.init.xavier_normal_, config=cfg)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(_McoreBlock(h, heads, tp, cfg) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as mtp
        t = tokens.t().contiguous()                                           # [s, b]
        x = self.wte(t) + self.wpe.weight[: t.size(0)].unsqueeze(1)           # [s, b, h]
        for block in self.blocks:
            x = block(x)
        x = mtp.copy_to_tensor_model_parallel_region(self.ln_f(x))
        logits = F.linear(x, self.wte.weight)                                 # [s, b, V/tp]
        return mtp.vocab_parallel_cross_entropy(logits, t).mean()
