"""The GPT data pipeline (Megatron-LM's): tokenizers (sentencepiece, tokenizer.json, Megatron's
--tokenizer-type names), indexed .bin/.idx datasets, GPT samples across document boundaries,
weighted blending, a consumed-samples DP sampler, a prefetching loader (``hybrid.data.loader``,
which imports torch) and the embedded default corpus.
"""

from hybrid.data.blending import BlendedDataset, parse_data_path
from hybrid.data.builder import build_gpt_datasets
from hybrid.data.default_corpus import ensure_default_dataset
from hybrid.data.gpt_dataset import GPTDataset, parse_split
from hybrid.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from hybrid.data.sampler import PretrainingSampler
from hybrid.data.tokenizer import Tokenizer
from hybrid.data.tokenizer_types import (MEGATRON_TOKENIZER_TYPES, NullTokenizer, TokenizerSpec,
                                         build_tokenizer)

__all__ = ["BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetError",
           "IndexedDatasetWriter", "MEGATRON_TOKENIZER_TYPES", "NullTokenizer", "PretrainingSampler",
           "Tokenizer", "TokenizerSpec", "build_gpt_datasets", "build_tokenizer",
           "ensure_default_dataset", "parse_data_path", "parse_split"]
