"""In transformers' own venv (tests/models/hf_env.py, as tests/models/test_hf_transformers.py): exports write a
``tokenizer.json`` that ``AutoTokenizer`` loads with sentencepiece blocked and that encodes and
decodes like our tokenizer - a byte-level BPE (GPT-2 and Llama exports) and a converted
sentencepiece model - and greedy generation with our KV cache, on a random ``LlamaForCausalLM``
imported at TP 1 and TP 2, equals transformers' ``generate``."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hybrid.data.tokenizer import Tokenizer, train_tokenizer
from hybrid.generation import SamplingParams, generate
from hybrid.parallel_state import ParallelState
from models.gpt.config import GPTConfig
from models.gpt.hf import load_hf_directory
from models.gpt.weights import build_model, save_canonical
from tests.models.test_gpt_options import LLAMA
from tests.models.test_hf_export import random_canonical
from tests.models.test_hf_transformers import TEXTS, hf_python  # noqa: F401 (fixture)

TOKENIZER_SCRIPT = r"""
import json, sys
sys.modules["sentencepiece"] = None      # AutoTokenizer must not need it
import transformers
model_dir, texts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
tok = transformers.AutoTokenizer.from_pretrained(model_dir)
ids = [tok.encode(t) for t in texts]
json.dump({"version": transformers.__version__, "class": type(tok).__name__, "ids": ids,
           "decoded": [tok.decode(i) for i in ids], "eos": tok.eos_token_id}, open(out, "w"))
"""

GENERATE_SCRIPT = r"""
import json, sys, torch, transformers
out_dir, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=203, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
model = transformers.LlamaForCausalLM(config).eval()
model.save_pretrained(out_dir, safe_serialization=True)
with torch.no_grad():
    ids = torch.tensor(prompts)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
json.dump(out.tolist(), open(out_dir + "/generated.json", "w"))
"""


def _auto_tokenizer(hf_python: str, model_dir: Path, tmp_path: Path) -> dict:
    out = tmp_path / "tok.json"
    run = subprocess.run([hf_python, "-c", TOKENIZER_SCRIPT, str(model_dir), json.dumps(TEXTS),
                          str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind,llama", [("bpe", False), ("bpe", True), ("sentencepiece", True)],
                         ids=["bpe-gpt2", "bpe-llama", "sentencepiece-llama"])
def test_export_tokenizer_json_loads_in_auto_tokenizer(tmp_path, hf_python, kind, llama):  # noqa: F811
    from tools import export_hf
    model = train_tokenizer(TEXTS * 20, tmp_path / "tok", 400, kind=kind)
    ours = Tokenizer(model)
    options = LLAMA if llama else {}
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                       vocab_size=ours.vocab_size, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0, **options)
    weights = save_canonical(tmp_path / "w.safetensors", random_canonical(config, seed=1), config)
    out_dir = tmp_path / "hf"
    assert export_hf.main(["--load", str(weights), "--out", str(out_dir),
                           "--tokenizer-model", model]) == 0
    assert (out_dir / "tokenizer.json").is_file()
    assert (out_dir / "tokenizer.model").is_file() == (kind == "sentencepiece")
    hf_config = json.loads((out_dir / "config.json").read_text())
    assert hf_config["model_type"] == ("llama" if llama else "gpt2")
    assert hf_config["eos_token_id"] == ours.eod
    meta = _auto_tokenizer(hf_python, out_dir, tmp_path)
    assert meta["ids"] == [ours.encode(t) for t in TEXTS], meta
    assert meta["decoded"] == TEXTS
    assert meta["eos"] == ours.eod


def _generate_on_ranks(rank, world_size, hf_dir, prompts, new):
    from hybrid.topology import Topology
    state = (ParallelState.single_process() if world_size == 1 else
             ParallelState.initialize(Topology(world_size, world_size, gpus_per_node=world_size)))
    canonical, config = load_hf_directory(hf_dir, make_vocab_size_divisible_by=1)
    model = build_model(config, state, canonical)
    assert hasattr(model, "new_kv_cache")
    greedy = SamplingParams(temperature=0.0)
    cached = generate(model, torch.tensor(prompts), new, greedy, use_cache=True)
    uncached = generate(model, torch.tensor(prompts), new, greedy, use_cache=False)
    return cached.tolist(), uncached.tolist()


def test_greedy_generation_with_kv_cache_equals_transformers_generate(tmp_path, hf_python):  # noqa: F811
    from hybrid.testing.multirank import run_on_ranks
    prompts = torch.randint(0, 203, (2, 6), generator=torch.Generator().manual_seed(3)).tolist()
    new = 20
    hf_dir = str(tmp_path / "hf")
    run = subprocess.run([hf_python, "-c", GENERATE_SCRIPT, hf_dir, json.dumps(prompts), str(new)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(Path(hf_dir, "generated.json").read_text())
    assert len(theirs[0]) == 6 + new
    ours = [_generate_on_ranks(0, 1, hf_dir, prompts, new)]
    ours += run_on_ranks(_generate_on_ranks, 2, args=(hf_dir, prompts, new), timeout=300)
    for cached, uncached in ours:
        assert cached == theirs
        assert uncached == theirs
