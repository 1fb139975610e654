"""Every entry point fails the same way (docs/troubleshooting.md): the trainer and each tool in
tools/, run as real subprocesses on bad input, must exit non-zero (2 for bad input), print exactly one
``error: ...`` line on stderr naming the problem (checked words), print no traceback, and write
nothing: every file that existed before keeps its sha256 and no file appears in the case's
directory or the shared inputs (a checkpoint, an HF export, a corpus). The sample-index cache may
gain files (it is a cache), but none of its files may change.

The cases run concurrently in one module fixture (most fail while parsing arguments, so the cost is
mostly interpreter and torch start-up); the checkpoint and export they need are built once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from hybrid.data.indexed_dataset import IndexedDatasetWriter
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import ROOT, load_entry, tiny_cli, tree_hashes

PY = sys.executable
ENTRY_POINTS = {
    "pretrain": [PY, "launch/pretrain_gpt.py"], "generate": [PY, "tools/generate.py"],
    "evaluate": [PY, "tools/evaluate.py"], "export_hf": [PY, "tools/export_hf.py"],
    "import_hf": [PY, "tools/import_hf.py"], "preprocess_data": [PY, "tools/preprocess_data.py"],
    "train_tokenizer": [PY, "tools/train_tokenizer.py"], "dry_run": [PY, "-m", "tools.dry_run"],
    "paper_tables": [PY, "-m", "tools.paper_tables"], "perf_estimate": [PY, "-m", "tools.perf_estimate"],
    "build_default_corpus": [PY, "tools/build_default_corpus.py"],
}
CASE_TIMEOUT_S = 300      # generous: the CI machine's two cores are shared


@dataclass
class Workspace:
    root: Path
    corpus: dict
    cache: Path
    ckpt: Path
    hf: Path
    shared: list[Path]     # read-only inputs every case may use

    def trainer(self, *extra: str) -> list[str]:
        return tiny_cli(self.corpus, self.cache, extra=list(extra))


@dataclass(frozen=True)
class Case:
    name: str
    tool: str
    argv: Callable[[Workspace, Path], list[str]]   # (workspace, empty case dir) -> arguments
    words: tuple[str, ...]                        # the error line must contain each


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _junk(path: Path, size: int = 256) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def _one_document(prefix: Path) -> Path:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document(np.arange(3, 103))
    return prefix


def _config(c: Path, name: str, text: str) -> list[str]:
    return ["--config", str(_write(c / name, text))]


# ---- the catalogue ---------------------------------------------------------------------------------

TRAINER = [
    Case("cfg-value-wrong-type", "pretrain", lambda w, c: _config(
        c, "a.yaml", "model: {num_layers: two}\n"), ("model.num_layers", "integer")),
    Case("cfg-number-is-text", "pretrain", lambda w, c: _config(
        c, "a.yaml", "optimizer: {lr: fast}\n"), ("optimizer.lr", "a number")),
    Case("cfg-bool-is-text", "pretrain", lambda w, c: _config(
        c, "a.yaml", "optimizer: {bf16: maybe}\n"), ("optimizer.bf16", "true or false")),
    Case("cfg-list-is-mapping", "pretrain", lambda w, c: _config(
        c, "a.yaml", "data: {data_path: {a: 1}}\n"), ("data.data_path", "list")),
    Case("cfg-section-not-mapping", "pretrain", lambda w, c: _config(
        c, "a.yaml", "model: 3\n"), ("config section 'model'", "mapping")),
    Case("cfg-file-not-mapping", "pretrain", lambda w, c: _config(
        c, "a.yaml", "- model\n"), ("mapping of sections",)),
    Case("cfg-invalid-yaml", "pretrain", lambda w, c: _config(
        c, "a.yaml", "model: [\n"), ("not valid YAML",)),
    Case("cfg-invalid-toml", "pretrain", lambda w, c: _config(
        c, "a.toml", "[model\n"), ("not valid TOML",)),
    Case("cfg-is-directory", "pretrain", lambda w, c: (
        (c / "dir.yaml").mkdir(), ["--config", str(c / "dir.yaml")])[1], ("is not a file",)),
    Case("cfg-unknown-key", "pretrain", lambda w, c: _config(
        c, "a.yaml", "model: {num_layyers: 3}\n"), ("num_layyers", "known keys")),
    Case("tokenizer-not-sentencepiece", "pretrain", lambda w, c: w.trainer(
        "--tokenizer-model", str(_write(c / "vocab.json", "{}"))), ("not a sentencepiece model",)),
    Case("tokenizer-is-directory", "pretrain", lambda w, c: w.trainer("--tokenizer-model", str(c)),
         ("is a directory",)),
    Case("offload-path-is-file", "pretrain", lambda w, c: w.trainer(
        "--offload-optimizer", "nvme", "--offload-nvme-path", str(_write(c / "f", "x"))),
         ("--offload-nvme-path", "it is a file")),
    Case("offload-path-unwritable", "pretrain", lambda w, c: w.trainer(
        "--offload-optimizer", "nvme", "--offload-nvme-path", "/proc/no-such/nvme"),
         ("--offload-nvme-path", "not a writable directory")),
    Case("zero-hpz-without-stage-3", "pretrain", lambda w, c: w.trainer(
        "--zero-stage", "1", "--zero-hpz"), ("--zero-hpz", "use --zero-stage 3")),
    Case("zero-hybrid-shard-on-one-host", "pretrain", lambda w, c: w.trainer(
        "--zero-stage", "2", "--zero-hybrid-shard"), ("--zero-hybrid-shard", "one host", "drop the flag")),
    Case("tensorboard-dir-is-file", "pretrain", lambda w, c: w.trainer(
        "--tensorboard-dir", str(_write(c / "f", "x"))), ("--tensorboard-dir", "it is a file")),
    Case("sequence-parallel-seq-not-divisible", "pretrain", lambda w, c: w.trainer(
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "15"),
         ("--seq-length 15", "--sequence-parallel")),
    Case("ffn-not-divisible-by-tp", "pretrain", lambda w, c: w.trainer(
        "--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"), ("ffn hidden size 33",)),
    Case("valid-split-empty-while-evaluating", "pretrain", lambda w, c: w.trainer(
        "--data-path", str(_one_document(c / "one")), "--eval-iters", "1", "--eval-interval", "1"),
         ("validation split", "--eval-iters 0")),
    Case("lr-not-a-number", "pretrain", lambda w, c: w.trainer("--lr", "nan"), ("--lr",)),
    Case("init-from-hf-not-hf", "pretrain", lambda w, c: w.trainer("--init-from-hf", str(c)),
         ("--init-from-hf", "Hugging Face")),
    Case("pp-with-zero3", "pretrain", lambda w, c: w.trainer(
        "--pipeline-model-parallel-size", "2", "--zero-stage", "3"),
         ("--zero-stage 3", "--pipeline-model-parallel-size", "2m gathers", "--zero-stage 1 or 2")),
    Case("pp-layers-not-divisible", "pretrain", lambda w, c: w.trainer(
        "--pipeline-model-parallel-size", "2", "--num-layers", "3"),
         ("--num-layers 3", "--pipeline-model-parallel-size 2")),
    Case("pp-virtual-not-divisor", "pretrain", lambda w, c: w.trainer(
        "--pipeline-model-parallel-size", "2", "--num-layers", "4",
        "--num-layers-per-virtual-pipeline-stage", "3"),
         ("--num-layers-per-virtual-pipeline-stage 3", "divisor of 2")),
    Case("pp-virtual-with-1f1b", "pretrain", lambda w, c: w.trainer(
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
        "--num-layers-per-virtual-pipeline-stage", "1"), ("interleaved", "go together")),
    Case("pp-unknown-schedule", "pretrain", lambda w, c: w.trainer(
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zigzag"),
         ("--pipeline-schedule", "zigzag", "1f1b")),
    Case("pp-world-not-divisible", "pretrain", lambda w, c: w.trainer(
        "--pipeline-model-parallel-size", "2"), ("1 ranks", "TP 1 x PP 2", "launch a multiple of 2")),
    Case("pp-interleaved-too-few-micro-batches", "pretrain", lambda w, c: w.trainer(
        "--dry-run", "--world-size", "8", "--gpus-per-node", "8", "--pipeline-model-parallel-size",
        "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
        "--global-batch-size", "4"), ("micro-batches per step (1)", "pipeline-model-parallel size 4",
                                      "--global-batch-size")),
]

GENERATE = [
    Case("gen-no-load", "generate", lambda w, c: [], ("--load",)),
    Case("gen-load-missing", "generate", lambda w, c: ["--load", str(c / "nope")], ("does not exist",)),
    Case("gen-load-empty-dir", "generate", lambda w, c: ["--load", str(c)], ("holds no checkpoint",)),
    Case("gen-corrupt-safetensors", "generate", lambda w, c: [
        "--load", str(_junk(c / "w.safetensors"))], ("not a readable safetensors file",)),
    Case("gen-prompt-ids-not-json", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--prompt-ids", "[[1, 2"], ("--prompt-ids", "not valid JSON")),
    Case("gen-prompt-ids-flat", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--prompt-ids", "[1, 2]"], ("list of token-id lists",)),
    Case("gen-prompt-id-out-of-vocab", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--prompt-ids", "[[99999]]"], ("99999", "token id")),
    Case("gen-negative-temperature", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--temperature", "-1"], ("--temperature",)),
    Case("gen-top-p-above-one", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--top-p", "2"], ("--top-p",)),
    Case("gen-zero-new-tokens", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--max-new-tokens", "0"], ("--max-new-tokens",)),
    Case("gen-top-k-not-int", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--top-k", "many"], ("--top-k",)),
    Case("gen-tokenizer-not-sentencepiece", "generate", lambda w, c: [
        "--load", str(w.ckpt), "--tokenizer-model", str(_write(c / "merges.txt", "a b\n"))],
         ("not a sentencepiece model",)),
]

EVALUATE = [
    Case("eval-zero-samples", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--eval-samples", "0"], ("--eval-samples",)),
    Case("eval-zero-micro-batch", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--micro-batch-size", "0"], ("--micro-batch-size",)),
    Case("eval-unknown-split-name", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--eval-split", "dev"], ("--eval-split",)),
    Case("eval-seq-longer-than-model", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--seq-length", "1000"], ("--seq-length 1000", "positions")),
    Case("eval-missing-data", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--data-path", str(c / "nope")], ("nope",)),
    Case("eval-bad-split", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--split", "a,b"], ("split", "numbers")),
    Case("eval-split-without-valid", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--split", "100,0,0"], ("no documents", "--split")),
    Case("eval-tokenizer-not-sentencepiece", "evaluate", lambda w, c: [
        "--load", str(w.ckpt), "--eod-mask-loss", "--tokenizer-model", str(_write(c / "t.json", "{}"))],
         ("not a sentencepiece model",)),
]

EXPORT = [
    Case("export-into-non-empty-dir", "export_hf", lambda w, c: [
        "--load", str(w.ckpt), "--out", str(_write(c / "out" / "notes.txt", "mine").parent)],
         ("not empty", "notes.txt", "--overwrite")),
    Case("export-onto-its-checkpoint", "export_hf", lambda w, c: [
        "--load", str(w.ckpt), "--out", str(w.ckpt), "--overwrite"], ("overlaps the input",)),
    Case("export-into-its-checkpoint", "export_hf", lambda w, c: [
        "--load", str(w.ckpt), "--out", str(w.ckpt / "hf")], ("overlaps the input",)),
    Case("export-out-is-file", "export_hf", lambda w, c: [
        "--load", str(w.ckpt), "--out", str(_write(c / "f", "x"))], ("is a file",)),
    Case("export-load-missing", "export_hf", lambda w, c: [
        "--load", str(c / "nope"), "--out", str(c / "out")], ("does not exist",)),
    Case("export-bad-dtype", "export_hf", lambda w, c: [
        "--load", str(w.ckpt), "--out", str(c / "out"), "--dtype", "fp8"], ("--dtype",)),
    Case("export-tokenizer-not-sentencepiece", "export_hf", lambda w, c: [
        "--load", str(w.ckpt), "--out", str(c / "out"), "--tokenizer-model", str(_write(c / "t", "x"))],
         ("not a sentencepiece model",)),
]

IMPORT = [
    Case("import-dir-missing", "import_hf", lambda w, c: [
        "--hf-dir", str(c / "nope"), "--out", str(c / "m.safetensors")], ("--hf-dir", "not a directory")),
    Case("import-not-hf-dir", "import_hf", lambda w, c: [
        "--hf-dir", str(_write(c / "hf" / "README", "x").parent), "--out", str(c / "m.safetensors")],
         ("not a Hugging Face model directory",)),
    Case("import-config-not-json", "import_hf", lambda w, c: [
        "--hf-dir", str(_hf_dir(c, "{")), "--out", str(c / "m.safetensors")],
         ("config.json", "not valid JSON")),
    Case("import-corrupt-weights", "import_hf", lambda w, c: [
        "--hf-dir", str(_hf_dir(c, (w.hf / "config.json").read_text())), "--out",
        str(c / "m.safetensors")], ("model.safetensors", "not a readable safetensors file")),
    Case("import-out-suffix", "import_hf", lambda w, c: [
        "--hf-dir", str(w.hf), "--out", str(c / "m.bin")], (".safetensors",)),
    Case("import-out-exists", "import_hf", lambda w, c: [
        "--hf-dir", str(w.hf), "--out", str(_write(c / "m.safetensors", "mine"))],
         ("already exist", "--overwrite")),
    Case("import-out-inside-hf-dir", "import_hf", lambda w, c: [
        "--hf-dir", str(w.hf), "--out", str(w.hf / "m.safetensors")], ("inside --hf-dir",)),
]

PREPROCESS = [
    Case("pre-input-missing", "preprocess_data", lambda w, c: [
        "--input", str(c / "nope.jsonl"), "--tokenizer-model", w.corpus["tokenizer"],
        "--output-prefix", str(c / "out")], ("nope.jsonl", "does not exist")),
    Case("pre-tokenizer-not-sentencepiece", "preprocess_data", lambda w, c: [
        "--input", str(_write(c / "a.txt", "text")), "--tokenizer-model", str(_write(c / "t", "x")),
        "--output-prefix", str(c / "out")], ("not a sentencepiece model",)),
    Case("pre-output-exists", "preprocess_data", lambda w, c: [
        "--input", str(_write(c / "a.txt", "text")), "--tokenizer-model", w.corpus["tokenizer"],
        "--output-prefix", str(_write(c / "out.bin", "mine").with_suffix(""))],
         ("already exist", "--overwrite")),
    Case("pre-output-is-input", "preprocess_data", lambda w, c: [
        "--input", str(_write(c / "a.idx", "text")), "--tokenizer-model", w.corpus["tokenizer"],
        "--output-prefix", str(c / "a"), "--overwrite"], ("is an input",)),
    Case("pre-invalid-json-line", "preprocess_data", lambda w, c: [
        "--input", str(_write(c / "a.jsonl", '{"text": "ok"}\n{"text": \n')),
        "--tokenizer-model", w.corpus["tokenizer"], "--output-prefix", str(c / "out")],
         ("a.jsonl:2", "not valid JSON")),
    Case("pre-missing-json-key", "preprocess_data", lambda w, c: [
        "--input", str(_write(c / "a.jsonl", '{"body": "x"}\n')), "--tokenizer-model",
        w.corpus["tokenizer"], "--output-prefix", str(c / "out")], ("--json-key",)),
    Case("pre-zero-workers", "preprocess_data", lambda w, c: [
        "--input", "a.txt", "--tokenizer-model", "t", "--output-prefix", "o", "--workers", "0"],
         ("--workers",)),
    Case("pre-output-under-a-file", "preprocess_data", lambda w, c: [
        "--input", str(_write(c / "a.txt", "text")), "--tokenizer-model", w.corpus["tokenizer"],
        "--output-prefix", str(_write(c / "f", "x") / "out")], ("is a file",)),
]

TOKENIZER = [
    Case("tok-vocab-too-small", "train_tokenizer", lambda w, c: [
        "--input", str(_write(c / "a.txt", "text")), "--vocab-size", "10",
        "--output-prefix", str(c / "tok")], ("--vocab-size 10", "at least 300")),
    Case("tok-input-missing", "train_tokenizer", lambda w, c: [
        "--input", str(c / "nope.txt"), "--output-prefix", str(c / "tok")], ("does not exist",)),
    Case("tok-output-exists", "train_tokenizer", lambda w, c: [
        "--input", str(_write(c / "a.txt", "text")),
        "--output-prefix", str(_write(c / "tok.model", "mine").with_suffix(""))],
         ("already exist", "--overwrite")),
    Case("tok-empty-corpus", "train_tokenizer", lambda w, c: [
        "--input", str(_write(c / "a.txt", "  \n\n")), "--output-prefix", str(c / "tok")],
         ("empty corpus",)),
    Case("tok-output-is-input", "train_tokenizer", lambda w, c: [
        "--input", str(_write(c / "a.model", "text")), "--output-prefix", str(c / "a"),
        "--overwrite"], ("is an input",)),
]

OTHER_TOOLS = [
    Case("dry-run-unknown-flag", "dry_run", lambda w, c: ["--jsn"], ("--jsn",)),
    Case("paper-tables-out-is-file", "paper_tables", lambda w, c: [
        "--out", str(_write(c / "f", "x"))], ("--out", "is a file")),
    Case("perf-missing-dims", "perf_estimate", lambda w, c: ["--hidden-size", "64"], ("--num-layers",)),
    Case("perf-heads-do-not-divide-hidden", "perf_estimate", lambda w, c: [
        "--num-layers", "2", "--hidden-size", "100", "--num-attention-heads", "16"],
         ("hidden size 100", "16 attention heads")),
    Case("perf-heads-not-split-by-tp", "perf_estimate", lambda w, c: [
        "--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "6",
        "--tensor-model-parallel-size", "4"], ("--num-attention-heads 6", "--tensor-model-parallel-size 4")),
    Case("perf-zero-tp", "perf_estimate", lambda w, c: [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--tensor-model-parallel-size", "0"], ("--tensor-model-parallel-size",)),
    Case("perf-zero-stage-5", "perf_estimate", lambda w, c: [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--zero-stage", "5"],
         ("--zero-stage",)),
    Case("corpus-vocab-too-small", "build_default_corpus", lambda w, c: [
        "--cache-dir", str(c / "cache"), "--vocab-size", "10"], ("--vocab-size 10",)),
    Case("corpus-cache-is-file", "build_default_corpus", lambda w, c: [
        "--cache-dir", str(_write(c / "f", "x"))], ("--cache-dir", "is a file")),
    Case("corpus-zero-max-bytes", "build_default_corpus", lambda w, c: [
        "--cache-dir", str(c / "cache"), "--max-bytes", "0"], ("--max-bytes",)),
]

CASES = TRAINER + GENERATE + EVALUATE + EXPORT + IMPORT + PREPROCESS + TOKENIZER + OTHER_TOOLS
# The default suite runs these (every entry point and every error class the issue names); the whole
# catalogue runs with the slow tests.
DEFAULT_SUITE = {
    "cfg-value-wrong-type", "cfg-section-not-mapping", "tokenizer-not-sentencepiece",
    "offload-path-is-file", "sequence-parallel-seq-not-divisible", "valid-split-empty-while-evaluating",
    "gen-prompt-ids-not-json", "eval-seq-longer-than-model", "export-into-non-empty-dir",
    "export-onto-its-checkpoint", "import-out-exists", "pre-output-is-input", "tok-vocab-too-small",
    "dry-run-unknown-flag", "paper-tables-out-is-file", "perf-heads-not-split-by-tp",
    "corpus-cache-is-file", "pp-with-zero3", "pp-interleaved-too-few-micro-batches",
}
PARAMS = [pytest.param(c, id=c.name, marks=() if c.name in DEFAULT_SUITE else pytest.mark.slow)
          for c in CASES]


def _hf_dir(c: Path, config_text: str) -> Path:
    """An HF-looking directory: ``config_text`` as config.json beside random bytes as weights."""
    _write(c / "hf" / "config.json", config_text)
    _junk(c / "hf" / "model.safetensors")
    return c / "hf"


# ---- running and judging ------------------------------------------------------------------------

@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    changed: list[str]          # files created, deleted or modified where nothing may be written


def _snapshot(w: Workspace, case_dir: Path) -> tuple[dict, dict]:
    return tree_hashes(case_dir, *w.shared), tree_hashes(w.cache)


def _changes(before: tuple[dict, dict], after: tuple[dict, dict]) -> list[str]:
    strict_before, cache_before = before
    strict_after, cache_after = after
    changed = sorted(k for k in set(strict_before) | set(strict_after)
                     if strict_before.get(k) != strict_after.get(k))
    return changed + sorted(k for k, h in cache_before.items() if cache_after.get(k) != h)


def _run(case: Case, w: Workspace) -> Outcome:
    case_dir = w.root / "cases" / case.name
    case_dir.mkdir(parents=True)
    argv = case.argv(w, case_dir)
    before = _snapshot(w, case_dir)
    proc = subprocess.run([*ENTRY_POINTS[case.tool], *argv], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=CASE_TIMEOUT_S)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, _changes(before, _snapshot(w, case_dir)))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    """A tiny corpus, a 2-iteration checkpoint trained on it and its HF export (in-process)."""
    from tools import export_hf
    root = tmp_path_factory.mktemp("entry_points")
    corpus = build_corpus(root / "corpus")
    cache, ckpt, hf = root / "cache", root / "ckpt", root / "hf"
    assert load_entry().main(tiny_cli(corpus, cache, extra=["--save", str(ckpt)])) == 0
    assert export_hf.main(["--load", str(ckpt), "--out", str(hf), "--no-tokenizer"]) == 0
    return Workspace(root, corpus, cache, ckpt, hf, shared=[root / "corpus", ckpt, hf])


@pytest.fixture(scope="module")
def outcomes(workspace, request) -> dict[str, Outcome]:
    """Every case this session selected, run concurrently (each its own subprocess and directory)."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bad_input_gives_one_error_line"]
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {case.name: pool.submit(_run, case, workspace) for case in selected}
        return {name: future.result() for name, future in futures.items()}


