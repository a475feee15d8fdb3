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


def test_a_txt_file_without_its_jsonl_is_not_replaced(tmp_path):
    """--output notes.jsonl replaced the user's notes.txt (the plain-text twin's name) with
    the corpus text in silence; a pair an earlier run wrote is still replaced."""
    (tmp_path / "notes.txt").write_text("my notes\n")
    with pytest.raises(SystemExit, match=r"notes\.jsonl: its plain-text copy would replace "
                                         r".*notes\.txt, which exists without .*notes\.jsonl "
                                         r"beside it .*move it away, or name another --output"):
        make_corpus.main(["--output", str(tmp_path / "notes.jsonl"), "--max-mb", "0.01"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"
    out = str(tmp_path / "c.jsonl")
    assert make_corpus.main(["--output", out, "--max-mb", "0.01"]) == 0
    assert make_corpus.main(["--output", out, "--max-mb", "0.02"]) == 0  # its own pair


def _stopping_after_one_document(stop):
    def files(max_bytes):
        yield "a.py", "x = 1\n"
        stop()
        yield "b.py", "y = 2\n"
    return files


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "full disk"])
def test_an_interrupted_or_failed_write_keeps_the_earlier_corpus(tmp_path, capsys,
                                                                 monkeypatch, how):
    """SIGTERM ended the tool on the spot with a truncated JSONL under the output's name;
    Ctrl-C left a shorter corpus that looked complete (and a traceback); a full disk an
    OSError traceback and a partial file. Now the earlier pair is kept, nothing else left,
    one line and status 143 / 130 / 1."""
    import errno
    import os
    import signal

    out = tmp_path / "c.jsonl"
    make_corpus.main(["--output", str(out), "--max-mb", "0.01"])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    stops = {"SIGTERM": lambda: os.kill(os.getpid(), signal.SIGTERM),
             "Ctrl-C": lambda: (_ for _ in ()).throw(KeyboardInterrupt),
             "full disk": lambda: (_ for _ in ()).throw(
                 OSError(errno.ENOSPC, "No space left on device"))}
    monkeypatch.setattr(make_corpus, "stdlib_files", _stopping_after_one_document(stops[how]))

    class Killed(Exception):
        pass

    def on_the_spot(signum, frame):  # stands for SIGTERM's default action
        raise Killed

    previous = signal.signal(signal.SIGTERM, on_the_spot)
    try:
        with pytest.raises(SystemExit) as stopped:
            try:
                make_corpus.main(["--output", str(out), "--max-mb", "0.01"])
            except KeyboardInterrupt:  # would end the test session, not fail the test
                pytest.fail("a KeyboardInterrupt escaped make_corpus.main")
        assert signal.getsignal(signal.SIGTERM) is on_the_spot
    finally:
        signal.signal(signal.SIGTERM, previous)
    if how == "full disk":
        assert str(stopped.value.code) == (
            f"error: cannot write --output {out} (No space left on device); the partial files "
            "were removed and earlier ones are unchanged: free space there (or raise the "
            "file-size limit, ulimit -f), or name an --output on a disk with room")
    else:
        assert stopped.value.code == {"SIGTERM": 143, "Ctrl-C": 130}[how]
        assert (f"make_corpus.py: interrupted {'by SIGTERM' if how == 'SIGTERM' else '(Ctrl-C)'}; "
                "no corpus was written and the partial files were removed") \
            in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_an_output_named_compressed_is_written_compressed(tmp_path, suffix):
    """--output corpus.jsonl.gz held plain text under a .gz name (preprocess_data.py then
    refused it as not gzip data), and its twin was corpus.jsonl.txt."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix]
    assert make_corpus.main(["--output", str(tmp_path / f"c.jsonl{suffix}"),
                             "--max-mb", "0.01"]) == 0
    with opener(tmp_path / f"c.jsonl{suffix}", "rt", encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert (tmp_path / "c.txt").read_text().startswith(first["text"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl" + suffix, "c.txt"]
