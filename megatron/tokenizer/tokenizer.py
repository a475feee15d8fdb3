"""`build_tokenizer` and the small tokenizers; see `megatron/tokenizer/__init__.py`."""
from __future__ import annotations

import os
import sys
from typing import List, Mapping, Optional, Tuple

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HuggingFaceTokenizer", "NullTokenizer")
# the package each tokenizer type imports (requirements.txt installs them all)
TOKENIZER_PACKAGES = {"GPT2BPETokenizer": "tiktoken", "SentencePieceTokenizer": "sentencepiece",
                      "GPTSentencePieceTokenizer": "sentencepiece",
                      "HuggingFaceTokenizer": "tokenizers"}


class TokenizerPackageMissing(ImportError, ValueError):
    """The package a tokenizer type needs is not installed. A ValueError too, so every
    caller that reports a tokenizer it cannot build (ValueError, OSError) reports this one
    in one line instead of a traceback."""


class NullTokenizer:
    """Text is space-separated integer ids; `vocab_size` is N + 1 and the EOD id is N."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        try:
            vocab_size = int(vocab_size)
        except (TypeError, ValueError):
            raise ValueError(f"--vocab-size {vocab_size!r} is not an integer; NullTokenizer "
                             "needs the number of token ids, e.g. --vocab-size 50257") from None
        if vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size}: NullTokenizer needs a number of token "
                             "ids >= 1, e.g. --vocab-size 50257")
        self._eod = vocab_size
        self._vocab_size = vocab_size + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer expects space-separated integers, got {text[:60]!r}"
                             ) from e

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _need(value: Optional[str], flag: str, tokenizer_type: str,
          file: Optional[Tuple[str, str]] = None) -> str:
    """`value` of `flag`, which must exist. `file` = (what, name part): the flag takes a
    file, so a directory is refused, naming the file in it whose name has that part."""
    if value is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}: pass {flag} PATH")
    if not os.path.exists(value):
        raise ValueError(f"{flag} {value}: no such file or directory; check the path")
    if file is not None and os.path.isdir(value):
        found = sorted(n for n in os.listdir(value) if file[1] in n)
        inside = (f": {os.path.join(value, found[0])}" if len(found) == 1
                  else f", one of {', '.join(found)}" if found else "")
        raise ValueError(f"{flag} {value} is a directory; pass the {file[0]} in it{inside}")
    return value


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    vocab_size: Optional[int] = None, vocab_extra_ids: int = 0):
    """Build the tokenizer named by `--tokenizer-type`.

    The object has `.name`, `.vocab_size` (unpadded), `.eod`, `.tokenize(text) -> list[int]`
    and `.detokenize(ids) -> str`. Nothing is downloaded: all files are local.
    TokenizerPackageMissing (an ImportError and a ValueError) when the package the type
    needs is not installed.
    """
    try:
        return _build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_model,
                                vocab_size, vocab_extra_ids)
    except ModuleNotFoundError as e:
        package = TOKENIZER_PACKAGES.get(tokenizer_type)
        if package is None or (e.name or "").split(".")[0] != package:
            raise
        raise TokenizerPackageMissing(
            f"--tokenizer-type {tokenizer_type} needs the {package} package, which this "
            f"Python ({sys.executable}) cannot import ({e}); install it with `pip install "
            f"{package}` (or `pip install -r requirements.txt`)", name=package) from None


def _build_tokenizer(tokenizer_type: str, vocab_file: Optional[str], merge_file: Optional[str],
                     tokenizer_model: Optional[str], vocab_size: Optional[int],
                     vocab_extra_ids: int):
    """build_tokenizer without the report of a missing package."""
    if tokenizer_type == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
        return GPT2BPETokenizer(
            _need(vocab_file, "--vocab-file", tokenizer_type, ("vocab.json file", "vocab")),
            _need(merge_file, "--merge-file", tokenizer_type, ("merges.txt file", "merges")))
    if tokenizer_type == "SentencePieceTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
        return SentencePieceTokenizer(_need(tokenizer_model, "--tokenizer-model", tokenizer_type),
                                      vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import GPTSentencePieceTokenizer
        return GPTSentencePieceTokenizer(
            _need(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
        path = tokenizer_model if tokenizer_model is not None else vocab_file
        return HuggingFaceTokenizer(_need(path, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        raise ValueError(f"--tokenizer-type {tokenizer_type} is not supported: it has no "
                         "end-of-document token, which GPT pretraining needs; use "
                         "GPT2BPETokenizer or a SentencePiece tokenizer")
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


def eod_or_none(tokenizer) -> Optional[int]:
    """The tokenizer's end-of-document id, or None when it has none inside its vocabulary:
    a tokenizer.json without an EOS token (its `eod` raises), a SentencePiece model
    trained with eos_id -1 (GPTSentencePieceTokenizer's `eod` is then -1)."""
    if tokenizer is None:
        return None
    try:
        eod = int(tokenizer.eod)
    except (AttributeError, ValueError, TypeError):
        return None
    return eod if 0 <= eod < tokenizer.vocab_size else None


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of `make_vocab_size_divisible_by * tp_size` >= `vocab_size`."""
    multiple = make_vocab_size_divisible_by * tp_size
    if multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by x tp must be >= 1, got {multiple}")
    return ((vocab_size + multiple - 1) // multiple) * multiple


def checkpoint_vocab_mismatch(vocab_size: int, saved: Mapping) -> Optional[Tuple[bool, str]]:
    """Whether a tokenizer of `vocab_size` ids can be the one a checkpoint's model (its
    saved `args`) was trained with, judged by the padded vocabulary: None when it can;
    else (fatal, why). Fatal when the tokenizer has more ids than the model has rows (an
    id past them would index outside the embedding). Otherwise the model runs, but when
    no tensor-parallel size up to 64 pads `vocab_size` to the model's rows the tokenizer
    is not the training one (the saved `tensor_model_parallel_size` is not used: loaders
    overwrite it with the layout they load into)."""
    padded = saved.get("padded_vocab_size")
    if padded is None:
        return None
    padded = int(padded)
    named = ", ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in
                      ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
                       "vocab_size") if saved.get(k) is not None)
    trained = f"; the checkpoint was trained with {named}" if named else ""
    if vocab_size > padded:
        return True, (f"the tokenizer has {vocab_size} ids, more than the {padded} vocabulary "
                      f"rows of the checkpoint's model: it is not the tokenizer the model was "
                      f"trained with{trained}")
    divisible = int(saved.get("make_vocab_size_divisible_by") or 128)
    if any(pad_vocab_size(vocab_size, divisible, tp) == padded for tp in range(1, 65)):
        return None
    return False, (f"the tokenizer's {vocab_size} ids do not pad to the {padded} rows of the "
                   f"checkpoint's model at any tensor-parallel size up to 64 "
                   f"(--make-vocab-size-divisible-by {divisible}; at tp 1: "
                   f"{pad_vocab_size(vocab_size, divisible, 1)}): check that it is the "
                   f"tokenizer the model was trained with{trained}")


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.samefile(a, b):
            return True
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return True  # the saved file is gone or unreadable: nothing to compare against


def checkpoint_tokenizer_overrides(saved: Mapping, given: Mapping,
                                   advice: bool = True) -> List[str]:
    """Why the tokenizer flags `given` (dest -> value, None: not given) are likely not the
    ones the checkpoint's model (its saved `args`) was trained with, one line each: another
    --tokenizer-type, or a tokenizer file whose contents differ from the saved path's
    file where that still exists (files moved since training are given again: fine).
    `advice`: each line ends with "; leave FLAG out to use the checkpoint's"."""
    notes = []
    kind, was = given.get("tokenizer_type"), saved.get("tokenizer_type")
    if kind is not None and was is not None and kind != was:
        notes.append(f"--tokenizer-type {kind} is not the checkpoint's {was}: the ids (and "
                     f"the end-of-document id) may differ from training's"
                     + ("; leave --tokenizer-type out to use the checkpoint's" * advice))
    for dest in ("vocab_file", "merge_file", "tokenizer_model"):
        path, old = given.get(dest), saved.get(dest)
        if path is None or old is None or not os.path.isfile(path) or _same_file(path, old):
            continue
        flag = "--" + dest.replace("_", "-")
        notes.append(f"{flag} {path} differs from the file the checkpoint was trained with, "
                     f"{old}" + (f"; leave {flag} out to use the checkpoint's" * advice))
    return notes
