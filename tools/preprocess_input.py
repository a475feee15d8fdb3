"""tools/preprocess_data.py's input side: the input files (a file, a pipe, a directory or a
glob), plain / gzip / zstd decompression, and the reader that hands out chunks of whole
lines with their first line number (errors name the file and the last line read)."""
from __future__ import annotations

import glob
import os
import threading
import zlib

CHUNK_BYTES = 1 << 18
INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".gz", ".jsonl.zst",
                  ".json.zst", ".zst")


def input_files(pattern: str) -> list:
    """The input files: one file, a directory's JSONL files sorted, or a glob's matches."""
    if os.path.isdir(pattern):
        names = sorted(n for n in os.listdir(pattern) if n.endswith(INPUT_SUFFIXES))
        files = [os.path.join(pattern, n) for n in names]
    elif os.path.exists(pattern):  # a file, or a pipe: --input <(zstdcat a.zst), /dev/stdin
        files = [pattern]
    else:
        files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise SystemExit(f"--input {pattern}: no input files found (expected a .jsonl/.gz/.zst "
                         "file, a directory of them or a glob pattern)")
    return files


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


def _open(path: str):
    """(decompressed binary stream, raw file) for plain, gzip or zstd files."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith(".zst"):
        return _ZstdFrames(raw), raw
    return raw, raw


def _read_error(path: str, line_no: int, error: BaseException) -> InputError:
    """The error for a read of `path` that failed after `line_no - 1` complete lines."""
    kind = "gzip" if path.endswith(".gz") else "zstd" if path.endswith(".zst") else ""
    where = f" after line {line_no - 1}" if line_no > 1 else ""
    plain = (f", or not {kind} data at all (a plain .jsonl named .{path.rsplit('.', 1)[1]}? "
             "rename it)" if kind and line_no == 1 and not isinstance(error, EOFError) else "")
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
            stream, raw = _open(path)
            self._current = raw
            try:
                yield from self._chunks(path, stream)
            finally:
                self._current = None
                self.done_bytes += os.path.getsize(path) if os.path.isfile(path) else 0
                stream.close()
                raw.close()

    def _chunks(self, path: str, stream):
        line_no, pending = 1, []  # pending: bytes read after the last newline
        while True:
            try:
                block = stream.read(CHUNK_BYTES)
            except (EOFError, OSError, zlib.error) as e:
                raise _read_error(path, line_no, e) from None
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
