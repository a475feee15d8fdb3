"""The tokenizer across the Hugging Face conversions: to-hf exports the checkpoint's
tokenizer files (so AutoTokenizer loads them, whatever the family) and takes files that
moved, from-hf records the model's tokenizer in the checkpoint (copied, so the Hugging
Face directory may go) or names the special ids a NullTokenizer import loses.
The mappings and logits: tests/test_hf_interop.py."""
from __future__ import annotations

import json
import os
import shlex

import pytest

from megatron import hf_convert
from tests.test_hf_interop import (
    LLAMA,
    VOCAB,
    _cli,
    _save_hf_model,
    _train,
    _transformers,
)

safetensors = pytest.importorskip("safetensors", reason="the HF export writes safetensors")



def test_to_hf_exports_the_tokenizer_files(tmp_path, capsys):
    """Hugging Face -> from-hf -> to-hf kept the weights but not the tokenizer: the export
    had no tokenizer.json, so AutoTokenizer could not load it. The checkpoint's tokenizer
    files that a Hugging Face tokenizer reads as they are now come along."""
    tf = _transformers()
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", "a", "b", "c"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf, ck, out = tmp_path / "hf", tmp_path / "ck", tmp_path / "out"
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=5, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=4, eos_token_id=0)).save_pretrained(str(hf))
    tok.save(str(hf / "tokenizer.json"))
    assert _cli("from-hf", "--input", hf, "--save", ck) == 0
    assert _cli("to-hf", "--load", ck, "--output", out) == 0
    assert "tokenizer.json, config.json" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert tf.AutoTokenizer.from_pretrained(str(out))("a c b")["input_ids"] == [2, 4, 3]


def test_from_hf_advice_with_use_checkpoint_args_names_the_tokenizer_file(tmp_path, capsys):
    """--use-checkpoint-args takes the tokenizer type from the checkpoint, not its files:
    from-hf's 'train from it with pretrain_gpt.py --load OUT --use-checkpoint-args' stopped
    at '--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model'. The advice now
    carries the tokenizer file, and the command it gives validates."""
    tf = _transformers()
    tokenizers = pytest.importorskip("tokenizers")
    from megatron.arguments import parse_and_validate
    from pretrain_gpt import tokenizer_vocab_size

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", "a", "b", "c"])}, unk_token="[UNK]"))
    hf, ck = tmp_path / "hf", tmp_path / "ck"
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=5, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=4, eos_token_id=0)).save_pretrained(str(hf))
    tok.save(str(hf / "tokenizer.json"))
    assert _cli("from-hf", "--input", hf, "--save", ck) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    advice = shlex.split(last.split("train from it with ")[1].split(", or with")[0])
    assert advice[:4] == ["pretrain_gpt.py", "--load", str(ck), "--use-checkpoint-args"]
    assert advice[4] == "--tokenizer-model" and len(advice) == 6
    assert advice[5] == str(ck / "tokenizer"), "a copy in the checkpoint, not in --input"
    assert (ck / "tokenizer" / "tokenizer.json").read_bytes() == \
        (hf / "tokenizer.json").read_bytes()
    cfg = parse_and_validate(advice[1:] + ["--micro-batch-size", "1", "--lr", "1e-4",
                                           "--train-iters", "1", "--mock-data"],
                             world_size=1, env={}, cuda_available=False,
                             vocab_size_fn=tokenizer_vocab_size)
    assert cfg.args["tokenizer_type"] == "HuggingFaceTokenizer"


