"""Concatenate Megatron `.bin/.idx` datasets into one (documents in the order given).

    python tools/merge_datasets.py --input DIR_OR_PREFIX [PREFIX ...] --output-prefix OUT

A directory contributes every `<name>.bin/.idx` pair in it, sorted by name. All inputs
must share one dtype, and name each dataset once; the `.bin` files are copied and the
doc_idx entries shifted. The temporaries of a preprocess_data.py or merge_datasets.py run
in a directory are skipped (those of a killed run named, with the command that removes
them). Ctrl-C or SIGTERM ends a merge with status 130 or 143 and one line; its partial
files are removed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
    missing_dataset_hint,
)
from tools.interruptible import run_interruptible  # noqa: E402
from tools.leftover_temporaries import stale_temporaries_warning, temporary_files  # noqa: E402
from tools.preprocess_data import (  # noqa: E402
    _warn_stale_temporaries,
    interrupted_dataset_message,
    make_output_dir,
    output_error,
    output_prefix_problem,
    temporary_prefix,
    writing,
)


def directory_prefixes(directory: str) -> list:
    """Prefixes of the `.bin/.idx` pairs in `directory`, sorted; a `.bin` or `.idx` without
    its partner is an error (Megatron's tool asserts the same), naming the file."""
    files = {n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))}
    stale, live = temporary_files(directory, files)
    warning = stale_temporaries_warning(stale, f"in --input {directory} are skipped")
    if warning:
        print(warning, file=sys.stderr)
    if live:
        print(f"warning: --input {directory}: skipped {len(live)} temporary file(s) that a "
              f"running preprocess_data.py or merge_datasets.py is writing ({live[0]}, ...)",
              file=sys.stderr)
    files -= {os.path.basename(p) for p in stale + live}
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
    """Dataset prefixes named by `inputs` (prefixes, or directories of .bin/.idx pairs). A
    dataset's .bin and .idx, both given (a shell glob `--input data/*`), name it once."""
    prefixes, partners = [], set()  # partners: (prefix, suffix) of a file given by name
    for item in inputs:
        if os.path.isdir(item):
            prefixes += directory_prefixes(item)
        else:
            if item.endswith((".bin", ".idx")):
                item, suffix = item[:-4], item[-4:]
                partner = {".bin": ".idx", ".idx": ".bin"}[suffix]
                if (item, partner) in partners:  # its pair's other file, given already
                    partners.remove((item, partner))
                    continue
                partners.add((item, suffix))
            if not MMapIndexedDataset.exists(item):
                raise SystemExit(f"--input {item}: {item}.bin/.idx not found"
                                 f"{missing_dataset_hint(item)}")
            prefixes.append(item)
    check_each_once(prefixes)
    return prefixes


def check_each_once(prefixes) -> None:
    """SystemExit when two of `prefixes` name one dataset (a prefix given twice, or also
    in a directory given, or through a symlink): its documents were merged twice over."""
    seen = {}
    for prefix in prefixes:
        key = os.path.realpath(data_file_path(prefix))
        if key in seen:
            same = prefix if seen[key] == prefix else f"{seen[key]} and {prefix}"
            raise SystemExit(f"error: --input names the dataset {same} twice ({key}): its "
                             "documents would be in the merged dataset twice. Name each "
                             "dataset once (to sample one more often, give it a larger "
                             "weight in --data-path instead)")
        seen[key] = prefix


def open_inputs(prefixes) -> dict:
    """prefix -> dtype of each input; a truncated or corrupt one ends the run naming it,
    and so do inputs that mix Megatron's --append-eod layout with exact ones
    (`check_eod_layouts`)."""
    dtypes, uncounted, sequences = {}, {}, {}
    for prefix in prefixes:
        try:
            dataset = MMapIndexedDataset(prefix)
        except ValueError as exc:
            raise SystemExit(f"error: --input {prefix}: {exc}") from None
        dtypes[prefix], uncounted[prefix] = dataset.dtype, dataset.uncounted_eods
        sequences[prefix] = len(dataset)
        del dataset
    check_eod_layouts(uncounted, sequences)
    return dtypes


