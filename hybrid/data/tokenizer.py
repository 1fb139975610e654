"""The tokenizer of the GPT data pipeline: one interface over sentencepiece and Hugging Face models.

- a sentencepiece BPE model with byte fallback (``.model``, tools/train_tokenizer.py --type
  sentencepiece). Byte fallback means any UTF-8 text encodes (unknown characters become their bytes)
  and the normalisation is the identity, so ``decode(encode(text)) == text`` for ordinary text,
  including the indentation and newlines of source code. Its end-of-document id is ``</s>``.
- a Hugging Face ``tokenizers`` file (``tokenizer.json``): byte-level BPE as in GPT-2 / Llama-3
  (tools/train_tokenizer.py --type bpe, end of document ``<|endoftext|>``), or any pretrained
  ``tokenizer.json`` such as one written by transformers' ``save_pretrained``. Its end-of-document
  token is the ``eos_token`` of a ``tokenizer_config.json`` beside it, else the first special token
  among :data:`EOD_TOKENS`.

The kind is chosen by the file: a ``*.json`` file is a ``tokenizer.json``, any other file a
sentencepiece model, and a directory stands for the ``tokenizer.json`` (else ``tokenizer.model``)
inside it. GPT-2's separate ``vocab.json`` + ``merges.txt`` and Megatron's ``--tokenizer-type``
names are built by :func:`hybrid.data.tokenizer_types.build_tokenizer`. Special tokens written in a
document's text are encoded as text, never as their special ids.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

# sentencepiece reads at most this many bytes per "sentence"; longer chunks are split.
MAX_PIECE_INPUT = 8192
UNK_ID, BOS_ID, EOD_ID = 0, 1, 2
CHARACTER_COVERAGE = 0.9995   # sentencepiece: characters rarer than this share become byte pieces
BPE_EOD = "<|endoftext|>"      # the end-of-document token of tools/train_tokenizer.py --type bpe
# end-of-document tokens of common pretrained tokenizer.json files (GPT-2, Llama-3, Llama-2, Gemma)
EOD_TOKENS = (BPE_EOD, "<|end_of_text|>", "</s>", "<eos>")
HF_FILE, SENTENCEPIECE_FILE = "tokenizer.json", "tokenizer.model"
GPT2_FILES_FIX = ("for GPT-2's vocab.json + merges.txt pass --tokenizer-type GPT2BPETokenizer "
                  "--vocab-file vocab.json --merge-file merges.txt")
TOKENIZER_TYPES = ("sentencepiece", "bpe")


class TokenizerError(ValueError):
    """A tokenizer model that is not a readable sentencepiece model or tokenizer.json; the message
    says what to pass."""


def resolve_tokenizer_file(model_path: str | Path) -> str:
    """The tokenizer file ``model_path`` stands for (a directory's tokenizer.json / .model)."""
    path = str(model_path)
    if os.path.isdir(path):
        for name in (HF_FILE, SENTENCEPIECE_FILE):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise TokenizerError(f"tokenizer model {path!r} is a directory without {HF_FILE} or "
                             f"{SENTENCEPIECE_FILE}; pass the .model or tokenizer.json file "
                             f"(tools/train_tokenizer.py writes PREFIX.model or PREFIX.json)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer model {path!r} does not exist; train one with "
                                "tools/train_tokenizer.py")
    return path


class Tokenizer:
    """encode/decode, vocab_size and eod over a sentencepiece model or a Hugging Face ``tokenizers``
    object; ``kind`` is "sentencepiece", "tokenizer.json" or "gpt2-bpe" (GPT-2's vocab/merges,
    :meth:`from_hf`)."""

    def __init__(self, model_path: str | Path):
        path = resolve_tokenizer_file(model_path)
        self.model_path = path
        self.kind = "tokenizer.json" if path.endswith(".json") else "sentencepiece"
        if self.kind == "tokenizer.json":
            self._hf = _load_tokenizer_json(path)
            self._eod = _hf_eod(self._hf, path)
            return
        self._hf = None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as err:   # sentencepiece: "could not parse ModelProto"
            raise TokenizerError(
                f"tokenizer model {path!r} is not a sentencepiece model ({' '.join(str(err).split())}); "
                f"pass a sentencepiece .model or a Hugging Face tokenizer.json; {GPT2_FILES_FIX}") from None

    @classmethod
    def from_hf(cls, hf: HFTokenizer, eod: int | None, source: str, kind: str) -> "Tokenizer":
        """A tokenizer over an in-memory ``tokenizers`` object (``source`` names its files in
        messages); special tokens in the text stay text, as for a tokenizer.json."""
        tok = cls.__new__(cls)
        tok.model_path, tok.kind, tok._hf, tok._eod = source, kind, hf, eod
        hf.encode_special_tokens = True
        return tok

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return self._hf.get_vocab_size(with_added_tokens=True)
        return self._sp.vocab_size()

    @property
    def eod(self) -> int:
        eos = self._eod if self._hf is not None else self._sp.eos_id()
        if eos is None or eos < 0:
            fix = ("name its end-of-document token as eos_token in a tokenizer_config.json beside it"
                   if self._hf is not None else "retrain it with tools/train_tokenizer.py")
            raise ValueError(f"tokenizer {self.model_path!r} defines no end-of-document id; {fix}")
        return eos

    def special_tokens(self) -> dict[str, tuple[str, int] | None]:
        """``bos`` / ``eos`` / ``unk``: (token, id), or None where the model has none (a
        tokenizer.json's eos is its end-of-document token)."""
        if self._hf is not None:
            eos = (self._hf.id_to_token(self._eod), self._eod) if self._eod is not None else None
            return {"bos": None, "eos": eos, "unk": None}
        return {name: (self._sp.id_to_piece(i), i) if i >= 0 else None for name, i in
                (("bos", self._sp.bos_id()), ("eos", self._sp.eos_id()), ("unk", self._sp.unk_id()))}

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=False).ids
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._hf is not None:
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        return self._sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids])
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        if self._hf is not None:
            return self._hf.id_to_token(int(i))
        return self._sp.id_to_piece(int(i))

    def to_tokenizer_json(self) -> HFTokenizer:
        """This tokenizer as a fresh Hugging Face ``tokenizers`` object (a sentencepiece model
        converted by hybrid.data.sentencepiece_convert)."""
        if self.kind == "tokenizer.json":
            return HFTokenizer.from_file(self.model_path)
        if self._hf is not None:
            return HFTokenizer.from_str(self._hf.to_str())
        from hybrid.data.sentencepiece_convert import convert_sentencepiece
        return convert_sentencepiece(self.model_path)


