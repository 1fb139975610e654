"""KV-cache decoding (models/gpt/kv_cache.py, hybrid/generation.py): tokens fed in pieces through the
cache give the logits of one full forward (GPT-2 and the Llama options: learned and rotary positions,
GQA), generation with the cache equals generation without it (greedy and sampled, including the
sliding window past the model's positions), at TP 1 and TP 2."""

import pytest
import torch

from hybrid.generation import SamplingParams, generate
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import gather_from_tp
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.model import GPTModel
from tests.models.test_gpt_options import LLAMA, options_config

CASES = {"gpt2": {}, "llama": LLAMA}
PROMPT = [[5, 17, 99], [42, 0, 250]]


def _model(name, state):
    model = GPTModel(options_config(CASES[name]), state, device="meta")
    model.init_weights(3)
    return model.eval()


def _pieces_vs_full(model):
    tokens = torch.randint(0, 251, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache()
        pieces = torch.cat([model(tokens[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 16))], 1)
    return full, pieces


def _generations(model):
    prompt = torch.tensor(PROMPT)
    out = []
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=20, seed=3)):
        # 3 + 30 tokens > 16 positions: the window slides and the cache is rebuilt
        out.append((generate(model, prompt, 30, params), generate(model, prompt, 30, params,
                                                                   use_cache=False)))
    return out


@pytest.mark.parametrize("name", CASES)
def test_tp1_cache_matches_full_forward_and_generation(name):
    model = _model(name, ParallelState.single_process())
    full, pieces = _pieces_vs_full(model)
    torch.testing.assert_close(pieces, full, rtol=1e-5, atol=1e-5)
    for cached, uncached in _generations(model):
        assert torch.equal(cached, uncached)


def _tp2(rank, world_size):
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    model = _model("llama", state)
    full, pieces = _pieces_vs_full(model)
    full, pieces = (gather_from_tp(t.contiguous(), state.tp) for t in (full, pieces))
    return full.numpy(), pieces.numpy(), [(a.numpy(), b.numpy()) for a, b in _generations(model)]


@pytest.mark.slow   # CI budget: the TP 1 cases stay in the default set
def test_tp2_cache_matches():
    for full, pieces, generations in run_on_ranks(_tp2, 2, timeout=300):
        torch.testing.assert_close(torch.from_numpy(pieces), torch.from_numpy(full), rtol=1e-5, atol=1e-5)
        for cached, uncached in generations:
            assert (cached == uncached).all()


def test_cache_refuses_overflow_and_sequence_parallel():
    model = _model("llama", ParallelState.single_process())
    cache = model.new_kv_cache(max_len=4)
    model(torch.tensor(PROMPT), cache=cache)
    with pytest.raises(ValueError, match="holds 4 positions; 3 are used and 2 more do not fit"):
        model(torch.tensor(PROMPT)[:, :2], cache=cache)
    model.sequence_parallel = True
    with pytest.raises(ValueError, match="sequence_parallel=False to generate"):
        model.new_kv_cache()