def test_catalogue_covers_every_entry_point():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
    assert {c.tool for c in CASES} == set(ENTRY_POINTS)
    assert {c.tool for c in CASES if c.name in DEFAULT_SUITE} == set(ENTRY_POINTS)
    assert DEFAULT_SUITE <= {c.name for c in CASES}


@pytest.mark.parametrize("case", PARAMS)
def test_bad_input_gives_one_error_line(outcomes, case):
    out = outcomes[case.name]
    both = out.stdout + out.stderr
    assert "Traceback" not in both, both
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, both
    for word in case.words:
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert out.returncode == 2, both
    assert out.changed == [], f"written or changed: {out.changed}"


# ---- the counterparts that must succeed -----------------------------------------------------------

def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    """YAML 1.1 reads 1e-3 as a string; the config accepts it as the number it is (and 5e6 for an
    integer field), while a flag still overrides it."""
    from pretrain.arguments import parse_args
    f = _write(tmp_path / "run.yaml", "optimizer: {lr: 1e-3, min_lr: 1e-5}\n"
                                      "parallel: {zero_bucket_size: 5e6}\n")
    cfg, _ = parse_args(["--config", str(f)])
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.parallel.zero_bucket_size) == (1e-3, 1e-5, 5_000_000)
    assert isinstance(cfg.parallel.zero_bucket_size, int)
    cfg, _ = parse_args(["--config", str(f), "--lr", "2e-3"])
    assert cfg.optimizer.lr == 2e-3