def test_to_hf_takes_tokenizer_files_that_moved(tmp_path, capsys):
    """The tokenizer files a checkpoint records may be gone where it is exported (another
    machine, a renamed directory): the export then kept every padded row, had no eos id
    and no tokenizer files, and to-hf had no way to name the files. --vocab-file/
    --merge-file/--tokenizer-model (and --tokenizer-type) give them again; files with
    more ids than the model's rows are refused."""
    from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 300, False)  # 557 ids: 640 rows
    (tmp_path / "tok").mkdir()
    write_bpe_files(tmp_path / "tok", vocab, merges)
    _train(tmp_path / "ck", f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/tok/"
                            f"vocab.json --merge-file {tmp_path}/tok/merges.txt", steps=1)
    (tmp_path / "tok").rename(tmp_path / "moved")
    capsys.readouterr()
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "a") == 0
    assert "keeping all 640 padded vocabulary rows: give its files again (--vocab-file/" \
        in capsys.readouterr().out
    moved = ["--vocab-file", tmp_path / "moved/vocab.json",
             "--merge-file", tmp_path / "moved/merges.txt"]
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "b", *moved) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["vocab_size"] == len(vocab) and config["eos_token_id"] == vocab["<|endoftext|>"]
    assert (tmp_path / "b" / "merges.txt").read_bytes() == \
        (tmp_path / "moved" / "merges.txt").read_bytes()
    (tmp_path / "big").mkdir()
    big = {**vocab, **{f"<|x{i}|>": len(vocab) + i for i in range(100)}}  # 657 ids
    vocab_file, merge_file = write_bpe_files(tmp_path / "big", big, merges)
    with pytest.raises(SystemExit, match=r"error: the tokenizer has 657 ids, more than the 640 "
                                         r"vocabulary rows .*trained with --tokenizer-type "
                                         r"GPT2BPETokenizer, --vocab-file .*/tok/vocab.json"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "c",
             "--vocab-file", vocab_file, "--merge-file", merge_file)


def test_to_hf_warns_of_tokenizer_files_other_than_the_checkpoints(tmp_path, capsys):
    """Other tokenizer files than the ones the checkpoint was trained with (which still
    exist) were taken in silence, and the export cut the embedding to their vocabulary
    and took their eos id. Now a WARNING names the flag and both files."""
    from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

    (tmp_path / "tok").mkdir()
    (tmp_path / "other").mkdir()
    vocab, merges = write_bpe_files(tmp_path / "tok", *train_tiny_bpe(TRAIN_TEXT, 300, False))
    other, other_merges = write_bpe_files(tmp_path / "other",
                                          *train_tiny_bpe(TRAIN_TEXT, 250, False))
    _train(tmp_path / "ck", f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} "
                            f"--merge-file {merges}", steps=1)
    capsys.readouterr()
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "a",
                "--vocab-file", vocab) == 0
    assert "WARNING" not in capsys.readouterr().out
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "b",
                "--vocab-file", other, "--merge-file", other_merges) == 0
    out = capsys.readouterr().out
    assert (f"WARNING: --vocab-file {other} differs from the file the checkpoint was trained "
            f"with, {vocab}; leave --vocab-file out") in out
    assert "vocab 507," in out  # the rows cut to the other tokenizer's 507 ids


def test_tokenizer_files_by_tokenizer_type(tmp_path):
    vocab, merges = tmp_path / "v.json", tmp_path / "m.txt"
    vocab.write_text("{}")
    merges.write_text("")
    files = hf_convert.tokenizer_files({"tokenizer_type": "GPT2BPETokenizer",
                                        "vocab_file": str(vocab), "merge_file": str(merges)})
    assert files == {"vocab.json": str(vocab), "merges.txt": str(merges)}
    moved = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/elsewhere/vocab.json",
             "merge_file": str(merges)}
    assert hf_convert.tokenizer_files(moved) == {}, "never half a tokenizer"
    for kind in ("NullTokenizer", "SentencePieceTokenizer"):  # nothing HF reads as it is
        assert hf_convert.tokenizer_files({"tokenizer_type": kind,
                                           "tokenizer_model": str(vocab)}) == {}


