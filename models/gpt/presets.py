"""Named GPT presets: small CPU models, the Llama family, and the paper's experiment rows as data.

- ``PRESETS``: model configs by name ("tiny", "small", "tiny-llama" for CPU runs; "gpt2-1.5B",
  "llama2-7B", "llama3-8B", ...). The Llama presets use the published architectures (Touvron et
  al. 2023 "Llama 2", Table 1 and the released configs; Meta's Llama 3 / 3.1 model card): rotary
  positions, RMSNorm (eps 1e-5), SwiGLU with the released FFN sizes, no biases, untied output
  layer, grouped-query attention with 8 groups for Llama-2 70B and all of Llama 3, Llama-3.1's
  rope scaling; their parameter counts equal the published ones exactly.
- Mixture of experts (issue 32): "mixtral-8x7b" (MixtralForCausalLM) and "qwen1.5-moe-a2.7b"
  (Qwen2MoeForCausalLM: fine-grained and shared experts), at full size, whose total and active
  parameter counts equal those of transformers' models of the released configs exactly.
- ``PAPER_RUNS``: every row of ZeRO Table 5 (Figure 2 throughput comparison; a ZeRO row and a Megatron
  baseline row per size), Table 6 (60B superlinear scaling) and Table 10 (data-parallel only) as a
  :class:`PaperRun` with its GPU count, model-parallel degree, batch per replica and total batch.
  Numbers are copied from docs/design.md §Paper; seq 1024 and the GPT-2 vocab 50257 are the paper's stated values.

Look up with :func:`get_config` and :func:`get_paper_run`; names are listed by :func:`paper_run_names`.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.gpt.config import ConfigError, GPTConfig

PAPER_SEQ_LENGTH = 1024
GPT2_VOCAB_SIZE = 50257


@dataclass(frozen=True)
class PaperRun:
    """One row of a paper table: the model plus how it was laid out on the cluster."""

    name: str             # e.g. "table5-zero-100B", "table5-megatron-40B", "table6-60B-64gpus"
    table: str            # "table5" | "table6" | "table10"
    size_label: str       # the paper's size label, e.g. "100B"
    config: GPTConfig
    gpus: int
    tp: int               # the paper's MP degree
    micro_batch: int      # batch per data-parallel replica
    global_batch: int
    zero: bool            # ZeRO run (True) or Megatron baseline (False)

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def label_parameters(self) -> float:
        """The size label as a number of parameters ("1.5B" -> 1.5e9)."""
        return float(self.size_label.rstrip("B")) * 1e9


def _model(layers: int, hidden: int, heads: int) -> GPTConfig:
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     vocab_size=GPT2_VOCAB_SIZE, seq_length=PAPER_SEQ_LENGTH)


# Table 5: size -> (ZeRO row, Megatron baseline row), each GPUs/MP/layers/hidden/heads/batch/total.
_TABLE5 = {
    "1.5B": ((400, 1, 48, 1600, 16, 24, 9600), (400, 2, 48, 1600, 16, 16, 3200)),
    "8B": ((400, 4, 72, 3072, 24, 64, 6400), (400, 8, 72, 3072, 24, 8, 400)),
    "40B": ((400, 4, 88, 6144, 32, 12, 1200), (384, 32, 88, 6144, 64, 4, 48)),
    "60B": ((400, 16, 132, 6144, 32, 64, 1600), (384, 64, 132, 6144, 64, 4, 24)),
    "80B": ((400, 16, 100, 8192, 64, 32, 800), (384, 128, 100, 8192, 128, 4, 12)),
    "100B": ((400, 16, 125, 8192, 64, 32, 800), (384, 128, 125, 8192, 128, 2, 6)),
    "120B": ((400, 16, 150, 8192, 64, 24, 600), (384, 128, 150, 8192, 128, 2, 6)),
    "140B": ((400, 16, 175, 8192, 64, 16, 400), (384, 128, 175, 8192, 128, 2, 6)),
    "170B": ((400, 16, 212, 8192, 64, 12, 300), (256, 256, 212, 8192, 256, 2, 2)),
}

# Table 6: 60B, MP 16, 75 layers, hidden 8192, 32 heads; GPUs -> (batch per replica, total batch).
_TABLE6 = {64: (16, 64), 128: (48, 384), 256: (48, 768), 400: (64, 1600)}

# Table 10: data parallel only, 128 GPUs, MP 1: size -> (layers, hidden, heads, batch per replica).
_TABLE10 = {
    "1.5B": (34, 1920, 16, 24), "2.5B": (54, 1920, 16, 24), "4B": (64, 2304, 24, 16),
    "6B": (52, 3072, 24, 12), "8B": (72, 3072, 24, 8), "10B": (50, 4096, 32, 6),
    "11B": (54, 4096, 32, 4), "12B": (58, 4096, 32, 4), "13B": (62, 4096, 32, 2),
}


def _table5_runs() -> list[PaperRun]:
    runs = []
    for size, rows in _TABLE5.items():
        for zero, (gpus, mp, layers, hidden, heads, mb, gb) in zip((True, False), rows):
            kind = "zero" if zero else "megatron"
            runs.append(PaperRun(f"table5-{kind}-{size}", "table5", size, _model(layers, hidden, heads),
                                 gpus, mp, mb, gb, zero))
    return runs


def _table6_runs() -> list[PaperRun]:
    return [PaperRun(f"table6-60B-{gpus}gpus", "table6", "60B", _model(75, 8192, 32), gpus, 16, mb, gb,
                     True)
            for gpus, (mb, gb) in _TABLE6.items()]


def _table10_runs() -> list[PaperRun]:
    return [PaperRun(f"table10-{size}", "table10", size, _model(layers, hidden, heads), 128, 1, mb,
                     mb * 128, True)
            for size, (layers, hidden, heads, mb) in _TABLE10.items()]


PAPER_RUNS: dict[str, PaperRun] = {r.name: r for r in
                                   _table5_runs() + _table6_runs() + _table10_runs()}

def _llama(layers: int, hidden: int, heads: int, ffn: int, *, vocab: int, seq: int,
           query_groups: int | None = None, rotary_base: float = 10000.0,
           rope_scaling: bool = False) -> GPTConfig:
    """A Llama-architecture config (no dropout, as Meta trained them)."""
    gqa = dict(group_query_attention=True, num_query_groups=query_groups) if query_groups else {}
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     ffn_hidden_size=ffn, vocab_size=vocab, seq_length=seq,
                     hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                     rotary_base=rotary_base, use_rope_scaling=rope_scaling, normalization="RMSNorm",
                     norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                     untie_embeddings_and_output_weights=True, **gqa)


LLAMA2_VOCAB, LLAMA3_VOCAB = 32000, 128256
_LLAMA2 = dict(vocab=LLAMA2_VOCAB, seq=4096)
_LLAMA3 = dict(vocab=LLAMA3_VOCAB, seq=8192, query_groups=8, rotary_base=500000.0, rope_scaling=True)

LLAMA_PRESETS: dict[str, GPTConfig] = {
    "llama2-7B": _llama(32, 4096, 32, 11008, **_LLAMA2),
    "llama2-13B": _llama(40, 5120, 40, 13824, **_LLAMA2),
    "llama2-70B": _llama(80, 8192, 64, 28672, query_groups=8, **_LLAMA2),
    "llama3-8B": _llama(32, 4096, 32, 14336, **_LLAMA3),
    "llama3-70B": _llama(80, 8192, 64, 28672, **_LLAMA3),
    # CPU: every Llama option at a size that trains in minutes (4 heads in 2 groups: TP 1 or 2)
    "tiny-llama": GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=2048,
                            seq_length=128, make_vocab_size_divisible_by=64,
                            position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                            group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                            untie_embeddings_and_output_weights=True),
}

def _mixtral_8x7b() -> GPTConfig:
    """Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1; the released config.json):
    Mistral-7B's attention (32 heads, 8 key/value groups, rotary base 1e6, 32k positions) and in
    every layer 8 SwiGLU experts of width 14336, top-2 (top-k of the logits, softmax over the k)."""
    return _llama(32, 4096, 32, 14336, vocab=LLAMA2_VOCAB, seq=4096, query_groups=8,
                  rotary_base=1e6).replace(max_position_embeddings=32768, num_experts=8,
                                           moe_router_topk=2, moe_router_pre_softmax=False)


def _qwen15_moe_a27b() -> GPTConfig:
    """Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM, the released config.json): 24 layers of 16 heads with
    QKV biases, 60 fine-grained experts of width 1408, top-4 (softmax over all 60, then the top 4,
    not renormalised: norm_topk_prob false), a shared expert of width 5632 behind a sigmoid gate in
    every layer; vocab 151936, RMSNorm eps 1e-6, rotary base 1e6, 8192 positions."""
    return GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                     vocab_size=151936, seq_length=4096, max_position_embeddings=8192,
                     hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                     rotary_base=1e6, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                     add_bias_linear=False, add_qkv_bias=True,
                     untie_embeddings_and_output_weights=True, num_experts=60, moe_router_topk=4,
                     moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=5632,
                     moe_shared_expert_gate=True, moe_router_pre_softmax=True)


# Mixture-of-experts models at full size (issue 32); parameter counts equal transformers' exactly
# (tests/models/test_moe_presets.py): total / active
MOE_PRESETS: dict[str, GPTConfig] = {
    "mixtral-8x7b": _mixtral_8x7b(),             # 46,702,792,704 / 12,879,925,248
    "qwen1.5-moe-a2.7b": _qwen15_moe_a27b(),     # 14,315,784,192 /  2,689,173,504
}

PRESETS: dict[str, GPTConfig] = {
    # CPU presets: quick tests and the default pretraining run on the embedded corpus.
    "tiny": GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512,
                      seq_length=64, make_vocab_size_divisible_by=64),
    "small": GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=4096,
                       seq_length=128, make_vocab_size_divisible_by=64),
    # GPT-2 family, seq 1024 (the ZeRO paper's 1.5B is Table 5's 48 x 1600).
    "gpt2-small": _model(12, 768, 12),
    "gpt2-medium": _model(24, 1024, 16),
    "gpt2-large": _model(36, 1280, 20),
    "gpt2-1.5B": _model(48, 1600, 16),
    # The ZeRO-100B headline model (Table 5, 125 x 8192, 64 heads) and the 170B one.
    "zero-100B": PAPER_RUNS["table5-zero-100B"].config,
    "zero-170B": PAPER_RUNS["table5-zero-170B"].config,
    **LLAMA_PRESETS,
    **MOE_PRESETS,
}


def get_config(name: str) -> GPTConfig:
    """A model preset by name; paper run names (e.g. "table5-zero-40B") work too."""
    if name in PRESETS:
        return PRESETS[name]
    if name in PAPER_RUNS:
        return PAPER_RUNS[name].config
    raise ConfigError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)} or a paper run "
                      f"({', '.join(paper_run_names())})")


def get_paper_run(name: str) -> PaperRun:
    """A paper table row by name, e.g. "table5-zero-100B", "table5-megatron-40B", "table10-13B"."""
    try:
        return PAPER_RUNS[name]
    except KeyError:
        raise ConfigError(f"unknown paper run {name!r}; choose one of {', '.join(paper_run_names())}") \
            from None


def paper_run_names(table: str | None = None) -> list[str]:
    return [n for n, r in PAPER_RUNS.items() if table is None or r.table == table]


def table5(size: str, zero: bool = True) -> PaperRun:
    """The Table 5 row of ``size`` ("1.5B" ... "170B"): the ZeRO run or the Megatron baseline."""
    return get_paper_run(f"table5-{'zero' if zero else 'megatron'}-{size}")
