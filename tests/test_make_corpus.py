"""tools/make_corpus.py: the JSONL output and its plain-text twin are two files, the usage
text keeps its example's line break, and a vocabulary SentencePiece cannot learn from the
corpus is a clean error naming the limit."""
from __future__ import annotations

import json

import pytest

from tools import make_corpus


def test_output_ending_in_txt_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"c\.txt: .*the output itself; name the JSONL file "
                                         rf"{tmp_path}/c\.jsonl$"):
        make_corpus.main(["--output", str(tmp_path / "c.txt"), "--max-mb", "0.01"])
    assert not (tmp_path / "c.txt").exists()
    assert make_corpus.main(["--output", str(tmp_path / "c.jsonl"), "--max-mb", "0.01"]) == 0
    first = (tmp_path / "c.jsonl").read_text().splitlines()[0]
    assert set(json.loads(first)) == {"text", "source"}
    assert (tmp_path / "c.txt").read_text().startswith(json.loads(first)["text"])


def test_usage_example_keeps_its_line_continuation(capsys):
    with pytest.raises(SystemExit):
        make_corpus.main(["--help"])
    assert "--max-mb 6 \\\n        --tokenizer-prefix data/spm" in capsys.readouterr().out


def test_vocab_size_beyond_the_corpus_names_the_limit(tmp_path):
    pytest.importorskip("sentencepiece")
    with pytest.raises(SystemExit, match=r"--vocab-size 60000 is more than SentencePiece can "
                                         r"learn from .*: at most \d+ here; lower --vocab-size"):
        make_corpus.main(["--output", str(tmp_path / "c.jsonl"), "--max-mb", "0.05",
                          "--tokenizer-prefix", str(tmp_path / "spm"), "--vocab-size", "60000"])


def test_vocab_size_without_tokenizer_prefix_is_refused(tmp_path, capsys):
    """--vocab-size alone trained nothing and said nothing: now it names the missing flag."""
    with pytest.raises(SystemExit):
        make_corpus.main(["--output", str(tmp_path / "c.jsonl"), "--vocab-size", "1000"])
    assert ("--vocab-size 1000 is the size of the SentencePiece tokenizer, which only "
            "--tokenizer-prefix PREFIX trains; add it or drop --vocab-size") \
        in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()


@pytest.mark.parametrize("max_mb", ["nan", "0", "-1"])
def test_max_mb_that_is_no_positive_number_is_refused(tmp_path, capsys, max_mb):
    """--max-mb nan was a ValueError traceback; 0 and -1 wrote one document in silence."""
    with pytest.raises(SystemExit):
        make_corpus.main(["--output", str(tmp_path / "c.jsonl"), "--max-mb", max_mb])
    assert f"--max-mb {float(max_mb)} must be a number > 0" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()


def test_output_that_is_a_directory_is_refused(tmp_path):
    """--output naming a directory (or its .txt twin one) was an IsADirectoryError traceback,
    after the other file of the pair had been created."""
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(SystemExit, match=r"d\.jsonl is a directory; name a file"):
        make_corpus.main(["--output", str(tmp_path / "d.jsonl"), "--max-mb", "0.01"])
    (tmp_path / "e.txt").mkdir()
    with pytest.raises(SystemExit, match=r"e\.txt is a directory; name a file"):
        make_corpus.main(["--output", str(tmp_path / "e.jsonl"), "--max-mb", "0.01"])
    assert not (tmp_path / "e.jsonl").exists()
