"""Turn JSON lines into Megatron `.bin/.idx` datasets (one per `--json-keys` key).

    python tools/preprocess_data.py --input corpus.jsonl.zst --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 2

writes `my-gpt2_text_document.bin/.idx`. `--input` is a JSONL file (plain, `.gz`, `.zst`,
`.bz2` or `.xz`; compressed data under another name is recognized by its first bytes), a
directory of such files (read in sorted order), a glob pattern or a pipe
(`<(zstdcat corpus.zst)`, `/dev/stdin`). The input is streamed: chunks of lines go to
`--workers` processes (each builds its tokenizer once) and at most a few chunks per worker
are in flight, so memory stays bounded. The `.bin` is
byte-identical to Megatron-LM 23.05's tool for the same input and tokenizer; unlike it,
with `--append-eod` each document's size counts its EOD token, and every key's `.idx` is
written. A malformed line (bad JSON, bytes that are not UTF-8, missing key, value neither
text nor a list of text, text the tokenizer cannot encode) stops the run with its file and
line number, or is skipped and counted with `--skip-bad-lines`. Blank lines are ignored.
A run that reads no document is an error, and so is a truncated or corrupt compressed
file. Output goes to temporary files beside the targets, renamed into place when
complete, so a failed or interrupted (Ctrl-C, SIGTERM) run leaves an existing dataset
intact; a missing output directory is created. A run killed with SIGKILL cannot remove
its temporaries: the next run at that prefix names them, with the command that removes
them (merge_datasets.py skips them). Megatron-LM 23.04's `--chunk-size` is
accepted and ignored, with a warning.

`--split-sentences` splits each text with NLTK punkt (`pip install nltk` and
`python -m nltk.downloader punkt_tab`, or NLTK_DATA pointing at a copy of that data):
every sentence is one sequence of the `_sentence` dataset, the documents are its
doc_idx, and `--append-eod` ends each document's last sentence. Unlike Megatron's tool
there is no intermediate `_ss` file and one run does it all.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import secrets
import signal
import sys
import threading
import time
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron.arguments_inputs import tokenizer_file_dests  # noqa: E402
from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer.document_encoder import (  # noqa: E402
    build_tokenizer_from_options,
    check_split_sentences,
    encode_chunk,
    init_worker,
    options_from_args,
)
from megatron.write_errors import file_size_limit_text  # noqa: E402
from tools.case_names import case_clashes, ignores_case  # noqa: E402
from tools.interruptible import run_interruptible  # noqa: E402
from tools.leftover_temporaries import (  # noqa: E402
    stale_temporaries_warning,
    temporary_files,
)
from tools.preprocess_input import (  # noqa: E402
    InputError,
    Reader,
    input_files,
)

# Megatron 23.05's choices that a GPT framework cannot train with: one line, not argparse's
# 'invalid choice', tells a Megatron user what to pass instead
_NO_EOD_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")
_VOCAB_SIZE_DEFAULT = 786  # Megatron-LM's default for --vocab-size (read by NullTokenizer only)


def get_args(argv=None) -> argparse.Namespace:
    """Megatron 23.05's preprocess_data.py flags, plus --skip-bad-lines."""
    from megatron.cli_suggest import SuggestingParser

    p = SuggestingParser(description="Preprocess JSON lines into Megatron datasets",
                         allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", type=str, required=True,
                   help="JSONL file (.gz/.zst/.bz2/.xz ok), directory of them, or glob pattern")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="space separated keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true", help="split documents into "
                   "sentences with NLTK punkt (needs nltk and its punkt_tab data)")
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences, "
                   "keep the whitespace (newlines) after a sentence instead of dropping it")
    g.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed "
                   "lines instead of stopping at the first one")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", type=str, required=True,
                   choices=[*_NO_EOD_TYPES, "GPT2BPETokenizer", "SentencePieceTokenizer",
                            "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                            "NullTokenizer"])
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-size", default=_VOCAB_SIZE_DEFAULT, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to each non-empty document")
    g.add_argument("--lang", type=str, default="english", help="NLTK punkt language")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", type=str, required=True)
    g.add_argument("--dataset-impl", type=str, default="mmap", choices=["lazy", "cached", "mmap"])
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="worker processes")
    g.add_argument("--partitions", type=int, default=1, help="documents are dealt round-robin "
                   "into this many parts, written one after another (Megatron's order)")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress "
                   "lines")
    g.add_argument("--chunk-size", type=int, default=None, help="Megatron-LM 23.04's "
                   "documents per worker task; accepted and ignored (chunks are sized in "
                   "bytes here)")
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tokenizer_type in _NO_EOD_TYPES:
        parser.exit(2, f"{parser.prog}: error: --tokenizer-type {args.tokenizer_type} is not "
                    "supported: it has no end-of-document token, which GPT pretraining needs; "
                    "use GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
                    "HuggingFaceTokenizer or NullTokenizer\n")
    if args.dataset_impl != "mmap":
        parser.error(f"--dataset-impl {args.dataset_impl} is not supported: only the mmap "
                     "format is written (Megatron 23.06 crashes on the legacy ones too)")
    if args.workers < 1 or args.partitions < 1 or args.workers % args.partitions:
        parser.error(f"--workers ({args.workers}) must be a positive multiple of --partitions "
                     f"({args.partitions})")
    problem = output_prefix_problem(args.output_prefix, "<prefix>_<key>_document.bin/.idx")
    if problem:
        parser.error(problem)
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    repeated = sorted({k for k in args.json_keys if args.json_keys.count(k) > 1})
    if repeated:  # each key writes <output-prefix>_<key>_<level>.bin/.idx
        parser.error(f"--json-keys {' '.join(args.json_keys)}: {', '.join(repeated)} given "
                     "twice; each key writes its own dataset: name each key once")
    _check_key_names(parser, args)
    _check_case_clashes(parser, args)
    if args.chunk_size is not None:
        print(f"warning: --chunk-size {args.chunk_size} ignored: Megatron-LM 23.04's flag; "
              "the input is handed to the workers in chunks of bytes", file=sys.stderr)
    if args.split_sentences:
        check_split_sentences(args.lang)
    elif args.keep_newlines:
        print("warning: --keep-newlines has no effect without --split-sentences",
              file=sys.stderr)
    _warn_unread(args)


