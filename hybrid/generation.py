"""Autoregressive sampling from a tensor-parallel GPT (GPT-2 §2 decoding; Megatron-LM's text
generation over vocab-parallel logits).

With a model that offers a key/value cache (``model.new_kv_cache()``, models/gpt/kv_cache.py) the
prompt runs once and every further step feeds only the newest token; otherwise (or with
``use_cache=False``) each step runs the whole context. Either way the step takes this rank's vocab
slice of the logits at the *last* position only, ``[b, V_padded/tp]``, and all-gathers it over the TP group into ``[b, V_padded]``
(through :mod:`hybrid.comm`, so the volume is in the ledger); padding columns are dropped. Every TP
rank then holds bit-identical logits and draws from its own ``torch.Generator`` seeded with the same
seed, so all ranks pick the same token without a broadcast. A one-process model (TP 1) takes the
same path with a size-1 group.

Sampling: ``temperature == 0`` is greedy (argmax); otherwise logits / temperature, then top-k (keep
the k largest) and top-p / nucleus (keep the smallest set of tokens whose probability reaches p,
Holtzman et al. 2020), then one multinomial draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid import comm
from hybrid.comm import Group


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token; ``temperature=0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0          # 0: no top-k filtering
    top_p: float = 1.0      # 1.0: no nucleus filtering
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row ``[n, V]``, set the rest to -inf (k=0: unchanged).
    Ties at the k-th value are all kept."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]                     # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering of each row ``[n, V]``: keep the most probable tokens, in order, until
    their cumulative probability reaches ``p`` (at least one token); -inf elsewhere."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)       # [n, V]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs        # mass of the strictly more probable tokens
    drop_sorted = before >= p                    # the first token always has before = 0 < p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids ``[n]`` from full-vocab logits ``[n, V]`` (fp32)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits / params.temperature, params.top_k), params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def gather_vocab(local: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """Vocab-parallel logits ``[n, V_padded/tp]`` of this rank -> full ``[n, vocab_size]`` on every
    TP rank (one all-gather; padding columns dropped)."""
    if group.size > 1:
        shard = local.t().contiguous()                                     # [V_p/tp, n]
        full = shard.new_empty(group.size * shard.size(0), shard.size(1))   # [V_p, n]
        comm.all_gather_into(full, shard, group)
        local = full.t()
    return local[:, :vocab_size]


@torch.no_grad()
def last_token_logits(model, tokens: torch.Tensor, cache=None) -> torch.Tensor:
    """Full-vocab fp32 logits ``[b, V]`` at the last position of ``tokens [b, s]`` (which continue
    ``cache``'s positions when given)."""
    out = model(tokens) if cache is None else model(tokens, cache=cache)
    local = out[:, -1, :].float()                                          # [b, V_p/tp]
    return gather_vocab(local, model.group, model.config.vocab_size)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams = SamplingParams(),
             *, eod: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """Extend ``prompt [b, s0]`` (int64 ids, same on every TP rank) by up to ``max_new_tokens``;
    returns ``[b, s0 + n]``. A row that produced ``eod`` keeps emitting ``eod``; generation stops
    when every row has. Contexts longer than the model's positions keep their newest tokens (with a
    cache: the window's cache is rebuilt from them, so results equal the uncached ones)."""
    if prompt.dim() != 2 or prompt.size(1) == 0:
        raise ValueError(f"prompt must be [batch, seq>0] token ids, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(params.seed)
    tokens = prompt.to(device)
    done = torch.zeros(tokens.size(0), dtype=torch.bool, device=device)
    window = model.config.max_position_embeddings
    cached = use_cache and hasattr(model, "new_kv_cache") and not getattr(model, "sequence_parallel", False)
    cache = None
    for _ in range(max_new_tokens):
        if not cached:
            logits = last_token_logits(model, tokens[:, -window:])
        elif cache is None or cache.length == window:   # first step, or the window slides
            cache = model.new_kv_cache()
            logits = last_token_logits(model, tokens[:, -window:], cache)
        else:
            logits = last_token_logits(model, tokens[:, -1:], cache)
        nxt = sample_next(logits, params, generator)                        # [b]
        if eod is not None:
            nxt = nxt.masked_fill(done, eod)
            done |= nxt == eod
        tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
        if eod is not None and bool(done.all()):
            break
    model.train(was_training)
    return tokens
