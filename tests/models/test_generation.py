"""Sampling over vocab-parallel logits (hybrid/generation.py, tools/generate.py).

Pure checks: top-k / top-p filters on hand-computed cases, the filtered draw frequencies against the
renormalised distribution, parameter validation. Model checks: greedy decoding of TP 2 (two ranks),
TP 1 and a greedy loop over the single-device reference GPT produce identical tokens; seeded
sampling with temperature / top-k / top-p reproduces exactly, and both TP ranks draw the same
tokens; tools/generate.py run on two ranks prints what the one-process run prints; eod stops a row.
"""

import json

import pytest
import torch

from hybrid.generation import SamplingParams, generate, sample_next, top_k_filter, top_p_filter
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.reference import ReferenceGPT
from models.gpt.weights import build_model, save_canonical
from tests.models.test_hf_export import CONFIG, random_canonical

NEG = float("-inf")
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11)


def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 1.0, 5.0]])
    assert top_k_filter(logits, 2).tolist() == [[NEG, 3.0, 2.0, NEG], [5.0, 5.0, NEG, 5.0]]
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 9), logits)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])             # order: 1, 3, 0, 2
    logits = probs.log().unsqueeze(0)
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.79) == [False, True, False, True]
    assert kept(0.81) == [True, True, False, True]
    assert kept(0.01) == [False, True, False, False]          # at least the top token
    assert kept(1.0) == [True] * 4


def test_filtered_draws_follow_the_renormalised_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, seed=0)
    g = torch.Generator().manual_seed(0)
    draws = sample_next(probs.log().expand(20000, 4), params, g)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    torch.testing.assert_close(freq, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0], dtype=torch.float64),
                               rtol=0, atol=0.015)
    hot = sample_next(probs.log().expand(20000, 4), SamplingParams(temperature=0.5, seed=0), g)
    sharp = probs ** 2 / (probs ** 2).sum()                   # temperature 0.5 squares the probs
    torch.testing.assert_close(torch.bincount(hot, minlength=4).double() / 20000, sharp.double(),
                               rtol=0, atol=0.015)
    assert sample_next(torch.tensor([[0.0, 2.0, 1.0]]), SamplingParams(temperature=0), None).item() == 1


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def _prompt():
    return torch.randint(0, CONFIG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))


def _reference_greedy(canonical, prompt, n):
    ref = ReferenceGPT(CONFIG)
    ref.load_state_dict(canonical)
    tokens = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = ref.eval()(tokens[:, -CONFIG.max_position_embeddings:])[:, -1].argmax(-1)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return tokens


def _generate_all(state, canonical, prompt):
    model = build_model(CONFIG, state, canonical)
    greedy = generate(model, prompt, 20, SamplingParams(temperature=0))   # runs past 16 positions
    sampled = [generate(model, prompt, 12, SAMPLED) for _ in range(2)]
    other_seed = generate(model, prompt, 12, SamplingParams(0.9, 20, 0.9, seed=12))
    return greedy, sampled, other_seed


def _ranks(rank, world_size, canonical, prompt, weights_file):
    from tools import generate as tool
    state = ParallelState.initialize(Topology(world_size, world_size, gpus_per_node=world_size))
    greedy, sampled, other = _generate_all(state, canonical, prompt)
    args = tool.parse_args(["--load", weights_file, "--prompt-ids", json.dumps(prompt.tolist()),
                            "--max-new-tokens", "8", "--temperature", "0.7", "--top-k", "5",
                            "--seed", "3"])
    return greedy.numpy(), [s.numpy() for s in sampled], other.numpy(), tool.run(args, state)


def test_tp2_tp1_and_reference_agree_and_sampling_is_seeded(tmp_path):
    canonical, prompt = random_canonical(CONFIG), _prompt()
    weights_file = str(save_canonical(tmp_path / "w.safetensors", canonical, CONFIG))
    greedy, sampled, other = _generate_all(ParallelState.single_process(), canonical, prompt)
    assert torch.equal(greedy, _reference_greedy(canonical, prompt, 20))
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], other)
    assert not torch.equal(sampled[0], greedy[:, :17])       # sampling is not greedy here
    from tools import generate as tool
    args = tool.parse_args(["--load", weights_file, "--prompt-ids", json.dumps(prompt.tolist()),
                            "--max-new-tokens", "8", "--temperature", "0.7", "--top-k", "5",
                            "--seed", "3"])
    tool_tp1 = tool.run(args, ParallelState.single_process())
    ranks = run_on_ranks(_ranks, 2, args=(canonical, prompt, weights_file))
    for g, s, o, tool_out in ranks:
        assert torch.equal(torch.from_numpy(g), greedy)      # TP 2 greedy == TP 1 greedy
        assert torch.equal(torch.from_numpy(o), torch.from_numpy(ranks[0][2]))
        for a, b in zip(s, ranks[0][1]):                     # both TP ranks draw the same tokens
            assert (a == b).all()
        assert [r["ids"] for r in tool_out] == [r["ids"] for r in ranks[0][3]]
        assert len(tool_out) == 2 and all(len(r["ids"]) == 8 for r in tool_out)
    # sampled TP 2 vs TP 1: the logits differ by rounding only, so the draws agree here
    assert [r["ids"] for r in ranks[0][3]] == [r["ids"] for r in tool_tp1]


def test_eod_stops_a_row_and_pads_it():
    canonical, prompt = random_canonical(CONFIG), _prompt()
    model = build_model(CONFIG, ParallelState.single_process(), canonical)
    greedy = generate(model, prompt, 6, SamplingParams(temperature=0))
    eod = int(greedy[0, 5])                                   # row 0's first new token
    out = generate(model, prompt, 6, SamplingParams(temperature=0), eod=eod)
    assert (out[0, 5:] == eod).all()
    row1 = greedy[1, 5:].tolist()
    if eod not in row1:
        assert out[1].tolist() == greedy[1].tolist()
    single = generate(model, prompt[:1], 6, SamplingParams(temperature=0), eod=eod)
    assert single.shape == (1, 6)                             # stopped after one token


def test_generate_cli_with_text_prompt_and_hf_tokenizer(tmp_path, capsys):
    """tools/generate.py main(): an HF export carrying its tokenizer, text prompts, JSON output."""
    from hybrid.data.tokenizer import Tokenizer, train_tokenizer
    from models.gpt.hf import save_hf_directory
    from tools import generate as tool
    spm = train_tokenizer(["def f(x):\n    return x * 2\n"] * 50, tmp_path / "spm", 300)
    config = CONFIG.replace(vocab_size=Tokenizer(spm).vocab_size)
    hf_dir = save_hf_directory(tmp_path / "hf", config, random_canonical(config), tokenizer_model=spm)
    assert tool.main(["--load", str(hf_dir), "--prompt", "def f(", "--prompt", "return",
                      "--max-new-tokens", "5", "--top-p", "0.8", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in lines] == [Tokenizer(spm).encode(t) for t in ("def f(", "return")]
    for r in lines:
        assert isinstance(r["text"], str) and 1 <= len(r["ids"]) <= 5
