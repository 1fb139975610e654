"""FP8 training of the GPT's transformer layers (issue 36 item 4; docs/fp8.md).

:func:`enable_fp8` gives every column- and row-parallel linear of the transformer layers (QKV,
attention output, MLP in and out, SwiGLU's gate/up included) an
:class:`~hybrid.tensor_parallel.fp8_linear.Fp8Scaling`, so their GEMMs run in fp8. The word
embedding, the output layer (fused with the cross-entropy) and the norms stay in the model's dtype,
as in Transformer Engine and Megatron-LM; with ``first_last_bf16`` (Megatron's
``--first-last-layers-bf16``) the first ``num_at_start`` and last ``num_at_end`` transformer layers
of the whole model stay in bf16 too. The parameters are untouched: masters, optimizer and
checkpoints are the same as without fp8.
"""

from __future__ import annotations

from torch import nn

from hybrid.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from hybrid.tensor_parallel.fp8_linear import Fp8Scaling
from hybrid.tensor_parallel.fp8_scaling import Fp8Recipe


def fp8_layer_indices(num_layers: int, first_last_bf16: bool = False, num_at_start: int = 1,
                      num_at_end: int = 1) -> list[int]:
    """Global indices of the transformer layers whose linears run in fp8."""
    if not first_last_bf16:
        return list(range(num_layers))
    return [i for i in range(num_layers) if num_at_start <= i < num_layers - num_at_end]


def enable_fp8(models: list[nn.Module] | nn.Module, recipe: Fp8Recipe, *,
               first_last_bf16: bool = False, num_at_start: int = 1, num_at_end: int = 1,
               device=None) -> int:
    """Attach FP8 state to the linears of the transformer layers of ``models`` (a GPTModel, or a
    pipeline stage's chunks: their ``layers`` are registered under global indices). ``device``:
    where delayed scaling's amax histories live (default: the model's device). Returns the number
    of fp8 linears on this rank."""
    models = models if isinstance(models, (list, tuple)) else [models]
    count = 0
    for model in models:
        keep = set(fp8_layer_indices(model.config.num_layers, first_last_bf16, num_at_start,
                                     num_at_end))
        where = device if device is not None else model.state.device
        for offset, layer in enumerate(model.layers):
            if model.layers.start + offset not in keep:
                continue
            for module in layer.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.fp8 = Fp8Scaling(recipe, device=where)
                    count += 1
    return count
