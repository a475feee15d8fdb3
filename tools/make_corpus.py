#!/usr/bin/env python
"""Build a JSONL text corpus from what ships with Python itself (no download), and
optionally train a SentencePiece tokenizer on it.

    python tools/make_corpus.py --output data/corpus.jsonl --max-mb 6 \\
        --tokenizer-prefix data/spm --vocab-size 4096

Documents are the standard library's source files (code, comments and docstrings), one
JSON object {"text": ...} per file, in a fixed order, so the corpus is the same on every
machine with the same Python version. The same text is written as plain text (for the
tokenizer) beside the output, with the suffix .txt: the output must not end in .txt, and a
.txt file of that name is only replaced together with its JSONL (an earlier run's pair).
An output named .gz, .bz2, .xz or .zst (zstandard needed) is written compressed so (the
twin of corpus.jsonl.gz is corpus.txt), as preprocess_data.py reads it.
Both are written to temporary names and renamed into place when complete: Ctrl-C, SIGTERM
or a full disk leaves the earlier files as they were (status 130, 143, or 1 and one line).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.interruptible import run_interruptible  # noqa: E402


def stdlib_files(max_bytes: int):
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "test", "tests", "idlelib") for p in rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        yield str(Path(*rel)), text
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            return


# output suffix -> opener of a compressed text file (zstandard is imported when used)
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}


def text_twin(output: Path) -> Path:
    """The plain-text copy of `output`: its name without a compression suffix, with .txt."""
    plain = output.with_suffix("") if output.suffix in _COMPRESSED else output
    return plain.with_suffix(".txt")


def open_output(path: Path, name: str):
    """`path` opened for writing text, compressed as the output `name`'s suffix says (the
    file was named .gz but held plain text, which preprocess_data.py refused)."""
    module = _COMPRESSED.get(Path(name).suffix)
    if module is None:
        return path.open("w", encoding="utf-8")
    try:
        opener = __import__(module)
    except ImportError:
        raise SystemExit(f"error: --output {name}: writing .zst needs zstandard (pip install "
                         "zstandard); or name the output .jsonl, .gz, .bz2 or .xz") from None
    return opener.open(path, "wt" if module != "zstandard" else "w", encoding="utf-8")


def check_output(output: Path) -> None:
    """SystemExit when the plain-text twin of `output` would be `output` itself (the JSONL
    overwritten with plain text, which preprocess_data.py then rejects)."""
    if text_twin(output) == output:
        raise SystemExit(f"error: --output {output}: the plain-text copy is written to the "
                         f"output's name with the suffix .txt, which here is the output itself; "
                         f"name the JSONL file {output.with_suffix('.jsonl')}")
    for path in (output, text_twin(output)):
        if path.is_dir():
            raise SystemExit(f"error: --output {output}: {path} is a directory; name a file "
                             "whose name and .txt twin are no directories, e.g. "
                             f"{path / 'corpus.jsonl'}")
    twin = text_twin(output)
    if twin.exists() and not output.exists():  # not an earlier run's pair: the user's file
        raise SystemExit(f"error: --output {output}: its plain-text copy would replace "
                         f"{twin}, which exists without {output} beside it (so no earlier "
                         "run of this tool wrote it); move it away, or name another --output")


def write_corpus(output: Path, max_mb: float) -> tuple:
    """Write `output` and its .txt twin through temporary names renamed into place once
    both are complete (an interrupted or failed run removes them): (documents, bytes)."""
    check_output(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    targets = (output, text_twin(output))
    tmps = [p.with_name(f"{p.name}.tmp{os.getpid()}") for p in targets]
    docs = nbytes = 0
    try:
        with open_output(tmps[0], output.name) as f, tmps[1].open("w", encoding="utf-8") as plain:
            for name, text in stdlib_files(int(max_mb * 1e6)):
                f.write(json.dumps({"text": text, "source": name}) + "\n")
                plain.write(text + "\n")
                docs += 1
                nbytes += len(text.encode("utf-8"))
        for tmp, path in zip(tmps, targets):
            os.replace(tmp, path)
    except BaseException as exc:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk, a quota: one line, no traceback
            raise SystemExit(f"error: cannot write --output {output} ({exc.strerror or exc}); "
                             "the partial files were removed and earlier ones are unchanged: "
                             "free space there (or raise the file-size limit, ulimit -f), or "
                             "name an --output on a disk with room"
                             ) from None
        raise
    return docs, nbytes


def write_corpus_interruptible(output: Path, max_mb: float) -> tuple:
    """`write_corpus`; Ctrl-C or SIGTERM is SystemExit 130 or 143 with one line (the partial
    files removed; a SIGTERM left a truncated JSONL, Ctrl-C a shorter valid-looking one)."""
    written = []
    status = run_interruptible(
        lambda: written.append(write_corpus(output, max_mb)),
        lambda how: (f"make_corpus.py: interrupted {how}; no corpus was written and the "
                     f"partial files were removed (an earlier {output} is unchanged): run "
                     "the same command again"))
    if status:
        raise SystemExit(status)
    return written[0]


def train_sentencepiece(text_file: Path, prefix: str, vocab_size: int) -> None:
    try:
        import sentencepiece as spm
    except ImportError:
        raise SystemExit("error: sentencepiece is not installed (pip install sentencepiece)")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=str(text_file), model_prefix=prefix, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, character_coverage=1.0,
            input_sentence_size=200_000, shuffle_input_sentence=True, max_sentence_length=8192,
            num_threads=os.cpu_count() or 1, remove_extra_whitespaces=False, split_digits=True,
            minloglevel=2,
        )
    except RuntimeError as exc:
        limit = re.search(r"value <= (\d+)", str(exc))
        if limit is None:
            raise SystemExit(f"error: SentencePiece could not train on {text_file}: {exc}"
                             ) from None
        raise SystemExit(f"error: --vocab-size {vocab_size} is more than SentencePiece can "
                         f"learn from {text_file}: at most {limit.group(1)} here; lower "
                         "--vocab-size or raise --max-mb") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True, help="JSONL file to write (a .txt twin is written too)")
    ap.add_argument("--max-mb", type=float, default=6.0, help="stop after this much text")
    ap.add_argument("--tokenizer-prefix", default=None,
                    help="also train a SentencePiece BPE model: writes PREFIX.model/.vocab")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="the tokenizer's vocabulary (with --tokenizer-prefix; default 4096)")
    a = ap.parse_args(argv)
    if a.vocab_size is not None and not a.tokenizer_prefix:
        ap.error(f"--vocab-size {a.vocab_size} is the size of the SentencePiece tokenizer, which "
                 "only --tokenizer-prefix PREFIX trains; add it or drop --vocab-size")
    if not (math.isfinite(a.max_mb) and a.max_mb > 0):  # nan: a traceback; 0: one document
        ap.error(f"--max-mb {a.max_mb} must be a number > 0 (megabytes of text, e.g. 6)")
    a.vocab_size = 4096 if a.vocab_size is None else a.vocab_size
    t0 = time.time()
    docs, nbytes = write_corpus_interruptible(Path(a.output), a.max_mb)
    if docs == 0:
        raise SystemExit("error: found no standard-library source files to build a corpus from")
    print(f"corpus: {docs} documents, {nbytes / 1e6:.1f} MB -> {a.output} ({time.time() - t0:.1f} s)")
    if a.tokenizer_prefix:
        t1 = time.time()
        train_sentencepiece(text_twin(Path(a.output)), a.tokenizer_prefix, a.vocab_size)
        print(f"tokenizer: SentencePiece BPE, vocab {a.vocab_size} -> {a.tokenizer_prefix}.model "
              f"({time.time() - t1:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
