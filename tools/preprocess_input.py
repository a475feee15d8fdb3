"""tools/preprocess_data.py's input side: the input files (a file, a pipe, a directory or a
glob), plain / gzip / zstd / bzip2 / xz decompression, and the reader that hands out chunks
of whole lines with their first line number (errors name the file and the last line read).

A file is decompressed by its suffix, or, under any other name, by its first bytes (which
no JSON line starts with): a `corpus.jsonl` that holds gzip data is read as gzip, not as
text whose NUL bytes were reported as UTF-16."""
from __future__ import annotations

import glob
import lzma
import os
import threading
import zlib

CHUNK_BYTES = 1 << 18
INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".gz", ".jsonl.zst",
                  ".json.zst", ".zst", ".jsonl.bz2", ".json.bz2", ".bz2", ".jsonl.xz",
                  ".json.xz", ".xz")
# compression -> (suffix, first bytes of its data)
COMPRESSIONS = {"gzip": (".gz", b"\x1f\x8b"), "zstd": (".zst", b"\x28\xb5\x2f\xfd"),
                "bzip2": (".bz2", b"BZh"), "xz": (".xz", b"\xfd7zXZ\x00")}
# first bytes of files that are no JSON lines at all -> what they are, and the fix
_NOT_JSON_LINES = {
    b"PAR1": ("a Parquet file", "convert it to JSON lines, e.g. python -c \"import pandas; "
              "pandas.read_parquet('IN.parquet').to_json('OUT.jsonl', orient='records', "
              "lines=True)\""),
    b"PK\x03\x04": ("a zip archive", "unzip it and pass the .jsonl files it holds"),
}


def input_files(pattern: str) -> list:
    """The input files: one file, a directory's JSONL files sorted, or a glob's matches."""
    if os.path.isdir(pattern):
        names = sorted(n for n in os.listdir(pattern) if n.endswith(INPUT_SUFFIXES))
        files = [os.path.join(pattern, n) for n in names]
    elif os.path.exists(pattern):  # a file, or a pipe: --input <(zstdcat a.zst), /dev/stdin
        files = [pattern]
    else:
        files = sorted(glob.glob(pattern))
    files = [f for f in files if not os.path.isdir(f)]  # a directory named like a shard
    _check_files(pattern, files)
    return files


def _check_files(pattern: str, files: list) -> None:
    """SystemExit for no files, a dangling symbolic link (skipped, its documents would be
    lost unsaid) or one file both compressed and not (`zstd -d a.jsonl.zst` keeps the
    .zst beside the a.jsonl it writes: every document would be read twice)."""
    broken = [f for f in files if not os.path.exists(f)]
    if broken:
        target = f" to {os.readlink(broken[0])}" if os.path.islink(broken[0]) else ""
        more = f" (and {len(broken) - 1} more such links)" if len(broken) > 1 else ""
        raise SystemExit(f"--input {pattern}: {broken[0]} is a symbolic link{target}, which "
                         f"does not exist{more}; restore its target, or remove the link")
    if not files:
        raise SystemExit(f"--input {pattern}: no input files found (expected a .jsonl file, "
                         "plain or .gz/.zst/.bz2/.xz, a directory of them or a glob pattern)")
    stems = {}
    for f in files:
        stem = next((f[:-len(s)] for s, _ in COMPRESSIONS.values() if f.endswith(s)), f)
        stems.setdefault(stem, []).append(f)
    twins = next((found for found in stems.values() if len(found) > 1), None)
    if twins:
        raise SystemExit(f"--input {pattern}: {' and '.join(twins)} look like one file, compressed "
                         "and not (a decompressor keeps its input beside its output): every "
                         "document would be read twice. Move one of them out of the "
                         "directory, or pass a glob that matches one kind, e.g. --input "
                         f"'{os.path.join(os.path.dirname(twins[0]), '*' + os.path.splitext(twins[-1])[1])}'")


class InputError(Exception):
    """An input file that cannot be read to its end (truncated or corrupt compressed data,
    a read error); raised by the Reader inside the pool's feeder thread, which hands it to
    the main process in input order (so it is reported after the lines before it)."""


class _ZstdFrames:
    """The decompressed bytes of a zstd file, frame after frame (and skippable frames).
    zstandard's stream_reader ends quietly where a truncated file stops mid-frame, so the
    cut-off last line looked like bad JSON (or, with --skip-bad-lines, the loss went
    unnoticed); here the input ending inside a frame raises EOFError."""

    def __init__(self, raw):
        import zstandard

        self._raw, self._error = raw, zstandard.ZstdError
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._obj, self._fed = self._new(), False
        self._out = bytearray()

    def read(self, size: int) -> bytes:
        while len(self._out) < size:
            rest = b""
            if self._obj.eof:  # a frame ended: what follows it starts the next one
                rest, self._obj, self._fed = self._obj.unused_data, self._new(), False
            block = rest or self._raw.read(1 << 16)
            if not block:
                if self._fed and not self._obj.eof:
                    raise EOFError("the zstd data ends inside a frame")
                break
            self._fed = True
            try:
                self._out += self._obj.decompress(block)
            except self._error as e:
                raise OSError(f"corrupt zstd data ({e})") from None
        data = bytes(self._out[:size])
        del self._out[:size]
        return data

    def close(self) -> None:
        self._out = bytearray()


