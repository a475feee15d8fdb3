"""Encode chunks of JSON lines into token arrays (the worker side of preprocess_data.py).

A chunk is (path, first line number, bytes of whole lines). For each line and each json
key the value (text, or a list of already split sentences) is tokenized sentence by
sentence; empty sentences are dropped; with `append_eod` the EOD id ends every non-empty
document and is counted in its last sentence's size. The result per key is the flat token
bytes (in the dataset dtype), the sentence sizes, the sentences per document and the
tokens per document -- ready for `IndexedDatasetBuilder.add_batch`.

With `split_sentences` a text value is split by NLTK's pretrained punkt model for `lang`
(the `punkt_tab` data package; pickled `punkt` on nltk < 3.8.2), each sentence becoming
its own sequence; the whitespace between sentences is dropped, or with `keep_newlines`
kept at the end of the sentence before it (Megatron's rule). A list value is taken as
already split.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

try:  # noticeably faster; json is the fallback and the reference for what is accepted
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None


class BadLine(ValueError):
    """A line that is not a JSON object with the wanted keys."""


class NotJSON(BadLine):
    """A line that does not parse as JSON at all (plain text input, for instance)."""


class NotUTF8(BadLine):
    """A line whose bytes are not UTF-8 (a Latin-1 or cp1252 file, for instance): the fix
    is converting the file, not its JSON."""


class OutOfVocabulary(BadLine):
    """A line whose ids fall outside the tokenizer's vocabulary (NullTokenizer text): the
    fix is the vocabulary, not skipping lines."""


@dataclass
class EncoderOptions:
    tokenizer_type: str
    vocab_file: Optional[str]
    merge_file: Optional[str]
    tokenizer_model: Optional[str]
    vocab_size: Optional[str]
    json_keys: Tuple[str, ...]
    append_eod: bool
    dtype: str
    skip_bad_lines: bool
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"


def options_from_args(args, dtype) -> EncoderOptions:
    """EncoderOptions from preprocess_data.py's parsed arguments."""
    return EncoderOptions(args.tokenizer_type, args.vocab_file, args.merge_file,
                          args.tokenizer_model, args.vocab_size, tuple(args.json_keys),
                          args.append_eod, np.dtype(dtype).str, args.skip_bad_lines,
                          args.split_sentences, args.keep_newlines, args.lang)


def build_tokenizer_from_options(opts: EncoderOptions):
    from megatron.tokenizer.tokenizer import build_tokenizer

    return build_tokenizer(opts.tokenizer_type, vocab_file=opts.vocab_file,
                           merge_file=opts.merge_file, tokenizer_model=opts.tokenizer_model,
                           vocab_size=opts.vocab_size)


def _punkt_package() -> str:
    """The NLTK data package holding punkt: `punkt_tab` (plain-text tables) since nltk
    3.8.2, the pickled `punkt` before (nltk >= 3.9 refuses to load those pickles)."""
    from nltk.tokenize import punkt

    return "punkt_tab" if hasattr(punkt, "PunktTokenizer") else "punkt"


def _load_punkt(lang: str):
    """NLTK's pretrained punkt sentence splitter for `lang`, found on nltk.data.path
    (which NLTK fills from NLTK_DATA and its default locations). Raises LookupError
    when the data is not installed, ValueError for a malformed language name."""
    if _punkt_package() == "punkt_tab":
        from nltk.tokenize.punkt import PunktTokenizer

        return PunktTokenizer(lang)
    import nltk

    return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")


def _installed_punkt_languages(package: str) -> List[str]:
    """Languages of `package` found on nltk.data.path (for the error message)."""
    import nltk

    langs = set()
    for root in nltk.data.path:
        directory = os.path.join(str(root), "tokenizers", package)
        if os.path.isdir(directory):
            langs.update(os.path.splitext(n)[0] for n in os.listdir(directory)
                         if not n.startswith("."))
    return sorted(langs)


def check_split_sentences(lang: str) -> None:
    """Raise SystemExit, naming the fix, unless NLTK and its punkt data for `lang`
    are installed (so --split-sentences fails before any input is read)."""
    try:
        import nltk
    except ImportError:
        raise SystemExit("--split-sentences needs NLTK, which is not installed: pip install "
                         "nltk, then python -m nltk.downloader punkt_tab (or drop the flag)"
                         ) from None
    except LookupError as e:  # nltk 3.9.0 loads wordnet data on import
        why = " ".join(str(e).split())[:200]
        raise SystemExit(f"--split-sentences: NLTK fails to import here ({why}...); NLTK "
                         "3.9.0 does without its data: pip install 'nltk>=3.9.1' (or drop "
                         "the flag)") from None
    try:
        _load_punkt(lang)
    except (LookupError, ValueError, OSError) as e:
        package = _punkt_package()
        installed = _installed_punkt_languages(package)
        raise SystemExit(
            f"--split-sentences: NLTK {nltk.__version__} has no {package} sentence splitter "
            f"for --lang {lang!r} ({type(e).__name__}; installed languages: "
            f"{', '.join(installed) or 'none'}; searched {list(map(str, nltk.data.path))}). "
            f"Fix: python -m nltk.downloader {package} -- or, without internet, copy an "
            f"nltk_data directory holding tokenizers/{package}/{lang}"
            f"{'/' if package == 'punkt_tab' else '.pickle'} and point NLTK_DATA at it -- "
            "or pick an installed --lang, or drop --split-sentences") from None


