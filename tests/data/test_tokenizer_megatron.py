"""Megatron's tokenizer flags (hybrid/data/tokenizer_types.py): GPT-2's vocab.json + merges.txt encode
like transformers' GPT2TokenizerFast from the same files (in the test-only venv of tests/models/hf_env.py)
and like the tokenizer.json they were saved from; NullTokenizer; one clear error for each bad
combination of flags or files; tools/preprocess_data.py with Megatron's command line (its output
names and EOD default); and a tiny training run with --tokenizer-type GPT2BPETokenizer whose
checkpoint generates with that tokenizer."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from hybrid.data import IndexedDataset, build_tokenizer
from hybrid.data.tokenizer import BPE_EOD, Tokenizer, TokenizerError, train_tokenizer
from hybrid.data.tokenizer_types import NullTokenizer
from tests.reliability_helpers import ROOT, load_entry, tiny_cli
from tests.models.test_hf_transformers import hf_python  # noqa: F401 (fixture)
from tools import generate, preprocess_data
from tools._cli import run_cli

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN = [(STDLIB / n).read_text() for n in ("textwrap.py", "bisect.py", "colorsys.py")]
# held out of training: unseen words, so merges stop early; whitespace runs, digits, contractions
SAMPLES = [(STDLIB / "heapq.py").read_text()[:3000], "Hello world, it's 2024 -- don't   stop\n\n\t x",
           "  leading spaces", "trailing  \n", "Ünïcödé 漢字 🙂 and emoji", "a\r\nb", "'ll 've 're"]

GPT2_SCRIPT = r"""
import json, sys, transformers
directory, texts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
tok = transformers.GPT2TokenizerFast.from_pretrained(directory)
ids = [tok.encode(t) for t in texts]
json.dump({"version": transformers.__version__, "ids": ids, "eos": tok.eos_token_id, "size": len(tok),
           "decoded": [tok.decode(i, clean_up_tokenization_spaces=False) for i in ids]}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> dict[str, str]:
    """A byte-level BPE (vocab 400, <|endoftext|> id 0) saved as GPT-2's vocab.json + merges.txt,
    beside the tokenizer.json it was trained as."""
    root = tmp_path_factory.mktemp("gpt2")
    tokenizer_json = train_tokenizer(TRAIN, root / "bpe", 400, kind="bpe")
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    vocab, merges = HFTokenizer.from_file(tokenizer_json).model.save(str(gpt2))
    assert Path(merges).read_text().startswith("#version")   # GPT-2's merges.txt header
    return {"vocab": vocab, "merges": merges, "dir": str(gpt2), "json": tokenizer_json}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    return train_tokenizer(TRAIN, tmp_path_factory.mktemp("sp") / "sp", 500)


def _gpt2(files) -> Tokenizer:
    return build_tokenizer("GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=files["merges"])


def test_gpt2_bpe_encodes_like_the_tokenizer_json_it_came_from(gpt2_files):
    tok, reference = _gpt2(gpt2_files), Tokenizer(gpt2_files["json"])
    assert tok.kind == "gpt2-bpe"
    assert tok.vocab_size == len(json.loads(Path(gpt2_files["vocab"]).read_text())) == 400
    assert tok.id_to_piece(tok.eod) == BPE_EOD
    for text in SAMPLES + ["written <|endoftext|> stays text"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text) and tok.decode(ids) == text
        assert tok.eod not in ids
    assert len(tok.encode(SAMPLES[0])) < 0.8 * len(SAMPLES[0].encode())   # merges are applied
    # vocab/merges without a type mean GPT2BPETokenizer, as the only type that reads both
    assert build_tokenizer(vocab_file=gpt2_files["vocab"],
                           merge_file=gpt2_files["merges"]).encode(SAMPLES[1]) == tok.encode(SAMPLES[1])


def test_gpt2_bpe_equals_transformers_gpt2_tokenizer(gpt2_files, hf_python, tmp_path):  # noqa: F811
    out = tmp_path / "hf.json"
    run = subprocess.run([hf_python, "-c", GPT2_SCRIPT, gpt2_files["dir"], json.dumps(SAMPLES),
                          str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    hf, tok = json.loads(out.read_text()), _gpt2(gpt2_files)
    assert [tok.encode(t) for t in SAMPLES] == hf["ids"], hf["version"]
    assert hf["decoded"] == SAMPLES
    assert (hf["size"], hf["eos"]) == (tok.vocab_size, tok.eod)


def test_null_tokenizer_reads_ids(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (100, 99)
    assert tok.encode("5 17  3\n98") == [5, 17, 3, 98] and tok.decode([5, 17]) == "5 17"
    with pytest.raises(TokenizerError, match="whitespace-separated token ids"):
        tok.encode("hello")
    with pytest.raises(TokenizerError, match="outside 0..99"):
        tok.encode("1 100")


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["no-merge", "swapped", "no-eod", "tokenizer-json-as-vocab",
                                  "json-as-sentencepiece", "sentencepiece-as-hf", "hub-name",
                                  "extra-file", "null-no-size", "unknown-type", "nothing"])
def test_build_tokenizer_errors_say_what_to_pass(gpt2_files, sp_model, tmp_path, case):
    f, sp = gpt2_files, sp_model
    no_eod = {k: v for k, v in json.loads(Path(f["vocab"]).read_text()).items() if k != BPE_EOD}
    kwargs, error, match = {
        "no-merge": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=f["vocab"]),
                     TokenizerError, "--merge-file is missing"),
        "swapped": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=f["merges"],
                         merge_file=f["vocab"]), TokenizerError, "not GPT-2's vocab.json.*swapped"),
        "no-eod": (dict(tokenizer_type="GPT2BPETokenizer", merge_file=f["merges"],
                        vocab_file=_write(tmp_path / "v.json", json.dumps(no_eod))),
                   TokenizerError, "has no <\\|endoftext\\|>"),
        "tokenizer-json-as-vocab": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=f["json"],
                                         merge_file=f["merges"]), TokenizerError,
                                    "is a Hugging Face tokenizer.json.*HuggingFaceTokenizer"),
        "json-as-sentencepiece": (dict(tokenizer_type="SentencePieceTokenizer", model=f["json"]),
                                  TokenizerError, "not a sentencepiece model.*HuggingFaceTokenizer"),
        "sentencepiece-as-hf": (dict(tokenizer_type="HuggingFaceTokenizer", model=sp),
                                TokenizerError, "SentencePieceTokenizer"),
        "hub-name": (dict(tokenizer_type="HuggingFaceTokenizer", model="openai-community/gpt2"),
                     FileNotFoundError, "not downloaded.*--local-dir"),
        "extra-file": (dict(tokenizer_type="SentencePieceTokenizer", model=f["json"],
                            merge_file=f["merges"]), TokenizerError, "drop --merge-file"),
        "null-no-size": (dict(tokenizer_type="NullTokenizer"), TokenizerError, "needs --vocab-size"),
        "unknown-type": (dict(tokenizer_type="BertWordPieceCase", vocab_file=f["vocab"]),
                         TokenizerError, "not supported; choose one of GPT2BPETokenizer"),
        "nothing": ({}, TokenizerError, "no tokenizer given"),
    }[case]
    with pytest.raises(error, match=match):
        build_tokenizer(**kwargs)


