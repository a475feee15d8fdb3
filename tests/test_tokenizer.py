"""Tokenizers: the fast GPT-2 BPE equals a plain reference implementation of GPT-2's
algorithm (bytes_to_unicode, pre-tokenisation regex, greedy lowest-rank merges) on tricky
text; SentencePiece special-token handling matches Megatron's loop; Null and HF basics."""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import warnings
from pathlib import Path

import pytest
import regex

from megatron.tokenizer import build_tokenizer, pad_vocab_size
from megatron.tokenizer.gpt2_bpe import GPT2_PATTERN, bytes_to_unicode

GPT2_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2"
HAVE_GPT2 = (GPT2_DIR / "gpt2-vocab.json").is_file() and (GPT2_DIR / "gpt2-merges.txt").is_file()

TRICKY = [
    "Hello world! It's a test, isn't it? We'll see; they'd've done 'S 'LL.",
    "a  b   c\t\td\n\n\n  e \r\n f   ",
    "    leading and trailing    ",
    "<|endoftext|>",
    "text<|endoftext|>more <|endoftext|> <|endoftext|>",
    "e\u0301 n\u0303 a\u0308\u0304 \u0915\u094d\u0937",  # combining marks, Devanagari
    "日本語のテキストと中文文本，还有한국어",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️",
    "numbers 1234567890 ١٢٣ ⅷ ½ 3.14e-10",
    "\x00\x01\x1c\x1d\x1e\x1f\x7f \x85 \xa0 \u2028 \u2029 \u200b \u3000 \ufeff end",
    "mixed\u00a0nbsp and\u2003em space",
    "def f(x):\n    return x**2  # comment\n\n\nclass A:\n\tpass\n",
    "ÀÉÎÕÜ ñ ß ø å æ œ Ω ω Ж ж",
    "",
    " ",
    "\n",
    "'''\"\"\"```",
]


class ReferenceBPE:
    """GPT-2's encoder algorithm written plainly (no caching tricks besides a dict)."""

    def __init__(self, vocab: dict, merges: list):
        self.encoder = vocab
        self.ranks = {tuple(m): i for i, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.pattern = regex.compile(GPT2_PATTERN)

    def bpe(self, word: str) -> list:
        parts = list(word)
        while len(parts) > 1:
            pairs = {(parts[i], parts[i + 1]) for i in range(len(parts) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list:
        ids = []
        for piece in self.pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(mapped))
        return ids


def train_tiny_bpe(text: str, num_merges: int, shuffle_ids: bool = False):
    """Byte-level BPE training: repeatedly merge the most frequent adjacent pair."""
    byte_encoder = bytes_to_unicode()
    pattern = regex.compile(GPT2_PATTERN)
    words = collections.Counter(
        tuple(byte_encoder[b] for b in piece.encode("utf-8")) for piece in pattern.findall(text))
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        new_words = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    tokens = [byte_encoder[b] for b in range(256)] + [a + b for a, b in merges]
    tokens = list(dict.fromkeys(tokens)) + ["<|endoftext|>"]
    ids = list(range(len(tokens)))
    if shuffle_ids:
        random.Random(0).shuffle(ids)
    return dict(zip(tokens, ids)), merges


def write_bpe_files(directory: Path, vocab: dict, merges: list):
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                          encoding="utf-8")
    return str(vocab_file), str(merge_file)


def random_texts(seed: int, count: int) -> list:
    rng = random.Random(seed)
    pools = [(0x20, 0x7E), (0x0, 0x2FF), (0x300, 0x36F), (0x4E00, 0x4FFF), (0x1F300, 0x1FAFF),
             (0x2000, 0x206F), (0x0, 0xFFFF)]
    out = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(1, 30)):
            lo, hi = rng.choice(pools)
            c = rng.randint(lo, hi)
            if 0xD800 <= c <= 0xDFFF:
                c = 0x20
            chars.append(chr(c))
        out.append("".join(chars))
    return out


TRAIN_TEXT = (" ".join(TRICKY) + " the quick brown fox jumps over the lazy dog. " * 20
              + "def tokenize(text): return [int(x) for x in text.split()]\n" * 10
              + "日本語のテキスト 😀😀 naïve café résumé coöperate " * 10)


