"""Perplexity of a checkpoint at any layout (tools/evaluate.py).

A real training checkpoint (the trainer, TP 2, ZeRO stage 1, two steps) is evaluated on an indexed
dataset built here (random documents, hybrid.data's Megatron indices) at TP 1 x DP 1 (one process),
TP 2 x DP 1 and TP 1 x DP 2 (one 2-rank spawn). All must agree to rtol 1e-5, and equal
exp(mean loss) of the single-device reference GPT over the same samples, computed here with
``F.cross_entropy``. ``--eod-mask-loss`` drops exactly the positions whose input is eod.
"""

import math

import numpy as np
import pytest
import torch

from hybrid.data import IndexedDatasetWriter, build_gpt_datasets
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.reference import ReferenceGPT
from models.gpt.weights import load_canonical, load_model

VOCAB, EOD, SAMPLES = 200, 2, 12


def _train_and_save(rank, world_size, save_dir, tp, iters):
    from tests.training_helpers import make_trainer, tiny_args
    extra = ["--save", save_dir, "--save-interval", str(iters), "--lr-decay-iters", str(iters)]
    make_trainer(tiny_args(tp=tp, zero=1, iters=iters, extra=extra)).train()


def write_training_checkpoint(save_dir, tp: int = 2, iters: int = 2) -> str:
    """Train the tiny model of tests/training_helpers for ``iters`` steps on ``tp`` ranks and save."""
    run_on_ranks(_train_and_save, tp, args=(str(save_dir), tp, iters), timeout=300)
    return str(save_dir)


def write_dataset(prefix) -> str:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix) as w:
        for _ in range(40):
            doc = rng.integers(3, VOCAB, rng.integers(5, 40)).tolist()
            w.add_document(doc + [EOD])
    return str(prefix)


def _args(ckpt, data, tp, extra=()):
    return ["--load", ckpt, "--data-path", data, "--split", "50,50,0", "--eval-split", "valid",
            "--eval-samples", str(SAMPLES), "--seq-length", "16", "--micro-batch-size", "5",
            "--seed", "5", "--tensor-model-parallel-size", str(tp), *extra]


def _eval_ranks(rank, world_size, ckpt, data):
    from tools import evaluate
    out = {}
    for tp in (2, 1):                       # TP 2 x DP 1, then TP 1 x DP 2, in one spawn
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
        args = evaluate.parse_args(_args(ckpt, data, tp))
        out[tp] = evaluate.run(args, state).to_dict()
    return out


def _reference_perplexity(ckpt, data) -> tuple[float, float]:
    state_dict, config = load_canonical(ckpt)
    model = ReferenceGPT(config.replace(hidden_dropout=0.0, attention_dropout=0.0))
    model.load_state_dict(state_dict)
    dataset = build_gpt_datasets([data], "50,50,0", 16, [0, SAMPLES, 0], 5, vocab_size=VOCAB)[1]
    batch = torch.from_numpy(np.stack([dataset[i] for i in range(SAMPLES)]))
    tokens, labels = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        logits = model.eval()(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(),
                                             reduction="none").view_as(tokens)
    keep = tokens != EOD
    return math.exp(loss.mean().item()), math.exp(loss[keep].mean().item())


def test_perplexity_same_at_every_layout_and_equals_reference(tmp_path):
    from tools import evaluate
    ckpt = write_training_checkpoint(tmp_path / "ckpt", tp=2, iters=2)
    data = write_dataset(tmp_path / "data")
    expected, expected_masked = _reference_perplexity(ckpt, data)
    single = evaluate.run(evaluate.parse_args(_args(ckpt, data, 1)), ParallelState.single_process())
    assert single.tokens == SAMPLES * 16 and single.samples == SAMPLES
    assert math.isclose(single.perplexity, expected, rel_tol=1e-5), (single, expected)
    assert 50 < expected < 1000            # a barely trained model over 200 tokens: near-uniform
    for rank_result in run_on_ranks(_eval_ranks, 2, args=(ckpt, data)):
        for tp, r in rank_result.items():
            assert math.isclose(r["perplexity"], expected, rel_tol=1e-5), (tp, r, expected)
            assert r["tokens"] == single.tokens
    state = ParallelState.single_process()
    dataset = build_gpt_datasets([data], "50,50,0", 16, [0, SAMPLES, 0], 5, vocab_size=VOCAB)[1]
    masked = evaluate.evaluate_perplexity(load_model(ckpt, state), dataset, state,
                                          num_samples=SAMPLES, eod_mask=EOD)
    assert math.isclose(masked.perplexity, expected_masked, rel_tol=1e-5), (masked, expected_masked)


def test_eod_mask_and_bad_sample_count(tmp_path):
    from tools import evaluate
    from models.gpt.config import GPTConfig
    from models.gpt.weights import build_model
    from tests.models.test_hf_export import random_canonical
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=VOCAB,
                       seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    state = ParallelState.single_process()
    model = build_model(config, state, random_canonical(config))
    data = write_dataset(tmp_path / "data")
    dataset = build_gpt_datasets([data], "50,50,0", 16, [0, SAMPLES, 0], 5, vocab_size=VOCAB)[1]
    full = evaluate.evaluate_perplexity(model, dataset, state, num_samples=SAMPLES)
    masked = evaluate.evaluate_perplexity(model, dataset, state, num_samples=SAMPLES, eod_mask=EOD)
    eods = sum(int((dataset[i][:-1] == EOD).sum()) for i in range(SAMPLES))
    assert eods > 0 and masked.tokens == full.tokens - eods
    # --reset-position-ids --reset-attention-mask: the model's loss under the documents' layout
    from hybrid.data.documents import document_ids, reset_position_ids
    from models.gpt.token_layout import TokenLayout
    packed = evaluate.evaluate_perplexity(model, dataset, state, num_samples=SAMPLES,
                                          documents=(EOD, True, True))
    batch = torch.from_numpy(np.stack([dataset[i] for i in range(SAMPLES)]).astype(np.int64))
    tokens, labels = batch[:, :-1], batch[:, 1:]
    layout = TokenLayout(position_ids=reset_position_ids(tokens, EOD),
                         document_ids=document_ids(tokens, EOD))
    with torch.no_grad():
        want = math.exp(model(tokens, labels, layout=layout).double().mean().item())
    assert math.isclose(packed.perplexity, want, rel_tol=1e-6), (packed, want)
    assert not math.isclose(packed.perplexity, full.perplexity, rel_tol=1e-4)
    with pytest.raises(ValueError, match="--eval-samples"):
        evaluate.evaluate_perplexity(model, dataset, state, num_samples=len(dataset) + 1)


def test_evaluate_cli_prints_json(tmp_path, capsys):
    import json
    from tools import evaluate
    from models.gpt.config import GPTConfig
    from models.gpt.weights import save_canonical
    from tests.models.test_hf_export import random_canonical
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=VOCAB,
                       seq_length=16)
    weights = save_canonical(tmp_path / "w.safetensors", random_canonical(config), config)
    data = write_dataset(tmp_path / "data")
    assert evaluate.main(_args(str(weights), data, 1, ["--data-cache-dir", str(tmp_path)])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == SAMPLES * 16 and out["tensor_model_parallel_size"] == 1
    assert math.isclose(out["perplexity"], math.exp(out["loss"]))