def test_model_file_types_read_their_kind(gpt2_files, sp_model):
    assert build_tokenizer("SentencePieceTokenizer", model=sp_model).encode("x = 1") == \
        Tokenizer(sp_model).encode("x = 1")
    assert build_tokenizer("HuggingFaceTokenizer", model=gpt2_files["json"]).kind == "tokenizer.json"


def _jsonl(path: Path, docs: list[dict]) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def test_preprocess_with_megatron_flags_writes_megatron_names(gpt2_files, tmp_path):
    docs = [{"text": t, "title": f"doc {i}"} for i, t in enumerate(SAMPLES)]
    corpus = _jsonl(tmp_path / "corpus.jsonl", docs)
    megatron = ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer",
                "--vocab-file", gpt2_files["vocab"], "--merge-file", gpt2_files["merges"]]
    assert preprocess_data.main(megatron + ["--output-prefix", str(tmp_path / "my-gpt2"),
                                            "--json-keys", "text", "title", "--append-eod",
                                            "--workers", "2"]) == 0
    tok = _gpt2(gpt2_files)
    for key in ("text", "title"):
        ds = IndexedDataset(tmp_path / f"my-gpt2_{key}_document")
        assert [list(ds[i]) for i in range(ds.num_documents)] == \
            [tok.encode(d[key]) + [tok.eod] for d in docs]
    # Megatron's default without --append-eod: no end-of-document id
    assert preprocess_data.main(megatron + ["--output-prefix", str(tmp_path / "plain")]) == 0
    ds = IndexedDataset(tmp_path / "plain_text_document")
    assert [list(ds[i]) for i in range(ds.num_documents)] == [tok.encode(d["text"]) for d in docs]
    # without --tokenizer-type: our layout, PREFIX.bin/.idx, end of document appended by default
    assert preprocess_data.main(["--input", corpus, "--vocab-file", gpt2_files["vocab"],
                                 "--merge-file", gpt2_files["merges"], "--output-prefix",
                                 str(tmp_path / "ours")]) == 0
    ds = IndexedDataset(tmp_path / "ours")
    assert list(ds[1]) == tok.encode(docs[1]["text"]) + [tok.eod]


