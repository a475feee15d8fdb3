"""End-to-end speed of tools/preprocess_data.py: GPT-2 BPE over JSONL of Python sources.

    python benchmarks/preprocess_bench.py [--mb 20] [--vocab-dir ../shared/data/gpt2]

Builds a JSONL corpus (one document per `.py` file of the running interpreter's standard
library, `--mb` megabytes), then preprocesses it with --workers 1 and 2 and prints MB/s
(of JSON input) and docs/s, timed from the start of `run` (tokenizer loading included) to
the last `.idx` written; the best of `--repeat` runs, as other load on the machine only
slows runs down.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import preprocess_data  # noqa: E402


def build_corpus(path: str, megabytes: float) -> int:
    """Write stdlib `.py` files as {"text": source} lines until `megabytes`; return docs."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs, written = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        for root, dirs, files in os.walk(stdlib):
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                    line = json.dumps({"text": f.read()}) + "\n"
                out.write(line)
                docs += 1
                written += len(line)
                if written >= megabytes * 1e6:
                    return docs
    return docs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=20.0)
    p.add_argument("--vocab-dir", default=os.path.join(ROOT, "..", "shared", "data", "gpt2"))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3, help="runs per setting; the best is shown")
    args = p.parse_args(argv)
    vocab = os.path.join(args.vocab_dir, "gpt2-vocab.json")
    merges = os.path.join(args.vocab_dir, "gpt2-merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        raise SystemExit(f"GPT-2 vocab/merges not found in {args.vocab_dir}; pass --vocab-dir")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "code.jsonl")
        docs = build_corpus(corpus, args.mb)
        size = os.path.getsize(corpus)
        print(f"corpus: {docs} documents, {size / 1e6:.1f} MB of JSONL (stdlib sources)")
        print(f"{'workers':>8} {'seconds':>8} {'MB/s':>8} {'docs/s':>9}")
        for workers in args.workers:
            argv_ = ["--input", corpus, "--output-prefix", os.path.join(tmp, f"w{workers}"),
                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                     "--merge-file", merges, "--append-eod", "--workers", str(workers),
                     "--log-interval", str(10 ** 9)]
            times = []
            for _ in range(args.repeat):
                start = time.time()
                preprocess_data.run(preprocess_data.get_args(argv_))
                times.append(time.time() - start)
            seconds = min(times)
            print(f"{workers:>8} {seconds:>8.2f} {size / seconds / 1e6:>8.2f} "
                  f"{docs / seconds:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
