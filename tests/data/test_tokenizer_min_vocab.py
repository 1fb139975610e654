"""A vocab size too small for sentencepiece's trainer is refused before training, naming the
smallest that works (hybrid.data.tokenizer.sentencepiece_min_vocab); under the launcher the
trainer's --vocab-size on the default corpus is one ``error:`` line, exit 2, no restart advice."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from hybrid.data import tokenizer
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import ROOT


def _texts() -> list[str]:
    """Documents over ~150 distinct characters of uneven frequency (ASCII words, then rarer
    accented and Greek letters), so the required characters are a strict subset."""
    rng = random.Random(3)
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xC0, 0xFF)] + [
        chr(c) for c in range(0x3B1, 0x3C9)]
    weights = [1.0 / (i + 1) ** 1.3 for i in range(len(alphabet))]
    return ["".join(rng.choices(alphabet, weights, k=400)) + "\n" + " ".join(["def f(x):"] * 20)
            for _ in range(60)]


def test_min_vocab_is_sentencepieces_own_threshold(tmp_path, monkeypatch):
    texts = _texts()
    needed = tokenizer.sentencepiece_min_vocab(list(tokenizer.training_chunks(texts)))
    assert 300 < needed < 256 + 3 + len(set("".join(texts)))   # a subset of the characters
    with pytest.raises(ValueError, match=f"use --vocab-size {needed} or more"):
        tokenizer.train_tokenizer(texts, tmp_path / "small", needed - 1)
    tokenizer.train_tokenizer(texts, tmp_path / "ok", needed)             # the threshold trains
    monkeypatch.setattr(tokenizer, "sentencepiece_min_vocab", lambda chunks: 0)
    with pytest.raises(RuntimeError, match=f"{needed - 1} vs {needed}"):  # sentencepiece's own refusal
        tokenizer.train_tokenizer(texts, tmp_path / "below", needed - 1)


@pytest.mark.slow
def test_trainer_vocab_too_small_for_the_default_corpus_is_one_line(tmp_path):
    args = [sys.executable, "launch/torchrun.py", "--standalone", "--nproc-per-node", "2",
            "launch/pretrain_gpt.py", "--vocab-size", "301", "--train-iters", "1", "--eval-iters", "0",
            "--data-cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "use --vocab-size" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr, proc.stderr[-3000:]
