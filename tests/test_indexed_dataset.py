"""Megatron mmap .bin/.idx: writer bytes, reader views, hand-built index, bad files."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    best_dtype,
    missing_dataset_hint,
    write_index,
)

REPO = Path(__file__).resolve().parents[1]

# The worked example of the format description: docs [10,11,12] and [20,21] as uint16.
EXAMPLE_BIN = bytes.fromhex("0a000b000c0014001500")
EXAMPLE_IDX = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<QQ", 2, 3)
               + struct.pack("<ii", 3, 2) + struct.pack("<qq", 0, 6) + struct.pack("<qqq", 0, 1, 2))


def write(prefix: Path, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(np.array(seq))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def test_worked_example_bytes(tmp_path):
    assert len(EXAMPLE_IDX) == 82
    write(tmp_path / "a", [[[10, 11, 12]], [[20, 21]]])
    assert (tmp_path / "a.bin").read_bytes() == EXAMPLE_BIN
    assert (tmp_path / "a.idx").read_bytes() == EXAMPLE_IDX
    builder = IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16)
    builder.add_doc([10, 11, 12], [3])
    builder.add_doc(np.array([20, 21]), [2])
    builder.finalize(str(tmp_path / "b.idx"))
    assert (tmp_path / "b.idx").read_bytes() == EXAMPLE_IDX


def test_hand_built_index_loads(tmp_path):
    (tmp_path / "h.bin").write_bytes(EXAMPLE_BIN)
    (tmp_path / "h.idx").write_bytes(EXAMPLE_IDX)
    ds = MMapIndexedDataset(str(tmp_path / "h"))
    assert len(ds) == 2 and ds.dtype == np.uint16
    assert ds[0].tolist() == [10, 11, 12] and ds[1].tolist() == [20, 21]
    assert ds.sizes.tolist() == [3, 2] and ds.pointers.tolist() == [0, 6]
    assert ds.doc_idx.tolist() == [0, 1, 2]
    assert ds.get(0, offset=1, length=2).tolist() == [11, 12]
    assert ds.get(1, offset=1).tolist() == [21]
    assert [a.tolist() for a in ds[0:2]] == [[10, 11, 12], [20, 21]]
    with pytest.raises(IndexError):
        ds.get(2)
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64,
                                   np.float64, np.float32, np.uint16])
def test_round_trip_all_dtypes(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 100, rng.integers(0, 7)).astype(dtype)
             for _ in range(rng.integers(0, 4))] for _ in range(30)]
    write(tmp_path / "r", docs, dtype)
    ds = MMapIndexedDataset(str(tmp_path / "r"))
    flat = [seq for doc in docs for seq in doc]
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(flat)
    for got, want in zip(ds, flat):
        np.testing.assert_array_equal(got, want)
    assert (tmp_path / "r.bin").read_bytes() == b"".join(np.asarray(s, dtype).tobytes()
                                                        for s in flat)
    assert ds.doc_idx.tolist() == [0] + list(np.cumsum([len(d) for d in docs]))


def test_views_do_not_copy(tmp_path):
    write(tmp_path / "v", [[list(range(1000))]])
    ds = MMapIndexedDataset(str(tmp_path / "v"))
    item = ds[0]
    assert not item.flags.owndata and not item.flags.writeable
    assert not ds.sizes.flags.owndata and not ds.doc_idx.flags.owndata


def test_add_batch_and_merge(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    b.add_batch(np.array([1, 2, 3, 4, 5, 6]), np.array([2, 1, 3]), np.array([2, 0, 1]))
    b.finalize(str(tmp_path / "x.idx"))
    x = MMapIndexedDataset(str(tmp_path / "x"))
    assert x.doc_idx.tolist() == [0, 2, 2, 3] and x[2].tolist() == [4, 5, 6]
    write(tmp_path / "y", [[[7, 8]], [[9]]])
    m = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    m.merge_file_(str(tmp_path / "x"))
    m.merge_file_(str(tmp_path / "y"))
    m.finalize(str(tmp_path / "m.idx"))
    merged = MMapIndexedDataset(str(tmp_path / "m"))
    assert [s.tolist() for s in merged] == [[1, 2], [3], [4, 5, 6], [7, 8], [9]]
    assert merged.doc_idx.tolist() == [0, 2, 2, 3, 4, 5]
    write(tmp_path / "z", [[[1]]], np.int32)
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetBuilder(str(tmp_path / "w.bin"), np.uint16).merge_file_(str(tmp_path / "z"))


def test_merge_tool(tmp_path):
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "a", [[[1, 2]]])
    write(tmp_path / "d" / "b", [[[3]], [[4, 5]]])
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input",
                    str(tmp_path / "d"), "--output-prefix", str(out)], check=True)
    ds = MMapIndexedDataset(str(out))
    assert [s.tolist() for s in ds] == [[1, 2], [3], [4, 5]] and ds.doc_idx.tolist() == [0, 1, 2, 3]
    write(tmp_path / "c", [[[1]]], np.int32)
    r = subprocess.run([sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input",
                        str(tmp_path / "d" / "a"), str(tmp_path / "c"), "--output-prefix",
                        str(tmp_path / "bad")], capture_output=True, text=True)
    assert r.returncode != 0 and "different dtypes" in r.stderr


def _corrupt(tmp_path, name, idx=None, bin_=None):
    (tmp_path / f"{name}.idx").write_bytes(EXAMPLE_IDX if idx is None else idx)
    (tmp_path / f"{name}.bin").write_bytes(EXAMPLE_BIN if bin_ is None else bin_)
    return str(tmp_path / name)


@pytest.mark.parametrize("name,idx,bin_,message", [
    ("magic", b"XNTIDX\x00\x00" + EXAMPLE_IDX[8:], None, "bad magic"),
    ("version", EXAMPLE_IDX[:9] + struct.pack("<Q", 2) + EXAMPLE_IDX[17:], None, "version 2"),
    ("code", EXAMPLE_IDX[:17] + bytes([9]) + EXAMPLE_IDX[18:], None, "dtype code 9"),
    ("short_header", EXAMPLE_IDX[:20], None, "truncated index"),
    ("short_index", EXAMPLE_IDX[:-8], None, "truncated index"),
    ("long_index", EXAMPLE_IDX + b"\x00" * 8, None, "oversized index"),
    ("short_bin", None, EXAMPLE_BIN[:-2], "truncated data file"),
    ("long_bin", None, EXAMPLE_BIN + b"\x00" * 3, "oversized data file"),
    ("doc_idx", EXAMPLE_IDX[:-8] + struct.pack("<q", 5), None, "doc_idx"),
    ("pointers", EXAMPLE_IDX[:42] + struct.pack("<q", 4) + EXAMPLE_IDX[50:], None, "pointers"),
])
def test_corrupt_files_raise(tmp_path, name, idx, bin_, message):
    prefix = _corrupt(tmp_path, name, idx, bin_)
    with pytest.raises(ValueError, match=message) as info:
        MMapIndexedDataset(prefix)
    assert name in str(info.value)  # the message names the file


def test_an_idx_of_another_dtype_is_named_as_such(tmp_path):
    """The worked example's uint16 .bin under an .idx that says int32 (the dtype the tools
    pick for a vocabulary of 65500 ids or more): the message says which dtype the .bin
    fits, not only 'truncated' (which sent users to copy the .bin again)."""
    prefix = str(tmp_path / "mixed")
    (tmp_path / "mixed.bin").write_bytes(EXAMPLE_BIN)
    write_index(prefix + ".idx", np.int32, np.array([3, 2]), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"mixed.bin: truncated data file: 10 bytes, the index "
                                         r"\(2 sequences, 5 tokens of int32\) implies 20; it "
                                         r"holds exactly that many tokens of int16 or uint16: "
                                         r"the .idx says int32, another dtype than the .bin "
                                         r"was written in"):
        MMapIndexedDataset(prefix)


def _legacy_idx(code=8, element_size=2, sizes=(3, 2), doc_idx=(0, 1, 2), dims=None):
    """A legacy TNTIDX index (older Megatron-LM's --dataset-impl lazy/cached) by hand."""
    n = len(sizes)
    dims = list(range(n + 1)) if dims is None else dims
    data = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return (b"TNTIDX\x00\x00" + struct.pack("<QQQQQQ", 1, code, element_size, n, len(sizes),
                                             len(doc_idx))
            + struct.pack(f"<{n + 1}q", *dims) + struct.pack(f"<{n + 1}q", *data)
            + struct.pack(f"<{len(sizes)}q", *sizes) + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def test_legacy_index_reads_like_the_mmap_one(tmp_path):
    """The worked example's .bin under a legacy index gives the same sizes, pointers,
    doc_idx and tokens as under the mmap index."""
    legacy = MMapIndexedDataset(_corrupt(tmp_path, "legacy", _legacy_idx()))
    mmap = MMapIndexedDataset(_corrupt(tmp_path, "mmap"))
    assert legacy.dtype == mmap.dtype == np.uint16
    for name in ("sizes", "pointers", "doc_idx"):
        assert getattr(legacy, name).tolist() == getattr(mmap, name).tolist(), name
    assert [x.tolist() for x in legacy[0:2]] == [[10, 11, 12], [20, 21]]
    assert legacy.get(0, 1, 2).tolist() == [11, 12]


@pytest.mark.parametrize("idx,message", [
    (_legacy_idx(code=6, element_size=8), "dtype code 6"),
    (_legacy_idx(code=8, element_size=4), "element size 4"),
    (_legacy_idx()[:-8], "truncated legacy index"),
    (_legacy_idx(dims=[0, 2, 3]), "multi-dimensional items"),
    (_legacy_idx(doc_idx=(0, 1)), "doc_idx"),
])
def test_bad_legacy_index_is_named(tmp_path, idx, message):
    with pytest.raises(ValueError, match=message) as info:
        MMapIndexedDataset(_corrupt(tmp_path, "bad_legacy", idx))
    assert "bad_legacy.idx" in str(info.value)


def test_missing_file_and_megatron_eod_bug(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        MMapIndexedDataset(str(tmp_path / "nothing"))
    # Megatron 23.06 --append-eod: .bin holds one uncounted EOD per document.
    buggy_bin = np.array([10, 11, 12, 99, 20, 21, 99], dtype=np.uint16).tobytes()
    prefix = _corrupt(tmp_path, "bug", None, buggy_bin)
    with pytest.warns(UserWarning, match="off-by-one"):
        ds = MMapIndexedDataset(prefix)
    assert ds[1].tolist() == [99, 20]  # read exactly as Megatron reads it


def test_merging_megatron_eod_bug_data_with_exact_data_is_refused(tmp_path):
    """A Megatron-LM --append-eod .bin (one uncounted EOD per document) merged with an exact
    one was reported merged, and the output could not be read ('oversized data file',
    blamed on a copy cut short); sequences after the buggy input were misplaced too.
    Merging only buggy inputs stays allowed: read as Megatron reads the concatenation."""
    buggy_bin = np.array([10, 11, 12, 99, 20, 21, 99], dtype=np.uint16).tobytes()
    _corrupt(tmp_path, "bug", None, buggy_bin)
    write(tmp_path / "ok", [[[30, 31, 99]], [[40, 99]]])
    tool = [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input"]
    for order in (["bug", "ok"], ["ok", "bug"]):
        r = subprocess.run(tool + [str(tmp_path / n) for n in order]
                           + ["--output-prefix", str(tmp_path / "m")], capture_output=True,
                           text=True)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert (f"error: cannot merge {tmp_path / 'bug'} (written by Megatron-LM's "
                "preprocess_data.py --append-eod") in r.stderr
        assert f"with {tmp_path / 'ok'} (exact .bin/.idx)" in r.stderr
        assert not (tmp_path / "m.bin").exists() and not (tmp_path / "m.idx").exists()
    _corrupt(tmp_path, "bug2", None, buggy_bin)  # one dataset given twice is refused
    r = subprocess.run(tool + [str(tmp_path / "bug"), str(tmp_path / "bug2"),
                               "--output-prefix", str(tmp_path / "bb")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.warns(UserWarning, match="off-by-one"):
        merged = MMapIndexedDataset(str(tmp_path / "bb"))
    assert [s.tolist() for s in merged] == [[10, 11, 12], [99, 20], [21, 99, 10], [11, 12]]


def test_best_dtype():
    assert best_dtype(50257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(128000) == np.int32


def test_merge_tool_directory_needs_pairs(tmp_path):
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "a", [[[1, 2]]])
    write(tmp_path / "d" / "b", [[[3]]])
    (tmp_path / "d" / "b.bin").unlink()
    cmd = [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input",
           str(tmp_path / "d"), "--output-prefix", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and f"{tmp_path / 'd' / 'b.idx'} has no .bin" in r.stderr
    assert not (tmp_path / "out.bin").exists()


def test_merge_tool_output_directory_and_bad_inputs(tmp_path):
    """A missing --output-prefix directory is created (it was a FileNotFoundError
    traceback); a truncated input is an error naming it (a ValueError traceback)."""
    write(tmp_path / "a", [[[1, 2]]])
    write(tmp_path / "b", [[[3]], [[4, 5]]])
    tool = [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input",
            str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix"]
    r = subprocess.run(tool + [str(tmp_path / "new" / "m")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"Created output directory {tmp_path / 'new'}" in r.stderr
    assert [s.tolist() for s in MMapIndexedDataset(str(tmp_path / "new" / "m"))] == [
        [1, 2], [3], [4, 5]]
    (tmp_path / "b.bin").write_bytes((tmp_path / "b.bin").read_bytes()[:3])
    r = subprocess.run(tool + [str(tmp_path / "m2")], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"error: --input {tmp_path / 'b'}: {tmp_path / 'b.bin'}: truncated" in r.stderr


def test_merging_again_into_the_input_directory_names_the_fix(tmp_path):
    """`--input shards --output-prefix shards/merged` run twice: the first merge's output
    is an input of the second; the refusal named no fix (and had no 'error:')."""
    (tmp_path / "shards").mkdir()
    write(tmp_path / "shards" / "a", [[[1, 2]]])
    write(tmp_path / "shards" / "b", [[[3]]])
    out = tmp_path / "shards" / "merged"
    tool = [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input",
            str(tmp_path / "shards"), "--output-prefix", str(out)]
    subprocess.run(tool, check=True, capture_output=True)
    before = (tmp_path / "shards" / "merged.bin").read_bytes()
    r = subprocess.run(tool, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"error: --output-prefix {out} is also an input" in r.stderr, r.stderr
    assert "pass an --output-prefix outside the inputs, or move that .bin/.idx away" in r.stderr
    assert (tmp_path / "shards" / "merged.bin").read_bytes() == before


def test_a_dataset_named_twice_is_not_merged_twice(tmp_path):
    """A prefix given twice, or given beside its directory, or through a symlink, was
    merged once per naming: every document of it twice in the output, without a word."""
    from tools import merge_datasets

    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "a", [[[1, 2]]])
    write(tmp_path / "d" / "b", [[[3]]])
    (tmp_path / "alias").symlink_to("d")
    a, b = str(tmp_path / "d" / "a"), str(tmp_path / "d" / "b")
    for inputs, named in (([a, a], a), ([str(tmp_path / "d"), b], b),
                          ([a, str(tmp_path / "alias" / "a")],
                           f"{a} and {tmp_path / 'alias' / 'a'}")):
        with pytest.raises(SystemExit, match=f"^error: --input names the dataset {named} "
                                             r"twice \(.+\): its documents would be in the "
                                             "merged dataset twice"):
            merge_datasets.main(["--input", *inputs, "--output-prefix", str(tmp_path / "m")])
    assert not list(tmp_path.glob("m*"))


def test_a_shell_glob_naming_each_bin_and_idx_merges_each_dataset_once(tmp_path):
    """`merge_datasets.py --input data/*` (the shell gives each dataset's .bin and .idx)
    was refused as naming every dataset twice; a .bin given twice still is."""
    from tools import merge_datasets

    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "a", [[[1, 2]]])
    write(tmp_path / "d" / "b", [[[3]], [[4, 5]]])
    files = sorted(str(f) for f in (tmp_path / "d").iterdir())  # a.bin a.idx b.bin b.idx
    assert merge_datasets.main(["--input", *files, "--output-prefix", str(tmp_path / "m")]) == 0
    merged = MMapIndexedDataset(str(tmp_path / "m"))
    assert [s.tolist() for s in merged] == [[1, 2], [3], [4, 5]]
    assert merged.doc_idx.tolist() == [0, 1, 2, 3]
    a_bin = str(tmp_path / "d" / "a.bin")
    with pytest.raises(SystemExit, match="names the dataset .* twice"):
        merge_datasets.main(["--input", a_bin, files[1], a_bin, "--output-prefix",
                             str(tmp_path / "m2")])


def test_an_input_reached_through_a_symlink_is_not_the_output(tmp_path):
    """The output-is-an-input check compared the paths as given: an input directory named
    through a symlink (`data/current -> v3`), or an input that is a symlink to the output's
    file, was merged and then replaced by the merge (its documents twice over)."""
    from tools import merge_datasets

    (tmp_path / "v3").mkdir()
    write(tmp_path / "v3" / "a", [[[1, 2]]])
    write(tmp_path / "v3" / "merged", [[[3]]])  # an earlier merge's output
    (tmp_path / "current").symlink_to("v3")
    for ext in (".bin", ".idx"):
        (tmp_path / ("link" + ext)).symlink_to(tmp_path / "v3" / ("a" + ext))
    before = {p.name: p.read_bytes() for p in (tmp_path / "v3").iterdir()}
    for inputs, out in (([tmp_path / "current"], tmp_path / "v3" / "merged"),
                        ([tmp_path / "link"], tmp_path / "v3" / "a"),
                        ([tmp_path / "v3" / "a"], tmp_path / "current" / "a")):
        with pytest.raises(SystemExit, match=f"^error: --output-prefix {out} is also an input"):
            merge_datasets.main(["--input", *map(str, inputs), "--output-prefix", str(out)])
    assert {p.name: p.read_bytes() for p in (tmp_path / "v3").iterdir()} == before
    merge_datasets.main(["--input", str(tmp_path / "link"), "--output-prefix",
                         str(tmp_path / "other")])  # a symlinked input, another output
    assert [s.tolist() for s in MMapIndexedDataset(str(tmp_path / "other"))] == [[1, 2]]


def test_a_failed_merge_keeps_the_earlier_output(tmp_path, monkeypatch):
    """A full disk ended the merge with an OSError traceback; now one line names the output
    and the fix (the earlier output is kept either way)."""
    import errno

    from tools import merge_datasets

    write(tmp_path / "a", [[[1, 2]]])
    write(tmp_path / "b", [[[3]]])
    out = str(tmp_path / "out")
    merge_datasets.merge([str(tmp_path / "b")], out)
    real = IndexedDatasetBuilder.merge_file_

    def fail_on_b(self, prefix):
        if prefix.endswith("b"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, prefix)

    monkeypatch.setattr(IndexedDatasetBuilder, "merge_file_", fail_on_b)
    with pytest.raises(SystemExit, match=rf"^error: cannot write the dataset at --output-prefix "
                                         rf"{out}: No space left on device; free space there, or "
                                         r"pass an --output-prefix on a disk with room"):
        merge_datasets.merge([str(tmp_path / "a"), str(tmp_path / "b")], out)
    assert [s.tolist() for s in MMapIndexedDataset(out)] == [[3]]  # a's tokens not in it
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.bin", "a.idx", "b.bin", "b.idx", "out.bin", "out.idx"]


def test_two_merges_with_one_process_id_into_one_output_keep_their_files_apart(
        tmp_path, monkeypatch):
    """Two merges in containers (same process id) on shared storage, into the same
    --output-prefix, shared one `.tmp<pid>.bin`: the later one failed and its writes
    corrupted the other's output."""
    import os

    from tools import merge_datasets

    write(tmp_path / "a", [[[1, 2]]])
    write(tmp_path / "b", [[[3]]])
    out = str(tmp_path / "out")
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    real = IndexedDatasetBuilder.merge_file_
    calls = []

    def other_merge_meanwhile(self, prefix):
        calls.append(prefix)
        if len(calls) == 1:
            merge_datasets.merge([str(tmp_path / "b")], out)
        real(self, prefix)

    monkeypatch.setattr(IndexedDatasetBuilder, "merge_file_", other_merge_meanwhile)
    merge_datasets.merge([str(tmp_path / "a")], out)
    assert [s.tolist() for s in MMapIndexedDataset(out)] == [[1, 2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.bin", "a.idx", "b.bin", "b.idx", "out.bin", "out.idx"]


def test_prefix_with_a_suffix_suggests_dropping_it(tmp_path):
    write(tmp_path / "w", [[[1, 2]]])
    with pytest.raises(ValueError, match=rf"w\.bin\.idx: no such file .*without \.bin/\.idx: "
                                         rf"pass {tmp_path / 'w'}$"):
        MMapIndexedDataset(str(tmp_path / "w.bin"))


def test_the_output_prefix_given_for_the_dataset_names_its_files(tmp_path):
    """preprocess_data.py --output-prefix P writes P_<key>_document: P given to --data-path
    (or merge_datasets.py) names those; a .bin without its .idx says which was not written."""
    from megatron.arguments_report import find_missing_inputs

    write(tmp_path / "corpus_text_document", [[[1, 2]]])
    write(tmp_path / "corpus_title_document", [[[3]]])
    fix = (rf"preprocess_data\.py names its output <output-prefix>_<json key>_document .*: pass "
           rf"{tmp_path / 'corpus_text_document'} or {tmp_path / 'corpus_title_document'}$")
    with pytest.raises(ValueError, match=rf"corpus\.idx: no such file .*; {fix}"):
        MMapIndexedDataset(str(tmp_path / "corpus"))
    (tmp_path / "lonely.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match=r"lonely\.idx: no such file .*; the \.bin is there but "
                                         r"not its \.idx, which preprocess_data\.py and "
                                         r"merge_datasets\.py write last"):
        MMapIndexedDataset(str(tmp_path / "lonely"))
    missing = find_missing_inputs({"data_path": ["1", str(tmp_path / "corpus"),
                                                 "1", str(tmp_path / "lonely")]})
    assert any(m.startswith(f"{tmp_path / 'corpus'}.bin and ") and "pass " in m
               for m in missing), missing
    assert any(m.startswith(f"{tmp_path / 'lonely'}.idx (--data-path: the .bin is there")
               for m in missing), missing
    r = subprocess.run([sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input",
                        str(tmp_path / "corpus"), "--output-prefix", str(tmp_path / "m")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and f"pass {tmp_path / 'corpus_text_document'} or" in r.stderr


def test_gpt_samples_from_a_legacy_index_equal_the_mmap_ones(tmp_path):
    """The same documents under a legacy index and an mmap index give the same GPT
    training samples (what a run on older Megatron-LM data files reads)."""
    from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets

    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 500, size=int(rng.integers(3, 30))).tolist()] for _ in range(40)]
    write(tmp_path / "m", docs)
    sizes = [len(d[0]) for d in docs]
    (tmp_path / "l.bin").write_bytes((tmp_path / "m.bin").read_bytes())
    (tmp_path / "l.idx").write_bytes(_legacy_idx(sizes=sizes, doc_idx=range(len(docs) + 1)))
    out = {}
    for name in ("m", "l"):
        train, _, _ = build_train_valid_test_datasets([str(tmp_path / name)], "98,2,0",
                                                      [20, 2, 0], 16, 1234, None)
        out[name] = [train[i]["text"].tolist() for i in range(len(train))]
    assert out["l"] == out["m"] and len(out["m"]) >= 20


def test_a_truncated_or_oversized_bin_names_the_fix(tmp_path):
    """A .bin cut short (an interrupted copy) or grown (rewritten by another preprocessing
    run) said only the sizes; the message says to copy both files again or preprocess."""
    for name, bin_ in (("short", EXAMPLE_BIN[:-2]), ("long", EXAMPLE_BIN + b"\x00" * 3)):
        prefix = _corrupt(tmp_path, name, None, bin_)
        with pytest.raises(ValueError) as info:
            MMapIndexedDataset(prefix)
        message = str(info.value)
        assert f"{name}.bin: " in message
        assert message.endswith("copy both files again, or rerun tools/preprocess_data.py "
                                "for this prefix"), message


def test_prefix_with_a_trailing_dot_or_slash_suggests_dropping_it(tmp_path):
    """Shell completion of `corpus_text_document.<TAB>` stops at the '.' shared by .bin and
    .idx; that prefix (or one with a trailing '/') names the dataset without it."""
    write(tmp_path / "w", [[[1, 2]]])
    for typo in ("w.", "w/"):
        with pytest.raises(ValueError, match=rf"no such file .*trailing '\.' or '/'.*: "
                                             rf"pass {tmp_path / 'w'}$"):
            MMapIndexedDataset(f"{tmp_path}/{typo}")
    assert missing_dataset_hint(str(tmp_path / "nothing.")) == ""


_MERGE_STOPPED_MIDWAY = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tools import merge_datasets
real = IndexedDatasetBuilder.merge_file_
def merge_then_stop(self, prefix):
    real(self, prefix)  # the first input is in the partial .bin, then the signal comes
    os.kill(os.getpid(), signal.{signal})
IndexedDatasetBuilder.merge_file_ = merge_then_stop
sys.exit(merge_datasets.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signal_name,status,how", [("SIGTERM", 143, "by SIGTERM"),
                                                    ("SIGINT", 130, "(Ctrl-C)")])
def test_a_merge_stopped_by_sigterm_or_ctrl_c_removes_its_partial_files(tmp_path, signal_name,
                                                                        status, how):
    """SIGTERM (a scheduler's time limit, `timeout`) killed a merge on the spot: its partial
    `<out>.tmp<pid>-<random>.bin` (as large as the inputs merged so far) stayed, and a later
    merge said nothing of it; Ctrl-C printed a KeyboardInterrupt traceback."""
    write(tmp_path / "a", [[[1, 2]]])
    write(tmp_path / "b", [[[3]]])
    out = tmp_path / "out" / "merged"
    script = _MERGE_STOPPED_MIDWAY.format(repo=str(REPO), signal=signal_name)
    r = subprocess.run([sys.executable, "-c", script, "--input", str(tmp_path / "a"),
                        str(tmp_path / "b"), "--output-prefix", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == status, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert (f"merge_datasets.py: interrupted {how}; no dataset was written and the partial "
            f"files were removed (an earlier dataset at --output-prefix {out} is unchanged): "
            "run the same command again") in r.stderr, r.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_a_merge_names_the_temporaries_a_killed_merge_left_at_its_output(tmp_path, capsys):
    """A merge killed with SIGKILL leaves `<out>.tmp<pid>-<random>.bin`; the next merge into
    the same --output-prefix said nothing of it (preprocess_data.py names its own)."""
    from tools import merge_datasets

    write(tmp_path / "a", [[[1, 2]]])
    out = tmp_path / "merged"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"merged.tmp{dead}-0123abcd.bin"
    stale.write_bytes(b"\0" * 64)
    merge_datasets.main(["--input", str(tmp_path / "a"), "--output-prefix", str(out)])
    err = capsys.readouterr().err
    assert f"Remove them with: rm -f {stale}" in err, err
    assert stale.exists()  # named, never deleted: another host's merge may own it
    assert [s.tolist() for s in MMapIndexedDataset(str(out))] == [[1, 2]]
