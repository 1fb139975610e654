"""Megatron-LM's ``--tokenizer-type`` names over our tokenizers: one construction function.

:func:`build_tokenizer` takes Megatron's flags (``--tokenizer-type``, ``--vocab-file``,
``--merge-file``, ``--tokenizer-model``, ``--vocab-size``) with Megatron's meanings:

- ``GPT2BPETokenizer``: GPT-2's ``vocab.json`` (token -> id) + ``merges.txt``, byte-level BPE built by
  the ``tokenizers`` library as GPT-2 defines it; the end-of-document id is ``<|endoftext|>``'s and
  the vocabulary size is the number of vocab.json entries.
- ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local ``tokenizer.json`` or a directory
  holding one (hub names are not downloaded); end of document is its eos token.
- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``: ``--tokenizer-model`` is a
  sentencepiece ``.model``; end of document is its eos id (current Megatron-LM; its removed legacy
  SentencePieceTokenizer appended an extra ``<EOD>`` piece instead).
- ``NullTokenizer``: no files; a document is its token ids written as whitespace-separated
  integers, ``--vocab-size`` V gives ids 0..V-1 and end of document V-1 (current Megatron-LM).

Without a type, ``--tokenizer-model`` alone picks the kind by its file (:class:`Tokenizer`), and
``--vocab-file`` + ``--merge-file`` mean GPT2BPETokenizer. :class:`TokenizerSpec` is the picklable
recipe that preprocessing workers rebuild the tokenizer from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hybrid.data.tokenizer import BPE_EOD, Tokenizer, TokenizerError, resolve_tokenizer_file

GPT2_BPE, HUGGING_FACE, SENTENCEPIECE, NULL = ("GPT2BPETokenizer", "HuggingFaceTokenizer",
                                               "SentencePieceTokenizer", "NullTokenizer")
GPT_SENTENCEPIECE = "GPTSentencePieceTokenizer"   # Megatron's GPT variant: the same model, eos as eod
MEGATRON_TOKENIZER_TYPES = (GPT2_BPE, HUGGING_FACE, SENTENCEPIECE, GPT_SENTENCEPIECE, NULL)
# which of build_tokenizer's file arguments each type reads (anything else given is an error)
_READS = {GPT2_BPE: ("vocab_file", "merge_file"), HUGGING_FACE: ("model",),
          SENTENCEPIECE: ("model",), GPT_SENTENCEPIECE: ("model",), NULL: ()}
FLAGS = {"vocab_file": "--vocab-file", "merge_file": "--merge-file", "model": "--tokenizer-model"}


@dataclass(frozen=True)
class TokenizerSpec:
    """The arguments of :func:`build_tokenizer`: hashable and picklable."""
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    model: str | None = None
    vocab_size: int | None = None

    def build(self) -> "Tokenizer | NullTokenizer":
        return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file,
                               merge_file=self.merge_file, model=self.model,
                               vocab_size=self.vocab_size)

    def files(self) -> list[str]:
        """The files (or directory) this tokenizer is read from."""
        return [p for p in (self.vocab_file, self.merge_file, self.model) if p is not None]


def build_tokenizer(tokenizer_type: str | None = None, *, vocab_file: str | os.PathLike | None = None,
                    merge_file: str | os.PathLike | None = None, model: str | os.PathLike | None = None,
                    vocab_size: int | None = None) -> "Tokenizer | NullTokenizer":
    """The tokenizer Megatron-LM builds from these flags (see the module docstring); a wrong or
    missing file raises :class:`TokenizerError` (or FileNotFoundError) naming the flag and the fix.
    ``vocab_size`` is read by NullTokenizer only."""
    files = {"vocab_file": vocab_file, "merge_file": merge_file, "model": model}
    files = {k: None if v is None else str(v) for k, v in files.items()}
    if tokenizer_type is None:
        if files["vocab_file"] is not None or files["merge_file"] is not None:
            tokenizer_type = GPT2_BPE
        elif files["model"] is not None:
            return Tokenizer(files["model"])
        else:
            raise TokenizerError("no tokenizer given: pass --tokenizer-model (a sentencepiece "
                                 ".model or tokenizer.json) or --tokenizer-type with its files")
    if tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                             f"{', '.join(MEGATRON_TOKENIZER_TYPES)}")
    _check_files_read(tokenizer_type, files)
    if tokenizer_type == GPT2_BPE:
        return gpt2_bpe_tokenizer(files["vocab_file"], files["merge_file"])
    if tokenizer_type == NULL:
        return NullTokenizer(vocab_size)
    return _model_file_tokenizer(tokenizer_type, files["model"])


def _check_files_read(tokenizer_type: str, files: dict[str, str | None]) -> None:
    reads = _READS[tokenizer_type]
    wants = " and ".join(FLAGS[k] for k in reads) or "no files (documents are token ids)"
    for name, path in files.items():
        if path is not None and name not in reads:
            raise TokenizerError(f"--tokenizer-type {tokenizer_type} reads {wants}, not "
                                 f"{FLAGS[name]} {path}; drop {FLAGS[name]}"
                                 + (" (for a tokenizer.json use HuggingFaceTokenizer)"
                                    if tokenizer_type == GPT2_BPE else ""))
    for name in reads:
        if files[name] is None:
            raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {wants}; "
                                 f"{FLAGS[name]} is missing"
                                 + (" (GPT-2's merges.txt)" if name == "merge_file" else "")
                                 + (" (GPT-2's vocab.json)" if name == "vocab_file" else ""))


def _model_file_tokenizer(tokenizer_type: str, model: str) -> Tokenizer:
    """HuggingFaceTokenizer / SentencePieceTokenizer: ``model`` must be that kind of file."""
    if tokenizer_type == HUGGING_FACE and not os.path.exists(model):
        raise FileNotFoundError(
            f"--tokenizer-model {model!r} is not a local file or directory; models are not "
            f"downloaded from the Hugging Face hub: download it first (e.g. `huggingface-cli "
            f"download {model} --local-dir DIR`) and pass DIR")
    path = resolve_tokenizer_file(model)
    is_json = path.endswith(".json")
    if tokenizer_type == HUGGING_FACE and not is_json:
        raise TokenizerError(f"--tokenizer-model {model!r} is a sentencepiece model, not a Hugging "
                             f"Face tokenizer.json; use --tokenizer-type SentencePieceTokenizer")
    if tokenizer_type != HUGGING_FACE and is_json:
        raise TokenizerError(f"--tokenizer-model {model!r} is a .json file, not a sentencepiece "
                             f"model; for a tokenizer.json use --tokenizer-type HuggingFaceTokenizer, "
                             f"for GPT-2's vocab.json use GPT2BPETokenizer with --vocab-file and "
                             f"--merge-file")
    return Tokenizer(path)


def gpt2_bpe_tokenizer(vocab_file: str, merge_file: str) -> Tokenizer:
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (as GPT-2 and Megatron's
    GPT2BPETokenizer define it: GPT-2's pre-tokenizer regex, no prefix space, bytes as 256 visible
    characters); ``<|endoftext|>`` is the end-of-document token."""
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise FileNotFoundError(f"{flag} {path!r} {what}; pass GPT-2's "
                                    f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'} file")
    vocab = _read_gpt2_vocab(vocab_file)
    _check_merges_text(merge_file)
    try:
        bpe = models.BPE.from_file(vocab_file, merge_file)
    except Exception as err:   # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"--vocab-file {vocab_file!r} and --merge-file {merge_file!r} do not form "
                             f"a GPT-2 BPE ({' '.join(str(err).split())[:200]}); pass the vocab.json "
                             f"and merges.txt saved together") from None
    if BPE_EOD not in vocab:
        raise TokenizerError(f"--vocab-file {vocab_file!r} has no {BPE_EOD} token, GPT2BPETokenizer's "
                             f"end of document; pass GPT-2's vocab.json (or use a tokenizer.json with "
                             f"--tokenizer-type HuggingFaceTokenizer)")
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(BPE_EOD, special=True)])   # already in vocab: keeps its id
    return Tokenizer.from_hf(hf, hf.token_to_id(BPE_EOD), vocab_file, kind="gpt2-bpe")


