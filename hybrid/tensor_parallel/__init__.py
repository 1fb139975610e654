"""Tensor (intra-layer) model parallelism of Megatron-LM §3, with sequence parallelism (Korthikanti
et al. 2022): autograd communication operators, column/row-parallel linears, the vocab-parallel
embedding and cross-entropy (alone or fused with the output layer), TP-independent initialisation
and the TP random-number streams."""

from hybrid.tensor_parallel.async_linear import column_parallel_linear
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from hybrid.tensor_parallel.init import full_init, shard
from hybrid.tensor_parallel.layers import (ColumnParallelLinear, LayerNorm, RMSNorm,
                                           RowParallelLinear, VocabParallelEmbedding,
                                           VocabParallelOutput, set_tp_attributes)
from hybrid.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence, gather_from_tp,
                                             gather_sequence_replicated, reduce_from_tp,
                                             reduce_scatter_to_sequence,
                                             scatter_to_sequence, scatter_to_tp)
from hybrid.tensor_parallel.random import RNGStates, RNGTracker

__all__ = [
    "ColumnParallelLinear", "LayerNorm", "RMSNorm", "RNGStates", "RNGTracker", "RowParallelLinear",
    "VocabParallelEmbedding", "VocabParallelOutput", "column_parallel_linear", "copy_to_tp",
    "full_init", "gather_from_sequence", "gather_from_tp", "gather_sequence_replicated",
    "linear_cross_entropy",
    "reduce_from_tp", "reduce_scatter_to_sequence", "scatter_to_sequence", "scatter_to_tp",
    "set_tp_attributes", "shard", "vocab_parallel_cross_entropy",
]