def _warn_unread(args: argparse.Namespace) -> None:
    """The flags the chosen --tokenizer-type (or the absence of --split-sentences) never
    reads, given anyway (Megatron-LM ignores them silently): a --tokenizer-model under
    GPT2BPETokenizer writes GPT-2 ids, not the SentencePiece ids it names."""
    reads = tokenizer_file_dests(vars(args))
    unread = [f"--{d.replace('_', '-')} {getattr(args, d)}"
              for d in ("vocab_file", "merge_file", "tokenizer_model")
              if d not in reads and getattr(args, d) is not None]
    if args.tokenizer_type != "NullTokenizer" and str(args.vocab_size) != str(_VOCAB_SIZE_DEFAULT):
        unread.append(f"--vocab-size {args.vocab_size}")
    for flag in unread:
        print(f"warning: {flag} ignored: --tokenizer-type {args.tokenizer_type} does not read "
              "it; pass the --tokenizer-type that reads it, or drop it", file=sys.stderr)
    if not args.split_sentences and args.lang != "english":
        print(f"warning: --lang {args.lang} has no effect without --split-sentences",
              file=sys.stderr)


def output_error(output_prefix: str, error: OSError) -> SystemExit:
    """The exit for a failed write of the dataset at `output_prefix` (a full disk, a
    read-only directory, ...): the system's reason, the file when known, and the fix."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("free space there, or pass an --output-prefix on a disk with room (the .bin "
               "takes 2 bytes a token with a vocabulary under 65500 ids, else 4)")
    elif error.errno == errno.EFBIG:
        fix = (f"this process may write {file_size_limit_text()}: raise the file-size limit "
               "(ulimit -f unlimited) before the run, or pass an --output-prefix on a file "
               "system without one")
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "pass an --output-prefix in a directory you can write to"
    elif error.errno == errno.ENAMETOOLONG:
        fix = "pass a shorter --output-prefix (a file name holds at most 255 bytes)"
    else:
        fix = "check that directory, or pass another --output-prefix"
    where = f" ({error.filename})" if error.filename else ""
    return SystemExit(f"error: cannot write the dataset at --output-prefix {output_prefix}: "
                      f"{error.strerror or error}{where}; {fix}. The partial files were "
                      "removed; an earlier dataset there is unchanged")


def temporary_prefix(prefix: str, suffix: str = ".bin") -> str:
    """`<prefix>.tmp<pid>-<random>`, where the dataset at `prefix` is written before it is
    renamed into place (random: two runs in containers may share a process id);
    `<dir>/.tmp<pid>-<random>` when that file name (ending in `suffix`) would pass the
    file system's limit (255 bytes) while the final name does not."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = f"{prefix}.tmp{tag}"
    fits = [len(os.fsencode(os.path.basename(name))) <= 255
            for name in (tmp + suffix, prefix + ".bin")]
    if fits[0] or not fits[1]:  # a final name too long fails at once, on this name
        return tmp
    return os.path.join(os.path.dirname(prefix), f".tmp{tag}")