def test_special_ids_of_an_import_without_tokenizer_files_are_named_and_restored(tmp_path,
                                                                                  capsys):
    """A Llama directory without tokenizer files imports as NullTokenizer, whose one
    end-of-document id is --vocab-size; the model's own eos 2 / bos 1 were silently lost
    (to-hf wrote eos = vocab - 1, so generation never stopped at the real eos). from-hf
    names them with the to-hf flags, which put them back into config.json."""
    _save_hf_model(tmp_path / "hf", "llama")  # LlamaConfig: bos 1, eos 2
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
    out = capsys.readouterr().out
    assert (f"note: no tokenizer files in {tmp_path / 'hf'}: the checkpoint records "
            f"NullTokenizer, whose end-of-document id is {VOCAB}, not the model's eos 2, bos 1; "
            "pass to-hf --eos-token-id 2 --bos-token-id 1 when exporting it") in out
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "plain") == 0
    assert "pass them as --eos-token-id N --bos-token-id N" in capsys.readouterr().out
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "out",
                "--eos-token-id", 2, "--bos-token-id", 1) == 0
    out = capsys.readouterr().out
    assert "note: eos_token_id" not in out
    assert ": model.safetensors, config.json, generation_config.json\n" in out, out
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (cfg["eos_token_id"], cfg["bos_token_id"]) == (2, 1)
    assert (gen["eos_token_id"], gen["bos_token_id"]) == (2, 1)
    with pytest.raises(SystemExit, match=rf"--eos-token-id {VOCAB + 5} is outside the "
                                         rf"exported vocabulary of {VOCAB + 1} ids"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "bad",
             "--eos-token-id", VOCAB + 5)


def _generated(ck, prompt: str) -> dict:
    """`tools/generate.py --load CK --prompt PROMPT --greedy --json` run in-process."""
    import contextlib
    import io

    from tools import generate

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert generate.main(["--load", str(ck), "--prompt", prompt, "--greedy",
                              "--max-new-tokens", "6", "--no-stop-at-eod", "--json"]) == 0
    out = json.loads(buf.getvalue().strip().splitlines()[-1])
    return {k: out[k] for k in ("prompt_ids", "generated_ids", "generated_text")}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_round_trip_keeps_the_tokenizer_after_the_hf_directory_is_gone(tmp_path, family,
                                                                        capsys):
    """to-hf of a GPT2BPETokenizer (GPTSentencePieceTokenizer) checkpoint writes
    vocab.json + merges.txt (tokenizer.model) and no tokenizer.json; from-hf recorded
    NullTokenizer, so the import lost the tokenizer: generate.py refused text prompts and
    the advice's flags trained without it. Now the import records the same tokenizer type,
    its files copied into the checkpoint's tokenizer/ (the HF directory may be deleted),
    and generates the same text as the original checkpoint."""
    from megatron.checkpoint_reshard import locate_iteration
    from megatron.checkpoint_source import SourceCheckpoint

    if family == "gpt2":
        gpt2 = "/work/shared/data/gpt2"
        if not os.path.isfile(f"{gpt2}/gpt2-vocab.json"):
            pytest.skip("the GPT-2 vocabulary files are not here")
        tok = (f"--tokenizer-type GPT2BPETokenizer --vocab-file {gpt2}/gpt2-vocab.json "
               f"--merge-file {gpt2}/gpt2-merges.txt")
        kind, names = "GPT2BPETokenizer", {"vocab_file": "vocab.json", "merge_file": "merges.txt"}
    else:
        from tests.test_tokenizer import _train_sentencepiece

        tok = (f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "
               f"{_train_sentencepiece(tmp_path)}")
        kind, names = "GPTSentencePieceTokenizer", {"tokenizer_model": "tokenizer.model"}
    flags = f"{LLAMA} --bf16" if family == "llama" else ""
    from pretrain_gpt import tokenizer_vocab_size

    _train(tmp_path / "ck", f"{tok} {flags}", steps=1, vocab_size_fn=tokenizer_vocab_size)
    hf, imp = tmp_path / "hf", tmp_path / "imp"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", hf) == 0
    assert _cli("from-hf", "--input", hf, "--save", imp) == 0
    advice = capsys.readouterr().out.strip().splitlines()[-1]
    hf.rename(tmp_path / "deleted")  # a shared export is often removed once imported
    iter_dir = locate_iteration(str(imp), None)[0]
    args = SourceCheckpoint(iter_dir).args
    assert args["tokenizer_type"] == kind
    for dest, name in names.items():
        assert args[dest] == str(imp / "tokenizer" / name)
        assert f"--{dest.replace('_', '-')} {imp / 'tokenizer' / name}" in advice
    prompt = "First Citizen: we know"
    assert _generated(imp, prompt) == _generated(tmp_path / "ck", prompt)


