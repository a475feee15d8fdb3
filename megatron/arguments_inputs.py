"""What a run reads from disk, checked in validation (so --dry-run catches it too):

* the syntax of `--data-path` (and `--train/valid/test-data-path`) and of `--split`, with
  the dataset builder's own parsers, so the rules and messages are the builder's;
* the tokenizer's files: the flags its type needs are given and name existing files (under
  --dry-run a missing file is listed in the report instead, which then goes on with an
  assumed vocabulary: `assumed_vocab_size`);
* the tokenizer's vocabulary size for the tokenizers that need no library
  (`default_vocab_size`).

Whether the data files themselves exist is reported by `--dry-run`
(`arguments_report.find_missing_inputs`) and checked by the dataset builder.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, List, Mapping, Tuple

from megatron.arguments_common import ArgumentsError, flag_for_dest, warn

_DATA_LISTS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")

# tokenizer type -> the flags (dests) naming its files
_TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
}
_GPT2_HINT = ("(GPT-2's gpt2-vocab.json / gpt2-merges.txt); without files use --tokenizer-type "
              "NullTokenizer --vocab-size N (e.g. with --mock-data)")


def check_data_inputs(ns, explicit=frozenset()) -> None:
    """`--data-path` lists: one prefix or `weight prefix` pairs with numeric weights (the
    builder's `parse_weighted_prefixes`); `--split`: numbers with a positive sum (the
    builder's `get_train_valid_test_split`), unless --train/valid/test-data-path replace
    --data-path (then Megatron-LM ignores --split). What Megatron-LM ignores is warned: a
    member of a blend with weight 0, --train/valid/test-data-path beside --data-path, a --split given
    (`explicit`: the dests set on the command line) without --data-path, numbers of a
    --split past the third."""
    from megatron.core.datasets.blended import parse_weighted_prefixes
    from megatron.core.datasets.gpt_dataset import get_train_valid_test_split

    for dest in _DATA_LISTS:
        paths = getattr(ns, dest)
        if paths is not None:
            _check_quoted_blend(dest, paths)
            try:
                prefixes, weights = parse_weighted_prefixes(paths)
            except ValueError as e:
                raise ArgumentsError(f"{flag_for_dest(dest)}: {e}{_split_prefix(paths)}") from None
            unused = [p for p, w in zip(prefixes, weights) if w == 0]
            if unused:  # accepted in silence by Megatron-LM (its blending may pick one once)
                one = len(unused) == 1
                warn(f"{flag_for_dest(dest)}: weight 0 for {', '.join(unused)} (accepted, as "
                     f"in Megatron-LM): the blend draws at most one sample from "
                     f"{'it' if one else 'each'}; give {'it' if one else 'them'} a positive "
                     f"weight to train on {'it' if one else 'them'}, or drop the "
                     f"{'pair' if one else 'pairs'}")
            _warn_repeated_members(dest, paths, prefixes)
    separate = [flag_for_dest(d) for d in _DATA_LISTS[1:] if getattr(ns, d)]
    if ns.data_path and separate:
        warn(f"{', '.join(separate)} ignored: --data-path is given, and its --split "
             f"'{ns.split}' makes the train, validation and test sets (as in Megatron-LM); "
             f"drop --data-path to use {', '.join(separate)}")
    split_ignored = not ns.data_path and bool(separate)
    if split_ignored and "split" in explicit:
        warn(f"--split '{ns.split}' ignored: without --data-path, the documents of "
             f"{', '.join(separate)} are used whole")
    if not split_ignored:
        try:
            get_train_valid_test_split(ns.split, 1000)
        except ValueError as e:
            raise ArgumentsError(str(e)) from None
        numbers = ns.split.replace("/", ",").split(",")
        if len(numbers) > 3:  # Megatron-LM drops the rest silently
            warn(f"--split '{ns.split}': only the first three numbers (train, validation, "
                 f"test) are read; {','.join(n.strip() for n in numbers[3:])} ignored")


def _same_file_key(prefix: str) -> str:
    """What makes two spellings of a dataset prefix one dataset: the resolved `.bin` (links
    and relative paths followed), or the normalised path when it does not exist."""
    data = prefix + ".bin"
    return os.path.realpath(data) if os.path.exists(data) else os.path.abspath(prefix)


def _warn_repeated_members(dest: str, paths, prefixes: List[str]) -> None:
    """A dataset named twice in a blend (by the same or another spelling): the copies'
    indexes are built from the same documents with the same seed (the name does not enter
    them), so they draw the same samples in the same order and each sample comes twice --
    with equal weights in neighbouring positions of the blend, often one micro-batch.
    Megatron-LM does the same, silently; summing the weights draws distinct samples."""
    if len(paths) < 2:
        return
    groups: dict = {}
    for i, prefix in enumerate(prefixes):
        groups.setdefault(_same_file_key(prefix), []).append(i)
    for members in (m for m in groups.values() if len(m) > 1):
        names = sorted({prefixes[i] for i in members})
        raw = [paths[2 * i] for i in members]
        total = sum(float(w) for w in raw)
        warn(f"{flag_for_dest(dest)}: {' and '.join(names)} {'is' if len(names) == 1 else 'are'} "
             f"one dataset given {len(members)} times (weights {', '.join(raw)}): each copy "
             "is indexed from the same documents with the same --seed, so the copies draw the "
             "same samples in the same order and each is trained on once per copy (with equal "
             "weights in neighbouring samples of the blend), as in Megatron-LM; give it once "
             f"with the weights summed ({total:g}) to draw distinct samples instead")


def _split_prefix(words) -> str:
    """For `words` some consecutive of which join with spaces into an existing dataset
    prefix (one holding spaces, split into words by an unquoted $DATA_PATH or a launch
    script), the fix to append to the parse error; else ''."""
    for i in range(len(words)):
        for j in range(i + 2, len(words) + 1):
            prefix = " ".join(words[i:j])
            if os.path.isfile(prefix + ".idx"):
                return (f"; the words {words[i:j]} are the dataset prefix '{prefix}', which "
                        f"holds spaces and was split into words (an unquoted $DATA_PATH, or a "
                        f"launch script that splits DATA_PATH): pass it as one quoted "
                        f"argument, list it under data-path: in a --config YAML file, or use "
                        f"a symlink to it whose path has no spaces")
    return ""


def _check_quoted_blend(dest: str, paths) -> None:
    """One value that holds a whole blend ('0.3 a 0.7 b', from a quoted "$DATA_PATH" in a
    script) would be read as a single prefix and reported missing (by Megatron-LM too, when
    it opens it): refused, naming the fix, unless such a file exists. So is one holding
    prefixes of existing datasets without weights ('a b')."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    words = paths[0].split() if len(paths) == 1 else []
    if len(words) < 2 or any(os.path.exists(paths[0] + ext) for ext in ("", ".idx")):
        return
    flag = flag_for_dest(dest)
    try:
        parse_weighted_prefixes(words)
    except ValueError:
        if all(os.path.exists(w + ".idx") for w in words):  # 'a b': datasets without weights
            pairs = " ".join(f"1 {w}" for w in words)
            raise ArgumentsError(f"{flag} '{paths[0]}' is one argument holding {len(words)} "
                                 f"dataset prefixes: a blend takes 'weight prefix' pairs as "
                                 f"separate arguments, e.g. {flag} {pairs}") from None
        if _is_number(words[0]):  # '0.5 /my data/a 0.5 b': pairs, a prefix with spaces
            raise ArgumentsError(
                f"{flag} '{paths[0]}' is one argument that starts with a weight: a blend "
                f"takes 'weight prefix' pairs as separate arguments, and a prefix holding "
                f"spaces cannot be told apart from its neighbours in one argument: quote "
                f"each such prefix on its own ({flag} 0.5 '/my data/a' 0.5 b), or list the "
                f"pairs under {flag[2:]}: in a --config YAML file (read as one prefix, it "
                f"names no .bin/.idx either)") from None
        return  # a prefix with a space in it
    raise ArgumentsError(f"{flag} '{paths[0]}' is one argument holding 'weight prefix' "
                         f"pairs: pass its words as separate arguments ({flag} {paths[0]}), "
                         f"e.g. an unquoted $DATA_PATH in a shell script")


def unexpanded_home(path: str) -> str:
    """For a `path` beginning with '~' (a quoted ~, `--flag=~/x`, a --config value: nothing
    expanded it, as nothing does in Megatron-LM either), the fix to append to a message
    about it: '; ~ is not your home directory here: ...'; else ''."""
    if not path.startswith("~"):
        return ""
    home = os.path.expanduser(path)
    spelled = f"{home}" if home != path else "$HOME" + path[1:]
    return (f"; '~' was not expanded to a home directory (the shell does that only for an "
            f"unquoted ~ starting a word, not in --flag=~/... or a --config file): write "
            f"{spelled}, or ./{path} for a directory really named '~'")


def missing_home_hint(path: str) -> str:
    """`unexpanded_home` for a `path` that does not exist (a missing --load, say); ''
    when it exists (a directory really named '~')."""
    return "" if os.path.exists(path) else unexpanded_home(path)


def home_not_expanded(flag: str, path: str) -> str:
    """For an output directory `path` starting with an unexpanded '~', which would be
    created as a directory named '~' in the working directory (unless that exists), the
    error naming the fix; else ''."""
    hint = unexpanded_home(path) if path else ""
    if not hint or os.path.lexists(path.split(os.sep)[0]):
        return ""
    return f"{flag} {path}: would create a directory named '~' in {os.getcwd()}{hint}"


def check_output_paths(ns) -> None:
    """The output directories (--save, --tensorboard-dir, --data-cache-path):
    `home_not_expanded`."""
    for dest in ("save", "tensorboard_dir", "data_cache_path"):
        error = home_not_expanded(flag_for_dest(dest), getattr(ns, dest, None))
        if error:
            raise ArgumentsError(error)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _not_found(dest: str, path: str) -> str:
    """'--flag PATH: file not found; check the path', a relative path also shown resolved
    (the launch scripts run from the repository root, not from where they were started)."""
    where = "" if os.path.isabs(path) else f" (looked for {os.path.abspath(path)})"
    fix = unexpanded_home(path) or "; check the path"
    return f"{flag_for_dest(dest)} {path}: file not found{where}{fix}"


def _check_file(dest: str, path: str) -> None:
    """ArgumentsError naming the flag and the path when `path` does not exist."""
    if not os.path.exists(path):
        raise ArgumentsError(_not_found(dest, path))


def tokenizer_file_dests(args: Mapping[str, Any]) -> Tuple[str, ...]:
    """The dests naming the files of the run's --tokenizer-type."""
    if args.get("tokenizer_type") == "HuggingFaceTokenizer":
        return ("tokenizer_model",) if args.get("tokenizer_model") is not None else ("vocab_file",)
    return _TOKENIZER_FILES.get(args.get("tokenizer_type"), ())


def absent_tokenizer_files(args: Mapping[str, Any]) -> List[str]:
    """'--flag PATH: file not found; ...' for each file of the run's tokenizer that is
    named but does not exist (`Config.args`, or vars() of the namespace)."""
    return [_not_found(d, args[d]) for d in tokenizer_file_dests(args)
            if args.get(d) and not os.path.exists(args[d])]


# --dry-run with tokenizer files missing goes on with a vocabulary of this size, said in its
# report: GPT-2's (the usual gpt2-vocab.json), else LLaMA's SentencePiece one
_ASSUMED_VOCAB = {"GPT2BPETokenizer": 50257}
_ASSUMED_VOCAB_OTHERS = 32000


def vocab_assumed(args: Mapping[str, Any]) -> bool:
    """Whether `Config.args` hold an assumed vocabulary: a --dry-run whose tokenizer files
    are missing (its report leaves the vocabulary out of what it checks)."""
    return bool(args.get("dry_run")) and bool(absent_tokenizer_files(args))


def assumed_vocab_size(args: Mapping[str, Any]) -> int:
    """The vocabulary size (before padding) a --dry-run whose tokenizer files are missing
    assumes for its parameter counts and memory estimate."""
    return _ASSUMED_VOCAB.get(args.get("tokenizer_type"), _ASSUMED_VOCAB_OTHERS)


# Megatron 23.05's --tokenizer-type choices that have no end-of-document token
NO_EOD_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")


def check_tokenizer_type(ns) -> None:
    """Refuse Megatron's BERT WordPiece types (no end-of-document id, which GPT pretraining
    needs) while checking the arguments, before anything is printed or built, in the words
    of tools/preprocess_data.py's refusal."""
    if ns.tokenizer_type in NO_EOD_TOKENIZER_TYPES:
        raise ArgumentsError(
            f"--tokenizer-type {ns.tokenizer_type} is not supported: it has no "
            "end-of-document token, which GPT pretraining needs; use GPT2BPETokenizer, "
            "SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer or "
            "NullTokenizer")


def check_tokenizer_files(ns, files: bool = True) -> None:
    """The files of `--tokenizer-type` are named and exist: GPT2BPETokenizer --vocab-file
    and --merge-file, the SentencePiece types --tokenizer-model, HuggingFaceTokenizer
    --tokenizer-model (or --vocab-file). Megatron-LM asserts the same when it builds the
    tokenizer; here it fails before anything starts, with exit status 2. `files`: False
    checks only that the flags are given (--dry-run lists the missing files in its
    report: `absent_tokenizer_files`)."""
    kind = ns.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        dest = tokenizer_file_dests(vars(ns))[0]
        if getattr(ns, dest) is None:
            raise ArgumentsError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                                 "(a tokenizer.json file or a directory holding one)")
        if files:
            _check_file(dest, getattr(ns, dest))
        return
    dests = _TOKENIZER_FILES.get(kind, ())
    missing = [flag_for_dest(d) for d in dests if not getattr(ns, d)]
    if missing:
        hint = f" {_GPT2_HINT}" if kind == "GPT2BPETokenizer" else ""
        if kind == "GPT2BPETokenizer" and ns.tokenizer_model is not None:
            hint = (f"; --tokenizer-model {ns.tokenizer_model} is given but only the "
                    "SentencePiece and HuggingFace tokenizers read it: pass --tokenizer-type "
                    "SentencePieceTokenizer, GPTSentencePieceTokenizer or HuggingFaceTokenizer")
        elif kind == "GPT2BPETokenizer" and ns.vocab_size is not None:
            hint = (f"; --vocab-size {ns.vocab_size} is given but only NullTokenizer reads it: "
                    "pass --tokenizer-type NullTokenizer")
        default = " (the default)" if kind == "GPT2BPETokenizer" else ""
        raise ArgumentsError(f"--tokenizer-type {kind}{default} needs {' and '.join(missing)}"
                             f"{hint}")
    for dest in dests if files else ():
        _check_file(dest, getattr(ns, dest))


