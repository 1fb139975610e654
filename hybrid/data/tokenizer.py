"""The tokenizer of the GPT data pipeline: a sentencepiece BPE model with byte fallback.

Byte fallback means any UTF-8 text encodes (unknown characters become their bytes) and the
normalisation is the identity, so ``decode(encode(text)) == text`` for ordinary text, including the
indentation and newlines of source code. The end-of-document id (``eod``) is the model's ``</s>``;
the preprocessing tool appends it after every document, as Megatron does.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import sentencepiece as spm

log = logging.getLogger(__name__)

# sentencepiece reads at most this many bytes per "sentence"; longer chunks are split.
MAX_PIECE_INPUT = 8192
UNK_ID, BOS_ID, EOD_ID = 0, 1, 2


class TokenizerError(ValueError):
    """A tokenizer model that is not a readable sentencepiece model; the message says what to pass."""


class Tokenizer:
    """A thin wrapper around a sentencepiece model: encode/decode, vocab_size, eod."""

    def __init__(self, model_path: str | Path):
        path = str(model_path)
        if os.path.isdir(path):
            raise TokenizerError(f"tokenizer model {path!r} is a directory; pass the .model file "
                                 f"inside it (tools/train_tokenizer.py writes PREFIX.model)")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model {path!r} does not exist; train one with "
                                    "tools/train_tokenizer.py")
        self.model_path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as err:   # sentencepiece: "could not parse ModelProto"
            raise TokenizerError(
                f"tokenizer model {path!r} is not a sentencepiece model ({' '.join(str(err).split())}); "
                f"pass the .model file tools/train_tokenizer.py wrote (Hugging Face tokenizer.json "
                f"and GPT-2 vocab/merges files are not supported)") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def eod(self) -> int:
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"tokenizer {self.model_path!r} defines no end-of-document id; "
                             "retrain it with tools/train_tokenizer.py")
        return eos

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def training_chunks(texts: Iterable[str]) -> Iterator[str]:
    """Cut documents into paragraph-sized chunks that sentencepiece's trainer accepts.

    Chunks keep their newlines so BPE learns newline and indentation pieces."""
    for text in texts:
        for para in text.split("\n\n"):
            if not para.strip():
                continue
            data = para.encode("utf-8")
            # cut on a character boundary at or below the trainer's byte limit
            while len(data) > MAX_PIECE_INPUT:
                cut = MAX_PIECE_INPUT
                while (data[cut] & 0xC0) == 0x80:
                    cut -= 1
                yield data[:cut].decode("utf-8")
                data = data[cut:]
            yield data.decode("utf-8")


def train_tokenizer(texts: Iterable[str], output_prefix: str | Path, vocab_size: int,
                    num_threads: int = 1) -> str:
    """Train a BPE model on ``texts`` (an iterable of documents); returns the ``.model`` path.

    Deterministic for a given input: no sentence sampling, fixed special ids
    (unk 0, bos 1, eod/eos 2, no pad).
    """
    if vocab_size < 300:
        raise ValueError(f"vocab size {vocab_size} is too small: byte fallback alone needs 256 "
                         "ids plus specials; use at least 300")
    chunks = list(training_chunks(texts))
    if not chunks:
        raise ValueError("cannot train a tokenizer on an empty corpus: no non-blank text found")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(chunks), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["\n"],
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=-1, character_coverage=0.9995,
        max_sentence_length=MAX_PIECE_INPUT, input_sentence_size=0, hard_vocab_limit=False,
        num_threads=num_threads, minloglevel=2)
    path = f"{output_prefix}.model"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, path)
    log.info("trained a %d-piece BPE tokenizer on %d chunks -> %s",
             spm.SentencePieceProcessor(model_file=path).vocab_size(), len(chunks), path)
    return path
