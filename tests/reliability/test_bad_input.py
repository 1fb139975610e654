"""Bad input never hangs and never loses data (docs/design.md §9, §10): a catalogue of wrong
parallel layouts, broken data files, damaged checkpoints and bad command lines, each run through the
real entry point ``launch/pretrain_gpt.py`` (in-process ``main(argv)``, a few as subprocesses).

Every case must: return exit code 2, print exactly one ``error: ...`` line naming the problem (and
the fix), print no traceback, finish within a deadline, and leave every file of every existing
checkpoint byte-identical (sha256 of the trees before and after)."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid.data.indexed_dataset import IndexedDatasetWriter
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import ENTRY, ROOT, load_entry, tiny_cli, tree_hashes

DEADLINE_S = 60


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Corpus, a good checkpoint (2 iterations) and the entry module, built once."""
    root = tmp_path_factory.mktemp("bad_input")
    corpus = build_corpus(root / "corpus")
    entry = load_entry()
    good = root / "good_ckpt"
    assert entry.main(tiny_cli(corpus, root / "cache", extra=["--save", str(good)])) == 0
    return {"root": root, "corpus": corpus, "entry": entry, "good": good, "cache": root / "cache"}


# ---- case builders: each returns (argv extra flags, env vars) for a fresh case directory ----------

def _data_variant(env, case: Path, mutate) -> list[str]:
    """Copy the corpus to ``case`` and damage it with ``mutate(prefix)``."""
    prefix = case / "corpus"
    for suffix in (".bin", ".idx"):
        shutil.copy(env["corpus"]["prefix"] + suffix, str(prefix) + suffix)
    mutate(prefix)
    return ["--data-path", str(prefix)]


def _patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: Path, keep: int | None = None, drop: int = 0) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(keep if keep is not None else size - drop)


def _write_dataset(prefix: Path, docs: list[np.ndarray]) -> None:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)


def _ckpt_variant(env, case: Path, mutate) -> list[str]:
    """Copy the good checkpoint to ``case/ckpt`` and damage its iteration directory."""
    ckpt = case / "ckpt"
    shutil.copytree(env["good"], ckpt)
    it = ckpt / (ckpt / "latest").read_text().strip()
    mutate(it)
    return ["--load", str(ckpt), "--save", str(ckpt)]


def _flip_middle_byte(it: Path) -> None:
    shard = it / "rank_00000.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def _newer_format(it: Path) -> None:
    manifest = json.loads((it / "manifest.json").read_text())
    manifest["format_version"] = 99
    (it / "manifest.json").write_text(json.dumps(manifest))


def _file_in_the_way(case: Path) -> list[str]:
    (case / "afile").write_text("not a directory")
    return ["--save", str(case / "afile" / "ckpt")]


