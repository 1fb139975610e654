"""The per-forward TokenLayout (issue 31) carried through the GPT model on one rank: the identity
layout equals no layout, positions and documents reach the embedding, rotary and every layer, every
recompute mode reproduces the plain run bit for bit on the new paths, pipeline chunks pass it on, the
CP branch calls the context-parallel entry point, and a compiled layer takes it like the eager one.
Packed = separate training (the oracle): tests/models/test_document_masking.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.tensor_parallel import RNGTracker
from models.gpt.config import GPTConfig
from models.gpt.document_attention import document_attention
from models.gpt.model import GPTModel
from models.gpt.token_layout import TokenLayout

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             group_query_attention=True, num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
ARCH = {"gpt": {}, "llama": LLAMA}
B, S = 2, 24
EOD = 3


def _config(arch: str, dropout: float = 0.0, layers: int = 2) -> GPTConfig:
    return GPTConfig(layers, 32, 4, vocab_size=61, seq_length=S, ffn_hidden_size=48,
                     hidden_dropout=dropout, attention_dropout=dropout,
                     make_vocab_size_divisible_by=1, **ARCH[arch])


def _packed_batch():
    """Tokens with EODs (documents of 1, 5, ... tokens), per contract 2's positions and documents."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, 61, (B, S), generator=gen)
    tokens[0, [0, 6, 13]] = EOD        # sample 0: a document of length 1 first
    tokens[1, [9, 10]] = EOD           # sample 1: a document that is only its EOD
    labels = torch.randint(0, 61, (B, S), generator=gen)
    eod = (tokens == EOD).long()
    documents = eod.cumsum(1) - eod                                     # EODs strictly before t
    index = torch.arange(S).expand(B, S)
    starts = torch.zeros_like(tokens)
    for b in range(B):
        for t in range(1, S):
            starts[b, t] = t if eod[b, t - 1] else starts[b, t - 1]
    return tokens, labels, TokenLayout(position_ids=index - starts, document_ids=documents)