def test_export_overwrite_replaces_only_its_own_files(workspace, tmp_path):
    """--overwrite into a directory with a user's file and a stale export: the user's file is kept
    byte for byte, every export file is new, and a stale tokenizer the new export lacks is gone."""
    from tools import export_hf
    out = tmp_path / "out"
    _write(out / "notes.txt", "mine")
    _write(out / "tokenizer.model", "stale")
    _write(out / "config.json", "stale")
    assert export_hf.main(["--load", str(workspace.ckpt), "--out", str(out), "--no-tokenizer",
                           "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "tokenizer.model").exists()
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                      "model.safetensors", "notes.txt"]
    assert not list(tmp_path.glob(".*staging*"))   # the staging directory is gone


def test_evaluate_clamps_to_the_split_and_says_so(workspace, capsys):
    """More --eval-samples than the validation split has distinct samples: a warning on stderr and
    every distinct sample evaluated once (the same number as asking for exactly that many)."""
    from tools import evaluate
    assert evaluate.main(["--load", str(workspace.ckpt), "--eval-samples", "100000"]) == 0
    captured = capsys.readouterr()
    clamped = json.loads(captured.out.strip().splitlines()[-1])
    assert "warning: the valid split has only" in captured.err
    assert 0 < clamped["samples"] < 100000
    assert evaluate.main(["--load", str(workspace.ckpt), "--eval-samples", str(clamped["samples"])]) == 0
    exact = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert exact == clamped


def test_preprocess_overwrite_replaces_only_bin_and_idx(workspace, tmp_path):
    """--overwrite re-tokenizes into an existing prefix: .bin/.idx are the new corpus, a neighbour
    file (the tokenizer kept beside the data, say) is untouched."""
    from hybrid.data.indexed_dataset import IndexedDataset
    from tools import preprocess_data
    text = _write(tmp_path / "doc.txt", "def f(x):\n    return x\n")
    prefix = tmp_path / "data" / "corpus"
    neighbour = _write(tmp_path / "data" / "notes.txt", "mine")
    _write(Path(f"{prefix}.bin"), "old")
    _write(Path(f"{prefix}.idx"), "old")
    argv = ["--input", str(text), "--tokenizer-model", workspace.corpus["tokenizer"],
            "--output-prefix", str(prefix)]
    assert preprocess_data.main(argv + ["--overwrite"]) == 0
    assert IndexedDataset(prefix).num_documents == 1
    assert neighbour.read_text() == "mine"
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["corpus.bin", "corpus.idx", "notes.txt"]