def warn_unread_tokenizer_flags(ns, explicit=frozenset()) -> None:
    """The tokenizer flags that `--tokenizer-type` does not read, given anyway (Megatron-LM
    ignores them silently): a script naming a tokenizer file it does not train with, e.g.
    a SentencePiece --tokenizer-model under the default GPT2BPETokenizer. `explicit`: the
    dests set on the command line or in --config."""
    kind = ns.tokenizer_type
    if ns.vocab_size is not None and kind != "NullTokenizer":
        warn(f"--vocab-size {ns.vocab_size} is only read by NullTokenizer; the vocab size comes "
             f"from {kind}")
    if ns.vocab_extra_ids and kind != "SentencePieceTokenizer":
        warn(f"--vocab-extra-ids {ns.vocab_extra_ids} has no effect with {kind} "
             "(as in Megatron-LM)")
    reads = tokenizer_file_dests(vars(ns))
    unread = [d for d in ("vocab_file", "merge_file", "tokenizer_model")
              if d not in reads and d in explicit and getattr(ns, d) is not None]
    if not unread:
        return
    given = ", ".join(f"{flag_for_dest(d)} {getattr(ns, d)}" for d in unread)
    it = "it" if len(unread) == 1 else "them"
    source = (f"--vocab-size {ns.vocab_size}" if kind == "NullTokenizer" else
              " and ".join(f"{flag_for_dest(d)} {getattr(ns, d)}" for d in reads))
    default = (" (the default)" if kind == "GPT2BPETokenizer" and "tokenizer_type" not in explicit
               else "")
    warn(f"{given} {'is' if len(unread) == 1 else 'are'} not read by --tokenizer-type "
         f"{kind}{default}, which takes its vocabulary from {source}; pass the "
         f"--tokenizer-type that reads {it}, or drop {it} (Megatron-LM ignores {it} too)")