def _load_tokenizer_json(path: str) -> HFTokenizer:
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as err:   # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(
            f"tokenizer model {path!r} is not a sentencepiece model nor a Hugging Face tokenizer.json "
            f"({' '.join(str(err).split())[:200]}); pass a .model or tokenizer.json file; "
            f"{GPT2_FILES_FIX}") from None
    tok.encode_special_tokens = True   # "<|endoftext|>" inside a document is text, not eod
    return tok


def _hf_eod(tok: HFTokenizer, path: str) -> int | None:
    """The end-of-document id: tokenizer_config.json's eos_token beside ``path``, else a known one."""
    config = Path(path).with_name("tokenizer_config.json")
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return next((tok.token_to_id(t) for t in EOD_TOKENS if t in specials), None)


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
                    num_threads: int = 1, kind: str = "sentencepiece") -> str:
    """Train a tokenizer on ``texts`` (an iterable of documents); returns the file's path.

    ``kind`` "sentencepiece" writes ``OUTPUT_PREFIX.model``, "bpe" a byte-level BPE
    ``OUTPUT_PREFIX.json`` (:func:`train_bpe_tokenizer`).
    """
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if kind == "bpe":
        return train_bpe_tokenizer(texts, output_prefix, vocab_size)
    return _train_sentencepiece(texts, output_prefix, vocab_size, num_threads)


def _train_sentencepiece(texts: Iterable[str], output_prefix: str | Path, vocab_size: int,
                         num_threads: int) -> str:
    """Train a sentencepiece BPE model on ``texts``; returns the ``.model`` path.

    Deterministic for a given input: no sentence sampling, fixed special ids
    (unk 0, bos 1, eod/eos 2, no pad).
    """
    chunks = _checked_chunks(texts, vocab_size)
    needed = sentencepiece_min_vocab(chunks)
    if vocab_size < needed:   # sentencepiece would fail deep inside its trainer
        raise ValueError(f"vocab size {vocab_size} is too small for this corpus: sentencepiece "
                         f"needs a piece for each of its {needed - 256 - 3} most frequent "
                         f"characters ({CHARACTER_COVERAGE:.2%} coverage), the 256 byte pieces and "
                         f"3 specials; use --vocab-size {needed} or more")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(chunks), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["\n"],
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=-1, character_coverage=CHARACTER_COVERAGE,
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


def sentencepiece_min_vocab(chunks: list[str]) -> int:
    """The smallest vocab sentencepiece's trainer accepts for ``chunks`` (its own rule): one piece
    per "required" character - the most frequent ones until they cover CHARACTER_COVERAGE of all
    characters, the newline (a user symbol) among them - plus 256 byte pieces and unk, bos, eos."""
    counts = collections.Counter()
    for chunk in chunks:
        counts.update(chunk)
    total, covered, required = sum(counts.values()), 0, set()
    for char, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if covered >= CHARACTER_COVERAGE * total:
            break
        covered += n
        required.add(char)
    return len(required | {"\n"}) + 256 + 3


def _checked_chunks(texts: Iterable[str], vocab_size: int) -> list[str]:
    """The training chunks of ``texts``, after the checks both tokenizer kinds share."""
    if vocab_size < 300:
        raise ValueError(f"vocab size {vocab_size} is too small: the 256 byte ids alone need it, plus "
                         "specials; use at least 300")
    chunks = list(training_chunks(texts))
    if not chunks:
        raise ValueError("cannot train a tokenizer on an empty corpus: no non-blank text found")
    return chunks


def train_bpe_tokenizer(texts: Iterable[str], output_prefix: str | Path, vocab_size: int) -> str:
    """Train a byte-level BPE ``tokenizer.json`` (GPT-2 / Llama-3 style) on ``texts``; returns the
    ``OUTPUT_PREFIX.json`` path.

    Bytes are mapped to 256 visible characters, so every text encodes without an unknown token and
    decodes back exactly; GPT-2's pre-tokenizer regex splits words, numbers and whitespace runs
    before merging. ``<|endoftext|>`` (id 0) is the end-of-document token.
    """
    chunks = _checked_chunks(texts, vocab_size)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(chunks, trainer=trainer)
    path = f"{output_prefix}.json"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    log.info("trained a %d-token byte-level BPE tokenizer on %d chunks -> %s",
             tok.get_vocab_size(), len(chunks), path)
    return path