def _read_gpt2_vocab(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"--vocab-file {path!r} is not GPT-2's vocab.json, a JSON object of "
                             f"token -> id ({' '.join(str(err).split())[:120]}); check that "
                             f"--vocab-file and --merge-file are not swapped") from None
    if isinstance(vocab, dict) and "model" in vocab:
        raise TokenizerError(f"--vocab-file {path!r} is a Hugging Face tokenizer.json, not GPT-2's "
                             f"vocab.json; pass it as --tokenizer-model with --tokenizer-type "
                             f"HuggingFaceTokenizer")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerError(f"--vocab-file {path!r} is not GPT-2's vocab.json: it must be one JSON "
                             f"object mapping each token to its integer id")
    return vocab


def _check_merges_text(path: str) -> None:
    """merges.txt is text whose first line is not JSON (a swapped vocab.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().lstrip()
    except UnicodeDecodeError:
        raise TokenizerError(f"--merge-file {path!r} is not text, so not GPT-2's merges.txt (a "
                             f"'#version' line, then one 'left right' pair a line)") from None
    if first.startswith("{"):
        raise TokenizerError(f"--merge-file {path!r} is JSON, not GPT-2's merges.txt; check that "
                             f"--vocab-file and --merge-file are not swapped")


class NullTokenizer:
    """Megatron's NullTokenizer: documents are already token ids, written as whitespace-separated
    integers in 0..vocab_size-1; the end-of-document id is ``vocab_size - 1``."""

    kind = "null"

    def __init__(self, vocab_size: int | None):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise TokenizerError(f"--tokenizer-type NullTokenizer needs --vocab-size (the number of "
                                 f"ids, end of document included: at least 2), got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise TokenizerError(f"NullTokenizer reads documents as whitespace-separated token ids, "
                                 f"got {text[:60]!r}; tokenize the text first or choose another "
                                 f"--tokenizer-type") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"NullTokenizer id {bad[0]} is outside 0..{self.vocab_size - 1}; "
                                 f"raise --vocab-size above the largest id")
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def id_to_piece(self, i: int) -> str:
        return str(int(i))
