"""tools/import_megatron.py on checkpoints megatron-core 0.16.1 itself wrote (tests/checkpoint/megatron_writer.py,
run in the test-only environment of tests/checkpoint/megatron_env.py): a GPT (LayerNorm, GELU, learned
positions, tied output, biases) and a Llama-style model (RMSNorm, SwiGLU, GQA, rotary, untied, no
biases), each at TP 2 in the torch_dist format (stacked layers; and per-layer keys with SwiGLU's
halves as separate keys, as megatron-core writes with ``singleton_local_shards``) and the legacy
format.

Every imported weight must be bit-equal to what megatron-core held before saving - the expected
canonical tensors are assembled here from each rank's parameters by explicit per-head / per-group
loops, independently of models/gpt/megatron.py - and the imported model's logits must equal
megatron-core's forward on the same tokens within 1e-5. Megatron-core's whole forward runs on CPU
here (local layer spec, gloo); only its torch_dist save needs CUDA shims (see the writer).

Also: legacy checkpoints at PP 2 and with two virtual pipeline stages (megatron's own rank files
regrouped, the layers of each chunk numbered from 0, as Megatron-LM writes them) give the same
weights; megatron-core's DCP ``.metadata`` parsed as data (hybrid/checkpoint/pickle_opcodes.py)
equals what Python's unpickler builds from it; and a file holding a foreign pickled object is
refused, naming the object and the file, before it can run.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint.dcp_reader import read_metadata
from hybrid.checkpoint.foreign_files import ForbiddenPickleError, load_torch
from hybrid.parallel_state import ParallelState
from models.gpt.weights import canonical_state_dict, load_model
from tests.checkpoint import megatron_env
from tests.checkpoint.test_pickle_opcodes import assert_same_as_unpickled, unpickled
from tools._cli import run_cli
from tools.import_megatron import main as import_main

ROOT = Path(__file__).resolve().parents[2]
KINDS, FORMATS, TP = ("gpt", "llama"), ("torch_dist", "torch_dist_per_layer", "legacy"), 2


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Both models, both formats, written by megatron-core (about 20 s of CPU: two ranks importing it)."""
    try:
        python = megatron_env.build()
    except (RuntimeError, subprocess.SubprocessError) as err:
        pytest.fail(f"the megatron-core test environment could not be built ({err}); run "
                    f"`python -m tests.checkpoint.megatron_env` where PyPI is reachable")
    out = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([python, str(ROOT / "tests" / "checkpoint" / "megatron_writer.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"megatron-core's side failed:\n{done.stderr[-4000:]}"
    return out


def _import(load: Path, save: Path, *flags: str) -> Path:
    assert run_cli(import_main, ["--load", str(load), "--save", str(save), *flags]) == 0
    return save


def _megatron_args(written: Path, kind: str) -> argparse.Namespace:
    legacy = written / kind / "legacy" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    return load_torch(legacy)["args"]


def _expected(written: Path, kind: str) -> dict[str, torch.Tensor]:
    """Canonical tensors from the parameters each megatron rank held, by explicit index loops."""
    held = [load_file(str(written / kind / f"held_rank_{r}.safetensors")) for r in range(TP)]
    a = _megatron_args(written, kind)
    heads, groups, d = a.num_attention_heads, a.num_query_groups, a.hidden_size // a.num_attention_heads
    per_group, local_groups = heads // groups, groups // TP

    def rows(t, start, n):
        return t[start * d:(start + n) * d]

    def qkv(name):
        q, k, v = [], [], []
        for g in range(groups):
            local = held[g // local_groups][name]
            base = (g % local_groups) * (per_group + 2)            # [q heads, k, v] per group
            q += [rows(local, base + j, 1) for j in range(per_group)]
            k.append(rows(local, base + per_group, 1))
            v.append(rows(local, base + per_group + 1, 1))
        return torch.cat(q + k + v)

    def fc1(name):
        if not a.swiglu:
            return torch.cat([h[name] for h in held])
        halves = [h[name].chunk(2) for h in held]                   # per rank [gate_r; up_r]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])

    def replicated(name):
        for h in held[1:]:
            assert torch.equal(h[name], held[0][name]), name
        return held[0][name]

    out = {"embedding.word.weight": torch.cat([h["embedding.word_embeddings.weight"] for h in held]),
           "final_norm.weight": replicated("decoder.final_layernorm.weight")}
    if a.position_embedding_type == "learned_absolute":
        out["embedding.position.weight"] = replicated("embedding.position_embeddings.weight")
    if a.normalization == "LayerNorm":
        out["final_norm.bias"] = replicated("decoder.final_layernorm.bias")
    if a.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = torch.cat([h["output_layer.weight"] for h in held])
    for i in range(a.num_layers):
        m, o = f"decoder.layers.{i}.", f"layers.{i}."
        kinds = ("weight", "bias") if a.add_bias_linear else ("weight",)
        norm_kinds = ("weight", "bias") if a.normalization == "LayerNorm" else ("weight",)
        for kind_ in norm_kinds:
            out[f"{o}ln1.{kind_}"] = replicated(f"{m}input_layernorm.{kind_}")
            out[f"{o}ln2.{kind_}"] = replicated(f"{m}pre_mlp_layernorm.{kind_}")
        for kind_ in kinds:
            out[f"{o}attn.qkv.{kind_}"] = qkv(f"{m}self_attention.linear_qkv.{kind_}")
            out[f"{o}mlp.fc1.{kind_}"] = fc1(f"{m}mlp.linear_fc1.{kind_}")
        out[f"{o}attn.proj.weight"] = torch.cat([h[f"{m}self_attention.linear_proj.weight"]
                                                 for h in held], dim=1)
        out[f"{o}mlp.fc2.weight"] = torch.cat([h[f"{m}mlp.linear_fc2.weight"] for h in held], dim=1)
        if a.add_bias_linear:
            out[f"{o}attn.proj.bias"] = replicated(f"{m}self_attention.linear_proj.bias")
            out[f"{o}mlp.fc2.bias"] = replicated(f"{m}mlp.linear_fc2.bias")
    held_elements = sum(t.numel() for h in held for t in h.values())
    replicated_elements = sum(t.numel() for n, t in held[0].items()
                              if "norm" in n or "position" in n or n.endswith(("proj.bias", "fc2.bias")))
    assert sum(t.numel() for t in out.values()) == held_elements - replicated_elements * (TP - 1)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_weights_bit_equal_and_logits_match(written, tmp_path, kind, fmt):
    save = _import(written / kind / fmt, tmp_path / "ours")
    imported, _ = canonical_state_dict(save, kind="model")
    expected = _expected(written, kind)
    assert sorted(imported) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(imported[name], t), name

    reference = load_file(str(written / kind / "logits.safetensors"))
    model = load_model(save, ParallelState.single_process())
    with torch.no_grad():
        logits = model(reference["tokens"])[..., :reference["logits"].size(-1)]
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


def _regroup_into_stages(written: Path, kind: str, out: Path, layout: str) -> Path:
    """Megatron's TP 2 legacy rank files split into two model chunks as Megatron-LM lays them out:
    layer numbers local to each chunk, the embedding in the first, the final norm and the output
    layer (a copy of the embedding when tied) in the last. ``pp2``: two pipeline stages, files
    mp_rank_TT_PPP; ``vp2``: one stage holding two virtual stages, 'model0' and 'model1'."""
    source = written / kind / "legacy" / "iter_0000007"
    for t in range(TP):
        state = load_torch(source / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
        model = state.pop("model")
        first = {k: v for k, v in model.items() if k.startswith(("embedding.", "decoder.layers.0."))}
        last = {k.replace("decoder.layers.1.", "decoder.layers.0."): v for k, v in model.items()
                if k.startswith(("decoder.layers.1.", "decoder.final_layernorm", "output_layer"))}
        last.setdefault("output_layer.weight", model["embedding.word_embeddings.weight"].clone())
        if layout == "vp2":
            directory = out / "iter_0000007" / f"mp_rank_{t:02d}"
            directory.mkdir(parents=True)
            torch.save({**state, "model0": first, "model1": last}, directory / "model_optim_rng.pt")
            continue
        for stage, part in enumerate((first, last)):
            directory = out / "iter_0000007" / f"mp_rank_{t:02d}_{stage:03d}"
            directory.mkdir(parents=True)
            torch.save({**state, "model": part}, directory / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("7")
    return out


@pytest.mark.parametrize("layout", ["pp2", "vp2"])
@pytest.mark.parametrize("kind", KINDS)
def test_legacy_pipeline_stages(written, tmp_path, kind, layout):
    staged = _regroup_into_stages(written, kind, tmp_path / layout, layout)
    imported, _ = canonical_state_dict(_import(staged, tmp_path / "ours"), kind="model")
    expected = _expected(written, kind)
    assert sorted(imported) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(imported[name], t), name


def _legacy_with_args(written: Path, kind: str, out: Path, **changes) -> Path:
    """Megatron's legacy files of ``kind`` with ``args`` changed (``args=None``: removed)."""
    source = written / kind / "legacy" / "iter_0000007"
    for t in range(TP):
        state = load_torch(source / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
        if changes.get("args", True) is None:
            del state["args"]
        else:
            state["args"] = argparse.Namespace(**{**vars(state["args"]), **changes})
        (out / f"mp_rank_{t:02d}").mkdir(parents=True)
        torch.save(state, out / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    return out


def test_vocab_size_flag_drops_padding_rows(written, tmp_path):
    save = _import(written / "llama" / "torch_dist", tmp_path / "ours", "--vocab-size", "90")
    imported, config = canonical_state_dict(save, kind="model")
    expected = _expected(written, "llama")
    assert config["vocab_size"] == 90
    for name in ("embedding.word.weight", "output_layer.weight"):
        assert torch.equal(imported[name], expected[name][:90])


def test_overwrite_replaces_only_what_the_import_writes(written, tmp_path, capsys):
    save = tmp_path / "ours"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    source = written / "gpt" / "legacy"
    assert run_cli(import_main, ["--load", str(source), "--save", str(save)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    for _ in range(2):
        _import(source, save, "--overwrite")
    assert (save / "notes.txt").read_text() == "mine"
    imported, _ = canonical_state_dict(save, kind="model")
    assert all(torch.equal(imported[k], t) for k, t in _expected(written, "gpt").items())


def test_checkpoint_without_args_takes_the_model_flags(written, tmp_path, capsys):
    bare = _legacy_with_args(written, "gpt", tmp_path / "bare", args=None)
    assert run_cli(import_main, ["--load", str(bare), "--save", str(tmp_path / "none")]) == 2
    assert "--num-layers, --hidden-size, --num-attention-heads" in capsys.readouterr().err
    save = _import(bare, tmp_path / "ours", "--num-layers", "2", "--hidden-size", "32",
                   "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--seq-length", "8")
    imported, _ = canonical_state_dict(save, kind="model")
    assert all(torch.equal(imported[k], t) for k, t in _expected(written, "gpt").items())


def test_exact_gelu_needs_consent(written, tmp_path, capsys):
    erf = _legacy_with_args(written, "gpt", tmp_path / "erf", openai_gelu=False)
    assert run_cli(import_main, ["--load", str(erf), "--save", str(tmp_path / "refused")]) == 2
    assert "--approximate-gelu" in capsys.readouterr().err
    _import(erf, tmp_path / "ours", "--approximate-gelu")


class Smuggled:
    """A class of another module (this test file): not a checkpoint type."""


class RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("payload", ["os.system", "foreign class"])
def test_foreign_pickled_object_refused(tmp_path, capsys, payload):
    marker = tmp_path / "ran"
    obj = RunsACommand(marker) if payload == "os.system" else Smuggled()
    rank_dir = tmp_path / "megatron" / "iter_0000001" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(num_layers=1), "iteration": 1,
                "model": {"embedding.word_embeddings.weight": torch.zeros(4, 2)}, "extra": obj},
               rank_dir / "model_optim_rng.pt")
    with pytest.raises(ForbiddenPickleError) as err:
        load_torch(rank_dir / "model_optim_rng.pt")
    name = "system" if payload == "os.system" else f"{__name__}.Smuggled"
    assert name in str(err.value) and str(rank_dir / "model_optim_rng.pt") in str(err.value)

    assert run_cli(import_main, ["--load", str(tmp_path / "megatron" / "iter_0000001"),
                                 "--save", str(tmp_path / "ours")]) == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ") and name in message and "model_optim_rng.pt" in message
    assert not marker.exists() and not (tmp_path / "ours").exists()


def test_foreign_object_in_dcp_metadata_refused(tmp_path):
    directory = tmp_path / "iter_0000001"
    directory.mkdir()
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    marker = tmp_path / "ran"
    (directory / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    with pytest.raises(ForbiddenPickleError, match=r"system.*\.metadata|\.metadata.*system"):
        import_main(["--load", str(directory), "--save", str(tmp_path / "ours")])
    assert not marker.exists()


def test_dcp_metadata_parsed_as_data_equals_megatrons(written):
    """megatron-core's ``.metadata`` (TP 2 chunks, its save plans in ``all_local_plans``) read from
    its opcodes equals, field by field, what Python's unpickler builds (the oracle, test-only)."""
    files = sorted(written.glob("*/torch_dist*/iter_0000007/.metadata"))
    assert len(files) == len(KINDS) * 2, files
    for path in files:
        real = unpickled(path)
        assert_same_as_unpickled(read_metadata(path), real, str(path))
        assert real.all_local_plans, "megatron-core no longer stores its save plans in .metadata"


def test_not_a_megatron_directory_is_one_error_line(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "import_megatron.py"), "--load",
                           str(tmp_path / "elsewhere"), "--save", str(tmp_path / "ours")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1
    assert "latest_checkpointed_iteration.txt" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "ours").exists()
