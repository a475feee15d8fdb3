"""The samples of the zero-shot evaluations: token windows and loss masks.

A sample is (tokens, loss_mask): `tokens` has seq_length + 1 ids (inputs are the first
seq_length, labels the last seq_length), padded with the pad id (the tokenizer's
end-of-document); `loss_mask` has seq_length entries in label space, 1 where that label
is scored.

WIKITEXT103, sliding windows: with stride o (--overlapping-eval) window i starts at token
i * o. Window 0 scores all its labels; a later window scores only its last o labels (the
ones before were scored by an earlier window), so every target token (every token but the
first) is scored exactly once. Padding labels are never scored.

LAMBADA: context + target ids, the target's label positions scored.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from tasks.zeroshot_gpt.detokenizer import get_detokenizer, wikitext_detokenizer

Sample = Tuple[List[int], List[int]]  # (tokens [seq + 1], loss mask [seq])


def num_windows(num_tokens: int, seq_length: int, stride: int) -> int:
    """Windows over `num_tokens` tokens: max(ceil((targets - stride) / stride) + 1, 1)
    with targets = num_tokens - 1 (Megatron-LM's count: the first window scores seq_length
    targets, each later one `stride`; a trailing window may score none)."""
    targets = max(num_tokens - 1 - stride, 0)
    return max(math.ceil(targets / stride) + 1, 1)


def window(tokens: Sequence[int], index: int, seq_length: int, stride: int,
           pad_id: int) -> Sample:
    """Window `index`: tokens[index * stride : index * stride + seq_length + 1], padded to
    seq_length + 1 with `pad_id`; the mask scores its real labels, and for index > 0 with
    an overlap (stride < seq_length) only the last `stride` of them."""
    start = index * stride
    ids = list(tokens[start:start + seq_length + 1])
    real = len(ids)
    ids += [pad_id] * (seq_length + 1 - real)
    mask = [1] * max(real - 1, 0) + [0] * (seq_length + 1 - max(real, 1))
    if index > 0 and stride != seq_length:
        mask[:seq_length - stride] = [0] * (seq_length - stride)
    return ids, mask


class Windows(SequenceABC):
    """The windows of `tokens` (see the module doc), each made when it is read: a
    WikiText-103-sized text has thousands of windows of seq_length + 1 ids each."""

    def __init__(self, tokens: Sequence[int], seq_length: int, stride: int, pad_id: int):
        self.tokens, self.seq_length, self.stride, self.pad_id = tokens, seq_length, stride, pad_id
        self.count = num_windows(len(tokens), seq_length, stride)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        return window(self.tokens, index, self.seq_length, self.stride, self.pad_id)


def windows(tokens: Sequence[int], seq_length: int, stride: int, pad_id: int) -> List[Sample]:
    """Every window of `tokens`, as a list."""
    return list(Windows(tokens, seq_length, stride, pad_id))


@dataclass
class LanguageModelingData:
    """WIKITEXT103's samples and the counts its report needs."""

    samples: Sequence[Sample]  # a Windows
    num_original_tokens: int  # whitespace-separated words of the file, as Megatron counts
    num_tokenized_tokens: int


