"""Fused work under ``--compile`` (issue 36 item 5; docs/compile.md "Fused regions"): at TP 1 a whole
transformer layer traces into ONE graph, so inductor fuses its elementwise work (norm + residual
add, GELU or SwiGLU's ``silu(gate) * up``, the rotary rotation with its cos/sin table, bias adds)
around the GEMMs; an FP8 layer (tensorwise) as well. Checked with ``torch._dynamo.explain``
(tracing only, no inductor compile: seconds, not minutes); compiled-vs-eager numerics of the
layers are tests/models/test_compile_layers.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel.fp8_linear import Fp8Scaling
from hybrid.tensor_parallel.fp8_scaling import Fp8Recipe
from models.gpt import GPTConfig
from models.gpt.layer import TransformerLayer

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             add_bias_linear=False, group_query_attention=True, num_query_groups=2)


def _graphs(options: dict, fp8: bool = False):
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64,
                       seq_length=16, hidden_dropout=0.0, attention_dropout=0.0, **options)
    layer = TransformerLayer(config, ParallelState.single_process().tp, dtype=torch.bfloat16)
    if fp8:
        for module in (layer.attn.qkv, layer.attn.proj, layer.mlp.fc1, layer.mlp.fc2):
            module.fp8 = Fp8Scaling(Fp8Recipe(recipe="tensorwise"))
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer.forward)(x)
    torch._dynamo.reset()
    return explained.graph_count, [str(b.reason) for b in explained.break_reasons]


@pytest.mark.slow   # dynamo traces three layers: over a minute on the shared CI cores
def test_gpt2_llama_and_fp8_layers_trace_into_one_graph():
    for options, fp8 in (({}, False), (LLAMA, False), (LLAMA, True)):
        count, breaks = _graphs(options, fp8)
        assert (count, breaks) == (1, []), (options, fp8, breaks)
