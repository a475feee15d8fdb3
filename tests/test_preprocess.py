"""tools/preprocess_data.py end to end on small JSONL inputs (plain, .gz, .zst, directory)."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files
from tools import preprocess_data, preprocess_input

REPO = Path(__file__).resolve().parents[1]

DOCS = [
    {"text": "Hello world, this is document one.", "title": "One"},
    {"text": "def f(x):\n    return x  # ünïcödé 😀\n", "title": "Two <|endoftext|>"},
    {"text": "", "title": "Empty text"},
    {"text": ["First sentence.", " Second one.", ""], "title": ""},
    {"text": "the quick brown fox " * 50, "title": "Fox"},
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 200)
    vocab_file, merge_file = write_bpe_files(directory, vocab, merges)
    return vocab_file, merge_file


def write_jsonl(path: Path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    return path


def run_tool(bpe, input_path, prefix, *extra, workers=1):
    vocab_file, merge_file = bpe
    argv = ["--input", str(input_path), "--output-prefix", str(prefix), "--json-keys", "text",
            "title", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
            "--merge-file", merge_file, "--workers", str(workers), "--log-interval", "2", *extra]
    return preprocess_data.run(preprocess_data.get_args(argv))


def megatron_reference(tok, docs, key, append_eod):
    """What Megatron's encoder writes: .bin tokens, and sizes with the EOD counted (fixed)."""
    tokens, sizes, doc_idx = [], [], [0]
    for d in docs:
        value = d[key] if isinstance(d[key], list) else [d[key]]
        ids = [tok.tokenize(s) for s in value]
        ids = [i for i in ids if i]
        if ids and append_eod:
            ids[-1] = ids[-1] + [tok.eod]
        tokens += [t for i in ids for t in i]
        sizes += [len(i) for i in ids]
        doc_idx.append(len(sizes))
    return np.array(tokens, dtype=np.uint16).tobytes(), sizes, doc_idx


def check_outputs(bpe, prefix, docs, append_eod=True):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe[0], merge_file=bpe[1])
    for key in ("text", "title"):
        out = f"{prefix}_{key}_document"
        ds = MMapIndexedDataset(out)
        data, sizes, doc_idx = megatron_reference(tok, docs, key, append_eod)
        assert Path(out + ".bin").read_bytes() == data
        assert ds.sizes.tolist() == sizes and ds.doc_idx.tolist() == doc_idx
        if append_eod:  # every non-empty document's last sequence ends with EOD
            for d in range(len(doc_idx) - 1):
                if doc_idx[d + 1] > doc_idx[d]:
                    assert ds[doc_idx[d + 1] - 1][-1] == tok.eod


@pytest.mark.parametrize("workers", [1, 2])
def test_plain_jsonl_two_keys_append_eod(tmp_path, bpe, workers):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 7)
    counts = run_tool(bpe, src, tmp_path / "out", "--append-eod", workers=workers)
    assert counts["documents"] == 35 and counts["skipped"] == 0
    check_outputs(bpe, tmp_path / "out", DOCS * 7)
    assert MMapIndexedDataset(str(tmp_path / "out_text_document")).doc_idx.tolist()[:5] == [0, 1, 2, 2, 4]


def test_compressed_and_directory_inputs(tmp_path, bpe):
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "a.jsonl.gz", DOCS[:2], gzip.open)
    with open(tmp_path / "dir" / "b.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(
            "".join(json.dumps(d) + "\n" for d in DOCS[2:]).encode()))
    (tmp_path / "dir" / "notes.txt").write_text("ignored")
    run_tool(bpe, tmp_path / "dir", tmp_path / "out", "--append-eod")
    check_outputs(bpe, tmp_path / "out", DOCS)
    run_tool(bpe, tmp_path / "dir" / "a.jsonl.gz", tmp_path / "gz")
    check_outputs(bpe, tmp_path / "gz", DOCS[:2], append_eod=False)