def test_preprocess_null_tokenizer(tmp_path):
    corpus = _jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "40 5"}])
    assert preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "ids"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "50",
                                 "--append-eod"]) == 0
    ds = IndexedDataset(tmp_path / "ids_text_document")
    assert [list(ds[i]) for i in range(2)] == [[1, 2, 3, 49], [40, 5, 49]]


@pytest.mark.parametrize("case", ["no-merge", "swapped", "unknown-type", "hub-name", "null-text",
                                  "null-no-size", "keys-without-type", "missing-vocab"])
def test_preprocess_bad_input_is_one_error_line(gpt2_files, tmp_path, capsys, case):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "hello world", "title": "t"}])
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer"]
    argv, expected = {
        "no-merge": (gpt2 + ["--vocab-file", gpt2_files["vocab"]], "--merge-file is missing"),
        "swapped": (gpt2 + ["--vocab-file", gpt2_files["merges"], "--merge-file", gpt2_files["vocab"]],
                    "swapped"),
        "unknown-type": (["--tokenizer-type", "BertWordPieceCase"], "invalid choice"),
        "hub-name": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
                     "huggingface-cli download gpt2"),
        "null-text": (["--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
                      "whitespace-separated token ids"),
        "null-no-size": (["--tokenizer-type", "NullTokenizer"], "needs --vocab-size"),
        "keys-without-type": (["--tokenizer-model", gpt2_files["json"], "--json-keys", "text", "title"],
                              "several keys"),
        "missing-vocab": (gpt2 + ["--vocab-file", str(tmp_path / "nope.json"), "--merge-file",
                                  gpt2_files["merges"]], "nope.json' does not exist"),
    }[case]
    out = tmp_path / "out"
    assert run_cli(preprocess_data.main, ["--input", corpus, "--output-prefix", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1 and expected in err[-1]
    assert not list(tmp_path.glob("out*"))   # nothing written


def test_preprocess_script_error_has_no_traceback(gpt2_files, tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", corpus,
                          "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
                          "--vocab-file", gpt2_files["vocab"]], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: --tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file; --merge-file "
        "is missing (GPT-2's merges.txt)"]


def test_training_run_builds_gpt2_tokenizer_from_megatron_flags(gpt2_files, tmp_path, capsys):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TRAIN * 2])
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files["vocab"],
            "--merge-file", gpt2_files["merges"]]
    assert preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "data"),
                                 "--append-eod", *gpt2]) == 0
    data = {"prefix": str(tmp_path / "data_text_document"), "tokenizer": "unused"}
    argv = tiny_cli(data, tmp_path / "cache", extra=["--save", str(tmp_path / "ckpt"), *gpt2])
    cut = argv.index("--tokenizer-model")
    argv = argv[:cut] + argv[cut + 2:]
    entry = load_entry()
    assert entry.main(argv) == 0
    [metadata] = (tmp_path / "ckpt").glob("iter_*/metadata.json")
    saved = json.loads(metadata.read_text())
    assert saved["model_config"]["vocab_size"] == _gpt2(gpt2_files).vocab_size == 400
    assert saved["config"]["data"]["tokenizer_type"] == "GPT2BPETokenizer"
    # generation finds the run's tokenizer from those flags
    capsys.readouterr()
    assert generate.main(["--load", str(tmp_path / "ckpt"), "--prompt", "def wrap(",
                          "--max-new-tokens", "3", "--temperature", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompt"] == _gpt2(gpt2_files).encode("def wrap(")
    # the same run without the merge file (and checkpoint): one error line, exit status 2
    capsys.readouterr()
    argv = [a for a in argv if a not in ("--merge-file", gpt2_files["merges"], "--save",
                                         str(tmp_path / "ckpt"))]
    assert entry.main(argv) == 2
    assert "--merge-file is missing" in capsys.readouterr().err


@pytest.mark.parametrize("flags,expected", [
    (["--tokenizer-type", "BertWordPieceCase"], "--tokenizer-type 'BertWordPieceCase' is not supported"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"], "need --data-path"),
])
def test_training_refuses_bad_tokenizer_flags(tmp_path, capsys, flags, expected):
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--train-iters", "1", "--data-cache-dir", str(tmp_path), *flags]
    assert load_entry().main(argv) == 2
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.iterdir())   # the embedded corpus was not built
