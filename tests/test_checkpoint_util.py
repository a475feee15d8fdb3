"""`tools/checkpoint_util.py`: Megatron-LM's resharding command line over our reshard.

1. A checkpoint saved by a short CPU training run, resharded tp1 -> tp2 through Megatron's
   command line (with the flags that are accepted and ignored), holds the same tensors as
   through `checkpoint_convert.py reshard`, loads at tp2 without resharding and gives the
   same losses as both the saving run continuing (rtol 1e-5: fp32 on CPU, another
   reduction order) and the `checkpoint_convert` output (exactly).
2. Target sizes left out keep the checkpoint's; the optimizer state is kept.
3. Errors name the value and the fix: --model-type BERT, another --loader / --saver, sizes
   that do not split the model, a --save-dir holding a checkpoint or equal to --load-dir,
   --true-vocab-size / --vocab-file disagreeing with the tokenizer or with each other.
4. --true-vocab-size re-pads the vocabulary when the tokenizer's size is not known here.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron import checkpoint_reshard as reshard
from tests import forked_script
from tests.test_reshard import RTOL, _check_weights_only, _load_and_continue, _run, _saved
from tests.test_tokenizer import _train_sentencepiece
from tools import checkpoint_convert, checkpoint_util

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP2 = "--tensor-model-parallel-size 2"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(a tp 1 checkpoint at iteration 2 of a CPU run, the losses of that run after it)."""
    root = str(tmp_path_factory.getbasetemp() / "src-1-")
    return root, _saved("", 1, root)


def _util(load, save, *extra):
    return checkpoint_util.main(["--model-type", "GPT", "--load-dir", str(load),
                                 "--save-dir", str(save), *extra])


def _assert_same(a, b, where):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


def test_megatron_command_line_reshards_like_checkpoint_convert(source, tmp_path, capsys):
    root, expected = source
    util_out, convert_out = tmp_path / "util", tmp_path / "convert"
    assert _util(root, util_out, "--loader", "megatron", "--saver", "megatron",
                 "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1",
                 "--megatron-path", "/opt/Megatron-LM", "--max-queue-size", "50",
                 "--no-checking") == 0
    out = capsys.readouterr().out
    for words in ("--megatron-path /opt/Megatron-LM ignored", "--max-queue-size 50 ignored",
                  "--no-checking ignored", f"resharded iteration 2 of {root} (tp 1, pp 1, "
                  f"fp32 optimizer) -> {util_out / 'iter_0000002'} (tp 2, pp 1, fp32 "
                  "optimizer): 2 rank files"):
        assert words in out
    assert checkpoint_convert.main([
        "reshard", "--load", root, "--save", str(convert_out),
        "--target-tensor-model-parallel-size", "2",
        "--target-pipeline-model-parallel-size", "1"]) == 0
    assert _files(util_out) == _files(convert_out)
    for name in _files(util_out):
        if name.endswith(".pt"):
            _assert_same(torch.load(util_out / name, weights_only=True),
                         torch.load(convert_out / name, weights_only=True), name)
    _check_weights_only(str(util_out))
    losses, converted = _run(_load_and_continue, 2, TP2, str(util_out))
    assert converted is None  # written for tp 2: the plain load path
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
    reference, _ = _run(_load_and_continue, 2, TP2, str(convert_out))
    assert losses == reference


def test_target_sizes_default_to_the_checkpoints(source, tmp_path, capsys):
    root, _ = source
    assert _util(root, tmp_path / "out", "--true-vocab-size", "128") == 0
    assert "--true-vocab-size 128 changes nothing: the vocabulary is re-padded from the " \
           "checkpoint's tokenizer (NullTokenizer, 128 tokens) already" in capsys.readouterr().out
    assert reshard.read_layout(str(tmp_path / "out" / "iter_0000002")) == \
        reshard.Layout(1, 1, 1, "fp32")  # the optimizer state is kept


def test_target_sizes_also_take_the_model_parallel_spellings(source, tmp_path):
    """--target-tensor/pipeline-model-parallel-size (checkpoint_convert.py reshard's and
    pretrain_gpt.py's word order) were 'unrecognized arguments'."""
    root, _ = source
    assert _util(root, tmp_path / "out", "--target-tensor-model-parallel-size", "2",
                 "--target-pipeline-model-parallel-size", "2") == 0
    layout = reshard.read_layout(str(tmp_path / "out" / "iter_0000002"))
    assert (layout.tp, layout.pp) == (2, 2)


def _vocab_json(path, entries):
    path.write_text(json.dumps({f"t{i}": i for i in range(entries)}))
    return str(path)