def test_partitions_follow_megatron_order(tmp_path, bpe):
    docs = [{"text": f"document number {i}", "title": str(i)} for i in range(7)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    run_tool(bpe, src, tmp_path / "out", "--append-eod", "--partitions", "2", workers=2)
    # Lines are dealt round-robin into 2 partitions, written one after the other.
    check_outputs(bpe, tmp_path / "out", docs[0::2] + docs[1::2])
    assert not (tmp_path / "out_0_text_document.bin").exists()


def test_bad_lines(tmp_path, bpe):
    lines = [json.dumps(DOCS[0]), "", "{not json", json.dumps({"title": "no text"}),
             json.dumps({"text": 5, "title": "x"}), "[1, 2]", json.dumps(DOCS[1])]
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl:3: invalid JSON \(.*\); the input is "
                       r"JSON lines: one object such as \{\"text\": \"...\"\} per line"):
        run_tool(bpe, src, tmp_path / "out")
    counts = run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines", "--append-eod")
    assert counts["skipped"] == 4 and counts["documents"] == 2
    check_outputs(bpe, tmp_path / "out", [DOCS[0], DOCS[1]])
    src.write_text(json.dumps({"title": "x"}) + "\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1: missing key\(s\) \['text'\]; present: "
                       r"\['title'\]; --json-keys names the keys that hold the text"):
        run_tool(bpe, src, tmp_path / "out")


@pytest.mark.parametrize("fast_json", [True, False])
def test_a_utf16_file_is_named_at_its_first_line(tmp_path, bpe, monkeypatch, fast_json):
    """A UTF-16 file (Windows PowerShell's `>`): json decoded its first line from the byte
    order mark and took it as a document, then failed on line 2 as 'not valid utf-16-be',
    suggesting a Latin-1 conversion; with --skip-bad-lines one document was written."""
    from megatron.tokenizer import document_encoder

    if not fast_json:
        monkeypatch.setattr(document_encoder, "orjson", None)
    src = tmp_path / "wide.jsonl"
    src.write_bytes("".join(json.dumps(d) + "\r\n" for d in DOCS[:3]).encode("utf-16"))
    with pytest.raises(SystemExit, match=r"wide\.jsonl:1: not UTF-8 text: the line holds NUL "
                                         r"bytes .* iconv -f utf-16 -t utf-8"):
        run_tool(bpe, src, tmp_path / "out")
    # 4 byte lines: the last newline's zero byte ends the file after the third
    with pytest.raises(SystemExit, match=r"no documents written: all 4 lines were bad"):
        run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines")


def test_a_line_that_is_not_utf8_names_the_encoding_not_the_json(tmp_path, bpe):
    src = tmp_path / "latin.jsonl"
    src.write_bytes(json.dumps(DOCS[0]).encode() + b'\n{"text": "caf\xe9", "title": "t"}\n')
    with pytest.raises(SystemExit, match=r"latin\.jsonl:2: not UTF-8 text: byte 0xe9 at byte "
                                         r"14 of the line .* iconv -f latin1 -t utf-8"):
        run_tool(bpe, src, tmp_path / "out")
    src.write_bytes(b'{"text": "caf\xe9", "title": "t"}\n' * 2)
    with pytest.raises(SystemExit, match=r"no documents written: all 2 lines were bad") as e:
        run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines")
    assert "plain text" not in str(e.value)  # JSON it is: only the encoding is wrong


