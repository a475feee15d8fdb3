"""tools/preprocess_data.py --split-sentences with NLTK punkt, on punkt data built here.

No download: the fixture writes a small punkt model for 'english' (a few abbreviations,
no learned collocations or sentence starters) in the layout nltk reads -- the punkt_tab
tables, or the pickled `punkt` tokenizer on nltk < 3.8.2 -- and puts only that directory
on nltk.data.path, so the splits below do not depend on any data installed on the machine.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

nltk = pytest.importorskip("nltk", reason="--split-sentences needs nltk (pip install nltk)")

from megatron.core.datasets.indexed_dataset import MMapIndexedDataset  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402
from megatron.tokenizer.document_encoder import _sentence_splitter  # noqa: E402
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files  # noqa: E402
from tools import preprocess_data, preprocess_input  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ABBREVIATIONS = ["dr", "mr", "e.g", "u.s"]

# (document text, its sentences, its sentences with --keep-newlines)
CASES = [
    ("Dr. Smith went home.  He slept well! Did he? Yes.",
     ["Dr. Smith went home.", "He slept well!", "Did he?", "Yes."],
     ["Dr. Smith went home.  ", "He slept well! ", "Did he? ", "Yes."]),
    ("First line.\nSecond line.\n\nThird one, e.g. this.\n",
     ["First line.", "Second line.", "Third one, e.g. this."],
     ["First line.\n", "Second line.\n\n", "Third one, e.g. this."]),
    ("", [], []),
    ("no sentence end here", ["no sentence end here"], ["no sentence end here"]),
    ("(A quoted one.) And then\tthe next. Mr. X lives in the U.S. Today.",
     ["(A quoted one.)", "And then\tthe next.", "Mr. X lives in the U.S. Today."],
     # punkt moves a closing bracket back to its sentence and drops the space after it
     ["(A quoted one.)", "And then\tthe next. ", "Mr. X lives in the U.S. Today."]),
]


def write_punkt_data(root: Path, lang: str = "english") -> Path:
    """A punkt model for `lang` under root/tokenizers/, in the installed nltk's format."""
    from nltk.tokenize import punkt

    if hasattr(punkt, "PunktTokenizer"):  # punkt_tab: four plain-text tables
        directory = root / "tokenizers" / "punkt_tab" / lang
        directory.mkdir(parents=True)
        (directory / "abbrev_types.txt").write_text("\n".join(ABBREVIATIONS))
        for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
            (directory / name).write_text("")
    else:  # nltk < 3.8.2 loads a pickled tokenizer
        params = punkt.PunktParameters()
        params.abbrev_types = set(ABBREVIATIONS)
        (root / "tokenizers" / "punkt").mkdir(parents=True)
        with open(root / "tokenizers" / "punkt" / f"{lang}.pickle", "wb") as f:
            pickle.dump(punkt.PunktSentenceTokenizer(params), f)
    return root


@pytest.fixture(scope="module")
def punkt_root(tmp_path_factory):
    return write_punkt_data(tmp_path_factory.mktemp("nltk_data"))


@pytest.fixture
def punkt_path(monkeypatch, punkt_root):
    """Only the test's punkt data is visible to nltk (forked workers inherit this)."""
    monkeypatch.setattr(nltk.data, "path", [str(punkt_root)])
    return punkt_root


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 200)
    return write_bpe_files(tmp_path_factory.mktemp("bpe"), vocab, merges)


def run_tool(bpe, src, prefix, *extra, workers=1):
    argv = ["--input", str(src), "--output-prefix", str(prefix), "--json-keys", "text",
            "title", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe[0],
            "--merge-file", bpe[1], "--workers", str(workers), "--split-sentences", *extra]
    return preprocess_data.run(preprocess_data.get_args(argv))


def write_docs(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t, "title": "A title. Is it? Yes."}) + "\n"
                            for t in texts))
    return path


