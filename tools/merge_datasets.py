"""Concatenate Megatron `.bin/.idx` datasets into one (documents in the order given).

    python tools/merge_datasets.py --input DIR_OR_PREFIX [PREFIX ...] --output-prefix OUT

A directory contributes every `<name>.bin/.idx` pair in it, sorted by name. All inputs
must share one dtype; the `.bin` files are copied and the doc_idx entries shifted.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
)


def directory_prefixes(directory: str) -> list:
    """Prefixes of the `.bin/.idx` pairs in `directory`, sorted; a `.bin` or `.idx` without
    its partner is an error (Megatron's tool asserts the same), naming the file."""
    files = {n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))}
    for name in sorted(files):
        stem, ext = os.path.splitext(name)
        partner = {".idx": ".bin", ".bin": ".idx"}.get(ext)
        if partner is not None and stem + partner not in files:
            raise SystemExit(f"--input {directory}: {os.path.join(directory, name)} has no "
                             f"{partner} beside it; restore {stem + partner} or move {name} "
                             "out of the directory")
    names = sorted(n[:-4] for n in files if n.endswith(".idx"))
    if not names:
        raise SystemExit(f"--input {directory}: directory holds no .bin/.idx pairs")
    return [os.path.join(directory, n) for n in names]


def input_prefixes(inputs) -> list:
    """Dataset prefixes named by `inputs` (prefixes, or directories of .bin/.idx pairs)."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            prefixes += directory_prefixes(item)
        else:
            if item.endswith((".bin", ".idx")):
                item = item[:-4]
            if not MMapIndexedDataset.exists(item):
                raise SystemExit(f"--input {item}: {item}.bin/.idx not found")
            prefixes.append(item)
    return prefixes


def merge(prefixes, output_prefix: str) -> None:
    """Write `output_prefix.bin/.idx` = the datasets at `prefixes` one after another."""
    dtypes = {p: MMapIndexedDataset(p).dtype for p in prefixes}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p}: {d.name}" for p, d in dtypes.items())
        raise SystemExit(f"cannot merge datasets of different dtypes ({listing}); "
                         "re-tokenize them with one tokenizer")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise SystemExit(f"--output-prefix {output_prefix} is also an input")
    builder = IndexedDatasetBuilder(data_file_path(output_prefix), dtypes[prefixes[0]])
    for prefix in prefixes:
        builder.merge_file_(prefix)
    builder.finalize(index_file_path(output_prefix))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True,
                        help="dataset prefixes, or directories holding .bin/.idx pairs")
    parser.add_argument("--output-prefix", required=True)
    args = parser.parse_args(argv)
    prefixes = input_prefixes(args.input)
    merge(prefixes, args.output_prefix)
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)


if __name__ == "__main__":
    main()
