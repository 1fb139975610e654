"""The GPT data pipeline (Megatron-LM's): sentencepiece tokenizer, indexed .bin/.idx datasets,
GPT samples across document boundaries, weighted blending, a consumed-samples DP sampler, a
prefetching loader (``hybrid.data.loader``, which imports torch) and the embedded default corpus.
"""

from hybrid.data.blending import BlendedDataset, parse_data_path
from hybrid.data.builder import build_gpt_datasets
from hybrid.data.default_corpus import ensure_default_dataset
from hybrid.data.gpt_dataset import GPTDataset, parse_split
from hybrid.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from hybrid.data.sampler import PretrainingSampler
from hybrid.data.tokenizer import Tokenizer

__all__ = ["BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetError",
           "IndexedDatasetWriter", "PretrainingSampler", "Tokenizer", "build_gpt_datasets",
           "ensure_default_dataset", "parse_data_path", "parse_split"]