@contextlib.contextmanager
def writing(output_prefix: str):
    """Turn an OSError of the block into `output_error`'s exit."""
    try:
        yield
    except OSError as e:
        raise output_error(output_prefix, e) from None


class Writers:
    """One builder per key (and per partition); documents dealt round-robin to partitions.

    Everything is written to temporary files beside the targets (`<prefix>.tmp<pid>-<random>.*`:
    another run writing the same prefix from a container with the same process id, on shared
    storage, gets other names);
    `finalize()` renames them into place only when complete, each `.bin` before its `.idx`,
    and `abort()` removes them, so a failed run leaves an existing dataset untouched.
    """

    def __init__(self, args: argparse.Namespace, dtype):
        self.keys, self.partitions = args.json_keys, args.partitions
        level = "sentence" if args.split_sentences else "document"
        self.prefixes = {k: f"{args.output_prefix}_{k}_{level}" for k in self.keys}
        last = f"_{self.partitions - 1}.bin" if self.partitions > 1 else ".bin"
        self.tmp_prefixes = {k: temporary_prefix(p, last) for k, p in self.prefixes.items()}
        self.part_prefixes = {k: [f"{self.tmp_prefixes[k]}_{i}" for i in range(self.partitions)]
                              for k in self.keys}
        if self.partitions == 1:
            self.part_prefixes = {k: [self.tmp_prefixes[k]] for k in self.keys}
        self.output_prefix, self.dtype = args.output_prefix, dtype
        self.num_docs = 0
        self.num_tokens = {k: 0 for k in self.keys}
        self.builders = {k: [] for k in self.keys}
        try:
            with writing(self.output_prefix):
                for k in self.keys:
                    for p in self.part_prefixes[k]:
                        self.builders[k].append(IndexedDatasetBuilder(data_file_path(p), dtype))
        except BaseException:
            self.abort()
            raise

    def add(self, per_key: dict, num_docs: int) -> None:
        """Append one chunk's documents (a failed write ends the run, naming the fix)."""
        with writing(self.output_prefix):
            self._add(per_key, num_docs)

    def finalize(self) -> None:
        """Write every index, merge partitions, then move the files into place."""
        with writing(self.output_prefix):
            self._finalize()

    def _add(self, per_key: dict, num_docs: int) -> None:
        for key, (tokens, sizes, seqs, toks_per_doc) in per_key.items():
            tokens = np.frombuffer(tokens, dtype=self.dtype)
            self.num_tokens[key] += len(tokens)
            if self.partitions == 1:
                self.builders[key][0].add_batch(tokens, sizes, seqs)
                continue
            part = (self.num_docs + np.arange(num_docs)) % self.partitions
            token_part = np.repeat(part, toks_per_doc)
            seq_part = np.repeat(part, seqs)
            for i, builder in enumerate(self.builders[key]):
                builder.add_batch(tokens[token_part == i], sizes[seq_part == i],
                                  seqs[part == i])
        self.num_docs += num_docs

    def _finalize(self) -> None:
        for key in self.keys:
            for prefix, builder in zip(self.part_prefixes[key], self.builders[key]):
                builder.finalize(index_file_path(prefix))
            if self.partitions == 1:
                continue
            merged = IndexedDatasetBuilder(data_file_path(self.tmp_prefixes[key]), self.dtype)
            self.builders[key].append(merged)
            for prefix in self.part_prefixes[key]:
                merged.merge_file_(prefix)
                os.remove(data_file_path(prefix))
                os.remove(index_file_path(prefix))
            merged.finalize(index_file_path(self.tmp_prefixes[key]))
        for key in self.keys:
            for path in (data_file_path, index_file_path):  # .idx last
                os.replace(path(self.tmp_prefixes[key]), path(self.prefixes[key]))

    def abort(self) -> None:
        """Close and remove every temporary file; the targets are left as they were."""
        for key in self.keys:
            for builder in self.builders[key]:
                builder.close()
            for prefix in self.part_prefixes[key] + [self.tmp_prefixes[key]]:
                for path in (data_file_path(prefix), index_file_path(prefix)):
                    if os.path.exists(path):
                        os.remove(path)


