"""A local Hugging Face `tokenizer.json` (or a directory holding one) via `tokenizers`.

EOD is the tokenizer config's `eos_token` when a `tokenizer_config.json` sits beside the
file, else the first of `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>`, `<|eos|>` found
in the vocabulary. Text is encoded without adding special tokens, and a special token
written in the text (a literal `<|endoftext|>` in a web page) is ordinary text, as GPT-2's
encoder and GPT2BPETokenizer read it: a document never forges an end-of-document or other
control id; only --append-eod puts the EOD id in the data. Added tokens not marked
special (`"special": false`) are vocabulary and still encode to their ids.

`vocab_size` is the largest id + 1, not the number of tokens (`len(tokenizer)` in
Hugging Face, Megatron's later wrapper): a tokenizer.json whose ids have gaps, or whose
added tokens sit past the base vocabulary, still gets an embedding row and a dataset
dtype for every id it emits.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def _config_eos(directory: str) -> Optional[str]:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:  # not JSON, not UTF-8
        config = e
    if not isinstance(config, dict):
        what = f"does not parse as JSON ({config})" if isinstance(config, ValueError) else \
            f"holds a {type(config).__name__}, not a JSON object"
        raise ValueError(f"{path} {what}; it is read for its eos_token (the end-of-document "
                         "token): replace it with the model's own, or remove it")
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _plain_text_encoder(tok):
    """A copy of `tok` without its special added tokens, to encode text in which they are
    ordinary text: the pieces, and ids, of a tokenizer that never had them. (The
    `encode_special_tokens` switch splits the text around them first, so the ids at
    their edges differ from GPT-2's.)"""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    added = spec.get("added_tokens") or []
    kept = [t for t in added if not t.get("special")]
    if len(kept) == len(added):
        return tok
    spec["added_tokens"] = kept
    return Tokenizer.from_str(json.dumps(spec))


class HuggingFaceTokenizer:
    """`tokenizers.Tokenizer` from a local file; `vocab_size` is the largest id + 1
    (added tokens included)."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            sp_model = os.path.join(path, "tokenizer.model")
            hint = (f"; {path} holds a SentencePiece tokenizer.model: pass --tokenizer-type "
                    f"GPTSentencePieceTokenizer --tokenizer-model {sp_model}"
                    if os.path.isdir(path) and os.path.isfile(sp_model) else "")
            raise ValueError(f"HuggingFaceTokenizer: {file} not found; pass a tokenizer.json "
                             f"file or a directory holding one{hint}")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ValueError(f"--tokenizer-model {file}: not a Hugging Face tokenizer.json "
                             f"({e}); pass the tokenizer.json file (or its directory)") from None
        candidates = [_config_eos(os.path.dirname(os.path.abspath(file)))] + list(EOD_CANDIDATES)
        self._eod = None
        for token in candidates:
            if token is not None and self._tok.token_to_id(token) is not None:
                self._eod = self._tok.token_to_id(token)
                break
        self._file = file
        self._encoder = _plain_text_encoder(self._tok)
        # ids may have gaps: a count of tokens would leave the largest ids outside
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(),
                               default=-1) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ValueError(f"{self._file}: no end-of-document token found (looked for "
                             f"{', '.join(EOD_CANDIDATES)} and tokenizer_config.json eos_token)")
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._encoder.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
