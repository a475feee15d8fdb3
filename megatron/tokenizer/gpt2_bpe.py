"""GPT-2 byte-level BPE from a local `vocab.json` + `merges.txt`, run by tiktoken.

The ids are those of GPT-2's own encoder for any input: the text is cut with GPT-2's
pre-tokenisation regex, each piece is mapped to bytes and merged greedily by merge rank.
tiktoken performs the same greedy merge when every token's rank is its merge position,
so the encoding is built with ranks taken from the merges file; when the vocabulary ids
do not follow the merge order, ranks are translated to ids with a lookup table.

tiktoken also emits a piece that is itself a vocabulary token directly; GPT-2's loop
gives the same id whenever every token's string merges back to itself, which holds for
GPT-2's files and for vocabularies made by BPE training (the tests check both).

`<|endoftext|>` is the end-of-document id. Inside text it is ordinary text (GPT-2's
encoder and Megatron's tokenizer split it into `<|`, `endoftext`, `|>`).
"""
from __future__ import annotations

import json
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TEXT = "<|endoftext|>"
SWAPPED_HINT = ("--vocab-file takes GPT-2's vocab.json and --merge-file its merges.txt; "
                "were the two swapped?")


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to
    the characters 256, 257, ... so that no vocabulary string contains whitespace or
    control characters.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_merges(merge_file: str) -> List[Tuple[str, str]]:
    """Merge pairs in rank order, read as Megatron 23.05 (and GPT-2's own encoder, Hugging
    Face's GPT2Tokenizer) read them, `split('\\n')[1:-1]`: the first line is taken for the
    `#version` header and the text after the last newline for nothing, so a file without
    the header loses its first merge and one without a final newline its last, giving
    Megatron's ids for the same files; each such loss is warned. Blank lines are skipped."""
    merges = []
    try:
        # utf-8-sig: a byte order mark (a Windows editor's) is not part of the header line
        with open(merge_file, encoding="utf-8-sig") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:  # a binary file: a SentencePiece model, a .gz, ...
        raise ValueError(f"--merge-file {merge_file}: not a text merges file ({e}); "
                         f"{SWAPPED_HINT}") from None
    for lineno, line in enumerate(lines, 1):
        parts = line.split()
        if not parts or (lineno == 1 and line.startswith("#version")):
            continue
        if len(parts) != 2:  # the unread lines too: a vocab.json given here is one line
            raise ValueError(f"--merge-file {merge_file}:{lineno}: expected two symbols per "
                             f"merge line, got {line[:60]!r}; {SWAPPED_HINT}")
        if 1 < lineno < len(lines):
            merges.append((parts[0], parts[1]))
    _warn_unread_merge_lines(merge_file, lines)
    return merges


def _warn_unread_merge_lines(merge_file: str, lines: List[str]) -> None:
    """Warn of the merges that Megatron's `[1:-1]` leaves unread: a first line that is no
    `#version` header, a last line without a newline after it."""
    unread = []
    if lines[0].strip() and not lines[0].startswith("#version"):
        unread.append(f"its first line {lines[0][:60]!r} (Megatron takes line 1 for the "
                      "'#version: 0.2' header, which this file lacks)")
    if len(lines) > 1 and lines[-1].strip():
        unread.append(f"its last line {lines[-1][:60]!r} (the file does not end with a "
                      "newline)")
    if unread:
        warnings.warn(f"--merge-file {merge_file}: {' and '.join(unread)} is not read as a "
                      "merge, as in Megatron-LM 23.05 and GPT-2's encoder, so the token ids "
                      "are the ones their data has; if the merge belongs to the tokenizer, "
                      "fix the file (add the header line or the final newline) and "
                      "re-tokenize the data")


def _reachable_merges(merges: List[Tuple[str, str]]) -> List[bool]:
    """Whether each merge can ever fire in GPT-2's loop: both its symbols are bytes or
    results of merges that can fire. A merges file missing a merge (see read_merges)
    leaves the merges built on its result unreachable; tiktoken, which joins any two
    adjacent pieces whose concatenation has a rank, would still emit their tokens."""
    symbols = set(bytes_to_unicode().values())
    fires = [False] * len(merges)
    grown = True
    while grown:  # merges are nearly always in dependency order: one or two passes
        grown = False
        for rank, (a, b) in enumerate(merges):
            if not fires[rank] and a in symbols and b in symbols:
                fires[rank] = grown = True
                symbols.add(a + b)
    return fires


def _load_vocab(vocab_file: str) -> Dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8-sig") as f:  # json.load refuses a BOM
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({e}); "
                         f"{SWAPPED_HINT}") from None
    if not isinstance(vocab, dict):
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object mapping token -> "
                         f"id, got {type(vocab).__name__}; {SWAPPED_HINT}")
    bad = next(((t, i) for t, i in vocab.items()
                if not isinstance(i, int) or isinstance(i, bool) or i < 0), None)
    if bad is not None:
        raise ValueError(f"--vocab-file {vocab_file}: token {bad[0]!r} has id {bad[1]!r}; "
                         "the ids must be integers >= 0")
    return vocab


