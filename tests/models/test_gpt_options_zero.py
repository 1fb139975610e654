"""ZeRO stages 0-3 train the Llama-style GPT (rope with scaling, RMSNorm, SwiGLU, GQA, no biases; tied
and untied output layer) exactly like torch.optim.AdamW on the single-device oracle: 5 steps of
losses and the final parameters, fp32, rtol 1e-5, at TP 1 x DP 2 and TP 2 x DP 1 (with sequence
parallelism). Stage 3 builds the model on meta and partitions it from the canonical init. A few
cases in the default suite, the whole matrix marked slow.
"""

import itertools

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from tests.models.test_gpt_options import LLAMA, NO_DROPOUT
from tests.zero.test_stages import GPTTask, assert_matches_reference, reference_run, train
from models.gpt.config import GPTConfig

INIT_SEED = 11
ALL_CASES = list(itertools.product((1, 2), (False, True), (0, 1, 2, 3)))   # (tp, untied, stage)
DEFAULT_CASES = [(1, True, 1), (1, True, 3), (2, True, 2), (2, False, 3)]


class LlamaTask(GPTTask):
    """GPTTask's data, loss and optimizer on the Llama options (``heads`` in ``groups`` query groups)."""

    def __init__(self, untied: bool, sequence_parallel: bool = False, heads: int = 4, groups: int = 2):
        super().__init__(sequence_parallel)
        options = {**LLAMA, "num_query_groups": groups, "untie_embeddings_and_output_weights": untied}
        self.config = GPTConfig(2, 32, heads, vocab_size=101, seq_length=8, ffn_hidden_size=48,
                                **{**NO_DROPOUT, "make_vocab_size_divisible_by": 4}, **options)

    def model(self, state, materialize=True):
        model = GPTModel(self.config, state, device="meta", sequence_parallel=self.sequence_parallel)
        if materialize:
            model.init_weights(INIT_SEED)
        return model

    def reference(self):
        model = ReferenceGPT(self.config)
        model.init_weights(INIT_SEED)
        return model


def _stages(rank, world_size, cases):
    checked = []
    for tp in sorted({c[0] for c in cases}):
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
        for untied in sorted({c[1] for c in cases if c[0] == tp}):
            task = LlamaTask(untied, sequence_parallel=tp > 1)
            data = task.data()
            ref = reference_run(task, data)
            for stage in [c[2] for c in cases if c[:2] == (tp, untied)]:
                cfg = ZeroConfig(stage=stage, bucket_size=300)
                model = task.model(state, materialize=stage < 3)
                options = dict(seed=INIT_SEED) if stage == 3 else {}
                opt = build_zero_optimizer(model, state, cfg, task.adamw, **options)
                losses, results = train(task, state, opt, model, data, accum=1)
                what = f"llama untied={untied} stage {stage} tp {tp} dp {state.dp_size}"
                if stage == 3:   # compare the gathered TP-local parameters
                    _check_stage3(task, state, opt, losses, ref, what)
                else:
                    assert_matches_reference(task, state, model, losses, ref, 1e-5, 1e-6, what)
                torch.testing.assert_close(torch.tensor([r.grad_norm for r in results]),
                                           torch.tensor(ref[1]), rtol=1e-5, atol=0)
                checked.append(what)
    return checked


def _check_stage3(task, state, opt, losses, ref, what):
    ref_losses, _, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what} losses: {m}")
    gathered = opt.gathered_state_dict()
    assert gathered.keys() == ref_params.keys()
    for name, value in gathered.items():
        expected = task.shard(name, ref_params[name], None, state)
        torch.testing.assert_close(value.float(), expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} param {name}: {m}")


@pytest.mark.parametrize("cases", [pytest.param(DEFAULT_CASES, id="default"),
                                   pytest.param([c for c in ALL_CASES if c not in DEFAULT_CASES],
                                                id="rest", marks=pytest.mark.slow)])
def test_llama_zero_stages_match_adamw_on_the_oracle(cases):
    checked = run_on_ranks(_stages, 2, args=(cases,), timeout=900)
    assert len(checked[0]) == len(cases) and checked[0] == checked[1]