def _keep_newlines_lang_vars():
    """Punkt language vars for --keep-newlines, with Megatron's sentence-boundary rule:
    the whitespace after a sentence end (newlines included) is matched as part of the
    boundary, so it stays at the end of the sentence instead of being dropped. The match
    starts at the beginning of the token holding the sentence end, as Megatron's does, but
    is anchored there, so a long run of non-space text costs linear time (unanchored, it
    is quadratic, and nltk >= 3.10 aborts such a match after 5 s)."""
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepNewlinesLanguageVars(PunktLanguageVars):
        _period_context_fmt = r"""
            (?<!\S)\S*             # the token holding the sentence end, from its start
            %(SentEndChars)s
            \s*                    # whitespace after the end: part of this sentence
            (?=(?P<after_tok>
                %(NonWord)s         # either punctuation
                |
                (?P<next_tok>\S+)   # or the next token, which starts the next sentence
            ))"""

    return KeepNewlinesLanguageVars()


def _sentence_splitter(lang: str, keep_newlines: bool):
    """NLTK punkt for `lang`: as trained (whitespace between sentences dropped), or with
    --keep-newlines the same parameters with the whitespace kept in the sentence before."""
    splitter = _load_punkt(lang)
    if not keep_newlines:
        return splitter
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer(train_text=splitter._params,
                                  lang_vars=_keep_newlines_lang_vars())


def _not_utf8_message(e: UnicodeDecodeError) -> str:
    """Where a line stops being UTF-8, and the fix (convert the file)."""
    byte = e.object[e.start] if isinstance(e.object, bytes) and e.start < len(e.object) else None
    what = f"byte 0x{byte:02x}" if byte is not None else "a byte"
    return (f"not UTF-8 text: {what} at byte {e.start + 1} of the line is not valid {e.encoding} "
            f"({e.reason}); JSON lines must be UTF-8 encoded: convert the file, e.g. for "
            "Latin-1 text: iconv -f latin1 -t utf-8 IN.jsonl > OUT.jsonl")


def _wide_text_message(line: bytes) -> str:
    """The error for a line holding NUL bytes: UTF-16 or UTF-32 text (what Windows
    PowerShell's `>` and Out-File write), which json would decode line by line from a
    byte order mark or its zeros -- the first line read, the rest misaligned -- and no
    UTF-8 JSON line holds (JSON text has no raw control characters)."""
    return ("not UTF-8 text: the line holds NUL bytes (0x00), as UTF-16 text does (what "
            "Windows PowerShell's > and Out-File write; or UTF-32); JSON lines must be UTF-8 "
            "encoded: convert the file, e.g. iconv -f utf-16 -t utf-8 IN.jsonl > OUT.jsonl")


def _json_type(value) -> str:
    """`value`'s JSON type as a user reads it in the file ('null', 'a number', ...)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    for kind, name in ((str, "text"), (int, "a number"), (float, "a number"),
                       (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _json_file_hint(line: bytes) -> str:
    """The fix for a .json file (one array, or objects spread over lines) given where JSON
    lines are read: what exporters such as pandas' to_json() write by default."""
    start = line.lstrip()[:1]
    if start not in (b"[", b"{") or (start == b"{" and line.strip() != b"{"):
        return ""
    return ("; this looks like a JSON file (an array, or objects over several lines): "
            "convert it to one object per line, e.g. jq -c '.[]' IN.json > OUT.jsonl (for "
            "an array; jq -c . for objects)")