def _loss_and_grads(model, tokens, labels, layout):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels, layout=layout).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model(config, recompute=None, seed=11):
    rng = RNGTracker(17, 0)
    rng.seed_all()
    model = GPTModel(config, ParallelState.single_process(), rng=rng, recompute=recompute,
                     device="meta")
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("arch", ARCH)
def test_identity_layout_equals_no_layout(arch):
    """Positions 0..s-1 and one document: the same loss and gradients as the default path (the
    document core and per-token rotary angles agree with the causal core and the cached table)."""
    config = _config(arch)
    model = _model(config)
    tokens, labels, _ = _packed_batch()
    plain = _loss_and_grads(model, tokens, labels, None)
    index, one_document = torch.arange(S).expand(B, S), torch.zeros(B, S, dtype=torch.long)
    for layout in (TokenLayout(position_ids=index), TokenLayout(document_ids=one_document),
                   TokenLayout(position_ids=index, document_ids=one_document)):
        got = _loss_and_grads(model, tokens, labels, layout)
        torch.testing.assert_close(got[0], plain[0], rtol=1e-5, atol=1e-5)
        for name in plain[1]:
            torch.testing.assert_close(got[1][name], plain[1][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{arch} {layout}: {name}: {m}")
    assert TokenLayout().is_plain()


@pytest.mark.parametrize("arch", ARCH)
def test_positions_and_documents_change_the_function(arch):
    """Each field reaches the model: resetting positions changes the loss, and so do documents."""
    model = _model(_config(arch))
    tokens, labels, packed = _packed_batch()
    with torch.no_grad():
        plain = model(tokens, labels).sum()
        positions = model(tokens, labels, layout=TokenLayout(position_ids=packed.position_ids)).sum()
        documents = model(tokens, labels, layout=TokenLayout(document_ids=packed.document_ids)).sum()
    assert len({float(plain), float(positions), float(documents)}) == 3


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_on_the_layout_paths(mode):
    """With dropout on, selective (the document core through the checkpoint) and full recompute
    give the no-recompute loss and gradients bit for bit."""
    config = _config("llama", dropout=0.1)
    tokens, labels, layout = _packed_batch()
    ref = _loss_and_grads(_model(config), tokens, labels, layout)
    got = _loss_and_grads(_model(config, RecomputePlan.uniform(mode, config.num_layers)), tokens,
                          labels, layout)
    assert torch.equal(got[0], ref[0])
    for name in ref[1]:
        assert torch.equal(got[1][name], ref[1][name]), name


def test_pipeline_chunks_pass_the_layout():
    """Two stages (embedding + layer 0, layer 1 + output) with the layout = the whole model."""
    config = _config("gpt")
    tokens, labels, layout = _packed_batch()
    whole = _model(config)
    want = whole(tokens, labels, layout=layout)
    state = ParallelState.single_process()
    first = GPTModel(config, state, device="meta", layers=(0, 1), post_process=False)
    last = GPTModel(config, state, device="meta", layers=(1, 2), pre_process=False)
    for chunk in (first, last):
        chunk.init_weights(11)
    hidden = first(tokens, layout=layout)
    got = last(tokens, labels, hidden_states=hidden, layout=layout)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_context_parallel_branch_calls_the_cp_entry_point(monkeypatch):
    """A CP group of two ranks routes the core to context_parallel_attention with the contract's
    arguments (a stand-in module here; the real one: hybrid/context_parallel/attention.py)."""
    calls = []

    def fake(q, k, v, *, group, comm_type, token_index, document_ids=None, compute_dtype=None):
        calls.append((q.shape, k.shape, group, comm_type, token_index, document_ids))
        return document_attention(q, k, v, document_ids, compute_dtype=compute_dtype)

    module = types.ModuleType("hybrid.context_parallel.attention")
    module.context_parallel_attention = fake
    monkeypatch.setitem(sys.modules, "hybrid.context_parallel.attention", module)
    config = _config("llama")
    tokens, labels, packed = _packed_batch()
    group = types.SimpleNamespace(size=2)
    layout = TokenLayout(position_ids=packed.position_ids, document_ids=packed.document_ids,
                         token_index=torch.arange(S), cp_group=group, cp_comm_type="a2a")
    model = _model(config)
    got = model(tokens, labels, layout=layout)
    assert len(calls) == config.num_layers
    qs, ks, g, comm, index, docs = calls[0]
    assert qs == (B, 4, S, 8) and ks == (B, 2, S, 8) and g is group and comm == "a2a"
    assert index is layout.token_index and docs is packed.document_ids
    torch.testing.assert_close(got, model(tokens, labels, layout=packed), rtol=0, atol=0)


def test_bad_layouts_are_one_clear_error():
    model = _model(_config("gpt"))
    tokens, labels, packed = _packed_batch()
    with pytest.raises(ValueError, match="position_ids has shape"):
        model(tokens, labels, layout=TokenLayout(position_ids=packed.position_ids[:, :5]))
    with pytest.raises(ValueError, match="max position embeddings"):
        model(tokens, labels, layout=TokenLayout(position_ids=packed.position_ids + 10_000))
    with pytest.raises(ValueError, match="cp_comm_type"):
        model(tokens, labels, layout=TokenLayout(document_ids=packed.document_ids,
                                                 cp_comm_type="ring"))


@pytest.mark.slow
def test_compiled_layers_take_the_layout(tmp_path):
    """A --compile model with a packed layout gives the eager loss and gradients."""
    from models.gpt.compile import compile_layers
    config = _config("llama")
    tokens, labels, layout = _packed_batch()
    ref = _loss_and_grads(_model(config), tokens, labels, layout)
    model = _model(config)
    compile_layers(model, cache_dir=tmp_path)
    got = _loss_and_grads(model, tokens, labels, layout)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-4, atol=1e-5)
