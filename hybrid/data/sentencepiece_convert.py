"""Convert a sentencepiece model to a Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``).

Exports ship ``tokenizer.json`` so transformers' ``AutoTokenizer`` works without sentencepiece
installed. The ``.model`` file is a protobuf (``ModelProto``); the few fields a conversion needs are
read with a small wire-format reader, so no protobuf package is required:

    ModelProto      1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec
    SentencePiece   1 piece (string), 2 score (float), 3 type (1 normal, 2 unknown, 3 control,
                    4 user defined, 5 unused, 6 byte)
    TrainerSpec     3 model_type (1 unigram, 2 BPE)
    NormalizerSpec  2 precompiled_charsmap, 3 add_dummy_prefix, 4 remove_extra_whitespaces

A BPE model becomes a ``tokenizers`` BPE model whose merges are ranked by the score of the merged
piece (sentencepiece merges the highest-scoring pair first); a unigram model keeps its scores
(where two segmentations score exactly alike, the two libraries may pick different ones).
Whitespace is the visible ``▁`` in both, and byte pieces (``<0x41>``) give byte fallback.
:func:`convert_sentencepiece` checks the result encodes a probe text exactly like sentencepiece.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
SPACE = "\u2581"   # sentencepiece's visible space
PROBE = ["def add(a, b):\n    return a + b\n", "  indented\n\n\tand blank lines  ", "héllo wörld 123",
         "日本語のテキスト, emoji 🙂 and symbols ∑∫", "x = [1, 2, 3]  # 2024-01-01"]


class ConversionError(ValueError):
    """A sentencepiece model this converter cannot reproduce exactly."""


@dataclass
class SentencePieceModel:
    pieces: list[tuple[str, float, int]] = field(default_factory=list)   # (piece, score, type)
    model_type: int = UNIGRAM
    charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True


def _fields(data: bytes):
    """Yield ``(field number, wire type, value)`` of one protobuf message."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 1:
            yield number, wire, data[pos:pos + 8]
            pos += 8
        elif wire == 2:
            size = varint()
            yield number, wire, data[pos:pos + size]
            pos += size
        elif wire == 5:
            yield number, wire, data[pos:pos + 4]
            pos += 4
        else:
            raise ConversionError(f"unsupported protobuf wire type {wire}")


def read_model(path: str | Path) -> SentencePieceModel:
    model = SentencePieceModel()
    try:
        for number, _, value in _fields(Path(path).read_bytes()):
            if number == 1:
                piece, score, kind = "", 0.0, NORMAL
                for n, _, v in _fields(value):
                    if n == 1:
                        piece = v.decode("utf-8")
                    elif n == 2:
                        score = struct.unpack("<f", v)[0]
                    elif n == 3:
                        kind = v
                model.pieces.append((piece, score, kind))
            elif number == 2:
                model.model_type = next((v for n, _, v in _fields(value) if n == 3), UNIGRAM)
            elif number == 3:
                for n, _, v in _fields(value):
                    if n == 2:
                        model.charsmap = v
                    elif n == 3:
                        model.add_dummy_prefix = bool(v)
                    elif n == 4:
                        model.remove_extra_whitespaces = bool(v)
    except (IndexError, UnicodeDecodeError, struct.error) as err:
        raise ConversionError(f"{path} is not a readable sentencepiece model ({err})") from None
    return model


def _bpe(sp: SentencePieceModel) -> models.BPE:
    vocab = {piece: i for i, (piece, _, _) in enumerate(sp.pieces)}
    merges = []
    for i, (piece, score, kind) in enumerate(sp.pieces):
        if kind != NORMAL:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-score, i, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = next((p for p, _, kind in sp.pieces if kind == UNKNOWN), None)
    return models.BPE(vocab, [(m[4], m[5]) for m in merges], unk_token=unk, fuse_unk=True,
                      byte_fallback=any(kind == BYTE for _, _, kind in sp.pieces))


def _unigram(sp: SentencePieceModel) -> models.Unigram:
    unk = next((i for i, (_, _, kind) in enumerate(sp.pieces) if kind == UNKNOWN), None)
    # sentencepiece's lattice never spells text with control or byte pieces ("</s>", "<0x41>"):
    # scored far below every normal piece they lose to the characters they are made of
    floor = min(s for _, s, k in sp.pieces if k == NORMAL) - 1e4
    vocab = [(p, s if k in (NORMAL, USER_DEFINED, UNKNOWN) else floor) for p, s, k in sp.pieces]
    return models.Unigram(vocab, unk, any(k == BYTE for *_, k in sp.pieces))


def convert_sentencepiece(path: str | Path) -> HFTokenizer:
    """The ``tokenizers`` equivalent of the sentencepiece model at ``path`` (checked on a probe)."""
    import sentencepiece as spm
    sp = read_model(path)
    if sp.model_type not in (UNIGRAM, BPE):
        raise ConversionError(f"{path} is a sentencepiece word/char model; only BPE and unigram "
                              f"models convert to tokenizer.json")
    tok = HFTokenizer(_bpe(sp) if sp.model_type == BPE else _unigram(sp))
    steps = [normalizers.Precompiled(sp.charsmap)] if sp.charsmap else []
    if sp.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if sp.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if sp.add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, _, kind in sp.pieces if kind in (UNKNOWN, CONTROL)])
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, _, kind in sp.pieces if kind == USER_DEFINED])
    tok.encode_special_tokens = True   # sentencepiece reads "</s>" in text as text
    reference = spm.SentencePieceProcessor(model_file=str(path))
    for text in PROBE:
        ours, theirs = tok.encode(text, add_special_tokens=False).ids, reference.encode(text)
        if ours != theirs:
            raise ConversionError(f"the tokenizer.json converted from {path} encodes {text!r} as "
                                  f"{ours[:12]}, sentencepiece as {theirs[:12]}")
    return tok