# (id, builder(env, case) -> extra argv, env vars, words the message must contain)
CASES = [
    # -- parallel layout (world size from the environment, as torchrun sets it) --
    ("world-not-divisible-by-tp", lambda e, c: ["--tensor-model-parallel-size", "2"],
     {"WORLD_SIZE": "3"}, ["3 ranks", "groups of 2", "--tensor-model-parallel-size"]),
    ("tp-larger-than-heads", lambda e, c: ["--tensor-model-parallel-size", "4"],
     {"WORLD_SIZE": "4"}, ["--num-attention-heads 2", "not divisible", "TP degree"]),
    ("heads-not-divisible-by-tp", lambda e, c: ["--tensor-model-parallel-size", "4",
                                                "--hidden-size", "24", "--num-attention-heads", "6"],
     {"WORLD_SIZE": "4"}, ["--num-attention-heads 6", "--tensor-model-parallel-size 4"]),
    ("hidden-not-divisible-by-tp", lambda e, c: ["--tensor-model-parallel-size", "4",
                                                 "--hidden-size", "18"],
     {"WORLD_SIZE": "4"}, ["--hidden-size 18", "--tensor-model-parallel-size 4"]),
    ("hidden-not-divisible-by-heads", lambda e, c: ["--hidden-size", "30", "--num-attention-heads", "4"],
     {}, ["hidden size 30", "4 attention heads", "--hidden-size"]),
    ("seq-over-max-positions", lambda e, c: ["--max-position-embeddings", "8"], {},
     ["--seq-length 16", "--max-position-embeddings 8"]),
    ("global-batch-not-divisible", lambda e, c: ["--global-batch-size", "6"], {"WORLD_SIZE": "2"},
     ["global batch 6", "micro batch 2", "--global-batch-size"]),
    ("zero-stage-out-of-range", lambda e, c: ["--zero-stage", "4"], {}, ["--zero-stage", "0, 1, 2 or 3"]),
    ("tp-group-crosses-nodes", lambda e, c: ["--tensor-model-parallel-size", "4",
                                             "--num-attention-heads", "4"],
     {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, ["node", "allow-tp-across-nodes"]),
    ("preset-world-size-mismatch", lambda e, c: ["--world-size", "8"], {},
     ["--world-size 8", "1 ranks"]),
    ("bf16-and-fp16", lambda e, c: ["--bf16", "--fp16"], {}, ["--bf16 and --fp16", "pick one"]),
    ("min-lr-above-lr", lambda e, c: ["--min-lr", "1"], {}, ["--min-lr", "lower"]),
    # -- data --
    ("missing-idx", lambda e, c: _data_variant(e, c, lambda p: Path(f"{p}.idx").unlink()), {},
     ["corpus.idx"]),
    ("missing-bin", lambda e, c: _data_variant(e, c, lambda p: Path(f"{p}.bin").unlink()), {},
     ["corpus.bin"]),
    ("truncated-idx", lambda e, c: _data_variant(e, c, lambda p: _truncate(Path(f"{p}.idx"), drop=8)),
     {}, ["corpus.idx", "truncated", "rebuild"]),
    ("idx-shorter-than-header", lambda e, c: _data_variant(
        e, c, lambda p: _truncate(Path(f"{p}.idx"), keep=10)), {}, ["truncated", "rebuild"]),
    ("truncated-bin", lambda e, c: _data_variant(e, c, lambda p: _truncate(Path(f"{p}.bin"), drop=64)),
     {}, ["corpus.bin"]),
    ("wrong-magic", lambda e, c: _data_variant(
        e, c, lambda p: _patch_bytes(Path(f"{p}.idx"), 0, b"NOTANIDX\x00")), {}, ["magic"]),
    ("wrong-version", lambda e, c: _data_variant(
        e, c, lambda p: _patch_bytes(Path(f"{p}.idx"), 9, struct.pack("<Q", 7))), {},
     ["version 7", "supported"]),
    ("unknown-dtype-code", lambda e, c: _data_variant(
        e, c, lambda p: _patch_bytes(Path(f"{p}.idx"), 17, bytes([42]))), {}, ["dtype code 42"]),
    ("dtype-mismatch", lambda e, c: _data_variant(
        e, c, lambda p: _patch_bytes(Path(f"{p}.idx"), 17, bytes([4]))), {}, ["corpus"]),
    ("token-ids-over-vocab", lambda e, c: (_write_dataset(c / "big", [np.arange(990, 1010)] * 40),
                                           ["--data-path", str(c / "big")])[1], {},
     ["token id", "vocab size"]),
    ("empty-corpus", lambda e, c: (_write_dataset(c / "empty", []), ["--data-path", str(c / "empty")])[1],
     {}, ["empty"]),
    ("missing-tokenizer-model", lambda e, c: ["--tokenizer-model", str(c / "tok.model")], {},
     ["tok.model", "does not exist", "train one"]),
    # -- checkpoints (loaded with --load = --save: a failing resume must not overwrite anything) --
    ("truncated-shard", lambda e, c: _ckpt_variant(
        e, c, lambda it: _truncate(it / "rank_00000.safetensors", drop=100)), {},
     ["truncated shard", "rank_00000", "copy it again"]),
    ("hash-mismatch", lambda e, c: _ckpt_variant(e, c, _flip_middle_byte), {},
     ["hash mismatch", "rank_00000"]),
    ("missing-shard", lambda e, c: _ckpt_variant(
        e, c, lambda it: (it / "rank_00000.safetensors").unlink()), {}, ["missing shard", "rank_00000"]),
    ("other-model-dims", lambda e, c: ["--load", str(e["good"]), "--hidden-size", "32"], {},
     ["other dims", "hidden-size: checkpoint 16 vs this run 32"]),
    ("newer-format-version", lambda e, c: _ckpt_variant(e, c, _newer_format), {},
     ["format 99", "update the code"]),
    ("no-manifest", lambda e, c: _ckpt_variant(e, c, lambda it: (it / "manifest.json").unlink()), {},
     ["manifest.json", "interrupted save"]),
    ("latest-names-deleted-dir", lambda e, c: _ckpt_variant(e, c, shutil.rmtree), {},
     ["does not exist", "latest"]),
    ("load-dir-without-checkpoint", lambda e, c: ["--load", str(c)], {}, ["no checkpoint", "--load"]),
    # -- command line --
    ("unknown-flag", lambda e, c: ["--hidden-sise", "32"], {}, ["--hidden-sise", "--hidden-size"]),
    ("zero-hidden-size", lambda e, c: ["--hidden-size", "0"], {}, ["--hidden-size", "positive"]),
    ("negative-micro-batch", lambda e, c: ["--micro-batch-size", "-2"], {},
     ["--micro-batch-size", "positive"]),
    ("zero-train-iters", lambda e, c: ["--train-iters", "0"], {}, ["--train-iters", "positive"]),
    ("non-integer-size", lambda e, c: ["--num-layers", "two"], {}, ["--num-layers", "two"]),
    ("missing-config-file", lambda e, c: ["--config", str(c / "nope.yaml")], {},
     ["nope.yaml", "does not exist"]),
    ("bad-split", lambda e, c: ["--split", "a,b"], {}, ["--split", "969,30,1"]),
    ("bad-recompute-mode", lambda e, c: ["--recompute", "sometimes"], {}, ["--recompute"]),
    ("zero-distributed-timeout", lambda e, c: ["--distributed-timeout-minutes", "0"], {},
     ["--distributed-timeout-minutes", "positive"]),
    ("unwritable-save-dir", lambda e, c: _file_in_the_way(c), {}, ["--save", "writable"]),
]


class _Deadline:
    """SIGALRM after ``seconds``: an in-process case that hangs fails instead of blocking CI."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def fire(signum, frame):
            raise TimeoutError(f"case still running after {self.seconds} s (a hang)")
        self.previous = signal.signal(signal.SIGALRM, fire)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


def _check_output(stderr: str, words: list[str]) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    line = errors[0]
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    return line


def _case_dir(env, name: str) -> Path:
    case = env["root"] / "cases" / name
    case.mkdir(parents=True)
    return case


@pytest.mark.parametrize("name,build,env_vars,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_case(env, name, build, env_vars, words, capsys, monkeypatch):
    case = _case_dir(env, name)
    extra = build(env, case)
    for key, value in env_vars.items():
        monkeypatch.setenv(key, value)
    before = tree_hashes(env["good"], case)
    capsys.readouterr()
    start = time.monotonic()
    with _Deadline(DEADLINE_S):
        code = env["entry"].main(tiny_cli(env["corpus"], env["cache"], extra=extra))
    elapsed = time.monotonic() - start
    _check_output(capsys.readouterr().err, words)
    assert code == 2
    assert elapsed < DEADLINE_S
    assert tree_hashes(env["good"], case) == before     # nothing written, nothing deleted


def test_catalogue_is_large_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,extra_of", [
    ("cli-unknown-flag", lambda e, c: ["--num-layerz", "2"]),
    ("cli-truncated-shard", lambda e, c: _ckpt_variant(
        e, c, lambda it: _truncate(it / "rank_00000.safetensors", drop=100))),
])
def test_bad_input_real_process(env, name, extra_of):
    """The same through a real ``python launch/pretrain_gpt.py`` process: exit status 2, one line."""
    case = _case_dir(env, name)
    extra = extra_of(env, case)
    before = tree_hashes(env["good"], case)
    proc = subprocess.run([sys.executable, str(ENTRY), *tiny_cli(env["corpus"], env["cache"],
                                                                  extra=extra)],
                          capture_output=True, text=True, timeout=DEADLINE_S, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 2, proc.stderr
    _check_output(proc.stderr, [])
    assert tree_hashes(env["good"], case) == before


def test_bad_data_under_torchrun_exits_every_rank(env):
    """Two ranks, a truncated .idx: rank 0 fails while the other waits at a barrier; torchrun ends
    the job at once (no hang until the process-group timeout) with rank 0's one-line error."""
    from tests.reliability_helpers import torchrun
    case = _case_dir(env, "torchrun-truncated-idx")
    extra = _data_variant(env, case, lambda p: _truncate(Path(f"{p}.idx"), drop=8))
    start = time.monotonic()
    proc = subprocess.run(torchrun(2, tiny_cli(env["corpus"], env["cache"], extra=extra)),
                          capture_output=True, text=True, timeout=DEADLINE_S * 2, cwd=ROOT,
                          env=child_env())
    assert proc.returncode != 0
    assert time.monotonic() - start < DEADLINE_S
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all("truncated" in line and "rebuild" in line for line in errors)
