"""Tokenizers chosen by `--tokenizer-type`: GPT2BPETokenizer, SentencePieceTokenizer,
GPTSentencePieceTokenizer, HuggingFaceTokenizer, NullTokenizer.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    ids = tok.tokenize("hello"); text = tok.detokenize(ids); tok.eod; tok.vocab_size

`pad_vocab_size(vocab_size, make_vocab_size_divisible_by, tp_size)` gives the padded size
of the embedding table (Megatron pads to a multiple of divisible_by x TP).
"""
from megatron.tokenizer.tokenizer import (
                                          TOKENIZER_TYPES,
                                          NullTokenizer,
                                          build_tokenizer,
                                          eod_or_none,
                                          pad_vocab_size,
)

__all__ = ["TOKENIZER_TYPES", "NullTokenizer", "build_tokenizer", "eod_or_none", "pad_vocab_size"]