class ChunkEncoder:
    """Holds one tokenizer; `encode(chunk)` returns a picklable result dict."""

    def __init__(self, opts: EncoderOptions):
        self.opts = opts
        self.tokenizer = build_tokenizer_from_options(opts)
        self.dtype = np.dtype(opts.dtype)
        self.eod = np.array([self.tokenizer.eod], dtype=self.dtype) if opts.append_eod else None
        self._tokenize = getattr(self.tokenizer, "tokenize_array", None)
        self.splitter = (_sentence_splitter(opts.lang, opts.keep_newlines)
                         if opts.split_sentences else None)

    def _ids(self, text: str) -> np.ndarray:
        if self._tokenize is not None:
            return self._tokenize(text)
        return np.asarray(self.tokenizer.tokenize(text), dtype=np.int64)

    def _sentences(self, value, key: str) -> List[str]:
        if isinstance(value, str):
            if self.splitter is None:
                return [value]
            step = 1_000_000  # punkt is run on 1M-character pieces, as Megatron does
            return [s for i in range(0, len(value), step)
                    for s in self.splitter.tokenize(value[i:i + step])]
        if isinstance(value, list):
            wrong = next((i for i, s in enumerate(value) if not isinstance(s, str)), None)
            if wrong is None:
                return value
            raise BadLine(f"key {key!r} holds a list whose item {wrong} is "
                          f"{_json_type(value[wrong])}, expected text or a list of text")
        raise BadLine(f"key {key!r} holds {_json_type(value)}, expected text or a list of text")

    def _parse(self, line: bytes) -> dict:
        doc = None
        if orjson is not None:
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError:
                doc = None
        if doc is None:
            if b"\x00" in line:
                raise NotUTF8(_wide_text_message(line))
            try:
                doc = json.loads(line)
            except UnicodeDecodeError as e:
                raise NotUTF8(_not_utf8_message(e)) from None
            except ValueError as e:
                raise NotJSON(f"invalid JSON ({e}); the input is JSON lines: one object such "
                              'as {"text": "..."} per line' + _json_file_hint(line)) from None
        if not isinstance(doc, dict):
            raise BadLine(f"expected a JSON object, got {_json_type(doc)}"
                          + (_json_file_hint(line) if isinstance(doc, list) else ""))
        missing = [k for k in self.opts.json_keys if k not in doc]
        if missing:
            raise BadLine(f"missing key(s) {missing}; present: {sorted(doc)[:10]}; --json-keys "
                          "names the keys that hold the text (default: text)")
        return doc

    def _encode_text(self, value, key: str) -> list:
        """Non-empty token arrays of `value`'s sentences. Text the tokenizer cannot encode
        (a lone surrogate for GPT-2 BPE, a non-integer for NullTokenizer, ...) is a bad
        line like malformed JSON: reported with its file and line, or skipped."""
        sentences = self._sentences(value, key)
        try:
            encoded = [self._ids(s) for s in sentences]
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is this line's fault
            raise BadLine(f"key {key!r}: {self.tokenizer.name} cannot encode the text "
                          f"({type(e).__name__}: {e})") from None
        encoded = [ids for ids in encoded if len(ids)]
        vocab = self.tokenizer.vocab_size
        for ids in encoded:  # NullTokenizer takes any integer: keep the dtype from wrapping
            if ids.min() < 0 or ids.max() >= vocab:
                bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                fix = ("" if self.tokenizer.name != "NullTokenizer" else
                       "; token ids are integers >= 0" if bad < 0 else
                       f"; pass a --vocab-size larger than the text's largest id (this one "
                       f"allows ids up to {vocab - 1})")
                raise OutOfVocabulary(f"key {key!r}: token id {bad} outside the vocabulary "
                                      f"[0, {vocab}){fix}")
        return encoded

    def _encode_doc(self, doc: dict) -> list:
        out = []
        for key in self.opts.json_keys:
            pieces = self._encode_text(doc[key], key)
            sizes = [len(ids) for ids in pieces]
            if pieces and self.eod is not None:
                pieces.append(self.eod)
                sizes[-1] += 1
            out.append((pieces, sizes))
        return out

    def encode(self, chunk) -> dict:
        path, first_line, data = chunk
        per_key = [([], [], [], []) for _ in self.opts.json_keys]  # tokens, sizes, seqs, ntok
        docs, bad, not_json = 0, [], 0
        for line_no, line in enumerate(data.split(b"\n"), first_line):
            if not line.strip():
                continue
            try:
                encoded = self._encode_doc(self._parse(line))
            except BadLine as e:
                message = f"{path}:{line_no}: {e}"
                if not self.opts.skip_bad_lines:
                    return {"error": message, "skippable": not isinstance(e, OutOfVocabulary)}
                bad.append(message)
                not_json += isinstance(e, NotJSON)
                continue
            docs += 1
            for (tokens, sizes, seqs, ntok), (pieces, doc_sizes) in zip(per_key, encoded):
                tokens.extend(pieces)
                sizes.extend(doc_sizes)
                seqs.append(len(doc_sizes))
                ntok.append(sum(doc_sizes))
        keys = {}
        for key, (tokens, sizes, seqs, ntok) in zip(self.opts.json_keys, per_key):
            flat = (np.concatenate(tokens).astype(self.dtype, copy=False) if tokens
                    else np.zeros(0, dtype=self.dtype))
            keys[key] = (flat.tobytes(), np.asarray(sizes, dtype=np.int32),
                         np.asarray(seqs, dtype=np.int64), np.asarray(ntok, dtype=np.int64))
        return {"keys": keys, "docs": docs, "bytes": len(data), "bad": bad,
                "not_json": not_json}


_WORKER: Optional[ChunkEncoder] = None


def init_worker(opts: EncoderOptions) -> None:
    """Pool initializer: build this process's encoder once (a forked worker reuses the
    one its parent built with the same options)."""
    global _WORKER
    if _WORKER is None or _WORKER.opts != opts:
        _WORKER = ChunkEncoder(opts)


def encode_chunk(chunk) -> dict:
    """Pool task: encode one chunk with this process's encoder."""
    assert _WORKER is not None, "init_worker was not called"
    return _WORKER.encode(chunk)

