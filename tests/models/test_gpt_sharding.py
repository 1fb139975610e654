"""Canonical GPT layout, its TP sharding and the single-device reference (no process groups)."""

import math

import torch

from models.gpt import sharding
from models.gpt.presets import PRESETS
from models.gpt.reference import ReferenceGPT

CFG = PRESETS["tiny"].replace(vocab_size=250, make_vocab_size_divisible_by=1, hidden_dropout=0.0,
                              attention_dropout=0.0)


def _reference(seed=3):
    model = ReferenceGPT(CFG)
    model.init_weights(seed)
    return model


def test_state_dict_is_the_canonical_layout():
    sd = _reference().state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == sharding.canonical_shapes(CFG)
    assert sum(v.numel() for v in sd.values()) == CFG.num_parameters() - \
        (CFG.padded_vocab_size() - CFG.vocab_size) * CFG.hidden_size


def test_shard_unshard_roundtrip_and_vocab_padding():
    sd = _reference().state_dict()
    for tp in (1, 2, 4):
        shards = [sharding.shard_state_dict(CFG, sd, r, tp) for r in range(tp)]
        back = sharding.unshard_state_dict(CFG, shards)
        assert all(torch.equal(back[k], sd[k]) for k in sd)
        padded = torch.cat([s[sharding.WORD_EMBEDDING] for s in shards])
        assert padded.shape[0] == CFG.padded_vocab_size(tp)
        assert torch.count_nonzero(padded[CFG.vocab_size:]) == 0


def test_qkv_shards_hold_whole_heads():
    """TP rank r's QKV rows are q, k and v of heads [r*a/tp, (r+1)*a/tp), head by head."""
    sd = _reference().state_dict()
    h, a, d, tp = CFG.hidden_size, CFG.num_attention_heads, CFG.head_dim, 2
    full = sd["layers.0.attn.qkv.weight"]
    q, k, v = full.split(h)
    for r in range(tp):
        local = sharding.shard_state_dict(CFG, sd, r, tp)["layers.0.attn.qkv.weight"]
        per_head = local.view(a // tp, 3, d, h)
        for j in range(a // tp):
            head = r * a // tp + j
            rows = slice(head * d, (head + 1) * d)
            assert torch.equal(per_head[j, 0], q[rows]) and torch.equal(per_head[j, 1], k[rows])
            assert torch.equal(per_head[j, 2], v[rows])


def test_init_is_seeded_gpt2_style():
    a, b, c = _reference(3).state_dict(), _reference(3).state_dict(), _reference(4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[sharding.WORD_EMBEDDING], c[sharding.WORD_EMBEDDING])
    std = a["layers.0.attn.qkv.weight"].std().item()
    scaled = a["layers.0.mlp.fc2.weight"].std().item()
    assert abs(std - 0.02) < 0.002 and abs(scaled - 0.02 / math.sqrt(2 * CFG.num_layers)) < 0.002
    assert torch.all(a["layers.1.ln2.weight"] == 1) and torch.all(a["layers.1.attn.proj.bias"] == 0)


def test_reference_is_causal_and_starts_near_uniform():
    model = _reference()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % CFG.vocab_size
    with torch.no_grad():
        same = model(tokens)[:, :10], model(changed)[:, :10]
        loss = model(tokens, torch.roll(tokens, -1, 1))
    assert torch.allclose(*same) and loss.shape == (2, 16)
    assert abs(loss.mean().item() - math.log(CFG.vocab_size)) < 0.5