def read_text_file(path: str, what: str) -> str:
    """The whole file as UTF-8 text; SystemExit naming the file when it is missing, a
    directory, not UTF-8 (the line and byte) or holds nothing but whitespace."""
    if os.path.isdir(path):
        raise SystemExit(f"error: --valid-data {path} is a directory; pass the {what} file "
                         "to evaluate on")
    if not os.path.isfile(path):
        raise SystemExit(f"error: --valid-data {path}: file not found (the {what} file to "
                         "evaluate on)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SystemExit(f"error: --valid-data {path} line {line}: not UTF-8 text (byte "
                         f"0x{data[e.start]:02x} at offset {e.start}); the {what} file must be "
                         "UTF-8 (convert it, e.g. with iconv)") from None
    if not text.strip():
        raise SystemExit(f"error: --valid-data {path} is empty: the {what} file has no text")
    return text


def wikitext_warnings(path: str, text: str) -> List[str]:
    """Warnings for a WIKITEXT103 file that is probably not what was meant: WikiText's
    tokenized text (" @-@ " etc.) under a path that does not select the WikiText
    detokenizer (the detokenizer is picked by path, so it is not detokenized as
    WikiText), or JSON lines (LAMBADA's format)."""
    warnings = []
    wikitext = get_detokenizer(path) is wikitext_detokenizer
    if not wikitext and any(t in text for t in (" @-@ ", " @,@ ", " @.@ ")):
        warnings.append(f"WARNING: --valid-data {path} holds WikiText's tokenized text (\" @-@ "
                        "\") but its path does not select the WikiText detokenizer (a path "
                        "containing \"wiki\" and no \"ptb\" does): it is not detokenized as "
                        "WikiText. Name the file as WikiText-103 does (wiki.test.tokens) for "
                        "Megatron-LM's numbers")
    first = text.lstrip().split("\n", 1)[0]
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        record = None
    if isinstance(record, dict) and "text" in record:
        warnings.append(f"WARNING: --valid-data {path} looks like JSON lines ({{\"text\": ...}} "
                        "per line, LAMBADA's format); --task WIKITEXT103 scores the whole file "
                        "as raw text, braces and quotes included (--task LAMBADA reads JSON "
                        "lines)")
    return warnings


def build_wikitext_data(path: str, tokenizer, seq_length: int, stride: int,
                        warn=print) -> LanguageModelingData:
    """Read, detokenize (by path: detokenizer.get_detokenizer), tokenize, cut into windows.
    `warn` gets `wikitext_warnings`'s lines. SystemExit when the text has fewer than 2
    words or tokens (no target to score) or an id outside NullTokenizer's vocabulary."""
    text = read_text_file(path, "WIKITEXT103 text")
    for line in wikitext_warnings(path, text):
        warn(line)
    num_original = len(text.strip().split(" "))
    tokens = _tokenize(tokenizer.tokenize, get_detokenizer(path)(text), f"--valid-data {path}")
    _check_ids(tokens, tokenizer, f"--valid-data {path}")
    if len(tokens) < 2 or num_original < 2:
        raise SystemExit(f"error: --valid-data {path}: {num_original} word(s), {len(tokens)} "
                         "token(s); the perplexity needs at least 2 of each")
    return LanguageModelingData(Windows(tokens, seq_length, stride, tokenizer.eod),
                                num_original, len(tokens))


def lambada_split(text: str, tokenizer, strict: bool) -> Tuple[List[int], List[int]]:
    """(context ids, target ids) of one LAMBADA passage. Not strict: the last token is the
    target. Strict (--strict-lambada): the last whitespace-separated word is the target,
    tokenised with its leading space, the text before it (stripped) the context."""
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens[:-1], tokens[-1:]
    word = text.split()[-1]
    context = tokenizer.tokenize(text[:text.rfind(word)].strip())
    return context, tokenizer.tokenize(" " + word)


def _tokenize(tokenize, text: str, where: str):
    """`tokenize(text)`, a tokenizer's ValueError (NullTokenizer given words, not ids) as
    one line naming `where`."""
    try:
        return tokenize(text)
    except ValueError as e:
        raise SystemExit(f"error: {where}: the tokenizer cannot read it ({e}); evaluate with "
                         "the checkpoint's tokenizer flags (--tokenizer-type, --vocab-file, "
                         "--merge-file / --tokenizer-model)") from None


def _check_ids(ids: Sequence[int], tokenizer, where: str) -> None:
    """SystemExit naming `where` for an id outside NullTokenizer's vocabulary (it reads
    any integer; the other tokenizers only make ids of theirs): the model has no row for
    it (an IndexError) or only a padding row, which the softmax leaves out (an infinite
    loss)."""
    if getattr(tokenizer, "name", None) != "NullTokenizer" or not ids:
        return
    vocab, low, high = tokenizer.vocab_size, min(ids), max(ids)
    if low >= 0 and high < vocab:
        return
    text = f"error: {where}: token id {{}} is outside NullTokenizer's vocabulary [0, {vocab}): "
    if low < 0:
        raise SystemExit(text.format(low) + "token ids are integers >= 0")
    raise SystemExit(text.format(high) + f"evaluate with the --vocab-size the model was "
                     f"trained with (--vocab-size {vocab - 1} allows ids up to {vocab - 1}, "
                     "the end-of-document id)")


def lambada_sample(context: Sequence[int], target: Sequence[int], seq_length: int,
                   pad_id: int) -> Optional[Sample]:
    """context + target padded to seq_length + 1, the target's labels scored; None when
    longer than seq_length + 1."""
    ids = list(context) + list(target)
    if len(ids) > seq_length + 1:
        return None
    mask = [0] * (len(context) - 1) + [1] * len(target)
    pad = seq_length + 1 - len(ids)
    return ids + [pad_id] * pad, mask + [0] * pad


def _lambada_text(line: str, path: str, number: int) -> str:
    where = f"--valid-data {path} line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {where}: not JSON ({e}); LAMBADA's file has one JSON "
                         'object per line, e.g. {"text": "..."}') from None
    if not isinstance(record, dict) or "text" not in record:
        raise SystemExit(f'error: {where}: no "text" field; LAMBADA\'s file has one JSON '
                         'object per line, e.g. {"text": "..."}')
    text = record["text"]
    if not isinstance(text, str) or not text.split():
        raise SystemExit(f'error: {where}: "text" is empty')
    return text