def check_eod_layouts(uncounted: dict, sequences: dict) -> None:
    """A `.bin` written by Megatron-LM 23.06's preprocess_data.py --append-eod holds one EOD
    per document that its index does not count; readers take that surplus as the bug's
    mark (and read it as Megatron does). Merged with exact inputs, the surplus no longer
    matches the documents, so the output could not be read at all (its .bin 'oversized'),
    and the sequences after the first such input would start at the wrong byte: refused,
    naming the inputs of each kind and the fix."""
    buggy = [p for p, n in uncounted.items() if n]
    exact = [p for p, n in uncounted.items() if not n and sequences[p]]
    if not buggy or not exact:
        return
    raise SystemExit(
        f"error: cannot merge {', '.join(buggy)} (written by Megatron-LM's preprocess_data.py "
        f"--append-eod: one end-of-document token per document that its .idx does not "
        f"count) with {', '.join(exact)} (exact .bin/.idx): the merged .bin would not match "
        "its index, and every sequence after the first of those would be read from the wrong "
        "place. Preprocess the Megatron-LM input(s) again with tools/preprocess_data.py "
        "(which counts the EOD), or merge only datasets of one kind")


def merge(prefixes, output_prefix: str) -> None:
    """Write `output_prefix.bin/.idx` = the datasets at `prefixes` one after another.

    The files are written as `<output_prefix>.tmp<pid>-<random>.bin/.idx` (never another
    merge's, even one in a container with the same process id) and renamed into place
    (the .bin, then the .idx) only when complete: a failed merge leaves an earlier dataset
    at `output_prefix` as it was."""
    dtypes = open_inputs(prefixes)
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p}: {d.name}" for p, d in dtypes.items())
        raise SystemExit(f"cannot merge datasets of different dtypes ({listing}); "
                         "re-tokenize them with one tokenizer")
    if _output_is_an_input(output_prefix, prefixes):  # e.g. a merge run again into its
        # input directory: the earlier output is listed as an input
        raise SystemExit(f"error: --output-prefix {output_prefix} is also an input: "
                         f"{output_prefix}.bin/.idx is one of the datasets to merge (an "
                         "earlier merge's output in the --input directory?); pass an "
                         "--output-prefix outside the inputs, or move that .bin/.idx away")
    make_output_dir(output_prefix)
    tmp = temporary_prefix(output_prefix)
    with writing(output_prefix):
        builder = IndexedDatasetBuilder(data_file_path(tmp), dtypes[prefixes[0]])
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(index_file_path(tmp))
        for path in (data_file_path, index_file_path):  # .idx last
            os.replace(path(tmp), path(output_prefix))
    except BaseException as e:
        builder.close()
        for path in (data_file_path(tmp), index_file_path(tmp)):
            if os.path.exists(path):
                os.remove(path)
        if isinstance(e, OSError) and not _names_an_input(e, prefixes):
            raise output_error(output_prefix, e) from None
        raise


def _output_is_an_input(output_prefix: str, prefixes) -> bool:
    """Whether writing `output_prefix`'s .bin/.idx would replace an input's file: the same
    name under another spelling too (a symlinked directory, an input's symlink to it, a
    bind mount), which comparing the paths as given missed."""
    def entry(path: str) -> str:  # the directory entry a rename replaces
        return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                            os.path.basename(path))

    for path in (data_file_path, index_file_path):
        out = path(output_prefix)
        for p in prefixes:
            if entry(out) in (entry(path(p)), os.path.realpath(path(p))):
                return True
            if os.path.exists(out) and os.path.samefile(out, path(p)):
                return True
    return False


def _names_an_input(error: OSError, prefixes) -> bool:
    """Whether `error` is about reading one of the inputs rather than writing the output."""
    inputs = {os.path.abspath(path(p)) for p in prefixes
              for path in (data_file_path, index_file_path)}
    return bool(error.filename) and os.path.abspath(error.filename) in inputs


def main(argv=None) -> int:
    """The command line; the library's warnings (a dataset's index that does not match
    its .bin) print in one line each."""
    from megatron.entry_state import project_warnings_in_one_line

    with project_warnings_in_one_line():
        return _main(argv)


def _main(argv) -> int:
    from megatron.cli_suggest import SuggestingParser

    parser = SuggestingParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True,
                        help="dataset prefixes, or directories holding .bin/.idx pairs")
    parser.add_argument("--output-prefix", required=True)
    args = parser.parse_args(argv)
    problem = output_prefix_problem(args.output_prefix, "<prefix>.bin/.idx")
    if problem:
        parser.error(problem)
    prefixes = input_prefixes(args.input)
    if os.path.isdir(os.path.dirname(os.path.abspath(args.output_prefix))):
        _warn_stale_temporaries(args.output_prefix)  # a SIGKILLed merge's, of 100s of GB
    status = run_interruptible(  # SIGTERM removes the partial .bin as Ctrl-C does
        lambda: merge(prefixes, args.output_prefix),
        interrupted_dataset_message("merge_datasets.py", args.output_prefix))
    if status:
        return status
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
