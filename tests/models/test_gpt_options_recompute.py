"""Activation recompute on the Llama-style GPT (rope with scaling, RMSNorm, SwiGLU, GQA, no biases,
untied), dropout 0.1: every mode (selective attention core, full, full with Pa, Pa+cpu) gives the loss
and gradients of the run without recompute bit for bit, TP 1, and TP 2 with sequence parallelism."""

import torch

from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.config import GPTConfig
from tests.models.test_gpt_options import LLAMA
from tests.recompute.test_gpt import _step

CONFIG = GPTConfig(2, 64, 8, vocab_size=128, seq_length=16, ffn_hidden_size=96, hidden_dropout=0.1,
                   attention_dropout=0.1, **LLAMA)
MODES = ("selective", "full", "full-pa", "full-pa-cpu")


def _check_modes(state, sps):
    checked = []
    for sp in sps:
        ref = _step(state, CONFIG, 2, sp, "none")
        for mode in MODES:
            out = _step(state, CONFIG, 2, sp, mode)
            assert torch.equal(out["loss"], ref["loss"]), (mode, sp)
            for name, g in ref["grads"].items():
                assert torch.equal(out["grads"][name], g), (mode, sp, name)
            checked.append((sp, mode))
    return checked


def _rank(rank, world_size):
    return _check_modes(ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size)),
                        (True,))   # SP on: the harder path (the TP-only one is the parity tests)


def test_llama_recompute_tp1():
    assert len(_check_modes(ParallelState.single_process(), (False,))) == len(MODES)


def test_llama_recompute_tp2():
    checked = run_on_ranks(_rank, 2, timeout=300)
    assert len(checked[0]) == len(MODES)
