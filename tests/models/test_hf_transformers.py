"""Our HF export loads in Hugging Face transformers and gives our logits (tools/export_hf.py).

transformers is not a project dependency: it lives in the test-only environment of
:mod:`tests.models.hf_env` (built by ``launch/run_tests.sh`` before the suite, never inside it), and a small
script runs there. ``GPT2LMHeadModel.from_pretrained`` loads the export of a random model
(non-trivial biases and LayerNorms, vocab padded at TP 1) and its fp32 logits must match our
GPTModel's to 1e-4 (max abs); ``AutoTokenizer`` must encode and decode like our
sentencepiece tokenizer.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid.data.tokenizer import Tokenizer, train_tokenizer
from hybrid.parallel_state import ParallelState
from models.gpt.config import GPTConfig
from models.gpt.weights import build_model, save_canonical
from tests.models import hf_env
from tests.models.test_hf_export import random_canonical

TEXTS = ["def add(a, b):\n    return a + b\n", "  indented\n\nand blank lines", "héllo wörld 123",
         "import os\nprint(os.getcwd())"]

SCRIPT = r"""
import json, sys, torch, transformers
from safetensors.torch import save_file
model_dir, tokens, texts, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
model = transformers.GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor(tokens)).logits.contiguous()
save_file({"logits": logits}, out + ".safetensors")
tok = transformers.AutoTokenizer.from_pretrained(model_dir)
ids = [tok.encode(t) for t in texts]
json.dump({"version": transformers.__version__, "ids": ids, "decoded": [tok.decode(i) for i in ids],
           "eos": tok.eos_token_id, "tied": model.lm_head.weight.data_ptr() ==
           model.transformer.wte.weight.data_ptr()}, open(out + ".json", "w"))
"""

@pytest.fixture(scope="module")
def hf_python() -> str:
    python = hf_env.ready_python()
    if python is None:
        pytest.skip("the transformers test environment is not built: run `python -m tests.models.hf_env` "
                    "(launch/run_tests.sh does before the suite)")
    return python


def test_transformers_loads_export_with_same_logits_and_tokenizer(tmp_path, hf_python):
    from tools import export_hf
    spm_model = train_tokenizer(TEXTS * 20, tmp_path / "spm", 400)
    ours_tok = Tokenizer(spm_model)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                       vocab_size=ours_tok.vocab_size, seq_length=24,
                       hidden_dropout=0.0, attention_dropout=0.0)
    canonical = random_canonical(config, seed=5, scale=8.0)  # GELU variants differ here
    weights = save_canonical(tmp_path / "w.safetensors", canonical, config)
    out_dir = tmp_path / "hf"
    assert export_hf.main(["--load", str(weights), "--out", str(out_dir),
                           "--tokenizer-model", spm_model]) == 0
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    result = tmp_path / "result"
    run = subprocess.run([hf_python, "-c", SCRIPT, str(out_dir), json.dumps(tokens.tolist()),
                          json.dumps(TEXTS), str(result)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(str(result) + ".safetensors")["logits"]
    model = build_model(config, ParallelState.single_process(), canonical)
    with torch.no_grad():
        ours = model(tokens)[..., :config.vocab_size]
    diff = (theirs - ours).abs().max().item()
    assert diff < 1e-4, f"max |logits diff| = {diff}"
    meta = json.loads(Path(str(result) + ".json").read_text())
    assert meta["tied"], "lm_head is not tied to wte after from_pretrained"
    assert meta["eos"] == ours_tok.eod
    assert meta["ids"] == [ours_tok.encode(t) for t in TEXTS], meta["version"]
    assert meta["decoded"] == TEXTS