class Progress:
    """Progress lines on stderr: documents, docs/s, MB/s (of JSON text), input read, ETA."""

    def __init__(self, reader: Reader, interval: int):
        self.reader, self.interval = reader, interval
        self.start = time.time()
        self.docs = self.bytes = self.skipped = 0
        self._next = interval
        self._printed = -1  # the document count of the last line printed

    def update(self, docs: int, nbytes: int, skipped: int) -> None:
        self.docs += docs
        self.bytes += nbytes
        self.skipped += skipped
        if self.docs >= self._next:
            self._next = (self.docs // self.interval + 1) * self.interval
            self.print_line()

    def print_line(self, final: bool = False) -> None:
        """Print the progress line; the final one only when it differs from the last."""
        if final and self._printed == self.docs:
            return
        self._printed = self.docs
        print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        """Megatron's 'Processed N documents (x docs/s, y MB/s)' (MB = 2**20 bytes, as its
        tool counts), then the share of the input read and the ETA (none for a pipe)."""
        elapsed = max(time.time() - self.start, 1e-9)
        where = ""
        if self.reader.sized:
            fraction = self.reader.raw_bytes_read() / max(self.reader.total_bytes, 1)
            eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
            eta_text = _hours_minutes_seconds(eta) if eta == eta else "?"
            where = f", input {100 * fraction:.1f}% read, ETA {eta_text}"
        skipped = f", {self.skipped} bad lines skipped" if self.skipped else ""
        return (f"Processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 2**20:.2f} MB/s){where}{skipped}.")


def _hours_minutes_seconds(seconds: float) -> str:
    """'HH:MM:SS' with as many hours as it takes: a corpus of days is not shown modulo a day
    (megatron/interval_log.py formats the training ETA alike; this tool imports no torch)."""
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{sec:02d}"


def _pool(args: argparse.Namespace, dtype):
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    return ctx.Pool(args.workers, initializer=_init_pool_worker,
                    initargs=(options_from_args(args, dtype),))


# How long stopping the pool may take: terminate() and the pool's task thread each put a
# sentinel on the result queue, and wait forever for its lock when a worker was killed
# while it held it (putting its result) -- terminate() then before or after it kills the
# other workers.
POOL_STOP_S = 5.0


def _stop_pool(pool, timeout: float = POOL_STOP_S) -> None:
    """`pool.terminate()`, waited for at most `timeout` seconds (see POOL_STOP_S); then
    the workers it has not ended yet are killed. A pool thread left waiting is a daemon
    and ends with the process."""
    workers = list(getattr(pool, "_pool", []))  # the Pool's worker processes
    stopper = threading.Thread(target=pool.terminate, daemon=True, name="pool-stop")
    stopper.start()
    stopper.join(timeout)
    if stopper.is_alive():
        for worker in workers:
            if worker.exitcode is None:
                worker.kill()
                worker.join(timeout)


# How long the main process waits for the next result before it checks that no worker
# has died (a task lost with its worker is never answered: Pool.imap would wait forever).
WORKER_CHECK_S = 1.0


class WorkerDied(Exception):
    """A pool worker ended mid-run (the kernel's out-of-memory killer, a crash): the chunk
    it held is lost and its result never comes."""


def _results(pool, reader: Reader, check_s: float = WORKER_CHECK_S):
    """`pool.imap(encode_chunk, reader)` in input order, raising WorkerDied (with the dead
    worker's exit code) when a worker ends: Pool replaces a dead worker, but not its task."""
    import multiprocessing as mp

    workers = list(getattr(pool, "_pool", []))
    pids = {w.pid for w in workers}
    results = pool.imap(encode_chunk, reader, chunksize=1)
    while True:
        try:
            result = results.next(timeout=check_s)
        except StopIteration:
            return
        except mp.TimeoutError:
            dead = [w.exitcode for w in workers if w.exitcode is not None]
            if dead or {w.pid for w in getattr(pool, "_pool", [])} - pids:
                raise WorkerDied(dead[0] if dead else None) from None
            continue
        yield result


def _worker_died_message(code, docs: int, workers: int) -> str:
    """The error for WorkerDied: how the worker ended, and the fix."""
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if code == -signal.SIGKILL:
            how += " (usually the kernel's out-of-memory killer: see dmesg)"
    else:
        how = f"exited with status {code}" if code is not None else "ended"
    return (f"error: a worker process {how} while encoding the input ({docs} documents "
            "done), so a chunk of it was lost; no dataset was written and the partial files "
            f"were removed. Rerun with fewer --workers (now {workers}; a worker needs a few times "
            "the size of the largest document in memory) or on a machine with more memory")


def _init_pool_worker(opts) -> None:
    """Pool initializer. Ctrl-C reaches the whole foreground process group, but only the
    main process acts on it (it terminates the pool and removes the partial files): a
    worker ignores SIGINT, and dies quietly on the pool's SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    init_worker(opts)


def build_tokenizer_or_exit(args: argparse.Namespace):
    """The tokenizer of `args`; a missing, unreadable or wrong tokenizer file or value
    ends the run with `error: ...` naming it (no traceback)."""
    try:
        tokenizer = build_tokenizer_from_options(options_from_args(args, np.int32))
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: cannot build the {args.tokenizer_type}: {e}") from None
    if args.append_eod:
        check_eod(tokenizer, args)
    return tokenizer


def check_eod(tokenizer, args: argparse.Namespace) -> None:
    """--append-eod needs an end-of-document id inside the vocabulary: a tokenizer without
    one (a SentencePiece model trained with eos_id -1, a tokenizer.json without an EOS
    token) ends the run naming the fix, before any input is read."""
    try:
        eod = tokenizer.eod
    except ValueError as e:
        eod, why = None, str(e)
    else:
        why = f"its end-of-document id is {eod}"
    if eod is not None and 0 <= eod < tokenizer.vocab_size:
        return
    raise SystemExit(f"error: --append-eod: the {args.tokenizer_type} has no end-of-document "
                     f"token ({why}); drop --append-eod, or use a tokenizer that has one"
                     + (" (SentencePieceTokenizer adds <EOD> to the same model)"
                        if args.tokenizer_type == "GPTSentencePieceTokenizer" else ""))


def _check_case_clashes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Keys that differ only by case write one dataset where the file system ignores case
    (macOS): the second key's files replaced the first's, and both were reported written."""
    clashes = case_clashes(args.json_keys)
    directory = os.path.dirname(os.path.abspath(args.output_prefix))
    if clashes and ignores_case(directory):
        a, b = clashes[0][:2]
        level = "sentence" if args.split_sentences else "document"
        parser.error(f"--json-keys {' '.join(args.json_keys)}: {a} and {b} differ only by "
                     f"case, and the file system of {directory} ignores case (as macOS's "
                     f"does): {args.output_prefix}_{a}_{level}.bin/.idx and its {b} twin "
                     "would be one file, the second key's dataset replacing the first's. "
                     "Preprocess those keys in separate runs with different --output-prefix")


def _check_key_names(parser, args) -> None:
    """A key with a path separator: the write of <prefix>_meta/text_document.bin failed at
    the end, in an error that blamed --output-prefix. Keys are read from the top level of
    each JSON object, as in Megatron (no nested paths)."""
    seps = {os.sep, os.altsep or os.sep}
    for key in args.json_keys:
        if any(sep in key for sep in seps):
            parser.error(f"--json-keys {key!r}: a key becomes part of the output file names "
                         f"({args.output_prefix}_<key>_document.bin/.idx), and {os.sep!r} "
                         "cannot be in a file name; keys are top-level fields of each JSON "
                         "line (nested ones are not read): rename that field in the input")


def output_prefix_problem(output_prefix: str, written: str) -> Optional[str]:
    """Why `output_prefix` cannot be used (None when it can): one ending in a path separator
    names a directory, but the outputs are files `written` (e.g. '<prefix>.bin/.idx')
    beginning with it: a name is needed after the separator (the files were called
    `_text_document.bin` or the hidden `.bin`, or the run failed on a missing directory)."""
    if output_prefix and os.path.basename(output_prefix):
        return None
    example = os.path.join(output_prefix, "my-corpus")
    return (f"--output-prefix {output_prefix!r} names no file: the outputs are files "
            f"({written}) whose names begin with it, so it needs a name after the last "
            f"'/', e.g. --output-prefix {example}")


def make_output_dir(output_prefix: str) -> None:
    """Create the directory of `--output-prefix` when missing (and say so)."""
    directory = os.path.dirname(os.path.abspath(output_prefix))
    if os.path.isdir(directory):
        return
    try:
        os.makedirs(directory)
    except OSError as e:
        raise SystemExit(f"error: --output-prefix {output_prefix}: cannot create its directory "
                         f"{directory} ({e}); pass a prefix in a writable directory") from None
    print(f"Created output directory {directory}", file=sys.stderr)


def encode_all(args: argparse.Namespace, dtype, reader: Reader, writers: Writers,
               progress: Progress) -> dict:
    """Feed the input through the worker pool into `writers`; returns
    {'examples': first bad lines, 'not_json': bad lines that were not JSON at all}."""
    examples, not_json = [], 0
    pool = _pool(args, dtype)
    try:
        for result in _results(pool, reader):
            reader.slots.release()
            if "error" in result:
                hint = ("\n(pass --skip-bad-lines to skip and count malformed lines)"
                        if result.get("skippable", True) else "")
                raise SystemExit(f"error: {result['error']}{hint}")
            writers.add(result["keys"], result["docs"])
            examples += result["bad"][:max(0, 5 - len(examples))]
            not_json += result["not_json"]
            progress.update(result["docs"], result["bytes"], len(result["bad"]))
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    except WorkerDied as e:
        raise SystemExit(_worker_died_message(e.args[0], progress.docs, args.workers)) from None
    finally:
        reader.stop()
        _stop_pool(pool)
    return {"examples": examples, "not_json": not_json}


def check_documents(files: list, progress: Progress, not_json: int) -> None:
    """Stop (nothing is written) when no document was read."""
    if progress.docs:
        return
    if progress.skipped and not_json == progress.skipped:
        raise SystemExit(
            f"error: no documents written: none of the {progress.skipped} lines of "
            f"{', '.join(files[:3])} parsed as JSON, so the input looks like plain text. "
            "preprocess_data.py reads JSON lines ({\"text\": \"...\"} per document); convert "
            "plain text with, e.g. (one document per line): python -c \"import json, sys; "
            "[print(json.dumps({'text': line.rstrip(chr(10))})) for line in sys.stdin]\" "
            "< input.txt > input.jsonl")
    if progress.skipped:
        raise SystemExit(f"error: no documents written: all {progress.skipped} lines were bad "
                         "(see the examples above); fix the input or --json-keys")
    raise SystemExit(f"error: no documents written: {', '.join(files[:3])} holds no "
                     "non-blank lines")


def run(args: argparse.Namespace) -> dict:
    """Preprocess per `args`; returns counts {'documents', 'bytes', 'skipped', 'tokens' (per
    key), 'seconds'}.

    Output goes to temporary files renamed into place at the end (see `Writers`): a run
    that fails, or reads no document, leaves any existing dataset at the prefix intact."""
    files = input_files(args.input)
    tokenizer = build_tokenizer_or_exit(args)
    dtype = best_dtype(tokenizer.vocab_size)
    init_worker(options_from_args(args, dtype))  # forked workers inherit this encoder
    reader = Reader(files, max_in_flight=4 * args.workers)
    size = f"{reader.total_bytes / 1e6:.1f} MB" if reader.sized else "size unknown (a pipe)"
    print(f"Input: {len(files)} file(s), {size}; tokenizer {tokenizer.name} (vocab "
          f"{tokenizer.vocab_size}), dtype {np.dtype(dtype).name}", file=sys.stderr)
    make_output_dir(args.output_prefix)
    _warn_stale_temporaries(args.output_prefix)
    writers = Writers(args, dtype)
    progress = Progress(reader, args.log_interval)
    try:
        found = encode_all(args, dtype, reader, writers, progress)
        progress.print_line(final=True)
        if progress.skipped:
            print(f"Skipped {progress.skipped} bad lines; first ones:\n  "
                  + "\n  ".join(found["examples"]), file=sys.stderr)
        check_documents(files, progress, found["not_json"])
        writers.finalize()
    except BaseException:
        writers.abort()
        raise
    for key in args.json_keys:
        print(f"Wrote {writers.prefixes[key]}.bin/.idx: {progress.docs} documents, "
              f"{writers.num_tokens[key]} tokens", file=sys.stderr)
        if writers.num_tokens[key] == 0:
            print(f"warning: {writers.prefixes[key]} holds no tokens: the {progress.docs} "
                  f"documents' {key!r} values are all empty; training cannot use it",
                  file=sys.stderr)
    return {"documents": progress.docs, "bytes": progress.bytes, "skipped": progress.skipped,
            "tokens": dict(writers.num_tokens), "seconds": time.time() - progress.start}


def _warn_stale_temporaries(output_prefix: str) -> None:
    """Warn of the temporaries an earlier run at `output_prefix` (preprocess_data.py's, or
    merge_datasets.py's) left when it was killed (SIGKILL): they are never removed here, another host's run may own them."""
    directory = os.path.dirname(os.path.abspath(output_prefix))
    base = os.path.basename(output_prefix)
    names = [n for n in os.listdir(directory)
             if n.startswith((base + "_", base + ".tmp", ".tmp"))]  # .tmp: a merge's
    warning = stale_temporaries_warning(temporary_files(directory, names)[0])
    if warning:
        print(warning, file=sys.stderr)


def interrupted_dataset_message(tool: str, output_prefix: str) -> Callable[[str], str]:
    """`run_interruptible`'s line for a tool writing a .bin/.idx dataset at `output_prefix`."""
    return lambda how: (f"{tool}: interrupted {how}; no dataset was written and the partial "
                        f"files were removed (an earlier dataset at --output-prefix "
                        f"{output_prefix} is unchanged): run the same command again")


def main(argv=None) -> int:
    """Run the tool; Ctrl-C or SIGTERM ends it with status 130 or 143 and one line (the
    partial files are removed, an earlier dataset at the prefix is left as it was). The
    library's warnings (a merges file's unread line) print in one line each."""
    from megatron.entry_state import project_warnings_in_one_line

    with project_warnings_in_one_line():
        args = get_args(argv)
        return run_interruptible(lambda: run(args), interrupted_dataset_message(
            "preprocess_data.py", args.output_prefix))


if __name__ == "__main__":
    sys.exit(main())