def build_lambada_data(path: str, tokenizer, seq_length: int, strict: bool,
                       max_positions: Optional[int] = None) -> List[Sample]:
    """One sample per non-blank line of the JSON-lines file. SystemExit naming the line for
    a line that is not a JSON object with a non-empty "text", a passage with no context
    token or an id outside NullTokenizer's vocabulary; and, after reading every line, naming the passages longer than --seq-length + 1
    tokens (refused, not truncated: a cut context would change what is measured) with
    the fix `max_positions` (the model's --max-position-embeddings) allows."""
    text = read_text_file(path, "LAMBADA JSON-lines")
    samples, too_long = [], []
    # lines as Megatron-LM's readlines() (universal newlines) cuts them: str.splitlines
    # would also cut at U+2028, U+2029 and U+0085, which a JSON string may hold unescaped
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        text_ = _lambada_text(line, path, number)
        context, target = _tokenize(lambda t: lambada_split(t, tokenizer, strict), text_,
                                    f"--valid-data {path} line {number}")
        if not context or not target:
            raise SystemExit(f"error: --valid-data {path} line {number}: the passage has no "
                             "context before its last word")
        _check_ids(context + target, tokenizer, f"--valid-data {path} line {number}")
        sample = lambada_sample(context, target, seq_length, tokenizer.eod)
        if sample is None:
            too_long.append((number, len(context) + len(target)))
        else:
            samples.append(sample)
    if too_long:
        raise SystemExit(_too_long_message(path, too_long, len(samples), seq_length,
                                           max_positions))
    return samples


def _too_long_message(path: str, too_long: List[Tuple[int, int]], num_fitting: int,
                      seq_length: int, max_positions: Optional[int]) -> str:
    """The error for LAMBADA passages (line, tokens) longer than seq_length + 1 tokens."""
    longest = max(n for _, n in too_long)
    lines = ", ".join(f"line {number} ({n} tokens)" for number, n in too_long[:5])
    more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
    text = (f"error: --valid-data {path}: {len(too_long)} of {len(too_long) + num_fitting} "
            f"passage(s) are longer than the {seq_length + 1} tokens (context and target) "
            f"that --seq-length {seq_length} holds: {lines}{more}; ")
    if max_positions is not None and longest - 1 > max_positions:
        return text + (f"the longest needs --seq-length {longest - 1}, beyond the model's "
                       f"--max-position-embeddings {max_positions}: remove or shorten the "
                       f"passages longer than {max_positions + 1} tokens"
                       + (f", and evaluate at --seq-length {max_positions}"
                          if seq_length < max_positions else ""))
    return text + (f"evaluate with --seq-length {longest - 1}"
                   + (f" (the model's --max-position-embeddings is {max_positions})"
                      if max_positions is not None else "") + " or shorten these passages")