def test_cli_errors_and_progress(tmp_path, bpe):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 3)
    base = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
            "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", bpe[0], "--merge-file", bpe[1]]
    r = subprocess.run(base + ["--workers", "1", "--log-interval", "5"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "docs/s" in r.stderr and "MB/s" in r.stderr and "ETA" in r.stderr
    # an interval the document count is a multiple of: the last line is not printed twice
    r = subprocess.run(base + ["--workers", "1", "--log-interval", str(len(DOCS) * 3)],
                       capture_output=True, text=True)
    counts = re.findall(r"^Processed (\d+) documents", r.stderr, re.M)
    assert r.returncode == 0 and counts == [str(len(DOCS) * 3)], r.stderr
    r = subprocess.run(base + ["--workers", "3", "--partitions", "2"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "multiple of --partitions" in r.stderr
    try:
        import nltk  # noqa: F401
    except ImportError:
        r = subprocess.run(base + ["--workers", "1", "--split-sentences"], capture_output=True,
                           text=True)
        assert r.returncode != 0 and "needs NLTK" in r.stderr
    r = subprocess.run(base + ["--workers", "1"] + ["--input", str(tmp_path / "none.jsonl")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no input files" in r.stderr


def test_a_json_key_given_twice_is_a_usage_error(tmp_path):
    """Both keys wrote the same <prefix>_text_document files: a FileNotFoundError traceback
    at the end, after the whole input was tokenized."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3", "title": "4"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--workers", "1",
            "--json-keys", "text", "title", "text"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py")] + argv,
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "--json-keys text title text: text given twice" in r.stderr
    assert not list(tmp_path.glob("n_*"))


def _case_folding_exists(real_exists):
    """os.path.exists as a case-insensitive file system (macOS's APFS) answers it."""
    def exists(path):
        head, name = os.path.split(str(path))
        try:
            return any(n.casefold() == name.casefold() for n in os.listdir(head or "."))
        except OSError:
            return real_exists(path)
    return exists


def test_the_case_probe_sees_how_the_file_system_compares_names(tmp_path, monkeypatch):
    from tools.case_names import case_clashes, ignores_case

    assert case_clashes(["text", "title", "Text", "TEXT"]) == [["text", "Text", "TEXT"]]
    assert not ignores_case(str(tmp_path / "not" / "made"))  # Linux: case-sensitive
    monkeypatch.setattr(os.path, "exists", _case_folding_exists(os.path.exists))
    assert ignores_case(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_a_json_key_with_a_slash_is_named(tmp_path):
    """`--json-keys meta/text` failed writing <prefix>_meta/text_document.bin, in an error
    that blamed --output-prefix; the key is named before anything is read."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"meta/text": "1 2 3"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--workers", "1",
            "--json-keys", "meta/text"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py")] + argv,
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "error: --json-keys 'meta/text': a key becomes part of the output file names" in \
        r.stderr
    assert not list(tmp_path.glob("n*"))


def test_json_keys_differing_only_by_case_on_a_case_insensitive_file_system(
        tmp_path, monkeypatch, capsys):
    """On macOS `--json-keys text Text` wrote both datasets to one file: the Text key's
    replaced the text key's, and both were reported written."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3", "Text": "4"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out" / "n"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--workers", "1",
            "--json-keys", "text", "Text"]
    preprocess_data.get_args(argv)  # a case-sensitive file system: two datasets, as Megatron
    monkeypatch.setattr(os.path, "exists", _case_folding_exists(os.path.exists))
    with pytest.raises(SystemExit) as e:
        preprocess_data.get_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--json-keys text Text: text and Text differ only by case" in err
    assert f"{tmp_path / 'out' / 'n'}_text_document.bin/.idx and its Text twin" in err
    assert "separate runs with different --output-prefix" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_megatron_bert_tokenizer_types_are_refused_in_one_line_naming_the_choices(tmp_path,
                                                                                  kind):
    """Megatron 23.05 offers them; here argparse answered 'invalid choice' under the whole
    usage block, with no reason and no word of what to use instead."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b"}])
    (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n[SEP]\n[MASK]\na\nb\n")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            kind, "--vocab-file", str(tmp_path / "vocab.txt"), "--workers", "1"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py")] + argv,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"preprocess_data.py: error: --tokenizer-type {kind} is not supported: it has no "
        "end-of-document token, which GPT pretraining needs; use GPT2BPETokenizer, "
        "SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer or "
        "NullTokenizer"]
    assert not list(tmp_path.glob("n_*"))


def test_megatron_23_04_chunk_size_is_accepted_and_ignored(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--workers", "1", "--chunk-size", "25"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py")] + argv,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "warning: --chunk-size 25 ignored: Megatron-LM 23.04's flag" in r.stderr
    ds = MMapIndexedDataset(str(tmp_path / "n_text_document"))
    assert [s.tolist() for s in ds] == [[1, 2, 3], [4]]


def test_flags_the_tokenizer_does_not_read_are_warned(tmp_path, bpe, capsys):
    """Megatron-LM ignores them silently: a SentencePiece --tokenizer-model under
    GPT2BPETokenizer wrote GPT-2 ids without a word."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world"}])
    preprocess_data.get_args(_argv(src, tmp_path / "a", "--tokenizer-type", "GPT2BPETokenizer",
                                   "--vocab-file", bpe[0], "--merge-file", bpe[1],
                                   "--tokenizer-model", "sp.model", "--vocab-size", "1000",
                                   "--lang", "german"))
    err = capsys.readouterr().err
    assert ("warning: --tokenizer-model sp.model ignored: --tokenizer-type GPT2BPETokenizer "
            "does not read it") in err
    assert "warning: --vocab-size 1000 ignored" in err
    assert "warning: --lang german has no effect without --split-sentences" in err
    preprocess_data.get_args(_argv(src, tmp_path / "b", "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "1000"))
    preprocess_data.get_args(_argv(src, tmp_path / "c", "--tokenizer-type", "GPT2BPETokenizer",
                                   "--vocab-file", bpe[0], "--merge-file", bpe[1]))
    assert "warning" not in capsys.readouterr().err


def test_null_tokenizer(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "70000 4"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "80000", "--append-eod", "--workers", "1"]
    preprocess_data.run(preprocess_data.get_args(argv))
    ds = MMapIndexedDataset(str(tmp_path / "n_text_document"))
    assert ds.dtype == np.int32  # vocab 80001 >= 65500
    assert [s.tolist() for s in ds] == [[1, 2, 3, 80000], [70000, 4, 80000]]


def test_null_tokenizer_ids_beyond_vocab_size_name_the_flag(tmp_path):
    """An id above --vocab-size stopped the run with the range only; the fix (a larger
    --vocab-size) was not said, and the only hint was --skip-bad-lines."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 494"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--workers", "1"]
    with pytest.raises(SystemExit, match=r"in\.jsonl:1: key 'text': token id 494 outside the "
                                         r"vocabulary \[0, 101\); pass a --vocab-size larger "
                                         r"than the text's largest id \(this one allows ids "
                                         r"up to 100\)$") as err:
        preprocess_data.run(preprocess_data.get_args(argv))
    assert "--skip-bad-lines" not in str(err.value.code), "skipping lines is not the fix"
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 -2 494"}])  # said: a larger size
    with pytest.raises(SystemExit, match=r"in\.jsonl:1: key 'text': token id -2 outside the "
                                         r"vocabulary \[0, 101\); token ids are integers "
                                         r">= 0$"):
        preprocess_data.run(preprocess_data.get_args(argv))


def test_small_chunks_keep_line_numbers(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr(preprocess_input, "CHUNK_BYTES", 37)  # lines straddle many chunks
    docs = DOCS * 4
    lines = [json.dumps(d) for d in docs] + ["{oops"] + [json.dumps(DOCS[0])]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines))  # no final newline
    with pytest.raises(SystemExit, match=rf"in\.jsonl:{len(docs) + 1}: invalid JSON"):
        run_tool(bpe, src, tmp_path / "out", workers=2)
    counts = run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines", "--append-eod", workers=2)
    assert counts["skipped"] == 1
    check_outputs(bpe, tmp_path / "out", docs + [DOCS[0]])


def _argv(src, prefix, *tokenizer):
    return ["--input", str(src), "--output-prefix", str(prefix), *tokenizer, "--workers", "1"]


def test_tokenizer_argument_errors_exit_cleanly(tmp_path, bpe):
    vocab_file, merge_file = bpe
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer"]
    cases = [
        (gpt2 + ["--vocab-file", "/nope/vocab.json", "--merge-file", merge_file],
         r"--vocab-file /nope/vocab\.json: no such file"),
        (gpt2 + ["--merge-file", merge_file], r"needs --vocab-file: pass --vocab-file"),
        (gpt2 + ["--vocab-file", merge_file, "--merge-file", vocab_file],
         rf"--vocab-file {merge_file}: not a JSON vocabulary .*swapped"),
        (gpt2 + ["--vocab-file", vocab_file, "--merge-file", vocab_file],
         rf"--merge-file {vocab_file}:1: expected two symbols .*swapped"),
        # a directory was '[Errno 21] Is a directory', without the flag
        (gpt2 + ["--vocab-file", str(Path(vocab_file).parent), "--merge-file", merge_file],
         rf"--vocab-file {Path(vocab_file).parent} is a directory; pass the vocab\.json file "
         rf"in it: {vocab_file}$"),
        (gpt2 + ["--vocab-file", vocab_file, "--merge-file", str(tmp_path)],
         rf"--merge-file {tmp_path} is a directory; pass the merges\.txt file in it$"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "abc"],
         r"--vocab-size 'abc' is not an integer"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "-5"],
         r"--vocab-size -5: NullTokenizer needs a number of token ids >= 1"),
    ]
    for tokenizer, message in cases:
        with pytest.raises(SystemExit, match=r"^error: cannot build the \w+: .*" + message):
            preprocess_data.run(preprocess_data.get_args(_argv(src, tmp_path / "o", *tokenizer)))
    assert not list(tmp_path.glob("o*"))


def test_a_file_that_is_not_the_tokenizer_model_exits_cleanly(tmp_path, bpe):
    from tests.test_tokenizer import _train_sentencepiece

    model = _train_sentencepiece(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    vocab_listing = model[:-len(".model")] + ".vocab"
    cases = [
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", vocab_listing],
         rf"--tokenizer-model {vocab_listing}: not a SentencePiece model .*: pass {model}$"),
        (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", bpe[0]],
         rf"--tokenizer-model {bpe[0]}: not a SentencePiece model .*pass the <prefix>\.model"),
    ]
    if importlib.util.find_spec("tokenizers") is not None:
        cases.append((["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model],
                      rf"--tokenizer-model {model}: not a Hugging Face tokenizer\.json"))
    for tokenizer, message in cases:
        with pytest.raises(SystemExit, match=r"^error: cannot build the \w+: " + message):
            preprocess_data.run(preprocess_data.get_args(_argv(src, tmp_path / "o", *tokenizer)))
    assert not list(tmp_path.glob("o*"))


def test_append_eod_without_an_end_of_document_token_exits_cleanly(tmp_path):
    from tests.test_tokenizer import _train_sentencepiece

    model = _train_sentencepiece(tmp_path, eos_id=-1)
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    argv = _argv(src, tmp_path / "o", "--tokenizer-type", "GPTSentencePieceTokenizer",
                 "--tokenizer-model", model)
    with pytest.raises(SystemExit, match=r"^error: --append-eod: the GPTSentencePieceTokenizer "
                                         r"has no end-of-document token \(its end-of-document "
                                         r"id is -1\); drop --append-eod.*SentencePieceTokenizer"):
        preprocess_data.run(preprocess_data.get_args(argv + ["--append-eod"]))
    assert not list(tmp_path.glob("o*"))
    assert preprocess_data.run(preprocess_data.get_args(argv))["documents"] == len(DOCS)


def test_text_the_tokenizer_cannot_encode_is_a_bad_line(tmp_path, bpe):
    src = tmp_path / "enc.jsonl"
    src.write_text(json.dumps(DOCS[0]) + "\n"
                   + '{"text": "bad \\ud800 surrogate", "title": "t"}\n')
    with pytest.raises(SystemExit, match=r"enc\.jsonl:2: key 'text': \w+ cannot encode the "
                                         r"text \(UnicodeEncodeError"):
        run_tool(bpe, src, tmp_path / "out")
    counts = run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines", "--append-eod")
    assert counts["skipped"] == 1 and counts["documents"] == 1
    check_outputs(bpe, tmp_path / "out", [DOCS[0]])
    src = write_jsonl(tmp_path / "null.jsonl", [{"text": "hello"}, {"text": "1 2"},
                                                {"text": "3 99"}, {"text": "-1"}])
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]
    with pytest.raises(SystemExit, match=r"null\.jsonl:1: key 'text': NullTokenizer cannot"):
        preprocess_data.run(preprocess_data.get_args(_argv(src, tmp_path / "n", *null)))
    argv = _argv(src, tmp_path / "n", *null, "--skip-bad-lines")
    assert preprocess_data.run(preprocess_data.get_args(argv))["skipped"] == 3
    ds = MMapIndexedDataset(str(tmp_path / "n_text_document"))
    assert [s.tolist() for s in ds] == [[1, 2]]  # 99 >= 51 ids and -1 are bad lines too


def test_missing_output_directory_is_created(tmp_path, bpe, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    run_tool(bpe, src, tmp_path / "new" / "sub" / "out", "--append-eod")
    assert "Created output directory" in capsys.readouterr().err
    check_outputs(bpe, tmp_path / "new" / "sub" / "out", DOCS)


def test_an_output_prefix_that_names_only_a_directory_is_a_usage_error(tmp_path, bpe):
    """`--output-prefix out/` (a directory) wrote out/_text_document.bin, or stopped with a
    FileNotFoundError traceback when out/ did not exist; merge_datasets.py wrote the hidden
    out/.bin and out/.idx."""
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    (tmp_path / "there").mkdir()
    for prefix in (f"{tmp_path}/there/", f"{tmp_path}/new/"):
        with pytest.raises(SystemExit) as e:
            run_tool(bpe, src, prefix)
        assert e.value.code == 2
    err = subprocess.run(
        [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input", str(tmp_path / "x"),
         "--output-prefix", f"{tmp_path}/there/"], capture_output=True, text=True)
    assert err.returncode == 2 and (f"--output-prefix '{tmp_path}/there/' names no file: the "
                                    "outputs are files (<prefix>.bin/.idx)") in err.stderr
    assert f"e.g. --output-prefix {tmp_path}/there/my-corpus" in err.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "there"]
    assert not list((tmp_path / "there").iterdir())


@pytest.mark.parametrize("partitions", [1, 2])
def test_failed_run_keeps_the_existing_dataset(tmp_path, bpe, partitions, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    run_tool(bpe, src, tmp_path / "out", "--append-eod")
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.glob("out*"))
    monkeypatch.setattr(preprocess_input, "CHUNK_BYTES", 64)  # documents written, then the error
    bad = write_jsonl(tmp_path / "bad.jsonl", DOCS * 3)
    with open(bad, "a") as f:
        f.write("{oops\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl:16: invalid JSON"):
        run_tool(bpe, bad, tmp_path / "out", "--partitions", str(partitions),
                 workers=partitions)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.glob("out*")) == before
    assert len(before) == 4, "the .bin/.idx of both keys, no temporary file left"


def test_zero_documents_is_an_error_and_writes_nothing(tmp_path, bpe):
    src = tmp_path / "plain.txt"
    src.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n")
    with pytest.raises(SystemExit, match=r"no documents written: none of the 3 lines .*plain "
                                         r"text.*json\.dumps"):
        run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines")
    src.write_text(json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(SystemExit, match=r"no documents written: all 1 lines were bad"):
        run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines")
    src.write_text("\n\n")
    with pytest.raises(SystemExit, match=r"no documents written: .* holds no non-blank lines"):
        run_tool(bpe, src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt"]


def test_all_empty_documents_warn(tmp_path, bpe, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "", "title": "t"}] * 3)
    assert run_tool(bpe, src, tmp_path / "out")["documents"] == 3
    err = capsys.readouterr().err
    assert "out_text_document holds no tokens: the 3 documents' 'text' values" in err
    assert "title_document holds no tokens" not in err
    assert MMapIndexedDataset(str(tmp_path / "out_text_document")).doc_idx.tolist() == [0] * 4


def test_data_tokenized_with_a_huggingface_tokenizer_trains_with_it(tmp_path, capsys):
    """preprocess_data.py --tokenizer-type HuggingFaceTokenizer writes data that
    pretrain_gpt.py trains on with the same tokenizer (an extension choice: the vocabulary
    size and end-of-document id come from the tokenizer.json)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers


    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator([TRAIN_TEXT] * 3, trainer=trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(tmp_path / "tokenizer.json")]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": TRAIN_TEXT}] * 8)
    preprocess_data.run(preprocess_data.get_args(
        _argv(src, tmp_path / "hf", *tokenizer, "--append-eod")))
    ds = MMapIndexedDataset(str(tmp_path / "hf_text_document"))
    assert list(ds[0][-1:]) == [hf.token_to_id("</s>")]
    capsys.readouterr()
    assert _train_tiny(tokenizer, tmp_path, layers=2, hidden=32, heads=4, iters=2) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "iteration        2/       2" in out and "lm loss:" in out
    # the tokenizer.json's 200 ids, padded to a multiple of 128
    assert re.search(r"\n  padded_vocab_size \.+ 256\n", out)


def _train_tiny(tokenizer, tmp_path, layers: int, hidden: int, heads: int, iters: int) -> int:
    """pretrain_gpt.main's status for a tiny model on tmp_path/hf_text_document."""
    import pretrain_gpt

    return pretrain_gpt.main(tokenizer + [
        "--data-path", str(tmp_path / "hf_text_document"), "--split", "100,0,0",
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", str(iters),
        "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0", "--no-compile",
        "--data-cache-path", str(tmp_path / "cache")])


def test_progress_eta_counts_hours_past_a_day(monkeypatch):
    """A corpus that takes days shows its ETA in hours (it was taken modulo 24 hours)."""
    reader = type("Reader", (), {"total_bytes": 100, "sized": True,
                                 "raw_bytes_read": lambda self: 1})()
    progress = preprocess_data.Progress(reader, 1000)
    monkeypatch.setattr(preprocess_data.time, "time", lambda: progress.start + 3600.0)
    assert "ETA 99:00:00." in progress.line()  # 1% read in an hour


def test_a_tokenizer_json_whose_ids_have_gaps_preprocesses_and_trains(tmp_path, capsys):
    """HuggingFaceTokenizer's vocab_size was the number of tokens: a tokenizer.json whose
    ids have gaps (here 'c' is id 70000 among 5 tokens) stopped preprocess_data.py with
    'token id 70000 outside the vocabulary [0, 5)', and would have picked uint16 for ids
    past 65535 and an embedding without their rows. It is the largest id + 1."""
    tokenizers = pytest.importorskip("tokenizers")

    vocab = {"</s>": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 70000}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(tmp_path / "tokenizer.json")]
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer[-1]).vocab_size \
        == 70001
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c " * 10}] * 4)
    preprocess_data.run(preprocess_data.get_args(
        _argv(src, tmp_path / "hf", *tokenizer, "--append-eod")))
    ds = MMapIndexedDataset(str(tmp_path / "hf_text_document"))
    assert ds[0].dtype == np.int32 and list(ds[0][:4]) == [2, 3, 70000, 2]
    capsys.readouterr()
    assert _train_tiny(tokenizer, tmp_path, layers=1, hidden=16, heads=2, iters=1) == 0
    out = "".join(capsys.readouterr())
    assert re.search(r"\n  padded_vocab_size \.+ 70016\n", out)


def test_a_merges_file_warning_prints_in_one_line(tmp_path, bpe):
    """The tokenizer's warning of a merges.txt line it does not read (no final newline)
    printed as Python's `.../gpt2_bpe.py:86: UserWarning: ...` plus the source line; now
    one `WARNING:` line, as pretrain_gpt.py prints the library's warnings."""
    vocab_file, merge_file = bpe
    merges = tmp_path / "merges.txt"
    merges.write_text(Path(merge_file).read_text(encoding="utf-8").rstrip("\n"),
                      encoding="utf-8")
    src = write_jsonl(tmp_path / "in.jsonl", DOCS[:1])
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
         "--output-prefix", str(tmp_path / "out"), "--json-keys", "text", "--tokenizer-type",
         "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", str(merges),
         "--workers", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "is not read as a merge" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"WARNING: --merge-file {merges}: its "
                                                   "last line"), out.stderr
    assert "UserWarning" not in out.stderr and "warnings.warn(" not in out.stderr, out.stderr