def _vocab_size(vocab: Dict[str, int], vocab_file: str) -> int:
    """The largest id + 1. Megatron-LM takes len(vocab.json), the same for GPT-2's file and
    any vocabulary without gaps in its ids; with gaps that count would leave the largest
    ids (the data's, the end-of-document id) outside [0, vocab_size), so they are covered
    here, with a warning that Megatron-LM's padded vocabulary may differ."""
    size = max(vocab.values(), default=-1) + 1
    if size > len(vocab):
        warnings.warn(f"--vocab-file {vocab_file}: its ids have gaps (largest id {size - 1}, "
                      f"{len(vocab)} entries): the vocabulary size is taken as {size} so every "
                      f"id is a row of the model (Megatron-LM takes {len(vocab)}, leaving the "
                      "largest ids outside its vocabulary)")
    return size


def _mergeable_ranks(vocab: Dict[str, int], merges: List[Tuple[str, str]], vocab_file: str
                     ) -> Tuple[Dict[bytes, int], Dict[bytes, int]]:
    """(ranks for tiktoken, token bytes -> vocabulary id) for bytes and merge results."""
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    ranks: Dict[bytes, int] = {}
    ids: Dict[bytes, int] = {}
    for b, c in sorted(bytes_to_unicode().items()):
        if c not in vocab:
            raise ValueError(f"{vocab_file}: byte-level symbol {c!r} (byte {b}) is missing; "
                             "not a GPT-2 style byte-level BPE vocabulary")
        ranks[bytes([b])] = b
        ids[bytes([b])] = vocab[c]
    fires = _reachable_merges(merges)
    for rank, (a, b) in enumerate(merges):
        merged = a + b
        if merged not in vocab:
            raise ValueError(f"{vocab_file}: merge result {merged!r} of merge {rank} is not in the "
                             "vocabulary; vocab and merges files do not belong together")
        try:
            token = bytes(byte_decoder[ch] for ch in merged)
        except KeyError as e:
            raise ValueError(f"merge {merged!r} holds a character outside the byte map") from e
        if fires[rank] and token not in ranks:  # a repeated merge never fires again either
            ranks[token] = 256 + rank
            ids[token] = vocab[merged]
    return ranks, ids


def _id_to_bytes(vocab: Dict[str, int], ids: Dict[bytes, int]) -> Dict[int, bytes]:
    """Every vocabulary id -> its bytes: the bytes and merge results as merged, and the
    other entries (`<|endoftext|>`, tokens added to vocab.json such as `<|pad|>`, which the
    encoder never emits but a model can) spelled through the byte map as GPT-2's decoder
    does, their plain UTF-8 where a character is outside it."""
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    out = {i: t for t, i in ids.items()}
    for token, i in vocab.items():
        if i not in out:
            out[i] = (bytes(byte_decoder[ch] for ch in token)
                      if all(ch in byte_decoder for ch in token) else token.encode("utf-8"))
    return out


class GPT2BPETokenizer:
    """GPT-2 BPE tokenizer (Megatron's `GPT2BPETokenizer`); `vocab_size` is the largest id
    of vocab.json + 1: its number of entries, as in Megatron, unless the ids have gaps."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        import tiktoken

        vocab = _load_vocab(vocab_file)
        if EOD_TEXT not in vocab:
            raise ValueError(f"{vocab_file}: {EOD_TEXT} is missing; GPT2BPETokenizer needs it as "
                             "the end-of-document token")
        ranks, ids = _mergeable_ranks(vocab, read_merges(merge_file), vocab_file)
        self._vocab_size = _vocab_size(vocab, vocab_file)
        self._eod = vocab[EOD_TEXT]
        rank_of = np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks))
        id_of = np.fromiter((ids[t] for t in ranks), dtype=np.int64, count=len(ranks))
        if np.array_equal(rank_of, id_of):  # GPT-2's own files: ids are merge ranks
            self._rank_to_id: Optional[np.ndarray] = None
            special_rank = self._eod
            if special_rank in ranks.values():
                raise ValueError(f"{vocab_file}: id {self._eod} of {EOD_TEXT} is also used by "
                                 "another token")
        else:  # tiktoken emits ranks: translate them to vocabulary ids with a table
            table = np.zeros(int(rank_of.max()) + 1, dtype=np.int64)
            table[rank_of] = id_of
            self._rank_to_id = table
            special_rank = int(rank_of.max()) + 1
        self._encoding = tiktoken.Encoding(
            name=f"gpt2-local-{self._vocab_size}", pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks, special_tokens={EOD_TEXT: special_rank})
        self._id_to_bytes = _id_to_bytes(vocab, ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as a numpy array (uint32 or int64); fastest path."""
        if hasattr(self._encoding, "encode_to_numpy"):
            arr = self._encoding.encode_to_numpy(text, allowed_special=set(),
                                                 disallowed_special=())
        else:  # tiktoken < 0.9 has no encode_to_numpy (requirements.txt allows 0.7)
            text.encode("utf-8")  # a lone surrogate raises, as encode_to_numpy does
            arr = np.asarray(self._encoding.encode_ordinary(text), dtype=np.uint32)
        if self._rank_to_id is not None:
            arr = self._rank_to_id[arr]
        return arr

    def tokenize(self, text: str) -> List[int]:
        if self._rank_to_id is None:
            return self._encoding.encode_ordinary(text)
        return self.tokenize_array(text).tolist()

    def detokenize(self, ids) -> str:
        try:
            data = b"".join(self._id_to_bytes[int(i)] for i in ids)
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is not in the GPT2BPETokenizer's vocabulary "
                             f"({self._vocab_size} ids)") from None
        return data.decode("utf-8", errors="replace")
