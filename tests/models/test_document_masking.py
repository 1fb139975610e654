"""Issue 31's "document masking equals separate training" at CP 1: with --reset-position-ids and
--reset-attention-mask, the token-weighted loss of a packed batch and every parameter gradient equal
those of its documents run one by one through the single-device oracle (models/gpt/reference.py,
which knows nothing of packing: each document is its own sample, positions from 0), for GPT
(learned positions) and Llama options (rotary, RMSNorm, SwiGLU, GQA, untied). Hard cases: documents
of length 1, a sample with no EOD, a sample that is all EOD, an EOD last. Slow: documents across
the blocked core's query blocks (keys skipped left of each document), and TP 2 with and without
sequence parallelism (each rank's slice of the learned positions, rotary on the gathered sequence)."""

from __future__ import annotations

import pytest
import torch

from hybrid.data.documents import document_ids, reset_position_ids
from hybrid.parallel_state import ParallelState
from models.gpt import sharding
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from models.gpt.token_layout import TokenLayout

EOD, SEED = 1, 99
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             group_query_attention=True, num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
ARCH = {"gpt": {}, "llama": LLAMA}


def _config(arch: str, seq: int) -> GPTConfig:
    return GPTConfig(2, 32, 4, vocab_size=53, seq_length=seq, ffn_hidden_size=48, hidden_dropout=0.0,
                     attention_dropout=0.0, make_vocab_size_divisible_by=1, **ARCH[arch])


def _samples(seq: int, eods: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (never EOD) with EODs at the given indices of each sample, and labels."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 53, (len(eods), seq), generator=gen)
    for row, where in enumerate(eods):
        tokens[row, where] = EOD
    return tokens, torch.randint(0, 53, tokens.shape, generator=gen)


def _documents(row: torch.Tensor) -> list[slice]:
    """Each document's slice of a sample: up to and including its EOD (contract 2)."""
    out, start = [], 0
    for i, t in enumerate(row.tolist()):
        if t == EOD:
            out.append(slice(start, i + 1))
            start = i + 1
    if start < row.numel():
        out.append(slice(start, row.numel()))
    return out


def _packed(config, tokens, labels, state=None, sp=False):
    state = state or ParallelState.single_process()
    model = GPTModel(config, state, sequence_parallel=sp, device="meta")
    model.init_weights(SEED)
    layout = TokenLayout(position_ids=reset_position_ids(tokens, EOD),
                         document_ids=document_ids(tokens, EOD))
    loss = model(tokens, labels, layout=layout).sum() / tokens.numel()   # token-weighted mean
    loss.backward()
    grads = sharding.gather_canonical(config, {n: p.grad for n, p in model.named_parameters()},
                                      state.tp)
    return loss.detach(), grads


def _separate(config, tokens, labels):
    oracle = ReferenceGPT(config)
    oracle.init_weights(SEED)
    total = torch.zeros(())
    for row in range(tokens.size(0)):
        for doc in _documents(tokens[row]):   # one document = one sample of its own length
            total = total + oracle(tokens[row:row + 1, doc], labels[row:row + 1, doc]).sum()
    loss = total / tokens.numel()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in oracle.named_parameters()}


def _check(arch, seq, eods, got_loss=None, got=None):
    config = _config(arch, seq)
    tokens, labels = _samples(seq, eods)
    if got is None:
        got_loss, got = _packed(config, tokens, labels)
    want_loss, want = _separate(config, tokens, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5 * scale + 1e-12,
                                   msg=lambda m: f"{arch}: grad of {name}: {m}")


HARD = [[0, 1, 5, 11, 15],    # documents of length 1 (first, second), 4, 6, an EOD last
        [],                   # no EOD: one document
        list(range(16))]      # all EOD: sixteen documents of length 1


@pytest.mark.parametrize("arch", ARCH)
def test_packed_equals_separate_documents(arch):
    _check(arch, 16, HARD)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCH)
def test_packed_equals_separate_across_query_blocks(arch):
    """s = 160 > 2 blocks of 64: documents of 1, 50, 70, 39 tokens (some cross block borders) and
    one of 160; the blocked core skips the keys before each block's document."""
    _check(arch, 160, [[0, 50, 120], []])


def _tp2_packed(rank, world_size):
    from hybrid.topology import Topology
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    out = []
    for arch in ARCH:
        for sp in (False, True):
            tokens, labels = _samples(16, HARD)
            loss, grads = _packed(_config(arch, 16), tokens, labels, state, sp)
            out.append((arch, sp, loss.numpy(), {n: g.numpy() for n, g in grads.items()}))
    return out


@pytest.mark.slow
def test_packed_equals_separate_at_tp2_with_and_without_sp():
    from hybrid.testing.multirank import run_on_ranks
    results = run_on_ranks(_tp2_packed, 2, timeout=600)
    for arch, sp, loss, grads in results[0]:
        _check(arch, 16, HARD, torch.from_numpy(loss),
               {n: torch.from_numpy(g) for n, g in grads.items()})