def expected_dataset(tok, sentences_per_doc, append_eod):
    """(sequences, doc_idx) a sentence dataset must hold: one sequence per non-empty
    sentence, EOD only at the end of each non-empty document."""
    sequences, doc_idx = [], [0]
    for sentences in sentences_per_doc:
        ids = [i for i in (tok.tokenize(s) for s in sentences) if i]
        if ids and append_eod:
            ids[-1] = ids[-1] + [tok.eod]
        sequences += ids
        doc_idx.append(len(sequences))
    return sequences, doc_idx


@pytest.mark.parametrize("keep_newlines", [False, True])
@pytest.mark.parametrize("append_eod", [False, True])
def test_sentences_become_sequences(tmp_path, bpe, punkt_path, keep_newlines, append_eod):
    texts = [c[0] for c in CASES] + [["Already split.", " kept as given", ""]]
    sentences = [c[2] if keep_newlines else c[1] for c in CASES] + [texts[-1]]
    src = write_docs(tmp_path / "in.jsonl", texts)
    extra = (["--append-eod"] if append_eod else []) + (["--keep-newlines"] if keep_newlines
                                                        else [])
    counts = run_tool(bpe, src, tmp_path / "out", *extra)
    assert counts["documents"] == len(texts)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe[0], merge_file=bpe[1])
    ds = MMapIndexedDataset(str(tmp_path / "out_text_sentence"))
    sequences, doc_idx = expected_dataset(tok, sentences, append_eod)
    assert ds.doc_idx.tolist() == doc_idx == [0, 4, 7, 7, 8, 11, 13]
    assert [s.tolist() for s in ds] == sequences
    eod_positions = [i for i, s in enumerate(ds) if tok.eod in s.tolist()]
    assert eod_positions == ([3, 6, 7, 10, 12] if append_eod else [])  # last of each doc
    assert all(ds[i][-1] == tok.eod for i in eod_positions)
    title = MMapIndexedDataset(str(tmp_path / "out_title_sentence"))
    space = " " if keep_newlines else ""
    title_sentences = ["A title." + space, "Is it?" + space, "Yes."]
    assert title.doc_idx.tolist() == [3 * d for d in range(len(texts) + 1)]
    assert [s.tolist() for s in title][:3] == expected_dataset(tok, [title_sentences],
                                                               append_eod)[0]
    assert not list(tmp_path.glob("*_document.*")) and not list(tmp_path.glob("*_ss*"))


def test_workers_give_identical_files(tmp_path, bpe, punkt_path, monkeypatch):
    monkeypatch.setattr(preprocess_input, "CHUNK_BYTES", 300)  # many chunks per worker
    rng = random.Random(0)
    texts = [" ".join(rng.choice(CASES)[0] for _ in range(rng.randint(0, 4))) for _ in range(60)]
    src = write_docs(tmp_path / "in.jsonl", texts)
    outputs = {}
    for workers, partitions in ((1, 1), (2, 1), (2, 2)):
        prefix = tmp_path / f"w{workers}p{partitions}"
        run_tool(bpe, src, prefix, "--append-eod", "--keep-newlines", "--partitions",
                 str(partitions), workers=workers)
        outputs[workers, partitions] = [Path(f"{prefix}_{key}_sentence.{ext}").read_bytes()
                                        for key in ("text", "title") for ext in ("bin", "idx")]
    assert outputs[1, 1] == outputs[2, 1]
    ds = MMapIndexedDataset(str(tmp_path / "w1p1_text_sentence"))
    assert len(ds.doc_idx) == 61 and len(ds) > 60  # several sentences per document
    # --partitions deals documents round-robin, so compare it with one worker on that order.
    reordered = write_docs(tmp_path / "reordered.jsonl", texts[0::2] + texts[1::2])
    run_tool(bpe, reordered, tmp_path / "ref", "--append-eod", "--keep-newlines")
    assert outputs[2, 2] == [Path(f"{tmp_path}/ref_{key}_sentence.{ext}").read_bytes()
                             for key in ("text", "title") for ext in ("bin", "idx")]


