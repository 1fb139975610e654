"""DCP interop in torchtitan's Llama layout (issue 34, part 2; models/gpt/dcp.py, tools/dcp.py).

The oracle is a plain-PyTorch Llama with torchtitan's names and rotary convention
(tests/checkpoint/titan_llama.py) driven by torch's own APIs: ``torch.distributed.checkpoint``
save/load, ``torch.optim.AdamW`` and ``get/set_optimizer_state_dict(flatten_optimizer_state_dict=True)``,
which is how torchtitan's checkpointer stores the optimizer.

- default: the tool both ways, with torchtitan's classic and 0.3 (``qkv_linear``, ``lm_head``)
  names; a DCP checkpoint torch writes from the plain model and its AdamW state imports here
  (weights give the plain model's logits in the reference GPT, moments and step carried), and the
  export of that checkpoint loads back through torch's DCP and ``set_optimizer_state_dict`` into a
  fresh plain model and AdamW, equal to the original; errors name the problem.
- default: a DCP checkpoint of a plain model trained 2 steps by AdamW imports and trains on here:
  the loss of the next step and of the one after equal the plain model's continuing in torch.
- slow: our Llama trained at TP 2 x DP 2 (4 ranks), exported, loads with ``dcp.load`` into the
  plain model with the same per-token losses as the TP model and the reference's logits.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from hybrid.checkpoint import CheckpointReader
from hybrid.checkpoint.dcp_reader import DCPReader
from hybrid.testing.multirank import run_on_ranks
from models.gpt.config import GPTConfig
from models.gpt.dcp import DCPInteropError, export_dcp, from_titan, import_dcp
from models.gpt.hf_llama import permute_for_rotate_half
from models.gpt.reference import ReferenceGPT
from models.gpt.weights import canonical_state_dict
from pretrain.arguments import parse_args
from tests.checkpoint.titan_llama import TitanLlama
from tests.training_helpers import VOCAB, IndexedSamples, make_trainer, tiny_args

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _config() -> GPTConfig:
    cfg, _ = parse_args(tiny_args(extra=LLAMA))
    return cfg.model


def _optimizer(model: torch.nn.Module, lr=1e-3) -> torch.optim.AdamW:
    """AdamW with our rule: matrices and embeddings decay, norm weights do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=lr,
                             betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _batch(first: int, count: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([IndexedSamples(4096)[i] for i in range(first, first + count)]))


def _loss(model: TitanLlama, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _trained_titan(steps: int, seed: int = 0):
    """The plain model after ``steps`` AdamW steps on samples 100.. (so its moments are not zero)."""
    torch.manual_seed(seed)
    model = TitanLlama.of(_config())
    opt = _optimizer(model)
    for s in range(steps):
        opt.zero_grad()
        _loss(model, _batch(100 + 8 * s, 8)).backward()
        opt.step()
    return model, opt


def _save_titan_dcp(model, opt, step: int, path) -> None:
    """What torchtitan's checkpointer writes: the model flattened to the top level, the flattened
    optimizer state dict under 'optimizer', the step under 'train_state'."""
    state = {**model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt, options=FLAT),
             "train_state": {"step": torch.tensor(step, dtype=torch.int32)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _reference(state_dict: dict, config: GPTConfig) -> ReferenceGPT:
    model = ReferenceGPT(config)
    model.load_state_dict(state_dict)
    return model.eval()


# --- default ------------------------------------------------------------------------------------
def test_torch_dcp_imports_and_our_export_loads_back_through_torch(tmp_path):
    config = _config()
    model, opt = _trained_titan(2)
    _save_titan_dcp(model, opt, 2, tmp_path / "titan")
    final = import_dcp(tmp_path / "titan", tmp_path / "ours", config)
    assert final.name == "iter_0000002"

    reader = CheckpointReader(final)
    assert reader.metadata["optimizer"]["step_count"] == 2
    weights, _ = canonical_state_dict(final)
    tokens = _batch(0, 4)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(_reference(weights, config)(tokens), model.eval()(tokens),
                                   rtol=1e-5, atol=1e-5)
    # the moments too: Adam's exp_avg of a q projection, through the rotary permutation
    exp_avg, _ = canonical_state_dict(final, kind="exp_avg")
    wq = opt.state[model.layers[0].attention.wq.weight]["exp_avg"]
    torch.testing.assert_close(exp_avg["layers.0.attn.qkv.weight"][:wq.shape[0]],
                               permute_for_rotate_half(wq, config.num_attention_heads))

    out = export_dcp(final, tmp_path / "export")
    fresh = TitanLlama.of(config)
    fresh_opt = _optimizer(fresh)
    state = {**fresh.state_dict(), "optimizer": get_optimizer_state_dict(fresh, fresh_opt, options=FLAT)}
    # a fresh AdamW has no state yet: ask for every entry the trained one holds
    state["optimizer"] = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                          for k, v in get_optimizer_state_dict(model, opt, options=FLAT).items()}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    optimizer_state = state.pop("optimizer")
    fresh.load_state_dict(state)
    set_optimizer_state_dict(fresh, fresh_opt, optimizer_state, options=FLAT)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], fresh_opt.state[q][key], rtol=0, atol=0)


def test_without_the_rotary_permutation_the_logits_differ(tmp_path):
    """The check above can fail: the plain model with q/k rows in our layout computes other logits."""
    config = _config()
    model, _ = _trained_titan(0)
    state = model.state_dict()
    canonical = from_titan(config, state)
    wrong = TitanLlama.of(config)
    q_rows = config.num_attention_heads * config.head_dim
    state["layers.0.attention.wq.weight"] = canonical["layers.0.attn.qkv.weight"][:q_rows]
    wrong.load_state_dict(state)
    tokens = _batch(0, 2)[:, :-1]
    with torch.no_grad():
        assert (wrong.eval()(tokens) - model.eval()(tokens)).abs().max() > 1e-3