EOD_FLAGS = (  # the flags that act at the end-of-document id (also megatron/data_iterators.py)
    "reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def check_eod_flags(ns, tokenizer) -> None:
    """--reset-position-ids, --reset-attention-mask and --eod-mask-loss act at the
    tokenizer's end-of-document id: ArgumentsError, naming the flags, when it has none in
    its vocabulary (a tokenizer.json without an EOS token stopped the run with a traceback
    after the model was built; a SentencePiece model trained with eos_id -1 made the flags
    do nothing, as in Megatron-LM)."""
    from megatron.tokenizer import eod_or_none

    given = [flag_for_dest(d) for d in EOD_FLAGS if getattr(ns, d, False)]
    if not given or eod_or_none(tokenizer) is not None:
        return
    try:
        why = f"its end-of-document id is {tokenizer.eod}"
    except ValueError as e:
        why = str(e)
    verb = "act" if len(given) > 1 else "acts"
    raise ArgumentsError(f"{' and '.join(given)} {verb} at the end-of-document token, and the "
                         f"{ns.tokenizer_type} has none in its {tokenizer.vocab_size} ids "
                         f"({why}): drop {' and '.join(given)}, or use a tokenizer with one"
                         + (" (SentencePieceTokenizer adds <EOD> to the same model)"
                            if ns.tokenizer_type == "GPTSentencePieceTokenizer" else ""))


def default_vocab_size(args: argparse.Namespace) -> int:
    """Tokenizer vocab size before padding, for the tokenizers that need no library:
    NullTokenizer: --vocab-size N -> N + 1 (id N is end-of-document);
    GPT2BPETokenizer: the largest id of the --vocab-file JSON + 1 (its number of
    entries, as in Megatron-LM, unless the ids have gaps).
    Other tokenizer types need a `vocab_size_fn` from the tokenizer package."""
    kind = args.tokenizer_type
    if kind == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentsError("--tokenizer-type NullTokenizer needs --vocab-size N")
        return args.vocab_size + 1
    if kind == "GPT2BPETokenizer":
        if not args.vocab_file:
            raise ArgumentsError(f"GPT2BPETokenizer (the default --tokenizer-type) needs "
                                 f"--vocab-file and --merge-file {_GPT2_HINT}")
        _check_file("vocab_file", args.vocab_file)
        with open(args.vocab_file, encoding="utf-8-sig") as f:  # json refuses a BOM
            try:
                vocab = json.load(f)
            except ValueError as e:
                raise ArgumentsError(f"--vocab-file {args.vocab_file}: not a JSON vocabulary "
                                     f"({e})") from None
        # the tokenizer's size: the largest id + 1 (len(vocab) unless the ids have gaps)
        ids = [i for i in vocab.values() if isinstance(i, int)] if isinstance(vocab, dict) else []
        return max(ids) + 1 if ids else len(vocab)
    check_tokenizer_type(args)
    raise ArgumentsError(f"--tokenizer-type {kind} is not supported by this framework yet")
