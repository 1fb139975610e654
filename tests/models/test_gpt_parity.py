"""TP GPT vs the single-device oracle (docs/design.md §4), fp32, dropout off.

For TP 1, 2, 4, sequence parallelism on/off, a vocab divisible and not divisible by TP and two model
shapes: the logits, the per-token loss and EVERY parameter gradient (gathered from the TP shards with
models/gpt/sharding.py) match models/gpt/reference.py. The same spawn records the TP communication of
one forward+backward, checked against Megatron's count (test_tp_comm_volume_matches_megatron).
"""

import pytest
import torch
from torch.utils._pytree import tree_map

from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt import sharding
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT

SEED, BATCH = 1234, 2
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=1)
SHAPES = {  # name -> config; vocab 256 divides every TP degree, 251 none (padded to 252 / 256)
    "2x64-v256": GPTConfig(2, 64, 4, vocab_size=256, seq_length=16, **NO_DROPOUT),
    "2x64-v251": GPTConfig(2, 64, 4, vocab_size=251, seq_length=16, **NO_DROPOUT),
    "1x32-ffn48-v251": GPTConfig(1, 32, 8, vocab_size=251, seq_length=8, max_position_embeddings=12,
                                 ffn_hidden_size=48, **NO_DROPOUT),
}


def _batch(config: GPTConfig):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=g)
    return tokens, torch.randint(0, config.vocab_size, tokens.shape, generator=g)


def _run(model, config, ledger=None):
    """One forward + backward on the fixed batch: (loss [b, s], logits, {name: grad}); ``ledger``
    (if given) is reset first and holds the communication of this forward + backward only."""
    tokens, labels = _batch(config)
    if ledger is not None:
        ledger.reset()
    loss = model(tokens, labels)
    loss.mean().backward()
    if ledger is not None:
        ledger.enabled = False   # the logits-only forward below is not part of the count
    with torch.no_grad():
        logits = model(tokens)
    if ledger is not None:
        ledger.enabled = True
    return loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def _tp_cases(rank, world_size):
    """On 4 ranks: every case at TP 2 (x DP 2) and TP 4. Ranks of DP replica 0 return tensors."""
    out = []
    for tp in (2, 4):
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
        for name, config in SHAPES.items():
            for sp in (False, True):
                model = GPTModel(config, state, sequence_parallel=sp, device="meta")
                model.init_weights(SEED)
                local_params = sum(p.numel() for p in model.parameters())
                loss, logits, grads = _run(model, config, state.ledger)
                ledger = state.ledger.totals()
                keep = state.dp_rank == 0
                gathered = None
                if name == "2x64-v251":   # the in-process gather over TP (after the ledger count)
                    gathered = sharding.gather_canonical(config, grads, state.tp)
                    _check_canonical_roundtrip(model, config)
                out.append(dict(tp=tp, sp=sp, shape=name, dp_rank=state.dp_rank, loss=loss,
                                logits=logits if keep else None, grads=grads if keep else None,
                                grad_norm=sum(g.double().square().sum() for g in grads.values()),
                                ledger=ledger, local_params=local_params,
                                gathered=gathered if state.rank == 0 else None))
    # numpy arrays travel through the result queue by value (tensors would go by shared-memory
    # handles that die with the rank process)
    return tree_map(lambda x: x.numpy() if isinstance(x, torch.Tensor) else x, out)


def _check_canonical_roundtrip(model, config):
    """load_canonical_state_dict then canonical_state_dict gives the reference weights back."""
    reference = ReferenceGPT(config)
    reference.init_weights(SEED + 1)
    model.load_canonical_state_dict(reference.state_dict())
    back = model.canonical_state_dict()
    assert all(torch.equal(back[k], v) for k, v in reference.state_dict().items())


@pytest.fixture(scope="module")
def tp_results():
    results = run_on_ranks(_tp_cases, 4, timeout=240)
    return tree_map(lambda x: torch.from_numpy(x) if hasattr(x, "dtype") and not isinstance(x, float) else x,
                    results)


def _reference(config):
    model = ReferenceGPT(config)
    model.init_weights(SEED)
    return _run(model, config)