def test_splitter_with_and_without_keep_newlines(punkt_path):
    splitter = _sentence_splitter("english", keep_newlines=True)
    plain = _sentence_splitter("english", keep_newlines=False)
    for text, sentences, kept in CASES:
        assert plain.tokenize(text) == sentences
        assert splitter.tokenize(text) == kept
        if "(" not in text:  # all text but the trailing whitespace is kept
            assert "".join(kept) == text.rstrip()


def _megatron_lang_vars():
    """Megatron 23.05's --keep-newlines rule as it is written there (unanchored)."""
    from nltk.tokenize.punkt import PunktLanguageVars

    class Unanchored(PunktLanguageVars):
        _period_context_fmt = r"""
            \S*
            %(SentEndChars)s
            \s*
            (?=(?P<after_tok>
                %(NonWord)s
                |
                (?P<next_tok>\S+)
            ))"""

    return Unanchored()


def test_keep_newlines_matches_megatron_rule_in_linear_time(punkt_path):
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    ours = _sentence_splitter("english", keep_newlines=True)
    megatron = PunktSentenceTokenizer(ours._params, lang_vars=_megatron_lang_vars())
    words = ["Dr.", "home.", "well!", "he?", "e.g.", "(this.)", '"Quote."', "acting!!!",
             "a.b.", "U.S.", "end...", "?!", "x.y", "(", ")", ";", "'", "...x", "It", "is"]
    rng = random.Random(0)
    for _ in range(1500):
        text = "".join(rng.choice(words) + rng.choice([" ", "", "\n", "\n\n ", "  "])
                       for _ in range(rng.randint(1, 20)))
        assert ours.tokenize(text) == megatron.tokenize(text), repr(text)
    long_token = "Start here. " + "x" * 300_000 + " end. Next one."
    start = time.process_time()  # CPU time: a busy machine does not stretch it
    assert ours.tokenize(long_token)[-1] == "Next one."
    assert time.process_time() - start < 2.0  # the unanchored rule is quadratic here (minutes)


def test_missing_nltk_data_is_a_clear_error(tmp_path, bpe, monkeypatch):
    src = write_docs(tmp_path / "in.jsonl", ["Some text. More."])
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "empty")])
    from nltk.tokenize import punkt

    package = "punkt_tab" if hasattr(punkt, "PunktTokenizer") else "punkt"
    with pytest.raises(SystemExit, match=rf"no {package} .*installed languages: none.*"
                       rf"nltk\.downloader {package}.*NLTK_DATA"):
        run_tool(bpe, src, tmp_path / "out")
    write_punkt_data(tmp_path / "data")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "data")])
    with pytest.raises(SystemExit, match=r"--lang 'german'.*installed languages: english"):
        run_tool(bpe, src, tmp_path / "out", "--lang", "german")
    with pytest.raises(SystemExit, match=r"--lang '\.\./english'"):
        run_tool(bpe, src, tmp_path / "out", "--lang", "../english")
    monkeypatch.setitem(sys.modules, "nltk", None)  # as if nltk were not installed
    with pytest.raises(SystemExit, match=r"needs NLTK.*pip install nltk"):
        run_tool(bpe, src, tmp_path / "out")
    assert not list(tmp_path.glob("out*"))  # each failed before any output was written


def test_cli_finds_punkt_through_nltk_data(tmp_path, bpe, punkt_root):
    src = write_docs(tmp_path / "in.jsonl", [CASES[0][0]])
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
           "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", bpe[0], "--merge-file", bpe[1], "--workers", "1",
           "--split-sentences", "--append-eod"]
    env = dict(os.environ, NLTK_DATA=str(punkt_root))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert len(MMapIndexedDataset(str(tmp_path / "o_text_sentence"))) == 4
    r = subprocess.run(cmd + ["--lang", "nosuchlanguage"], capture_output=True, text=True,
                       env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "installed languages: english" in r.stderr and "nltk.downloader" in r.stderr
