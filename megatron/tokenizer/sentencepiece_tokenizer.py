"""SentencePiece tokenizers with Megatron 23.05's behaviour.

`SentencePieceTokenizer` appends special tokens that the model lacks, in this order:
`<CLS>`, `<SEP>`, `<EOD>`, `<MASK>`, the pad piece (or `<PAD>` when the model has no pad
id), the bos piece (or `<BOS>`), the eos piece (or `<EOS>`), then `<extra_id_0..n-1>`.
New ones get ids from `len(vocab)` on. Any special string inside text becomes its single
id (leftmost occurrence first; at equal positions the earlier special in that order wins).
EOD is `<EOD>`. `GPTSentencePieceTokenizer` is the plain model: nothing added, EOD is the
model's eos id.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Dict, List


def _load_model(model_file: str):
    """The SentencePiece model in `model_file`; ValueError naming the file when it is not
    one (the `.vocab` listing written beside the `.model`, a Hugging Face file, ...)."""
    import sentencepiece

    if os.path.isdir(model_file):
        found = sorted(n for n in os.listdir(model_file) if n.endswith(".model"))
        if len(found) == 1:
            inside = f"pass the model file in it: {os.path.join(model_file, found[0])}"
        elif found:
            inside = f"pass one of the model files in it: {', '.join(found)}"
        elif os.path.isfile(os.path.join(model_file, "tokenizer.json")):
            inside = ("it holds a Hugging Face tokenizer.json: pass --tokenizer-type "
                      "HuggingFaceTokenizer")
        else:
            inside = ("it holds no .model file: pass the <prefix>.model file SentencePiece "
                      "training wrote")
        raise ValueError(f"--tokenizer-model {model_file} is a directory; {inside}")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as e:
        hint = (f"; {model_file} looks like the listing SentencePiece writes beside the model: "
                f"pass {model_file[:-len('.vocab')]}.model" if model_file.endswith(".vocab")
                else "; pass the <prefix>.model file SentencePiece training wrote")
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model "
                         f"({str(e).strip()}){hint}") from None


def _piece_or(sp, piece_id: int, fallback: str) -> str:
    if 0 <= piece_id < sp.get_piece_size():
        return sp.id_to_piece(piece_id)
    return fallback


def _pieces(sp) -> Dict[int, str]:
    return {i: sp.id_to_piece(i) for i in range(sp.get_piece_size())}


class SentencePieceTokenizer:
    """Megatron's `SentencePieceTokenizer` (special tokens added, EOD = `<EOD>`)."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        self._sp = _load_model(model_file)
        self._vocab: Dict[str, int] = {}
        for i in range(self._sp.get_piece_size()):
            self._vocab.setdefault(self._sp.id_to_piece(i), i)
        self._specials: Dict[str, int] = {}
        names = ["<CLS>", "<SEP>", "<EOD>", "<MASK>",
                 _piece_or(self._sp, self._sp.pad_id(), "<PAD>"),
                 _piece_or(self._sp, self._sp.bos_id(), "<BOS>"),
                 _piece_or(self._sp, self._sp.eos_id(), "<EOS>")]
        names += [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in names:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self._specials[token] = self._vocab[token]
        self._inv_specials = {i: t for t, i in self._specials.items()}
        # Alternation in insertion order reproduces "leftmost, then first in order".
        self._special_re = re.compile("|".join(re.escape(t) for t in self._specials if t))
        self._eod = self._specials["<EOD>"]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @functools.cached_property
    def decoder(self) -> Dict[int, str]:
        """Megatron's `decoder`: id -> piece as the model spells it ('\u2581the', '<EOD>')."""
        return {**_pieces(self._sp), **self._inv_specials}

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(self._sp.encode_as_ids(text[pos:m.start()]))
            ids.append(self._specials[m.group()])
            pos = m.end()
        ids.extend(self._sp.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        text = ""
        last = 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_specials:
                text += self._sp.decode_ids(ids[last:i]) + " "
                text += self._inv_specials[token_id] + " "
                last = i + 1
        return text + self._sp.decode_ids(ids[last:])


class GPTSentencePieceTokenizer:
    """Megatron's `GPTSentencePieceTokenizer`: plain model ids, EOD = the model's eos id."""

    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str):
        self._sp = _load_model(model_file)
        self._eod = self._sp.eos_id()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    @functools.cached_property
    def decoder(self) -> Dict[int, str]:
        """Megatron's `decoder`: id -> piece as the model spells it ('\u2581the')."""
        return _pieces(self._sp)

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode_ids([int(i) for i in ids])