@pytest.mark.parametrize("extra,words", [
    (["--model-type", "BERT"], "--model-type BERT: this framework trains and converts GPT "
                               "models only; pass --model-type GPT"),
    (["--loader", "llama2_hf"], "--loader llama2_hf: the only loader here is 'megatron'"),
    (["--saver", "mcore"], "--saver mcore: the only saver here is 'megatron'"),
    (["--target-tensor-parallel-size", "3"], "--target-tensor-parallel-size 3 does not divide "
                                             "the saved model's --num-attention-heads 4"),
    (["--target-pipeline-parallel-size", "3"], "--target-pipeline-parallel-size 3 does not "
                                               "divide the saved model's 4 layers over 3 "
                                               r"stage\(s\); every stage needs the same number "
                                               "of layers. Use a size that fits: 1, 2, 4$"),
    (["--target-tensor-parallel-size", "0"], "--target-tensor-parallel-size must be >= 1, got 0"),
    (["--true-vocab-size", "100"], r"--true-vocab-size 100 disagrees with the checkpoint's "
                                   r"tokenizer \(NullTokenizer, 128 tokens\).* pass 128"),
    (["--true-vocab-size", "500"], "--true-vocab-size 500: the checkpoint's word embedding has "
                                   "128 rows"),
    (["--true-vocab-size", "128", "--vocab-file", "VOCAB3"],
     r"--true-vocab-size 128 and --vocab-file .*vocab.json \(3 entries\) disagree"),
    (["--vocab-file", "VOCAB3"], r"--vocab-file .*vocab.json \(3 entries\) disagrees"),
    (["--vocab-file", "MISSING"], "--vocab-file .*missing.json: file not found; check the path; "
                                  "--vocab-file takes a GPT-2 vocab.json"),
])
def test_errors_name_the_value_and_the_fix(source, tmp_path, extra, words):
    root, _ = source
    files = {"VOCAB3": _vocab_json(tmp_path / "vocab.json", 3),
             "MISSING": str(tmp_path / "missing.json")}
    extra = [files.get(x, x) for x in extra]
    argv = ["--load-dir", root, "--save-dir", str(tmp_path / "out")]
    argv = argv + extra if "--model-type" in extra else ["--model-type", "GPT"] + argv + extra
    with pytest.raises(SystemExit, match=words):
        checkpoint_util.main(argv)
    assert not os.path.exists(tmp_path / "out")


def test_save_dir_holding_a_checkpoint_is_refused(source, tmp_path):
    root, _ = source
    out = tmp_path / "out"
    assert _util(root, out, "--target-tensor-parallel-size", "2") == 0
    (out / "latest_checkpointed_iteration.txt").write_text("7")  # a later run's tracker
    with pytest.raises(SystemExit, match=f"--save-dir {out} already holds a checkpoint: "
                       r"latest_checkpointed_iteration.txt \('7'\), iter_0000002; .* Delete "
                       f"{out} or choose another --save-dir"):
        _util(root, out)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    with pytest.raises(SystemExit, match="is --load-dir; .* choose another --save-dir"):
        _util(root, root)
    with pytest.raises(SystemExit, match="is a file; pass a directory"):
        _util(root, out / "latest_checkpointed_iteration.txt")


def test_a_save_dir_with_an_unexpanded_tilde_is_refused(source, tmp_path, monkeypatch):
    """--save-dir "~/out" (quoted) and checkpoint_convert.py --save "~/out" wrote the
    checkpoint into a directory named '~' in the working directory."""
    root, _ = source
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/me")
    for call, flag in ((lambda out: _util(root, out), "--save-dir"),
                       (lambda out: checkpoint_convert.main(["reshard", "--load", root,
                                                             "--save", out, "--target-tensor-model-"
                                                             "parallel-size", "2"]), "--save")):
        with pytest.raises(SystemExit, match=rf"^error: {flag} ~/out: would create a directory "
                           rf"named '~' in {tmp_path}; '~' was not expanded .*: write "
                           r"/home/me/out, or ./~/out for a directory really named '~'$"):
            call("~/out")
        assert not (tmp_path / "~").exists()


def test_true_vocab_size_repads_when_the_tokenizer_is_not_known(tmp_path):
    """A checkpoint saved at tp 2 (130 tokens padded to 256 with 64 x tp) whose vocab file
    has moved: to tp 1, the saved padded size alone gives 256 rows, the true size 192."""
    args = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(tmp_path / "moved.json"),
            "padded_vocab_size": 256, "make_vocab_size_divisible_by": 64}
    size, note = checkpoint_util.choose_vocab_size(args, 130, None)
    assert size == 130 and "re-padded from --true-vocab-size 130" in note
    assert checkpoint_util.choose_vocab_size(args, None, _vocab_json(tmp_path / "v.json", 130)) \
        == (130, f"vocabulary re-padded from --vocab-file {tmp_path / 'v.json'} (130 entries): "
                 "the size of the checkpoint's tokenizer (GPT2BPETokenizer) is not known here")
    assert checkpoint_util.choose_vocab_size(args, None, None) == (None, None)
    assert checkpoint_convert.target_args(args, 1, 1, 1, None, False, 130)[
        "padded_vocab_size"] == 192
    assert checkpoint_convert.target_args(args, 1, 1, 1, None, False)["padded_vocab_size"] == 256