@pytest.mark.parametrize("shuffle_ids", [False, True])
def test_tiny_bpe_matches_reference(tmp_path, shuffle_ids):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 300, shuffle_ids)
    vocab_file, merge_file = write_bpe_files(tmp_path, vocab, merges)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    ref = ReferenceBPE(vocab, merges)
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    for text in TRICKY + random_texts(1, 300) + [TRAIN_TEXT]:
        ids = tok.tokenize(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.tokenize_array(text).tolist() == ids
        assert tok.detokenize(ids) == text
    assert all(ref.bpe(t) == [t] for t in vocab if t != "<|endoftext|>")


def test_bpe_detokenizes_every_vocabulary_id(tmp_path):
    """vocab.json entries that are neither a byte nor a merge result (tokens added for
    chat or padding, e.g. `<|pad|>`) are never produced by the encoder, but a model can
    sample them (generation draws from the whole vocabulary): they decode to their text,
    as GPT-2's decoder does, instead of a KeyError. An id outside the vocabulary is a
    ValueError naming it."""
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 300, False)
    vocab = {**vocab, "<|pad|>": len(vocab), "Ġ<|im_start|>": len(vocab) + 1,
             "<▁sep>": len(vocab) + 2}  # the last: a character outside the byte map
    tok = build_tokenizer("GPT2BPETokenizer", *write_bpe_files(tmp_path, vocab, merges))
    assert tok.vocab_size == len(vocab)
    text = "the quick fox"
    ids = tok.tokenize(text) + [vocab["<|pad|>"], vocab["Ġ<|im_start|>"],
                                vocab["<▁sep>"], tok.eod]
    assert tok.detokenize(ids) == text + "<|pad|> <|im_start|><▁sep><|endoftext|>"
    assert all(isinstance(tok.detokenize([i]), str) for i in range(tok.vocab_size))
    with pytest.raises(ValueError, match=rf"token id {len(vocab)} is not in the "
                                         rf"GPT2BPETokenizer's vocabulary \({len(vocab)} ids\)"):
        tok.detokenize([5, len(vocab)])


