"""Trust nothing before its hash (docs/design.md §8): every byte of a checkpoint file - the
safetensors header and its piece index included - is checked against the manifest before it is
used, and every refusal names the file and what is wrong with it.

In-process: an edited piece index, a corrupted header length, an unreadable manifest and a
``latest`` pointing outside the directory are each refused by name. Out of process: the trainer
(``--load``) and tools/evaluate.py, generate.py and export_hf.py on a checkpoint whose rank-file
header was edited exit with status 2 and one ``error:`` line naming the file, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import CheckpointError, CheckpointReader
from hybrid.checkpoint.format import LATEST_FILE, MANIFEST_FILE, Piece, rank_file_name
from hybrid.checkpoint.writer import save_checkpoint
from hybrid.parallel_state import ParallelState
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import ENTRY, ROOT, tiny_cli


def _edit_piece_index(path: Path) -> None:
    """Change one field of the JSON piece index in place, keeping the file's size (so only a hash
    can tell): the first piece now claims to be TP rank 1's."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = data[8:8 + length]
    edited = header.replace(b'\\"tp_rank\\": 0', b'\\"tp_rank\\": 1', 1)
    assert edited != header and len(edited) == len(header)
    path.write_bytes(data[:8] + edited + data[8 + length:])


@pytest.fixture
def saved(tmp_path) -> Path:
    world = ParallelState.single_process().world
    pieces = [Piece("w", "master", (4, 2), 0, 0, 1, 0, torch.arange(8.0)),
              Piece("b", "master", (3,), -1, 0, 1, 0, torch.ones(3))]
    return save_checkpoint(tmp_path, 1, pieces, {}, {"note": 1}, world, run_id="run-a")


def test_edited_piece_index_is_refused_before_it_is_parsed(saved):
    _edit_piece_index(saved / rank_file_name(0))
    for verify in ("lazy", "all"):
        with pytest.raises(CheckpointError, match=r"rank_00000.safetensors"):
            CheckpointReader(saved, verify=verify)
    with pytest.raises(CheckpointError, match=r"hash mismatch for the safetensors header of "
                                              r".*rank_00000.safetensors"):
        CheckpointReader(saved)


def test_corrupted_header_length_is_refused_by_name(saved):
    path = saved / rank_file_name(0)
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) * 4).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted header in .*rank_00000.safetensors: it "
                                              r"declares \d+ header bytes"):
        CheckpointReader(saved)


@pytest.mark.parametrize("text", ["{not json", '{"files": 3}', '{"files": {"../x": {}}}', "[]"])
def test_unreadable_manifest_is_refused_by_name(saved, text):
    (saved / MANIFEST_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=r"manifest.json is not a valid checkpoint manifest"):
        CheckpointReader(saved)


def test_latest_must_name_an_iteration_directory_inside(saved):
    (saved.parent / LATEST_FILE).write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"latest names '../../etc', not an iteration"):
        CheckpointReader(saved.parent)


# ---- real entry points -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corrupted(tmp_path_factory) -> tuple[dict, Path, Path]:
    """A tiny trainer checkpoint whose rank file's piece index was edited."""
    root = tmp_path_factory.mktemp("integrity")
    corpus = build_corpus(root / "corpus")
    save = root / "ckpt"
    done = subprocess.run([sys.executable, str(ENTRY), *tiny_cli(corpus, root / "cache", iters=2,
                                                                   extra=["--save", str(save)])],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    rank_file = save / "iter_0000002" / rank_file_name(0)
    _edit_piece_index(rank_file)
    return corpus, save, rank_file


@pytest.mark.parametrize("entry", ["trainer", *(pytest.param(e, marks=pytest.mark.slow)   # CI budget
                                   for e in ("evaluate", "generate", "export_hf"))])
def test_every_entry_point_refuses_an_edited_header(corrupted, tmp_path, entry):
    corpus, save, rank_file = corrupted
    commands = {
        "trainer": [str(ENTRY), *tiny_cli(corpus, tmp_path / "cache", iters=4,
                                          extra=["--save", str(save), "--load", str(save)])],
        "evaluate": ["tools/evaluate.py", "--load", str(save), "--data-path", corpus["prefix"],
                     "--tokenizer-model", corpus["tokenizer"], "--eval-samples", "2"],
        "generate": ["tools/generate.py", "--load", str(save), "--prompt-ids", "[[5, 6]]",
                     "--max-new-tokens", "2"],
        "export_hf": ["tools/export_hf.py", "--load", str(save), "--out", str(tmp_path / "hf"),
                      "--no-tokenizer"],
    }
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    proc = subprocess.run([sys.executable, *commands[entry]], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=child_env())
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert len(errors) == 1 and str(rank_file) in errors[0] and "header" in errors[0], errors
    assert "Traceback" not in proc.stderr
    after = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()
             if p.name != "job.lock"}
    assert after == {p: b for p, b in before.items() if p.name != "job.lock"}
    assert not (tmp_path / "hf").exists()