def compression(path: str, raw) -> str:
    """'gzip', 'zstd', 'bzip2', 'xz' or '' (plain) for the file `path` opened as `raw` (a
    buffered binary file, pipes included: its first bytes are peeked, not consumed);
    InputError for a Parquet file or a zip archive, naming the fix."""
    for kind, (suffix, _) in COMPRESSIONS.items():
        if path.endswith(suffix):
            return kind
    head = raw.peek(8)[:8]
    for kind, (_, magic) in COMPRESSIONS.items():
        if head.startswith(magic):
            return kind
    for magic, (what, fix) in _NOT_JSON_LINES.items():
        if head.startswith(magic):
            raise InputError(f"{path} is {what}, not JSON lines (one object such as "
                             '{"text": "..."} per line): ' + f"{fix}; nothing was written")
    return ""


def _decompressed(raw, kind: str):
    """The decompressed binary stream of `raw` holding `kind` data ('' for plain)."""
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind == "zstd":
        return _ZstdFrames(raw)
    if kind == "bzip2":
        import bz2

        return bz2.BZ2File(raw, mode="rb")
    if kind == "xz":
        return lzma.LZMAFile(raw, mode="rb")
    return raw


def _read_error(path: str, line_no: int, error: BaseException, kind: str) -> InputError:
    """The error for a read of `path` (of `kind` data) that failed after `line_no - 1`
    complete lines."""
    where = f" after line {line_no - 1}" if line_no > 1 else ""
    suffix = COMPRESSIONS[kind][0] if kind else ""
    plain = (f", or not {kind} data at all (a plain .jsonl named {suffix}? rename it)"
             if kind and path.endswith(suffix) and line_no == 1
             and not isinstance(error, EOFError) else "")
    return InputError(
        f"{path}: cannot read the {kind + ' ' if kind else ''}input{where} "
        f"({type(error).__name__}: {error}): the file is truncated or corrupt (an interrupted "
        f"download or copy?){plain}. Re-download or re-compress it, or move it out of "
        "--input; nothing was written")


class Reader:
    """Yields (path, first line number, bytes of whole lines) chunks of ~CHUNK_BYTES and
    tracks how much of the on-disk input has been read (for the ETA)."""

    def __init__(self, files: list, max_in_flight: int):
        self.files = files
        # a pipe has no size: then the progress lines show no share read and no ETA
        self.sized = all(os.path.isfile(f) for f in files)
        self.total_bytes = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
        self.done_bytes = 0
        self._current = None
        self._max_in_flight = max_in_flight
        self._stopped = False
        self.slots = threading.Semaphore(max_in_flight)

    def stop(self) -> None:
        """Let a feeder blocked on `slots` finish (the pool joins it when terminated)."""
        self._stopped = True
        for _ in range(self._max_in_flight + 1):
            self.slots.release()

    def _take_slot(self) -> bool:
        self.slots.acquire()
        return not self._stopped

    def raw_bytes_read(self) -> int:
        raw = self._current
        try:
            return self.done_bytes + (raw.tell() if raw is not None and not raw.closed else 0)
        except (OSError, ValueError):
            return self.done_bytes

    def __iter__(self):
        for path in self.files:
            try:
                raw = open(path, "rb")
            except OSError as e:  # unreadable, or gone since it was listed
                raise InputError(f"{path}: cannot open it ({e.strerror or e}); make it "
                                 "readable, or move it out of --input; nothing was "
                                 "written") from None
            self._current, stream = raw, raw
            try:
                kind = compression(path, raw)
                stream = _decompressed(raw, kind)
                yield from self._chunks(path, stream, kind)
            finally:
                self._current = None
                self.done_bytes += os.path.getsize(path) if os.path.isfile(path) else 0
                stream.close()
                raw.close()

    def _chunks(self, path: str, stream, kind: str = ""):
        line_no, pending = 1, []  # pending: bytes read after the last newline
        while True:
            try:
                block = stream.read(CHUNK_BYTES)
            except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
                raise _read_error(path, line_no, e, kind) from None
            if not block:
                data = b"".join(pending)
                if data and self._take_slot():
                    yield path, line_no, data
                return
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a block: gather without re-copying
                pending.append(block)
                continue
            data = b"".join(pending) + block[:cut]
            pending = [block[cut:]] if cut < len(block) else []
            if not self._take_slot():
                return
            yield path, line_no, data
            line_no += data.count(b"\n")


if __name__ == "__main__":
    raise SystemExit("tools/preprocess_input.py is a library module (the input side of the "
                     "preprocessing); run python tools/preprocess_data.py --help")