@pytest.mark.skipif(not HAVE_GPT2, reason="../shared/data/gpt2 not present")
def test_gpt2_matches_reference():
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(GPT2_DIR / "gpt2-vocab.json"),
                          merge_file=str(GPT2_DIR / "gpt2-merges.txt"))
    with open(GPT2_DIR / "gpt2-vocab.json", encoding="utf-8") as f:
        vocab = json.load(f)
    from megatron.tokenizer.gpt2_bpe import read_merges

    ref = ReferenceBPE(vocab, read_merges(str(GPT2_DIR / "gpt2-merges.txt")))
    assert tok.vocab_size == 50257 and tok.eod == 50256 and tok.name == "GPT2BPETokenizer"
    # tiktoken emits a whole piece that is itself a token without merging; GPT-2's loop
    # agrees because every GPT-2 token string merges back to itself:
    assert all(ref.bpe(t) == [t] for t in vocab if t != "<|endoftext|>")
    assert tok.tokenize("Hello world") == [15496, 995]
    # <|endoftext|> inside text is ordinary text for GPT-2's encoder (and Megatron's).
    assert tok.tokenize("<|endoftext|>") == ref.encode("<|endoftext|>") != [50256]
    for text in TRICKY + random_texts(2, 500):
        ids = tok.tokenize(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.detokenize(ids) == text


def test_gpt2_bad_files(tmp_path):
    vocab, merges = train_tiny_bpe("abc abc abd", 3)
    del vocab["<|endoftext|>"]
    vocab_file, merge_file = write_bpe_files(tmp_path, vocab, merges)
    with pytest.raises(ValueError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)
    with pytest.raises(ValueError, match="no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file="/nonexistent")
    with pytest.raises(ValueError, match="not supported: it has no end-of-document token"):
        build_tokenizer("BertWordPieceCase", vocab_file=vocab_file)
    good = tmp_path / "good"
    good.mkdir()
    vocab_file, _ = write_bpe_files(good, *train_tiny_bpe("abc abc abd", 3))
    binary = tmp_path / "sp.model"  # a SentencePiece model given as the merges file
    binary.write_bytes(b"\n\x80\x0bsome piece\x12\xff")  # was a bare UnicodeDecodeError
    with pytest.raises(ValueError, match=f"--merge-file {binary}: not a text merges file .*"
                                         "were the two swapped"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=str(binary))


def test_gpt2_files_saved_with_a_byte_order_mark(tmp_path):
    """vocab.json / merges.txt saved by a Windows editor start with a UTF-8 byte order mark:
    the mark is not part of the '#version' header (Megatron drops the header line, mark and
    all) nor of the JSON; the ids equal those of the files without it."""
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 40)
    plain = tmp_path / "plain"
    plain.mkdir()
    want = build_tokenizer("GPT2BPETokenizer", *write_bpe_files(plain, vocab, merges))
    vocab_file, merge_file = write_bpe_files(tmp_path, vocab, merges)
    for path in (vocab_file, merge_file):
        Path(path).write_bytes(b"\xef\xbb\xbf" + Path(path).read_bytes())
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    for text in TRICKY + [TRAIN_TEXT]:
        assert tok.tokenize(text) == want.tokenize(text)
    assert tok.vocab_size == want.vocab_size and tok.eod == want.eod


@pytest.mark.parametrize("gpt2", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAVE_GPT2, reason="../shared/data/gpt2 not present"))])
def test_merges_without_header_or_final_newline_give_megatrons_ids(tmp_path, gpt2):
    """Megatron 23.05 reads merges.txt as `split('\\n')[1:-1]`: without the '#version'
    header its first merge is dropped, without a final newline its last. All merges were
    kept here, so such files gave other ids than the user's Megatron-made data (GPT-2's
    files without the header: ' the' was one token, Megatron gives ' t' 'he'...). The ids
    are now Megatron's, tokens built on the dropped merge included, and the loss is
    warned, naming the lines."""
    if gpt2:
        with open(GPT2_DIR / "gpt2-vocab.json", encoding="utf-8") as f:
            vocab = json.load(f)
        lines = (GPT2_DIR / "gpt2-merges.txt").read_text(encoding="utf-8").split("\n")[1:-1]
    else:
        vocab, merges = train_tiny_bpe(TRAIN_TEXT, 300)
        lines = [f"{a} {b}" for a, b in merges]
    vocab_file, merge_file = write_bpe_files(tmp_path, vocab, [])
    Path(merge_file).write_text("\n".join(lines), encoding="utf-8")  # no header, no "\n"
    with pytest.warns(UserWarning) as record:
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    message = str(record[0].message)
    assert len(record) == 1 and message.startswith(f"--merge-file {merge_file}: its first line "
                                                   f"{lines[0]!r} (Megatron takes line 1 for")
    assert f"its last line {lines[-1]!r} (the file does not end with a newline)" in message
    ref = ReferenceBPE(vocab, [tuple(line.split()) for line in lines[1:-1]])
    first = lines[0].replace(" ", "").replace("Ġ", " ")
    texts = [first * 3, f"{first}{TRAIN_TEXT}"] + TRICKY + random_texts(3, 200)
    assert tok.tokenize(first) != [vocab[lines[0].replace(" ", "")]]
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.tokenize_array(text).tolist() == ids and tok.detokenize(ids) == text
    Path(merge_file).write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole file is read: nothing to warn
        full = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert full.tokenize(first) == [vocab[lines[0].replace(" ", "")]]


def test_null_tokenizer_and_padding():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("1 2  30") == [1, 2, 30] and tok.detokenize([4, 5]) == "4 5"
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 2) == 50432
    assert pad_vocab_size(256, 128, 2) == 256


def test_checkpoint_vocab_mismatch():
    """A tokenizer fits a checkpoint when some tensor-parallel size pads it to the model's
    rows (the saved tp is not trusted: loaders overwrite it); more ids than rows is fatal."""
    from megatron.tokenizer.tokenizer import checkpoint_vocab_mismatch

    tp2 = {"padded_vocab_size": 50432, "make_vocab_size_divisible_by": 128,
           "tensor_model_parallel_size": 1, "tokenizer_type": "GPT2BPETokenizer",
           "vocab_file": "gpt2-vocab.json"}
    assert checkpoint_vocab_mismatch(50257, tp2) is None  # GPT-2 trained at tp 2
    assert checkpoint_vocab_mismatch(50257, {}) is None
    fatal, why = checkpoint_vocab_mismatch(50433, tp2)
    assert fatal and why.startswith("the tokenizer has 50433 ids, more than the 50432 ")
    assert why.endswith("trained with --tokenizer-type GPT2BPETokenizer, --vocab-file "
                        "gpt2-vocab.json")
    fatal, why = checkpoint_vocab_mismatch(32000, tp2)  # a LLaMA SentencePiece model
    assert not fatal and "32000 ids do not pad to the 50432 rows" in why