@pytest.mark.parametrize("edit,words", [
    (lambda vocab: vocab.pop("<|endoftext|>"), "<|endoftext|> is missing"),
    (lambda vocab: None, "ids, more than the model's vocab_size 101"),
])
def test_from_hf_leaves_bpe_files_that_are_not_the_models_tokenizer(tmp_path, capsys, edit,
                                                                     words):
    """vocab.json + merges.txt of another BPE (no <|endoftext|>: GPT2BPETokenizer could not
    be built for training) or with more ids than the model has are not recorded as its
    GPT2BPETokenizer: NullTokenizer, and a note saying why."""
    from megatron.checkpoint_reshard import locate_iteration
    from megatron.checkpoint_source import SourceCheckpoint
    from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

    _save_hf_model(tmp_path / "hf", "gpt2")
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 10, False)
    edit(vocab)
    write_bpe_files(tmp_path / "hf", vocab, merges)
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
    out = capsys.readouterr().out
    assert "vocab.json and merges.txt in" in out and words in out
    args = SourceCheckpoint(locate_iteration(str(tmp_path / "ck"), None)[0]).args
    assert args["tokenizer_type"] == "NullTokenizer" and args["vocab_size"] == VOCAB
    assert not (tmp_path / "ck" / "tokenizer").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_exported_tokenizer_loads_whatever_the_family(tmp_path, family):
    """AutoTokenizer picks the tokenizer class by config.json's model_type: a GPT-2-family
    export of a GPTSentencePieceTokenizer checkpoint loaded its tokenizer.model as a
    GPT2Tokenizer of other ids (silently), and a Llama export of a GPT2BPETokenizer one
    failed to load. The export now names the class that reads its files."""
    tf = _transformers()
    from megatron.tokenizer import build_tokenizer
    from pretrain_gpt import tokenizer_vocab_size

    if family == "gpt2":
        from tests.test_tokenizer import _train_sentencepiece

        tok_args = {"tokenizer_type": "GPTSentencePieceTokenizer",
                    "tokenizer_model": _train_sentencepiece(tmp_path)}
        flags = f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model " \
                f"{tok_args['tokenizer_model']}"
    else:
        gpt2 = "/work/shared/data/gpt2"
        if not os.path.isfile(f"{gpt2}/gpt2-vocab.json"):
            pytest.skip("the GPT-2 vocabulary files are not here")
        tok_args = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": f"{gpt2}/gpt2-vocab.json",
                    "merge_file": f"{gpt2}/gpt2-merges.txt"}
        flags = (f"--tokenizer-type GPT2BPETokenizer --vocab-file {tok_args['vocab_file']} "
                 f"--merge-file {tok_args['merge_file']} {LLAMA}")
    _train(tmp_path / "ck", flags, steps=1, vocab_size_fn=tokenizer_vocab_size)
    out = tmp_path / "hf"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    ours = build_tokenizer(tok_args.pop("tokenizer_type"), **tok_args)
    theirs = tf.AutoTokenizer.from_pretrained(str(out))
    text = "First Citizen: we know it,\n  before we proceed any further. Zq@\u00fc"
    assert theirs(text)["input_ids"] == ours.tokenize(text)
    assert theirs.eos_token_id == ours.eod


@pytest.mark.parametrize("flags", [["--vocab-file", "{tmp}/nowhere.json"],
                                   ["--tokenizer-type", "GPTSentencePieceTokenizer",
                                    "--tokenizer-model", "{tmp}/nowhere.model"],
                                   ["--tokenizer-type", "GPTSentencePieceTokenizer",
                                    "--tokenizer-model", "{tmp}/not_a_model.txt"]])
def test_to_hf_refuses_tokenizer_flags_it_cannot_build(tmp_path, flags):
    """A mistyped --vocab-file (or a file that is no tokenizer) given to to-hf was a note:
    the export kept every padded row, no tokenizer file and eos_token_id null, exit 0. A
    tokenizer given on the command line that cannot be built is now refused, naming why,
    and nothing is written."""
    pytest.importorskip("sentencepiece")
    _train(tmp_path / "ck", "", steps=1)
    (tmp_path / "not_a_model.txt").write_text("hello\n")
    argv = [f.format(tmp=tmp_path) for f in flags]
    with pytest.raises(SystemExit) as exc:
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf", *argv)
    assert "cannot be built" in str(exc.value) and argv[-1] in str(exc.value)
    assert not (tmp_path / "hf").exists()
