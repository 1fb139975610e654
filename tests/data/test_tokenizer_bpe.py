"""Hugging Face ``tokenizer.json`` tokenizers (hybrid/data/tokenizer.py): training a byte-level BPE
with tools/train_tokenizer.py --type bpe, exact round trips, choosing the kind by the file, the
end-of-document token of a pretrained tokenizer.json, the sentencepiece -> tokenizer.json converter
against sentencepiece itself (BPE and unigram), and preprocess + a tiny training run + generation
with a BPE tokenizer."""

import io
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from hybrid.data.indexed_dataset import IndexedDataset
from hybrid.data.preprocess import preprocess
from hybrid.data.sentencepiece_convert import convert_sentencepiece
from hybrid.data.tokenizer import BPE_EOD, Tokenizer, TokenizerError, train_tokenizer
from tests.reliability_helpers import load_entry, tiny_cli
from tools import generate, train_tokenizer as train_tokenizer_cli

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / name for name in ("textwrap.py", "bisect.py", "colorsys.py", "heapq.py")]
TRICKY = ["def f(x):\n\tif x:  # tab, two spaces\n        return 'Ünïcödé 漢字 🙂'\n\n\n",
          "  leading spaces", "trailing  \n", "digits 1234567 and -3000", "", "ends with <|endoftext|>",
          "sentencepiece's </s> and <0x41> as text"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("bpe") / "tok"
    assert train_tokenizer_cli.main(["--type", "bpe", "--input", *map(str, SOURCES),
                                     "--vocab-size", "600", "--output-prefix", str(out)]) == 0
    return f"{out}.json"


def test_bpe_training_round_trips_exactly(bpe):
    tok = Tokenizer(bpe)
    assert tok.kind == "tokenizer.json" and tok.vocab_size == 600
    assert tok.id_to_piece(tok.eod) == BPE_EOD
    for text in [p.read_text() for p in SOURCES] + TRICKY:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eod not in ids   # "<|endoftext|>" written in a document is text
    source = SOURCES[0].read_text()
    assert len(tok.encode(source)) < len(source.encode()) / 2   # merges were learned
    # the same corpus trains the same tokenizer
    again = train_tokenizer([p.read_text() for p in SOURCES], Path(bpe).with_name("again"), 600,
                            kind="bpe")
    assert Tokenizer(again).encode(source) == tok.encode(source)


def test_kind_is_chosen_by_the_file(bpe, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(bpe).read_bytes())
    assert Tokenizer(folder).kind == "tokenizer.json"
    assert Tokenizer(folder).encode("x = 1") == Tokenizer(bpe).encode("x = 1")
    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    sp_model = train_tokenizer([p.read_text() for p in SOURCES], spm_dir / "tokenizer", 400)
    assert Tokenizer(spm_dir).kind == "sentencepiece" and Tokenizer(sp_model).kind == "sentencepiece"
    (spm_dir / "tokenizer.json").write_bytes(Path(bpe).read_bytes())
    assert Tokenizer(spm_dir).kind == "tokenizer.json"        # a directory prefers tokenizer.json
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="is a directory without tokenizer.json"):
        Tokenizer(tmp_path / "empty")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a sentencepiece model nor a Hugging Face"):
        Tokenizer(tmp_path / "vocab.json")
    (tmp_path / "merges.txt").write_text("a b\n")
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        Tokenizer(tmp_path / "merges.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer(tmp_path / "missing.json")


def test_pretrained_tokenizer_json_end_of_document(tmp_path):
    """A save_pretrained-style directory: eod is tokenizer_config.json's eos_token; without a
    config, a known end-of-document special token; with neither, a clear error on use."""
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|eot_id|>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())})
    hf = HFTokenizer(models.BPE(vocab, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.add_special_tokens(list(vocab)[:3])
    hf.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer(tmp_path).eod == 1                       # <|end_of_text|>, Llama-3's
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    assert Tokenizer(tmp_path).eod == 2
    assert Tokenizer(tmp_path).vocab_size == 3 + 256
    bare = HFTokenizer(models.BPE({"a": 0}, []))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="no end-of-document id"):
        Tokenizer(tmp_path / "bare.json").eod


def _unigram_model(path: Path, texts: list[str]) -> str:
    model = io.BytesIO()
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=500,
                                   model_type="unigram", byte_fallback=True,
                                   minloglevel=2)   # the defaults: nmt_nfkc, a dummy prefix
    path.write_bytes(model.getvalue())
    return str(path)


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_converts_to_identical_tokenizer_json(tmp_path, kind):
    texts = [p.read_text() for p in SOURCES]
    model = (train_tokenizer(texts, tmp_path / "spm", 500) if kind == "bpe"
             else _unigram_model(tmp_path / "uni.model", texts))
    converted, sp = convert_sentencepiece(model), spm.SentencePieceProcessor(model_file=model)
    converted.encode_special_tokens = True
    held_out = (STDLIB / "this.py").read_text() + (STDLIB / "glob.py").read_text()
    lines = held_out.split("\n") + TRICKY
    if kind == "bpe":
        lines.append(held_out)   # whole documents: newlines are user-defined pieces
    for text in lines:
        ids = converted.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert converted.decode(ids, skip_special_tokens=True) == sp.decode(ids)


def test_preprocess_train_and_generate_with_bpe(bpe, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    texts = [p.read_text() for p in SOURCES] * 3
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = tmp_path / "corpus"
    stats = preprocess([docs], prefix, bpe, workers=2, batch_docs=2)
    tok = Tokenizer(bpe)
    ds = IndexedDataset(prefix)
    assert stats.documents == len(texts) and stats.dtype == "uint16"
    for i, text in enumerate(texts):
        ids = ds[i]
        assert ids[-1] == tok.eod and list(ids[:-1]) == tok.encode(text)
    ckpt = tmp_path / "ckpt"
    corpus = {"prefix": str(prefix), "tokenizer": bpe}
    assert load_entry().main(tiny_cli(corpus, tmp_path / "cache", extra=["--save", str(ckpt)])) == 0
    capsys.readouterr()
    assert generate.main(["--load", str(ckpt), "--prompt", "def insort(", "--max-new-tokens", "5",
                          "--temperature", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompt"] == tok.encode("def insort(") and len(result["ids"]) >= 1
    assert np.all(np.asarray(result["ids"]) < tok.vocab_size)
    assert result["text"] == tok.decode([t for t in result["ids"] if t != tok.eod])