def _train_sentencepiece(tmp_path: Path, **extra) -> str:
    spm = pytest.importorskip("sentencepiece")
    lines = [line for line in TRAIN_TEXT.split("\n") if line.strip()] * 5
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix,
                                   vocab_size=120, model_type="bpe", minloglevel=2,
                                   character_coverage=1.0, **extra)
    return prefix + ".model"


def megatron_sp_tokenize(sp, specials: dict, text: str) -> list:
    """Megatron's loop: find each special's next index, take the earliest (first in order)."""
    ids, idx = [], 0
    while True:
        indices = {}
        for token in specials:
            pos = text[idx:].find(token)
            if pos >= 0:
                indices[token] = pos
        if not indices:
            break
        token = min(indices, key=indices.get)
        nxt = idx + indices[token]
        ids.extend(sp.encode_as_ids(text[idx:nxt]))
        ids.append(specials[token])
        idx = nxt + len(token)
    ids.extend(sp.encode_as_ids(text[idx:]))
    return ids


def test_sentencepiece_specials(tmp_path):
    model = _train_sentencepiece(tmp_path)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model, vocab_extra_ids=2)
    sp = tok._sp
    n = sp.get_piece_size()
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended (no pad id in the model); <s>, </s> exist.
    assert tok._specials["<CLS>"] == n and tok.eod == n + 2
    assert tok._specials["<PAD>"] == n + 4 and tok._specials["<s>"] == sp.bos_id()
    assert tok._specials["<extra_id_1>"] == n + 6 and tok.vocab_size == n + 7
    texts = ["the fox<EOD>the dog", "<s>a</s><EOD><EOD>", "x<MASK>y<CLS><extra_id_0>z",
             "no specials here", "<EO<EOD>D>"]
    for text in texts:
        assert tok.tokenize(text) == megatron_sp_tokenize(sp, tok._specials, text)
    assert tok.tokenize("a<EOD>")[-1] == tok.eod
    assert "<EOD>" in tok.detokenize(tok.tokenize("fox<EOD>dog"))
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert gpt.vocab_size == n and gpt.eod == sp.eos_id()
    assert gpt.tokenize("the fox") == sp.encode_as_ids("the fox")
    assert gpt.detokenize(gpt.tokenize("the quick fox")) == "the quick fox"


