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


def input_prefixes(inputs) -> list:
    """Dataset prefixes named by `inputs` (prefixes, or directories of .bin/.idx pairs)."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            names = sorted(n[:-4] for n in os.listdir(item) if n.endswith(".idx")
                           and os.path.isfile(os.path.join(item, n[:-4] + ".bin")))
            if not names:
                raise SystemExit(f"--input {item}: directory holds no .bin/.idx pairs")
            prefixes += [os.path.join(item, n) for n in names]
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
