"""--init-from-hf: a Hugging Face GPT-2 directory (models/gpt/hf.save_hf_directory of random weights)
starts the trainer at TP 2 with ZeRO stage 1 (weights overwritten in place) and stage 3 (meta model
filled through pretrained_init_fn). Oracle: the single-device reference GPT with those weights gives
the same loss on the samples of the first global batch. Other dims are refused naming the flags."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.testing.multirank import run_on_ranks
from models.gpt.config import GPTConfig
from models.gpt.hf import save_hf_directory
from models.gpt.reference import ReferenceGPT
from tests.training_helpers import SEQ, VOCAB, IndexedSamples, make_trainer, tiny_args

# the dims tiny_args gives the trainer
CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                   seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0)


def _random_weights(seed: int = 5) -> dict[str, torch.Tensor]:
    """Canonical weights unlike the trainer's seeded init (non-zero biases, non-unit norms)."""
    ref = ReferenceGPT(CONFIG)
    ref.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    return {name: (p + 0.1 * torch.randn(p.shape, generator=g)).clone()
            for name, p in ref.state_dict().items()}


def _reference_loss(weights: dict[str, torch.Tensor], sample_ids: list[int]) -> float:
    ref = ReferenceGPT(CONFIG)
    ref.load_state_dict(weights)
    samples = torch.stack([torch.from_numpy(IndexedSamples(4096)[i]) for i in sample_ids])
    with torch.no_grad():
        logits = ref.eval()(samples[:, :-1])                                  # [b, s, V]
    return F.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()).item()


def _first_losses(rank, world_size, hf_dir):
    out = {}
    for stage in (1, 3):
        record: list = []
        trainer = make_trainer(tiny_args(tp=2, zero=stage, iters=1,
                                         extra=["--init-from-hf", hf_dir]), record)
        trainer.train()
        out[stage] = (trainer.losses[0], [i for batch in record for i in batch])
    return out


def test_init_from_hf_first_loss_matches_reference(tmp_path):
    weights = _random_weights()
    hf_dir = str(save_hf_directory(tmp_path / "hf", CONFIG, weights))
    for per_stage in run_on_ranks(_first_losses, 2, args=(hf_dir,), timeout=300):
        for stage, (loss, samples) in per_stage.items():
            assert len(samples) == 8                       # the whole first global batch
            expected = _reference_loss(weights, samples)
            assert loss == pytest.approx(expected, abs=1e-5), stage
    # the trainer's own init gives another loss: the flag really changed the weights
    seeded = make_trainer(tiny_args(iters=1))
    seeded.train()
    assert abs(seeded.losses[0] - expected) > 1e-2


def test_init_from_hf_refuses_other_dims(tmp_path):
    hf_dir = str(save_hf_directory(tmp_path / "hf", CONFIG, _random_weights()))
    with pytest.raises(ValueError, match=r"n_layer 2 there, --num-layers 3 here.*pass --num-layers 2"):
        make_trainer(tiny_args(extra=["--init-from-hf", hf_dir, "--num-layers", "3"]))
    with pytest.raises(FileNotFoundError, match="not a Hugging Face GPT-2 directory"):
        make_trainer(tiny_args(extra=["--init-from-hf", str(tmp_path)]))


# a Llama of the trainer's dims: rotary, RMSNorm, SwiGLU, 2 query groups, no biases, untied output
LLAMA_CONFIG = CONFIG.replace(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                              group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                              untie_embeddings_and_output_weights=True, norm_epsilon=1e-6)
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6"]


def test_init_from_llama_directory_first_loss_matches_reference(tmp_path):
    """The flag takes the Llama directory models/gpt/hf writes (LlamaForCausalLM's config.json and
    names): the first loss is the reference Llama's with those weights; the trainer's own Llama
    init gives another."""
    ref = ReferenceGPT(LLAMA_CONFIG)
    ref.init_weights(5)
    g = torch.Generator().manual_seed(5)
    weights = {n: (p + 0.1 * torch.randn(p.shape, generator=g)).clone() for n, p in ref.state_dict().items()}
    hf_dir = str(save_hf_directory(tmp_path / "hf", LLAMA_CONFIG, weights))
    record: list = []
    trainer = make_trainer(tiny_args(iters=1, extra=["--init-from-hf", hf_dir, *LLAMA_FLAGS]), record)
    trainer.train()
    ref.load_state_dict(weights)
    samples = torch.stack([torch.from_numpy(IndexedSamples(4096)[i]) for b in record for i in b])
    with torch.no_grad():
        logits = ref.eval()(samples[:, :-1])                                  # [b, s, V]
    expected = F.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()).item()
    assert trainer.losses[0] == pytest.approx(expected, abs=1e-5)
    seeded = make_trainer(tiny_args(iters=1, extra=LLAMA_FLAGS))
    seeded.train()
    assert abs(seeded.losses[0] - expected) > 1e-2


def test_init_from_llama_directory_names_the_llama_flags(tmp_path):
    ref = ReferenceGPT(LLAMA_CONFIG)
    ref.init_weights(5)
    hf_dir = str(save_hf_directory(tmp_path / "hf", LLAMA_CONFIG, ref.state_dict()))
    with pytest.raises(ValueError, match=r"num_key_value_heads 2 there, --num-query-groups 4 here.*"
                                         r"pass --position-embedding-type rope --normalization "
                                         r"RMSNorm --swiglu --disable-bias-linear "
                                         r"--untie-embeddings-and-output-weights --ffn-hidden-size "
                                         r"64 --group-query-attention --num-query-groups 2"):
        make_trainer(tiny_args(extra=["--init-from-hf", hf_dir]))
