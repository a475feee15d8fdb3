"""tools/preprocess_data.py on messy inputs and hostile surroundings: truncated compressed
files, pipes, byte-order marks, values of the wrong JSON type, failing writes, Ctrl-C and
SIGTERM. (The well-formed paths are in test_preprocess.py.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_preprocess import DOCS, run_tool
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

REPO = Path(__file__).resolve().parents[1]
LINES = "".join(json.dumps(d) + "\n" for d in DOCS * 40).encode()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 200)
    return write_bpe_files(tmp_path_factory.mktemp("bpe"), vocab, merges)


def test_values_of_the_wrong_type_are_named_as_json(tmp_path, bpe, capsys):
    """The messages said 'holds NoneType' / 'holds list' (Python's names, and not which
    item of a list was wrong); a JSON array file now names the conversion."""
    lines = [{"text": None, "title": "t"}, {"text": ["a", 7], "title": "t"},
             {"text": {"a": "b"}, "title": "t"}, {"text": "ok", "title": False},
             {"text": "ok", "title": "t"}]
    src = tmp_path / "types.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in lines) + json.dumps(lines) + "\n")
    run_tool(bpe, src, tmp_path / "out", "--skip-bad-lines")
    err = capsys.readouterr().err
    for line_no, what in ((1, "key 'text' holds null,"),
                          (2, "key 'text' holds a list whose item 1 is a number,"),
                          (3, "key 'text' holds an object,"), (4, "key 'title' holds false,"),
                          (6, "expected a JSON object, got a list; this looks like a JSON "
                              "file .*jq -c '\\.\\[\\]' IN\\.json > OUT\\.jsonl")):
        assert re.search(rf"types\.jsonl:{line_no}: {what}", err), err
    (tmp_path / "pretty.json").write_text(json.dumps([{"text": "a"}], indent=2))
    with pytest.raises(SystemExit, match=r"pretty\.json:1: invalid JSON .*this looks like a "
                                         r"JSON file"):
        run_tool(bpe, tmp_path / "pretty.json", tmp_path / "out")