def test_huggingface_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"])
    hf.train_from_iterator([TRAIN_TEXT] * 3, trainer=trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
        assert tok.eod == hf.token_to_id("</s>")
        assert tok.vocab_size == hf.get_vocab_size()
        ids = tok.tokenize("the quick brown fox")
        assert ids == hf.encode("the quick brown fox", add_special_tokens=False).ids
        assert "quick" in tok.detokenize(ids)
    with pytest.raises(ValueError, match="no such file"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing.json"))
    assert os.path.isfile(tmp_path / "tokenizer.json")


def test_huggingface_tokenizer_reads_special_tokens_in_text_as_text(tmp_path):
    """A literal '<|endoftext|>' in a document became the EOD id (and any special token
    its id): web text forged document ends. It is ordinary text, as GPT-2's encoder reads
    it: a byte-level BPE tokenizer.json gives GPT2BPETokenizer's ids for the same
    vocabulary and merges. Added tokens not marked special still encode to their ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([TRAIN_TEXT] * 3, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab_file, merge_file = hf.model.save(str(tmp_path))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    hf.add_tokens(["<tab4>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tok.eod == gpt2.eod == hf.token_to_id("<|endoftext|>")
    for text in TRICKY + ["a<|im_start|>b <|endoftext|>", TRAIN_TEXT]:
        ids = tok.tokenize(text)
        assert ids == gpt2.tokenize(text), text
        assert tok.eod not in ids and hf.token_to_id("<|im_start|>") not in ids
        assert tok.detokenize(ids) == text
    assert tok.tokenize("x<tab4>") == [hf.token_to_id("x"), hf.token_to_id("<tab4>")]
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"


@pytest.mark.parametrize("text, words", [
    ('["</s>"]', "holds a list, not a JSON object"),
    ('{"eos_token": ', "does not parse as JSON (Expecting value"),
])
def test_a_damaged_tokenizer_config_is_named(tmp_path, text, words):
    """A tokenizer_config.json beside tokenizer.json that is not a JSON object was an
    AttributeError traceback (a list) or the parser's words without the file's name."""
    path = _hf_without_eos(tmp_path)
    (path / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError) as err:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert f"{path / 'tokenizer_config.json'} {words}" in str(err.value), str(err.value)
    assert "replace it with the model's own, or remove it" in str(err.value)


def _hf_without_eos(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator([TRAIN_TEXT] * 3, trainer=trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>"]))
    (tmp_path / "hf").mkdir()
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    return tmp_path / "hf"


RUN = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
       "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
       "--eval-iters", "0", "--log-interval", "1", "--use-cpu-initialization"]


def test_tokenizers_without_an_end_of_document_id(tmp_path):
    """A tokenizer.json without an EOS token, a SentencePiece model trained with eos_id
    -1: `eod_or_none` says None (generation and the server then never stop at one).
    Training with such a tokenizer runs (it stopped with a traceback once the model was
    built, reading `.eod` for nothing); the flags that act at the EOD id are refused."""
    pytest.importorskip("tokenizers")
    import pretrain_gpt
    from megatron.arguments import ArgumentsError, parse_and_validate
    from megatron.tokenizer import eod_or_none

    hf = _hf_without_eos(tmp_path)
    sp = _train_sentencepiece(tmp_path, bos_id=-1, eos_id=-1)
    hf_tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf))
    sp_tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp)
    assert sp_tok.eod == -1 and eod_or_none(sp_tok) is None and eod_or_none(hf_tok) is None
    assert eod_or_none(build_tokenizer("NullTokenizer", vocab_size=7)) == 7
    assert eod_or_none(build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp)) == \
        sp_tok.vocab_size + 2  # <EOD> after <CLS>, <SEP>
    hf_run = RUN + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf)]
    assert pretrain_gpt.main(hf_run) == 0
    for tokenizer, why in ((hf_run, "no end-of-document token found"),
                           (RUN + ["--tokenizer-type", "GPTSentencePieceTokenizer",
                                   "--tokenizer-model", sp], "its end-of-document id is -1")):
        for flags, verb in ((["--eod-mask-loss"], "acts"),
                            (["--reset-position-ids", "--reset-attention-mask"], "act")):
            with pytest.raises(ArgumentsError, match=rf"{' and '.join(flags)} {verb} at the "
                                                     rf"end-of-document token, .*{why}"):
                parse_and_validate(tokenizer + flags, world_size=1,
                                   vocab_size_fn=pretrain_gpt.tokenizer_vocab_size)


def test_tokenizer_model_directory_names_the_file_to_pass(tmp_path):
    """--tokenizer-model DIR (a Hugging Face model directory, say): the SentencePiece types
    said 'not a SentencePiece model (... Is a directory)'; now the model file in it is
    named, or the tokenizer type that reads what it holds. HuggingFaceTokenizer on a
    directory with only tokenizer.model names the SentencePiece type."""
    model = Path(_train_sentencepiece(tmp_path))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "tokenizer.model").write_bytes(model.read_bytes())
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        with pytest.raises(ValueError, match=rf"--tokenizer-model {llama} is a directory; pass "
                                             rf"the model file in it: {llama}/tokenizer\.model$"):
            build_tokenizer(kind, tokenizer_model=str(llama))
    with pytest.raises(ValueError, match=rf"{llama} holds a SentencePiece tokenizer\.model: pass "
                                         r"--tokenizer-type GPTSentencePieceTokenizer "
                                         rf"--tokenizer-model {llama}/tokenizer\.model"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(llama))
    pytest.importorskip("tokenizers")
    hf = _hf_without_eos(tmp_path)
    with pytest.raises(ValueError, match=r"is a directory; it holds a Hugging Face "
                                         r"tokenizer\.json: pass --tokenizer-type "
                                         r"HuggingFaceTokenizer"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(hf))


def test_vocab_extra_ids_only_extend_sentencepiece_tokenizer(tmp_path, caplog):
    """--vocab-extra-ids adds <extra_id_i> to SentencePieceTokenizer only (Megatron's
    GPTSentencePieceTokenizer passes 0): with the others it is warned as without effect
    (it was for GPT2BPETokenizer and NullTokenizer only)."""
    import pretrain_gpt
    from megatron.arguments import parse_and_validate

    model = _train_sentencepiece(tmp_path)
    rows = {}
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        caplog.clear()
        cfg = parse_and_validate(RUN + ["--tokenizer-type", kind, "--tokenizer-model", model,
                                        "--vocab-extra-ids", "30",
                                        "--make-vocab-size-divisible-by", "1"],
                                 world_size=1, vocab_size_fn=pretrain_gpt.tokenizer_vocab_size)
        rows[kind] = cfg.model.padded_vocab_size
        warned = f"--vocab-extra-ids 30 has no effect with {kind}" in caplog.text
        assert warned == (kind == "GPTSentencePieceTokenizer"), kind
    assert rows == {"SentencePieceTokenizer": 120 + 5 + 30, "GPTSentencePieceTokenizer": 120}


def test_gpt2_tokenize_array_without_encode_to_numpy(tmp_path, monkeypatch):
    """tiktoken before 0.9 (requirements.txt allows 0.7) has no Encoding.encode_to_numpy:
    tokenize_array (preprocess_data's path) gives the same ids and dtype without it."""
    for shuffle_ids in (False, True):
        vocab, merges = train_tiny_bpe(TRAIN_TEXT, 300, shuffle_ids)
        tok = build_tokenizer("GPT2BPETokenizer", *write_bpe_files(tmp_path, vocab, merges))
        text = TRAIN_TEXT + " <|endoftext|> tail"
        expected = tok.tokenize_array(text)

        class OldEncoding:  # the Encoding of tiktoken 0.7/0.8: no encode_to_numpy
            def __init__(self, encoding):
                self._encoding = encoding

            def encode_ordinary(self, text):
                return self._encoding.encode_ordinary(text)

        monkeypatch.setattr(tok, "_encoding", OldEncoding(tok._encoding))
        got = tok.tokenize_array(text)
        assert got.dtype == expected.dtype and got.tolist() == expected.tolist()
        assert tok.tokenize(text) == expected.tolist()
        with pytest.raises(UnicodeEncodeError):  # a bad line for preprocess_data
            tok.tokenize_array("bad \ud800 surrogate")


@pytest.mark.parametrize("kind,package", [("GPT2BPETokenizer", "tiktoken"),
                                          ("SentencePieceTokenizer", "sentencepiece"),
                                          ("GPTSentencePieceTokenizer", "sentencepiece"),
                                          ("HuggingFaceTokenizer", "tokenizers")])
def test_a_missing_tokenizer_package_is_named_with_its_install(kind, package, monkeypatch,
                                                              tmp_path):
    """Without the package (a bare environment) the run said `ModuleNotFoundError` in a
    traceback on every rank; now one configuration error that names it and `pip install`."""
    import pretrain_gpt
    from megatron.arguments_common import ArgumentsError

    files = {}
    for flag, name in (("vocab_file", "v.json"), ("merge_file", "m.txt"),
                       ("tokenizer_model", "t.model")):
        files[flag] = str(tmp_path / name)
        Path(files[flag]).write_text("")  # never read: the import comes first
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now fails
    with pytest.raises(ValueError, match=f"needs the {package} package.*pip install {package}"):
        build_tokenizer(kind, **files)
    args = argparse.Namespace(tokenizer_type=kind, vocab_size=None, vocab_extra_ids=0, **files)
    with pytest.raises(ArgumentsError, match=f"cannot build the {kind}: .*pip install {package}"):
        pretrain_gpt.run_tokenizer(args)