def _assert_close(actual, expected, what):
    """Elementwise |a - e| <= 1e-5 |e| + 1e-5 max|e| (relative to the tensor's scale: fp32 rounding
    of differently-ordered sums)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=what)


def _check_against_reference(config, tp, loss, logits_shards, grad_shards, label):
    ref_loss, ref_logits, ref_grads = _reference(config)
    _assert_close(loss, ref_loss, f"{label}: loss")
    logits = torch.cat(logits_shards, dim=-1)
    assert logits.shape[-1] == config.padded_vocab_size(tp)
    _assert_close(logits[..., :config.vocab_size], ref_logits, f"{label}: logits")
    grads = sharding.unshard_state_dict(config, grad_shards)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        _assert_close(grads[name], ref_grads[name], f"{label}: grad of {name}")


@pytest.mark.parametrize("name", SHAPES)
def test_tp1_matches_reference(name):
    config = SHAPES[name]
    model = GPTModel(config, ParallelState.single_process(), device="meta")
    model.init_weights(SEED)
    loss, logits, grads = _run(model, config)
    _check_against_reference(config, 1, loss, [logits], [grads], f"{name} tp1")


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_reference(tp_results, tp, sp, name):
    ranks = [next(c for c in per_rank if (c["tp"], c["sp"], c["shape"]) == (tp, sp, name))
             for per_rank in tp_results]
    mine = [c for c in ranks if c["dp_rank"] == 0]
    assert len(mine) == tp
    config = SHAPES[name]
    _check_against_reference(config, tp, mine[0]["loss"], [c["logits"] for c in mine],
                             [c["grads"] for c in mine], f"{name} tp{tp} sp={sp}")
    for c in ranks:  # every TP rank has the whole loss; DP replicas agree; replicated grads agree
        assert torch.equal(c["loss"], mine[0]["loss"])
        assert c["local_params"] == config.num_parameters_per_rank(tp)
    for name_, g in mine[0]["grads"].items():
        if sharding.partition_dim(name_) == -1:
            for other in mine[1:]:
                _assert_close(other["grads"][name_], g, f"replicated grad {name_} on every TP rank")
    if ranks[0]["gathered"] is not None:  # gathered in-process over TP == gathered here
        grads = sharding.unshard_state_dict(config, [c["grads"] for c in mine])
        assert all(torch.equal(ranks[0]["gathered"][k], grads[k]) for k in grads)
    if tp == 2:  # the DP replicas (ranks 0/2 and 1/3) computed the same thing
        assert ranks[0]["grad_norm"] == ranks[2]["grad_norm"]


def _megatron_tp_volume(config: GPTConfig, tp: int, sp: bool) -> dict[tuple[str, str], float]:
    """Bytes per rank on the TP group for one forward+backward (fp32), by op.

    Megatron-LM §3: 2 all-reduces of s*b*h per layer forward (after attention and MLP, `g`) and 2
    backward (`f` in front of QKV and MLP-in); plus the embedding (forward all-reduce of the partial
    lookups), the tied output layer (`f` backward) and the cross-entropy (all-reduce of max, then of
    sum-exp and target logit: 3 numbers per token).

    With SP (Korthikanti et al. 2022 §4.2.2) every activation all-reduce becomes an all-gather plus
    a reduce-scatter of the same s*b*h tensor - same ring volume. Two additions: a column-parallel
    linear saves only its input's sequence shard and all-gathers it again in backward for the weight
    gradient (2 per layer + the output layer); and the replicated parameters used on sequence shards
    get their gradients all-reduced: per layer 2 LayerNorms (4h) and 2 row-parallel biases (2h), the
    final LayerNorm (2h) and the used position rows (s*h).
    """
    s, b, h, l = config.seq_length, BATCH, config.hidden_size, config.num_layers
    ring, act = (tp - 1) / tp, s * b * h
    activations = act * (4 * l + 2)  # 4l per layer fwd+bwd, embedding fwd, output layer bwd
    cross_entropy = 3 * s * b
    if not sp:
        return {("tp", "all_reduce"): 4 * 2 * ring * (activations + cross_entropy)}
    params = l * 6 * h + 2 * h + s * h
    regather = act * (2 * l + 1)
    return {("tp", "all_reduce"): 4 * 2 * ring * (cross_entropy + params),
            ("tp", "all_gather"): 4 * ring * (activations + regather),
            ("tp", "reduce_scatter"): 4 * ring * activations}


def test_tp_comm_volume_matches_megatron(tp_results):
    for case in tp_results[0]:
        config = SHAPES[case["shape"]]
        expected = _megatron_tp_volume(config, case["tp"], case["sp"])
        assert case["ledger"] == pytest.approx(expected), (case["tp"], case["sp"], case["shape"])
        if case["sp"]:  # SP moves the activation volume of the all-reduces it replaces (+ regathers)
            tp, s, h, l = case["tp"], config.seq_length, config.hidden_size, config.num_layers
            plain = _megatron_tp_volume(config, tp, False)[("tp", "all_reduce")]
            ring = (tp - 1) / tp
            moved = sum(v for (g, op), v in case["ledger"].items() if op != "all_reduce")
            regather = 4 * ring * s * BATCH * h * (2 * l + 1)
            assert moved - regather == pytest.approx(plain - 8 * ring * 3 * s * BATCH)