def test_sentencepiece_checkpoint_is_repadded_from_its_tokenizer_model(tmp_path):
    """A SentencePiece run saved at tp 2 (125 tokens padded to 256 with 128 x tp): to tp 1
    the tokenizer built from the stored --tokenizer-model gives 128 rows, as a tp 1 run with
    that tokenizer pads them (the saved padded size alone would keep 256, which that run
    then refuses to load); a model file that has moved keeps the saved size."""
    model = _train_sentencepiece(tmp_path)
    args = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model,
            "padded_vocab_size": 256, "make_vocab_size_divisible_by": 128}
    assert checkpoint_convert.tokenizer_vocab_size(args) == 125
    assert checkpoint_convert.target_args(args, 1, 1, 1, None, False)["padded_vocab_size"] == 128
    moved = dict(args, tokenizer_model=str(tmp_path / "moved.model"))
    assert checkpoint_convert.tokenizer_vocab_size(moved) is None
    assert checkpoint_convert.target_args(moved, 1, 1, 1, None, False)["padded_vocab_size"] == 256


def test_unknown_tokenizer_size_at_another_tp_is_warned(capsys):
    """Tokenizer files not readable here and the tensor-parallel size changes: the saved
    padded size is kept, with a warning naming the sizes and the two ways out; at the
    saved tp nothing is said (nothing can go wrong there)."""
    args = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/nonexistent.model",
            "padded_vocab_size": 256, "make_vocab_size_divisible_by": 128,
            "tensor_model_parallel_size": 2}
    assert checkpoint_convert.target_args(args, 2, 1, 1, None, False)["padded_vocab_size"] == 256
    assert "warning" not in capsys.readouterr().err
    assert checkpoint_convert.target_args(args, 1, 1, 1, None, False)["padded_vocab_size"] == 256
    err = " ".join(capsys.readouterr().err.split())
    assert "saved 256 rows to 256" in err and "tensor parallel size 1" in err
    assert "--true-vocab-size" in err and "tokenizer files" in err


def test_script_help_says_what_is_ignored_and_kept():
    done = forked_script.run([sys.executable, os.path.join(REPO, "tools", "checkpoint_util.py"),
                              "--help"], dict(os.environ), timeout=120)  # imports come free
    assert done.returncode == 0, done.stderr[-2000:]
    text = " ".join(done.stdout.split())
    assert "--megatron-path, --max-queue-size and --no-checking are accepted and ignored" in text
    assert "the model AND the optimizer state" in text and "model weights only" in text


def test_load_dir_without_tracker_gets_a_fix_in_this_command_lines_flags(source, tmp_path):
    """No tracker under --load-dir: the fix names --load-dir (not --load) and, this command
    line having no --iteration, checkpoint_convert.py reshard's for picking an iteration."""
    root, _ = source
    iter_dir = os.path.join(root, "iter_0000002")
    with pytest.raises(SystemExit, match=f"--load-dir {iter_dir} is one checkpoint's iteration "
                       f"directory; --load-dir takes the directory above it: --load-dir {root} "
                       r"\(.*checkpoint_convert.py reshard --load " + root + " --iteration N"):
        _util(iter_dir, tmp_path / "out")
    untracked = tmp_path / "untracked"
    os.makedirs(untracked / "iter_0000002")
    with pytest.raises(SystemExit, match=f"--load-dir {untracked} has no latest_checkpointed_"
                       r"iteration.txt .* holds iter_0000002; write the iteration into .*"
                       f"checkpoint_convert.py reshard --load {untracked} --iteration N"):
        _util(untracked, tmp_path / "out")
    with pytest.raises(SystemExit, match="no checkpoint under --load-dir "):
        _util(tmp_path / "none", tmp_path / "out")
    with pytest.raises(SystemExit, match=r"holds no iter_XXXXXXX or release directory; '~' "
                       r"was not expanded to a home directory .*: write \S*/ckpt, or ./~/ckpt"):
        _util("~/ckpt", tmp_path / "out")  # a quoted ~
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("tool", ["checkpoint_util.py", "checkpoint_convert.py reshard"])
def test_sigterm_mid_conversion_removes_the_partial_output(source, tmp_path, capsys,
                                                           monkeypatch, tool):
    """SIGTERM (a scheduler's time limit, `timeout`, `kill`) after the first rank file ended
    a conversion on the spot: the new --save kept its partial iter_N.tmp (of the model's
    size) and .save.lock, and nothing said so. Handled as Ctrl-C is now: removed, one line,
    status 143; the process's own SIGTERM handler is back afterwards."""
    import signal

    class Killed(Exception):
        pass

    def on_the_spot(signum, frame):  # stands for SIGTERM's default action
        raise Killed

    real = checkpoint_convert.torch.save

    def save_then_sigterm(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(checkpoint_convert.torch, "save", save_then_sigterm)
    save = tmp_path / "out"
    previous = signal.signal(signal.SIGTERM, on_the_spot)
    try:
        if tool == "checkpoint_util.py":
            status = _util(source[0], save, "--target-tensor-parallel-size", "2")
        else:
            status = checkpoint_convert.main(["reshard", "--load", source[0], "--save",
                                              str(save), "--target-tensor-model-parallel-size",
                                              "2"])
        assert signal.getsignal(signal.SIGTERM) is on_the_spot
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 143
    assert (f"{tool}: interrupted by SIGTERM; the partial output was removed (the source "
            "checkpoint is untouched): run the same command again") in capsys.readouterr().err
    assert not save.exists()
