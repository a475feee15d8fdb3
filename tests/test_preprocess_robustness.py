"""tools/preprocess_data.py on messy inputs and hostile surroundings: truncated compressed
files, pipes, byte-order marks, values of the wrong JSON type, failing writes, Ctrl-C and
SIGTERM. (The well-formed paths are in test_preprocess.py.)"""
from __future__ import annotations

import argparse
import errno
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from megatron.tokenizer import document_encoder
from tests.test_preprocess import DOCS, check_outputs, run_tool, write_jsonl
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files
from tools import preprocess_data

REPO = Path(__file__).resolve().parents[1]
LINES = "".join(json.dumps(d) + "\n" for d in DOCS * 40).encode()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 200)
    return write_bpe_files(tmp_path_factory.mktemp("bpe"), vocab, merges)


def test_truncated_or_mislabelled_compressed_inputs_stop_naming_the_file(tmp_path, bpe):
    """A .gz cut short ended with an EOFError traceback from the pool; a cut .zst ended
    quietly, its cut-off last line reported as bad JSON (or, with --skip-bad-lines, the
    rest of the file lost without a word); a plain file named .gz: a BadGzipFile
    traceback."""
    zstandard = pytest.importorskip("zstandard")
    lines = LINES * 60  # several chunks: the cut comes after some were read
    whole = len(lines.split(b"\n")) - 1
    packed = gzip.compress(lines)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[:len(packed) // 2])
    packed = zstandard.ZstdCompressor().compress(lines)
    (tmp_path / "cut.jsonl.zst").write_bytes(packed[:len(packed) // 2])
    (tmp_path / "plain.jsonl.gz").write_bytes(LINES)
    cases = [("cut.jsonl.gz", r"gzip input after line (\d+) \(EOFError: Compressed file ended"),
             ("cut.jsonl.zst", r"zstd input after line (\d+) \(EOFError: the zstd data ends "
                               r"inside a frame\)"),
             ("plain.jsonl.gz", r"gzip input \(BadGzipFile: .*, or not gzip data at all "
                                r"\(a plain \.jsonl named \.gz\? rename it\)")]
    for name, message in cases:
        with pytest.raises(SystemExit) as e:
            run_tool(bpe, tmp_path / name, tmp_path / "out", "--skip-bad-lines", workers=2)
        text = str(e.value.code)
        found = re.search(
            rf"^error: {tmp_path / name}: cannot read the {message}", text)
        assert found, text
        assert "truncated or corrupt" in text and "nothing was written" in text
        if found.groups():
            assert 0 < int(found.group(1)) < whole
    assert not list(tmp_path.glob("out*"))
    # several frames, with a skippable frame between them, read as one stream
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"pad"
    half = LINES.index(b"\n", len(LINES) // 2) + 1
    compress = zstandard.ZstdCompressor().compress
    (tmp_path / "frames.jsonl.zst").write_bytes(compress(LINES[:half]) + skippable
                                                + compress(LINES[half:]))
    run_tool(bpe, tmp_path / "frames.jsonl.zst", tmp_path / "out")
    check_outputs(bpe, tmp_path / "out", DOCS * 40, append_eod=False)


def _feed_fifo(path: Path, data: bytes, keep_open: threading.Event = None):
    def feed():
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                if keep_open is not None:
                    keep_open.wait(60)
        except BrokenPipeError:  # the reader stopped first
            pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


def test_a_pipe_is_an_input(tmp_path, bpe, capsys):
    """--input <(zstdcat corpus.zst) or /dev/stdin, which Megatron's tool reads, was 'no
    input files found': only regular files counted."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    feeder = _feed_fifo(fifo, LINES)
    run_tool(bpe, fifo, tmp_path / "out", "--log-interval", "1")
    feeder.join(5)
    check_outputs(bpe, tmp_path / "out", DOCS * 40, append_eod=False)
    err = capsys.readouterr().err
    assert "size unknown (a pipe)" in err
    assert "Processed 200 documents (" in err and "% read" not in err  # no share, no ETA


@pytest.mark.parametrize("fast_json", [True, False])
def test_byte_order_marks_and_crlf_line_ends_are_read(tmp_path, bpe, monkeypatch, fast_json):
    """Files from Windows editors (a UTF-8 BOM, also where files were concatenated; CRLF
    line ends) read as their text, whether or not orjson is installed (it rejects a BOM
    and the line falls back to json, which takes it)."""
    bom = b"\xef\xbb\xbf"
    body = LINES.replace(b"\n", b"\r\n").split(b"\n", 1)
    (tmp_path / "bom.jsonl").write_bytes(bom + body[0] + b"\n" + bom + body[1])
    if not fast_json:
        monkeypatch.setattr(document_encoder, "orjson", None)
    run_tool(bpe, tmp_path / "bom.jsonl", tmp_path / "out")
    check_outputs(bpe, tmp_path / "out", DOCS * 40, append_eod=False)


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


def test_a_failed_write_names_the_output_and_the_fix(tmp_path, bpe, monkeypatch):
    """A full disk or a read-only directory ended the run with an OSError traceback."""
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    run_tool(bpe, src, tmp_path / "out")
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.glob("out*"))

    def full(self, tokens):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(IndexedDatasetBuilder, "_write", full)
    with pytest.raises(SystemExit, match=rf"^error: cannot write the dataset at --output-prefix "
                                         rf"{tmp_path / 'out'}: No space left on device; free "
                                         r"space there, or pass an --output-prefix on a disk "
                                         r"with room .*an earlier dataset there is unchanged$"):
        run_tool(bpe, src, tmp_path / "out", "--partitions", "2", workers=2)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.glob("out*")) == before
    monkeypatch.undo()
    real_open = open

    def read_only(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(tmp_path / "ro")):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    with pytest.raises(SystemExit, match=rf"Permission denied \({tmp_path / 'ro'}_text_document"
                                         r"\.tmp\d+-[0-9a-f]+\.bin\); pass an --output-prefix in a "
                                         r"directory you can write to"):
        run_tool(bpe, src, tmp_path / "ro")
    assert not list(tmp_path.glob("ro*"))


def test_a_file_size_limit_is_a_no_room_error_naming_the_limit(tmp_path, bpe):
    """A write past `ulimit -f` (EFBIG) got the generic 'check that directory' advice."""
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 200)
    code = (f"import resource, sys; sys.path.insert(0, {str(REPO)!r}); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY)); "
            "from tools import preprocess_data; preprocess_data.main(sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "--input", str(src), "--output-prefix",
                          str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
                          "--vocab-file", bpe[0], "--merge-file", bpe[1], "--workers", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert re.search(r"error: cannot write the dataset at --output-prefix .*: File too large"
                     r"[^;]*; this process may write files of at most 4.0 KiB \(ulimit -f "
                     r"4\): raise the file-size limit \(ulimit -f unlimited\)", out.stderr), \
        out.stderr
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("signum,to_group,status,how", [
    (signal.SIGINT, True, 130, "(Ctrl-C)"), (signal.SIGTERM, False, 143, "by SIGTERM")])
def test_ctrl_c_or_sigterm_mid_run_removes_the_partial_files(tmp_path, bpe, signum, to_group,
                                                             status, how):
    """Ctrl-C printed KeyboardInterrupt tracebacks (the main process's and the workers');
    SIGTERM left the partial .bin behind and the workers printed BrokenPipe tracebacks."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    release = threading.Event()
    feeder = _feed_fifo(fifo, LINES * 200, keep_open=release)  # > one chunk, then waits
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(fifo),
           "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", bpe[0], "--merge-file", bpe[1], "--workers", "2",
           "--log-interval", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stderr:  # mid-run: documents written, the input still open
            seen.append(line)
            if line.startswith("Processed"):
                break
        assert list(tmp_path.glob("out_text_document.tmp*.bin")), "".join(seen)
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        release.set()  # the producer of the pipe goes away with the group
        err = "".join(seen) + proc.stderr.read()
        assert proc.wait(30) == status, err
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
        feeder.join(5)
    assert f"preprocess_data.py: interrupted {how}; no dataset was written" in err
    assert "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_stopping_the_pool_ends_when_a_killed_worker_held_the_result_queue(monkeypatch):
    """A worker killed by Pool.terminate() while it put its result leaves the result
    queue's lock held: terminate() then waited for it forever (a SIGTERM mid-run hung
    preprocess_data.py with its workers already dead; seen in CI). The lock held here
    stands in for that worker. `_stop_pool` ends within its timeout, the workers gone."""
    import multiprocessing as mp
    import time

    def stuck_pool():
        pool = mp.get_context("fork").Pool(2)
        assert pool._outqueue._wlock.acquire(timeout=5)  # as the killed worker left it
        return pool

    pool = stuck_pool()
    plain = threading.Thread(target=pool.terminate, daemon=True)
    plain.start()
    plain.join(2.0)
    assert plain.is_alive(), "terminate() no longer hangs here: the scenario is not shown"
    pool._outqueue._wlock.release()  # let that one finish
    plain.join(10)

    pool = stuck_pool()
    workers = list(pool._pool)
    started = time.monotonic()
    preprocess_data._stop_pool(pool, timeout=1.0)
    assert time.monotonic() - started < 30.0  # terminate() alone waits until the release
    for worker in workers:
        worker.join(30)
        assert worker.exitcode is not None
    pool._outqueue._wlock.release()


def test_summary_and_progress_units(tmp_path, bpe, capsys, monkeypatch):
    """The last lines say how many tokens each dataset holds; MB/s counts MB of 2**20 bytes
    as Megatron's tool does (it was 10**6)."""
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    counts = run_tool(bpe, src, tmp_path / "out")
    err = capsys.readouterr().err
    for key in ("text", "title"):
        tokens = counts["tokens"][key]
        assert tokens > 0
        assert f"Wrote {tmp_path}/out_{key}_document.bin/.idx: 5 documents, {tokens} tokens" in err
    assert (tmp_path / "out_text_document.bin").stat().st_size == 2 * counts["tokens"]["text"]
    reader = type("Reader", (), {"total_bytes": 100, "sized": True,
                                 "raw_bytes_read": lambda self: 50})()
    progress = preprocess_data.Progress(reader, 1000)
    progress.docs, progress.bytes = 10, 3 * 2**20
    monkeypatch.setattr(preprocess_data.time, "time", lambda: progress.start + 2.0)
    assert progress.line() == ("Processed 10 documents (5.0 docs/s, 1.50 MB/s), input 50.0% "
                               "read, ETA 00:00:02.")


def test_two_runs_with_one_process_id_writing_one_prefix_keep_their_files_apart(tmp_path,
                                                                               monkeypatch):
    """Two runs in containers (same process id) on shared storage, writing the same
    --output-prefix, wrote one `.tmp<pid>.bin` together: one reported success over a
    corrupt dataset, the other failed claiming the earlier dataset was unchanged."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    args = argparse.Namespace(json_keys=["text"], partitions=1, split_sentences=False,
                              output_prefix=str(tmp_path / "out"))

    def chunk(tokens):
        toks = np.array(tokens, dtype=np.uint16)
        size = np.array([len(tokens)], dtype=np.int64)
        return {"text": (toks.tobytes(), size, np.ones(1, dtype=np.int64), size)}

    first = preprocess_data.Writers(args, np.uint16)
    second = preprocess_data.Writers(args, np.uint16)
    first.add(chunk([1, 2, 3]), 1)
    second.add(chunk([7, 8]), 1)
    first.finalize()
    assert [list(d) for d in MMapIndexedDataset(str(tmp_path / "out_text_document"))] == \
        [[1, 2, 3]]
    second.finalize()
    assert [list(d) for d in MMapIndexedDataset(str(tmp_path / "out_text_document"))] == \
        [[7, 8]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out_text_document.bin",
                                                          "out_text_document.idx"]


def test_output_names_of_255_bytes_are_written(tmp_path, bpe, capsys):
    """An --output-prefix whose files' names take the file system's 255 bytes failed with
    'File name too long' on the temporary `<prefix>.tmp<pid>.bin` written first (the
    final names fit); merge_datasets.py likewise. A name that cannot fit names the fix."""
    from tools import merge_datasets

    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    prefix = tmp_path / ("é" * 118)  # + "_title_document.bin": 255 bytes
    run_tool(bpe, src, prefix, "--partitions", "2", workers=2)
    assert Path(f"{prefix}_title_document.idx").is_file()
    run_tool(bpe, src, prefix)
    check_outputs(bpe, prefix, DOCS, append_eod=False)
    merged = str(tmp_path / ("é" * 125 + "m"))  # + ".bin": 255 bytes
    merge_datasets.merge([f"{prefix}_text_document"], merged)
    assert Path(merged + ".bin").read_bytes() == Path(f"{prefix}_text_document.bin").read_bytes()
    with pytest.raises(SystemExit, match=r"File name too long .*; pass a shorter --output-prefix"):
        merge_datasets.merge([f"{prefix}_text_document"], merged + "x")
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]


_KILL_ONE_WORKER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from megatron.tokenizer import document_encoder
plain = document_encoder.ChunkEncoder.encode
def encode(self, chunk):
    if b"KILLME" in chunk[2]:  # as the out-of-memory killer ends a worker on a huge document
        os.kill(os.getpid(), signal.SIGKILL)
    return plain(self, chunk)
document_encoder.ChunkEncoder.encode = encode
from tools import preprocess_data
sys.exit(preprocess_data.main(sys.argv[1:]))
"""


def test_a_worker_killed_mid_run_ends_the_run_naming_it(tmp_path, bpe):
    """A worker killed mid-run (the out-of-memory killer on a huge document) hung the tool
    forever: Pool replaces the worker but never answers the task it held."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(LINES + b'{"text": "KILLME", "title": "x"}\n' + LINES)
    cmd = [sys.executable, "-c", _KILL_ONE_WORKER.format(repo=str(REPO)), "--input", str(src),
           "--output-prefix", str(tmp_path / "out"), "--json-keys", "text", "title",
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe[0],
           "--merge-file", bpe[1], "--workers", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, err
    assert "error: a worker process was killed by SIGKILL (usually the kernel's out-of-memory " \
           "killer: see dmesg) while encoding the input" in err, err
    assert "Rerun with fewer --workers (now 2;" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def _dead_pid() -> int:
    """The process id of a process that has ended."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _leave_temporaries(prefix: str) -> tuple:
    """What runs writing `prefix` (a dataset there) leave beside it when SIGKILLed: a
    finished partition's .bin/.idx pair and a lone .bin (dead owner: stale), and the .bin
    of a run writing now (this process: live). Returns (stale paths, live path)."""
    dead = _dead_pid()
    stale = []
    for tmp in (f"{prefix}.tmp{dead}-0123abcd_0", f"{prefix}.tmp{dead}-89abcdef"):
        for ext in (".bin", ".idx"):
            if tmp.endswith("_0") or ext == ".bin":
                shutil.copy(prefix + ext, tmp + ext)
                stale.append(tmp + ext)
    live = f"{prefix}.tmp{os.getpid()}-feedf00d.bin"
    shutil.copy(prefix + ".bin", live)
    return sorted(stale), live


def test_merging_a_directory_skips_the_temporaries_of_killed_or_running_runs(tmp_path, bpe,
                                                                            capsys):
    """A preprocess_data.py run killed with SIGKILL leaves its `.tmp<pid>-<random>` files:
    a lone .bin stopped merge_datasets.py over the directory ('has no .idx beside it;
    restore ...'), and a finished partition's pair was merged as a dataset (its documents
    twice). They are skipped; the stale ones are named with the command that removes them,
    and nothing is deleted (a running run's files are left alone, and not named)."""
    from tools import merge_datasets

    out = tmp_path / "out"
    run_tool(bpe, write_jsonl(tmp_path / "in.jsonl", DOCS), out / "c")
    stale, live = _leave_temporaries(str(out / "c_text_document"))
    merged = str(tmp_path / "merged")
    merge_datasets.main(["--input", str(out), "--output-prefix", merged])
    expected = [list(d) for name in ("c_text_document", "c_title_document")
                for d in MMapIndexedDataset(str(out / name))]
    assert [list(d) for d in MMapIndexedDataset(merged)] == expected
    err = capsys.readouterr().err
    assert "3 unfinished temporary file(s) of an interrupted" in err, err
    assert "Remove them with: rm -f " + " ".join(stale) in err, err
    assert "skipped 1 temporary file(s) that a running" in err and live in err, err
    assert all(os.path.exists(p) for p in stale + [live])


def test_a_later_run_names_the_stale_temporaries_of_its_prefix(tmp_path, bpe, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    run_tool(bpe, src, tmp_path / "c")
    stale, live = _leave_temporaries(str(tmp_path / "c_text_document"))
    capsys.readouterr()
    run_tool(bpe, src, tmp_path / "c")
    err = capsys.readouterr().err
    assert "Remove them with: rm -f " + " ".join(stale) in err, err
    assert live not in err
    check_outputs(bpe, tmp_path / "c", DOCS, append_eod=False)


def test_an_nltk_that_fails_to_import_names_the_fixed_release(monkeypatch):
    """NLTK 3.9.0 raises LookupError on `import nltk` when its wordnet data is not
    downloaded: --split-sentences said nothing useful (a traceback from inside NLTK)."""
    import builtins

    from megatron.tokenizer.document_encoder import check_split_sentences

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):
        if name == "nltk" or name.startswith("nltk."):
            raise LookupError("\n  Resource wordnet not found.\n  Please use the NLTK Downloader")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "nltk", raising=False)
    monkeypatch.setattr(builtins, "__import__", importing)
    with pytest.raises(SystemExit, match=r"NLTK fails to import here \(Resource wordnet not "
                                         r"found.*pip install 'nltk>=3\.9\.1'"):
        check_split_sentences("english")


def test_compressed_data_is_read_by_its_suffix_or_its_first_bytes(tmp_path, bpe):
    """A .jsonl.bz2 or .jsonl.xz (and gzip data saved as .jsonl) was read as plain text:
    its NUL bytes were reported as 'UTF-16 text (Windows PowerShell)' with an iconv fix
    that cannot work, and a directory of such files was 'no input files found'. A
    Parquet file or a zip archive is named as such, with the fix."""
    import bz2
    import lzma

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl.bz2").write_bytes(bz2.compress(LINES))
    (tmp_path / "dir" / "b.jsonl.xz").write_bytes(lzma.compress(LINES))
    (tmp_path / "gzip_named_plain.jsonl").write_bytes(gzip.compress(LINES))
    for name, docs in (("dir", DOCS * 80), ("dir/a.jsonl.bz2", DOCS * 40),
                       ("gzip_named_plain.jsonl", DOCS * 40)):
        run_tool(bpe, tmp_path / name, tmp_path / "out", workers=2)
        check_outputs(bpe, tmp_path / "out", docs, append_eod=False)
    packed = lzma.compress(LINES * 4)
    (tmp_path / "cut.jsonl.xz").write_bytes(packed[:len(packed) // 2])
    (tmp_path / "data.parquet").write_bytes(b"PAR1\x15\x04\x00\x00" + LINES[:64])
    (tmp_path / "data.zip").write_bytes(b"PK\x03\x04\x14\x00\x00\x00" + LINES[:64])
    cases = [("cut.jsonl.xz", r"cannot read the xz input( after line \d+)? \(EOFError"),
             ("data.parquet", r"is a Parquet file, not JSON lines .*pandas\.read_parquet"),
             ("data.zip", r"is a zip archive, not JSON lines .*unzip it")]
    for name, message in cases:
        with pytest.raises(SystemExit) as e:
            run_tool(bpe, tmp_path / name, tmp_path / "bad", "--skip-bad-lines")
        assert re.search(rf"^error: {tmp_path / name}:? {message}", str(e.value.code)), \
            e.value.code
    assert not list(tmp_path.glob("bad*"))


def test_a_dangling_link_or_an_unopenable_input_is_named(tmp_path, bpe):
    """A dangling symbolic link in an input directory ended the run with a
    FileNotFoundError traceback from the pool; matched by a glob it was skipped without a
    word (its documents lost); a directory named like a shard was an IsADirectoryError."""
    from tools.preprocess_input import InputError, Reader, input_files

    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "a.jsonl", DOCS)
    (tmp_path / "dir" / "sub.jsonl").mkdir()
    assert input_files(str(tmp_path / "dir")) == [str(tmp_path / "dir" / "a.jsonl")]
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "dir" / "b.jsonl")
    for pattern in ("dir", "dir/*.jsonl", "dir/b.jsonl"):
        with pytest.raises(SystemExit) as e:
            run_tool(bpe, tmp_path / pattern, tmp_path / "out")
        assert (f"{tmp_path / 'dir' / 'b.jsonl'} is a symbolic link to "
                f"{tmp_path / 'gone.jsonl'}, which does not exist") in str(e.value.code)
    assert not list(tmp_path.glob("out*"))
    with pytest.raises(InputError, match=r"gone\.jsonl: cannot open it \(No such file"):
        list(Reader([str(tmp_path / "gone.jsonl")], max_in_flight=2))


def test_a_file_both_compressed_and_not_is_not_read_twice(tmp_path, bpe):
    """`zstd -d a.jsonl.zst` (or gunzip -k, xz -dk) keeps its input beside a.jsonl: a
    directory (or glob) holding both was read whole twice, every document duplicated in
    the dataset without a word."""
    (tmp_path / "dir").mkdir()
    plain = write_jsonl(tmp_path / "dir" / "a.jsonl", DOCS).read_bytes()
    (tmp_path / "dir" / "a.jsonl.gz").write_bytes(gzip.compress(plain))
    write_jsonl(tmp_path / "dir" / "b.jsonl", DOCS)
    for pattern in ("dir", "dir/*"):
        with pytest.raises(SystemExit) as e:
            run_tool(bpe, tmp_path / pattern, tmp_path / "out")
        assert (f"{tmp_path / 'dir' / 'a.jsonl'} and {tmp_path / 'dir' / 'a.jsonl.gz'} look "
                "like one file, compressed and not") in str(e.value.code)
        assert f"--input '{tmp_path / 'dir' / '*.gz'}'" in str(e.value.code)
    assert not list(tmp_path.glob("out*"))
    run_tool(bpe, tmp_path / "dir/*.jsonl", tmp_path / "out")  # the glob the fix names
    check_outputs(bpe, tmp_path / "out", DOCS * 2, append_eod=False)
