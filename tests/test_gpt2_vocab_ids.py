"""GPT2BPETokenizer's vocabulary size for a vocab.json whose ids have gaps.

GPT-2's own vocab.json numbers its entries 0..N-1, so len(vocab) (Megatron-LM's size) is
the largest id + 1. A file whose ids skip values (tokens removed, specials put at a round
id) would give ids at or past len(vocab): an end-of-document id the tools took for none,
data written in a dtype too narrow for its ids, rows the model does not have.
"""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer, eod_or_none
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files
from tools import preprocess_data

FAR = 70_000  # past uint16, which len(vocab) (~300 entries) would pick for the .bin


def _gapped(tmp_path):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 40)
    the = next(t for t in vocab if t == "Ġthe")  # a merge result the text below uses
    vocab = {**vocab, the: FAR, "<|endoftext|>": FAR + 1}
    return vocab, write_bpe_files(tmp_path, vocab, merges)


def test_vocab_size_covers_the_largest_id_and_the_gap_is_warned(tmp_path):
    vocab, files = _gapped(tmp_path)
    with pytest.warns(UserWarning, match=rf"--vocab-file {files[0]}: its ids have gaps "
                                         rf"\(largest id {FAR + 1}, {len(vocab)} entries\)"):
        tok = build_tokenizer("GPT2BPETokenizer", *files)
    assert tok.vocab_size == FAR + 2 and eod_or_none(tok) == FAR + 1
    ids = tok.tokenize(" the fox")
    assert FAR in ids and max(ids) < tok.vocab_size
    assert tok.detokenize(ids + [tok.eod]) == " the fox<|endoftext|>"
    plain = tmp_path / "plain"
    plain.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no gaps: no warning, Megatron's len(vocab)
        vocab, merges = train_tiny_bpe(TRAIN_TEXT, 40)
        assert build_tokenizer("GPT2BPETokenizer",
                               *write_bpe_files(plain, vocab, merges)).vocab_size == len(vocab)


def test_preprocess_writes_every_id_of_a_gapped_vocabulary(tmp_path):
    """Before: --append-eod was refused ('no end-of-document token (its id is 70001)'), and
    without it the text was ('token id 70000 outside the vocabulary [0, 297)'). Now the
    .bin is int32 (uint16 cannot hold 70000) and holds the ids."""
    _, (vocab_file, merge_file) = _gapped(tmp_path)
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "the quick fox and the dog"}) + "\n", encoding="utf-8")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file,
            "--workers", "1", "--append-eod"]
    with pytest.warns(UserWarning, match="its ids have gaps"):
        preprocess_data.run(preprocess_data.get_args(argv))
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)
    data = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert data.dtype == np.int32
    assert data[0].tolist() == tok.tokenize("the quick fox and the dog") + [FAR + 1]


@pytest.mark.parametrize("bad", [-1, "7", 2.5, True])
def test_an_id_that_is_no_integer_is_named(tmp_path, bad):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 10)
    vocab_file, merge_file = write_bpe_files(tmp_path, {**vocab, "<|pad|>": bad}, merges)
    with pytest.raises(ValueError, match=rf"--vocab-file {vocab_file}: token '<\|pad\|>' has id "
                                         rf"{bad!r}; the ids must be integers >= 0"):
        build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)


def test_pretrain_pads_the_vocabulary_past_the_largest_id(tmp_path):
    """The padded vocabulary (from the --vocab-file, before any tokenizer is built) is the
    tokenizer's: the model has a row for id 70001. Before it padded len(vocab.json) = 297
    to 384 rows, and the data's ids past them ended the run."""
    import pretrain_gpt
    from megatron.arguments import parse_and_validate

    _, (vocab_file, merge_file) = _gapped(tmp_path)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": "the quick fox and the dog " * 8}) + "\n"
                           for _ in range(20)), encoding="utf-8")
    with pytest.warns(UserWarning, match="its ids have gaps"):
        preprocess_data.run(preprocess_data.get_args([
            "--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file,
            "--workers", "1", "--append-eod"]))
    argv = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--eval-iters",
            "0", "--split", "100,0,0", "--vocab-file", vocab_file, "--merge-file", merge_file,
            "--data-path", str(tmp_path / "out_text_document")]
    cfg = parse_and_validate(argv, world_size=1, env={"RANK": "0"}, cuda_available=False)
    assert cfg.model.padded_vocab_size == 70016  # 70002 padded to a multiple of 128
    with pytest.warns(UserWarning, match="its ids have gaps"):
        assert pretrain_gpt.main(argv) == 0


def test_the_padded_size_reads_a_vocab_file_with_a_byte_order_mark(tmp_path):
    """The tokenizer reads a vocab.json saved with a UTF-8 byte order mark (a Windows
    editor's); the argument check, which sizes the vocabulary first, refused it as 'not a
    JSON vocabulary'."""
    import argparse

    from megatron.arguments_inputs import default_vocab_size

    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 10)
    vocab_file, _ = write_bpe_files(tmp_path, vocab, merges)
    with open(vocab_file, "rb") as f:
        data = f.read()
    with open(vocab_file, "wb") as f:
        f.write(b"\xef\xbb\xbf" + data)
    ns = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file)
    assert default_vocab_size(ns) == len(vocab)