def test_bad_inputs_are_one_clear_error(tmp_path):
    config = _config()
    model, _ = _trained_titan(0)
    dcp.save({"something.else": torch.zeros(3)}, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    with pytest.raises(DCPInteropError, match="torchtitan Llama checkpoint"):
        import_dcp(tmp_path / "other", tmp_path / "a", config)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    wider = dataclasses.replace(config, hidden_size=64)
    with pytest.raises(DCPInteropError, match="--hidden-size"):
        import_dcp(tmp_path / "titan", tmp_path / "b", wider)
    gpt2 = dataclasses.replace(config, position_embedding_type="learned_absolute", swiglu=False,
                               normalization="LayerNorm")
    with pytest.raises(DCPInteropError, match="rotary positions, RMSNorm, SwiGLU"):
        import_dcp(tmp_path / "titan", tmp_path / "c", gpt2)


def test_tool_round_trip(tmp_path, capsys):
    from tools.dcp import main
    model, opt = _trained_titan(1)
    _save_titan_dcp(model, opt, 1, tmp_path / "titan")
    flags = [f for f in tiny_args(extra=LLAMA) if f not in ("--vocab-size", str(VOCAB))]
    assert main(["import", "--dcp-dir", str(tmp_path / "titan"), "--save", str(tmp_path / "ours"),
                 *flags]) == 0       # the vocab size from tok_embeddings
    assert main(["export", "--load", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / ".metadata").is_file()
    # torchtitan 0.3's names out and in again: the same weights and moments
    assert main(["export", "--load", str(tmp_path / "ours"), "--out", str(tmp_path / "v03"),
                 "--naming", "qkv_linear"]) == 0
    keys = DCPReader(tmp_path / "v03").tensor_shapes()
    assert "lm_head.weight" in keys and "layers.1.attention.qkv_linear.wk.weight" in keys
    assert "optimizer.state.layers.0.attention.qkv_linear.wq.weight.exp_avg" in keys
    assert main(["import", "--dcp-dir", str(tmp_path / "v03"), "--save", str(tmp_path / "again"),
                 *flags]) == 0
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        first, _ = canonical_state_dict(tmp_path / "ours", kind=kind)
        second, _ = canonical_state_dict(tmp_path / "again", kind=kind)
        for name, t in first.items():
            torch.testing.assert_close(second[name], t, rtol=0, atol=0)
    assert json.loads((tmp_path / "ours" / "iter_0000001" / "metadata.json").read_text())[
        "model_config"]["vocab_size"] == VOCAB


# --- slow: our TP 2 x DP 2 Llama out, a plain model's DCP in and on --------------------------------
def _train_tp2_dp2(rank, world_size, ckpt):
    trainer = make_trainer(tiny_args(tp=2, zero=2, iters=2, extra=LLAMA + [
        "--save", ckpt, "--save-interval", "2", "--lr-decay-iters", "4"]))
    trainer.train()
    trainer.model.eval()
    batch = _batch(1000, 2)
    with torch.no_grad():
        per_token = trainer.model(batch[:, :-1], batch[:, 1:])
    return per_token.tolist()    # plain numbers: a tensor would be shared memory of an exited rank


@pytest.mark.slow
def test_our_tp2_dp2_checkpoint_loads_into_a_plain_torch_model(tmp_path):
    ckpt = tmp_path / "ckpt"
    per_token = torch.tensor(run_on_ranks(_train_tp2_dp2, 4, args=(str(ckpt),), timeout=900)[0])
    out = export_dcp(ckpt, tmp_path / "dcp")
    config = GPTConfig.from_dict(CheckpointReader(ckpt).metadata["model_config"])
    plain = TitanLlama.of(config)
    state = {k: torch.empty_like(v) for k, v in plain.state_dict().items()}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)   # torch's own loader, torchtitan's names
    plain.load_state_dict(state)
    plain.eval()
    batch = _batch(1000, 2)
    with torch.no_grad():
        logits = plain(batch[:, :-1])
        theirs = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
        torch.testing.assert_close(theirs.view(2, -1), per_token.float(), rtol=1e-5, atol=1e-5)
        weights, _ = canonical_state_dict(ckpt)
        torch.testing.assert_close(logits, _reference(weights, config)(batch[:, :-1]),
                                   rtol=1e-5, atol=1e-5)


def test_a_plain_models_dcp_checkpoint_imports_and_trains_on(tmp_path):
    model, opt = _trained_titan(2)
    _save_titan_dcp(model, opt, 2, tmp_path / "titan")
    import_dcp(tmp_path / "titan", tmp_path / "ours", _config())
    trainer = make_trainer(tiny_args(iters=4, extra=LLAMA + [
        "--load", str(tmp_path / "ours"), "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
        "--clip-grad", "0", "--weight-decay", "0.01"]))
    trainer.train()
    assert trainer.ts.iteration == 4 and len(trainer.losses) == 2
    # the plain model continues in torch on the samples the trainer read (0-7, then 8-15)
    expected = []
    model.train()
    for s in range(2):
        opt.zero_grad()
        loss = _loss(model, _batch(8 * s, 8))
        expected.append(loss.item())
        loss.backward()
        opt.step()
    torch.testing.assert_close(trainer.losses[0], expected[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(trainer.losses[1], expected[1], rtol=1e-4, atol=0)
