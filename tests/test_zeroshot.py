"""tasks/main.py, Megatron-LM's zero-shot GPT evaluation (WIKITEXT103, LAMBADA).

Unit: the sliding windows score every target token once; the detokenizers; LAMBADA's
strict / non-strict split with a GPT-2 BPE tokenizer; the vocabulary-parallel argmax;
the all-positions rule of LAMBADA's accuracy. End to end: a model trained by
pretrain_gpt.py is evaluated by tasks/main.py and compared with a plain single-process
reference (tools/generate.load_model, torch's cross entropy and argmax): fp32, 1e-5
relative; then the same evaluation under tp=2, pp=2 (also interleaved) and dp=2 on gloo.
"""
from __future__ import annotations

import json
import math
import random
import re
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.tokenizer import build_tokenizer
from tasks.zeroshot_gpt import datasets, detokenizer, evaluate
from tests import forked_script
from tests.dist_utils import cpu_env, free_port, run_distributed
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-5  # fp32 on CPU: the layouts sum in other orders


# ------------------------------------------------------------------------------ windows
@pytest.mark.parametrize("n,seq,stride,expected_windows", [
    (10, 4, 4, 3), (10, 4, 2, 5), (11, 4, 1, 10), (5, 8, 3, 2), (2, 4, 4, 1), (1, 4, 2, 1),
    (17, 5, 3, 6), (9, 4, 3, 3), (33, 8, 8, 4), (41, 8, 5, 8)])
def test_windows_score_every_target_once(n, seq, stride, expected_windows):
    tokens = list(range(1, n + 1))  # token t sits at index t - 1; pad id 0
    wins = datasets.windows(tokens, seq, stride, pad_id=0)
    assert len(wins) == expected_windows  # max(ceil((n - 1 - stride) / stride) + 1, 1)
    scored = [0] * (n + 1)
    for ids, mask in wins:
        assert len(ids) == seq + 1 and len(mask) == seq
        for pos, m in enumerate(mask):
            if m:
                assert ids[pos + 1] != 0, "a pad label was scored"
                scored[ids[pos + 1]] += 1
    assert scored[2:] == [1] * (n - 1)  # every token but the first, once
    assert scored[1] == 0


def test_window_masks_by_hand():
    tokens = list(range(1, 11))
    wins = datasets.windows(tokens, 4, 2, pad_id=0)
    assert wins[0] == ([1, 2, 3, 4, 5], [1, 1, 1, 1])
    assert wins[1] == ([3, 4, 5, 6, 7], [0, 0, 1, 1])  # labels 4, 5 were scored in window 0
    assert wins[3] == ([7, 8, 9, 10, 0], [0, 0, 1, 0])  # label 10; the pad label is not
    assert wins[4] == ([9, 10, 0, 0, 0], [0, 0, 0, 0])  # Megatron's trailing window: empty
    assert datasets.windows(tokens, 4, 4, 0)[1] == ([5, 6, 7, 8, 9], [1, 1, 1, 1])


# ------------------------------------------------------------------------ detokenizers
def test_wikitext_detokenizer():
    raw = (" = = Gameplay = = \n The game ( released in 2011 ) cost 1 @,@ 000 dollars , "
           "it 's \" very good \" . The players ' choice ; 5 @.@ 5 ° C and a well @-@ known "
           "[ citation ] ! N items \n")
    assert detokenizer.wikitext_detokenizer(raw) == (
        ' == Gameplay ==\nThe game (released in 2011) cost 1,000 dollars, it\'s "very good". '
        "The players' choice; 5.5°C and a well-known [citation]! 1 items\n")
    assert detokenizer.wikitext_detokenizer("a N b = = = = c") == "a 1 b ==== c"


def test_detokenizer_by_path():
    """Megatron-LM's choice: "ptb", then "wiki", then "lambada" anywhere in the path; the
    LAMBADA one changes nothing."""
    assert detokenizer.get_detokenizer("data/wikitext-103/wiki.test.tokens")("a @-@ b") == "a-b"
    # WikiText-103's own file name selects it outside a "wikitext" directory too
    assert detokenizer.get_detokenizer("/data/eval/wiki.valid.tokens")("a @-@ b") == "a-b"
    assert detokenizer.get_detokenizer("ptb/test.txt")("do n't pay $ 1 N ") == "don't pay $11 "
    assert detokenizer.get_detokenizer("ptb/wiki.txt")("do n't") == "don't"
    curly = "\u201chi\u201d , he said"
    assert detokenizer.get_detokenizer("lambada_test.jsonl")(curly) == curly
    assert detokenizer.get_detokenizer("other.txt")("a @-@ b") == "a @-@ b"


# --------------------------------------------------------------------------- LAMBADA
@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 200)
    vocab_file, merge_file = write_bpe_files(tmp_path_factory.mktemp("bpe"), vocab, merges)
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)


def test_lambada_strict_and_plain_split(bpe):
    text = "the quick brown fox met a naïve quickly"
    context, target = datasets.lambada_split(text, bpe, strict=False)
    whole = bpe.tokenize(text)
    assert context == whole[:-1] and target == whole[-1:]
    context, target = datasets.lambada_split(text, bpe, strict=True)
    assert context == bpe.tokenize("the quick brown fox met a naïve")
    assert target == bpe.tokenize(" quickly") and len(target) == 3  # the whole last word
    ids, mask = datasets.lambada_sample(context, target, 40, pad_id=bpe.eod)
    n = len(context) + len(target)
    assert ids == context + target + [bpe.eod] * (41 - n)
    # label space: label i is token i + 1, so the target's labels start at len(context) - 1
    assert mask == [0] * (len(context) - 1) + [1] * len(target) + [0] * (41 - n)


def test_lambada_file_errors(bpe, tmp_path):
    def error(lines, seq=40):
        path = tmp_path / "lambada.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(SystemExit) as e:
            datasets.build_lambada_data(str(path), bpe, seq, strict=True)
        return str(e.value.code)

    good = json.dumps({"text": "the quick brown fox"})
    assert "line 2: no \"text\" field" in error([good, json.dumps({"txt": "a b"})])
    assert "line 1: not JSON" in error(["{oops"])
    assert "line 2 (" in error([good, json.dumps({"text": "the quick brown fox " * 20})], 40)
    assert "longer than the 41 tokens (context and target) that --seq-length 40 holds" in \
        error([json.dumps({"text": "fox " * 80})])
    assert "is empty" in error([""])
    with pytest.raises(SystemExit, match="file not found"):
        datasets.build_lambada_data(str(tmp_path / "nope.jsonl"), bpe, 40, strict=True)
    # a Latin-1 file was a UnicodeDecodeError traceback; a directory "file not found"
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "a b"}\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(SystemExit) as e:
        datasets.build_lambada_data(str(latin1), bpe, 40, strict=True)
    assert str(e.value.code) == (f"error: --valid-data {latin1} line 2: not UTF-8 text (byte "
                                 "0xe9 at offset 29); the LAMBADA JSON-lines file must be "
                                 "UTF-8 (convert it, e.g. with iconv)")
    with pytest.raises(SystemExit, match="not UTF-8 text"):
        datasets.build_wikitext_data(str(latin1), bpe, 40, 8)
    with pytest.raises(SystemExit, match=f"--valid-data {tmp_path} is a directory; pass the"):
        datasets.build_lambada_data(str(tmp_path), bpe, 40, strict=True)
    # NullTokenizer reads ids, not words: one line naming the file and line, no traceback
    from megatron.tokenizer.tokenizer import NullTokenizer
    null = NullTokenizer(50)
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"text": "1 2 3"}) + "\n" + good + "\n")
    with pytest.raises(SystemExit, match=f"--valid-data {words} line 2: the tokenizer cannot "
                                         "read it .*NullTokenizer expects"):
        datasets.build_lambada_data(str(words), null, 40, strict=False)
    with pytest.raises(SystemExit, match=f"--valid-data {words}: the tokenizer cannot read"):
        datasets.build_wikitext_data(str(words), null, 40, 8)
    # NullTokenizer takes any integer: an id outside its vocabulary [0, 51) was an
    # IndexError traceback (beyond the padded vocabulary) or, in a padding row, a report of
    # "avg loss: INF"; now one line naming the file, the line and the id
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"text": "1 2 3"}) + "\n" + json.dumps({"text": "1 -2 3"}) + "\n")
    with pytest.raises(SystemExit) as e:
        datasets.build_lambada_data(str(ids), null, 40, strict=True)
    assert str(e.value.code) == (f"error: --valid-data {ids} line 2: token id -2 is outside "
                                 "NullTokenizer's vocabulary [0, 51): token ids are integers "
                                 ">= 0")
    ids.write_text("1 2 60 3 4 50\n")  # 50, the end-of-document id, is in the vocabulary
    with pytest.raises(SystemExit) as e:
        datasets.build_wikitext_data(str(ids), null, 40, 8)
    assert str(e.value.code) == (f"error: --valid-data {ids}: token id 60 is outside "
                                 "NullTokenizer's vocabulary [0, 51): evaluate with the "
                                 "--vocab-size the model was trained with (--vocab-size 50 "
                                 "allows ids up to 50, the end-of-document id)")
    ids.write_text("1 2 50 3 4\n")
    assert datasets.build_wikitext_data(str(ids), null, 40, 8).num_tokenized_tokens == 5


def test_lambada_lines_are_split_at_newlines_only(tmp_path):
    """A JSON line may hold U+2028, U+2029 or U+0085 unescaped (json.dumps(...,
    ensure_ascii=False) writes them so); Megatron-LM reads the file line by line
    (readlines), so they are inside a passage. str.splitlines also split there: "line 1:
    not JSON" for a valid file, and later lines misnumbered."""
    from megatron.tokenizer.tokenizer import NullTokenizer

    path = tmp_path / "lambada.jsonl"
    lines = [json.dumps({"text": f"1 2{sep} 3 4"}, ensure_ascii=False)
             for sep in ("\u2028", "\u2029", "\x85")]
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8", newline="")
    samples = datasets.build_lambada_data(str(path), NullTokenizer(50), 8, strict=True)
    assert [s[0][:4] for s in samples] == [[1, 2, 3, 4]] * 3
    path.write_text("\n".join(lines + ["{oops"]) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=f"--valid-data {path} line 4: not JSON"):
        datasets.build_lambada_data(str(path), NullTokenizer(50), 8, strict=True)


def test_lambada_passages_too_long_are_named_together_with_a_fix_that_fits(bpe, tmp_path):
    """The first over-long passage stopped the run, its advice "a larger --seq-length (up to
    --max-position-embeddings)" even where --seq-length was already the model's limit. Now
    every one is named (the first five), and the advice is one the model can take."""
    path = tmp_path / "lambada.jsonl"
    short, long = "the quick brown fox", "the quick brown fox " * 5 + "jumps"
    n = len(bpe.tokenize(long))
    path.write_text("".join(json.dumps({"text": t}) + "\n"
                            for t in [short, long] + [short] * 3 + [long] * 6))

    def error(seq, max_positions):
        with pytest.raises(SystemExit) as e:
            datasets.build_lambada_data(str(path), bpe, seq, False, max_positions)
        return str(e.value.code)

    head = (f"error: --valid-data {path}: 7 of 11 passage(s) are longer than the 11 tokens "
            f"(context and target) that --seq-length 10 holds: line 2 ({n} tokens), line 6 "
            f"({n} tokens), line 7 ({n} tokens), line 8 ({n} tokens), line 9 ({n} tokens) and "
            "2 more; ")
    assert error(10, 64) == head + (f"evaluate with --seq-length {n - 1} (the model's "
                                    "--max-position-embeddings is 64) or shorten these passages")
    assert error(10, None) == head + f"evaluate with --seq-length {n - 1} or shorten these passages"
    assert error(10, 12).endswith(f"the longest needs --seq-length {n - 1}, beyond the model's "
                                  "--max-position-embeddings 12: remove or shorten the passages "
                                  "longer than 13 tokens, and evaluate at --seq-length 12")
    assert error(10, 10).endswith("longer than 11 tokens")
    assert len(datasets.build_lambada_data(str(path), bpe, n - 1, False, n - 1)) == 11


# ------------------------------------------------------------------ argmax and accuracy
def _argmax_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 16)
    logits[0, 0, 2] = logits[0, 0, 10] = 50.0  # a tie across the two TP halves: id 2 wins
    logits[1, :, 13:] = 1000.0  # padding rows (ids >= 13) must never win
    return logits


def _argmax_worker(rank, world_size):
    import torch.distributed as dist

    from megatron.core.tensor_parallel import vocab_parallel_argmax
    half = _argmax_logits().chunk(world_size, dim=-1)[rank]
    return vocab_parallel_argmax(half, dist.group.WORLD, vocab_limit=13)


def test_vocab_parallel_argmax():
    from megatron.core.tensor_parallel import vocab_parallel_argmax

    logits = _argmax_logits()
    expected = logits[..., :13].argmax(dim=-1)
    assert expected[0, 0] == 2
    assert torch.equal(vocab_parallel_argmax(logits, None, vocab_limit=13), expected)
    for got in run_distributed(_argmax_worker, 2):
        assert torch.equal(got, expected)


def test_lambada_accuracy_needs_every_scored_position():
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    predicted = torch.tensor([[7, 2, 3, 7], [1, 2, 7, 4], [0, 0, 0, 0]])
    logits = F.one_hot(predicted, 8).float()
    right = evaluate.CorrectCount(None, 8)(logits, {"labels": labels, "loss_mask": mask})
    # row 0: both scored positions right (unscored ones wrong: ignored); row 1: one scored
    # position wrong; row 2: a filler row with nothing scored counts as neither
    assert float(right) == 1.0


# ------------------------------------------------------------------------ end to end
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16",
         "--tokenizer-type", "GPT2BPETokenizer", "--make-vocab-size-divisible-by", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization"]
WIKI = (" = = Gameplay = = \n The game ( released in 2011 ) cost 1 @,@ 000 dollars , it 's "
        "\" very good \" . The quick brown fox jumps over the lazy dog . def tokenize ( text ) "
        ": return [ int ( x ) for x in text.split ( ) ] \n naïve café résumé coöperate \n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-layer model trained 4 iterations on mock data with the tiny GPT-2 BPE, saved;
    a WikiText-styled file and the tokenizer flags."""
    import pretrain_gpt

    d = tmp_path_factory.mktemp("zeroshot")
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 200)
    vocab_file, merge_file = write_bpe_files(d, vocab, merges)
    tok_flags = ["--vocab-file", vocab_file, "--merge-file", merge_file]
    assert pretrain_gpt.main(MODEL + tok_flags + [
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
        "--train-iters", "4", "--mock-data", "--save", str(d / "ckpt"),
        "--save-interval", "4", "--log-interval", "100", "--eval-iters", "0"]) == 0
    (d / "wikitext_sample.tokens").write_text(WIKI)
    return {"dir": d, "ckpt": str(d / "ckpt"), "tok_flags": tok_flags}


def _reference_model(trained):
    from tools.generate import load_model

    model, _, _ = load_model(trained["ckpt"])
    return model


def _reference_wikitext(model, tokenizer, path: Path, seq: int, stride: int) -> float:
    """avg loss from first principles: target j (token j + 1) is predicted from the window
    that scores it -- window 0 for j < seq, else the one starting at
    ((j - seq) // stride + 1) * stride -- with a softmax over the tokenizer's vocabulary."""
    text = path.read_text()
    tokens = tokenizer.tokenize(detokenizer.wikitext_detokenizer(text))
    total = 0.0
    with torch.no_grad():
        for j in range(len(tokens) - 1):
            start = 0 if j < seq else ((j - seq) // stride + 1) * stride
            logits = model(torch.tensor([tokens[start:j + 1]]))[0, -1, :tokenizer.vocab_size]
            total += float(F.cross_entropy(logits[None].double(), torch.tensor([tokens[j + 1]])))
    return total / (len(tokens) - 1)


def _lambada_file(model, tokenizer, path: Path) -> None:
    """Passages of words from TRAIN_TEXT; half end with the model's own greedy next token
    (kept when the text retokenizes to exactly context + that token), so that some are
    right."""
    rng = random.Random(1)
    words = TRAIN_TEXT.split()
    lines = []
    while len(lines) < 12:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
        if len(lines) % 2 == 0:
            ids = tokenizer.tokenize(text)
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids[-15:]]))[0, -1, :tokenizer.vocab_size].argmax())
            text = text + tokenizer.detokenize([nxt])
            if tokenizer.tokenize(text) != ids + [nxt] or not text.split() or len(ids) > 15:
                continue
        if 2 <= len(tokenizer.tokenize(text)) <= 17:
            lines.append(json.dumps({"text": text}))
    path.write_text("\n".join(lines) + "\n")


def _reference_lambada(model, tokenizer, path: Path, strict: bool) -> int:
    right = 0
    with torch.no_grad():
        for line in path.read_text().splitlines():
            text = json.loads(line)["text"]
            if strict:  # the last word, with its space, is the target
                word = text.split()[-1]
                context = tokenizer.tokenize(text[:text.rfind(word)].strip())
                target = tokenizer.tokenize(" " + word)
            else:
                ids = tokenizer.tokenize(text)
                context, target = ids[:-1], ids[-1:]
            ids = context + target
            logits = model(torch.tensor([ids[:-1]]))[0, :, :tokenizer.vocab_size]
            right += int(logits.argmax(-1)[len(context) - 1:].tolist() == target)
    return right


def _argv(trained, task, path, *extra):
    return ["--task", task, "--valid-data", str(path), "--load", trained["ckpt"],
            "--no-load-optim", "--no-load-rng", "--micro-batch-size", "3",
            "--log-interval", "5", *MODEL, *trained["tok_flags"], *extra]


@pytest.fixture(scope="module")
def single(trained):
    """Single-process results of tasks/main.py and the plain reference."""
    d = trained["dir"]
    model = _reference_model(trained)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=trained["tok_flags"][1],
                                merge_file=trained["tok_flags"][3])
    _lambada_file(model, tokenizer, d / "lambada.jsonl")
    runs = {
        "wiki": _argv(trained, "WIKITEXT103", d / "wikitext_sample.tokens",
                      "--overlapping-eval", "5"),
        "strict": _argv(trained, "LAMBADA", d / "lambada.jsonl", "--strict-lambada"),
        "plain": _argv(trained, "LAMBADA", d / "lambada.jsonl"),
    }
    got = {name: evaluate.main(argv) for name, argv in runs.items()}
    ref = {"wiki": _reference_wikitext(model, tokenizer, d / "wikitext_sample.tokens", 16, 5),
           "strict": _reference_lambada(model, tokenizer, d / "lambada.jsonl", True),
           "plain": _reference_lambada(model, tokenizer, d / "lambada.jsonl", False),
           "num_tokens": len(tokenizer.tokenize(detokenizer.wikitext_detokenizer(WIKI)))}
    return {"runs": runs, "got": got, "ref": ref}


def test_single_process_matches_reference(single):
    got, ref = single["got"], single["ref"]
    wiki = got["wiki"]
    assert wiki["avg_loss"] == pytest.approx(ref["wiki"], rel=REL)
    assert wiki["ppl"] == pytest.approx(math.exp(ref["wiki"]), rel=REL * 10)
    ratio = (ref["num_tokens"] - 1) / (len(WIKI.strip().split(" ")) - 1)
    assert wiki["token_ratio"] == pytest.approx(ratio, rel=1e-12) and ratio != 1.0
    assert wiki["adjusted_ppl"] == pytest.approx(math.exp(ref["wiki"] * ratio), rel=REL * 10)
    assert got["plain"]["num_examples"] == got["strict"]["num_examples"] == 12
    assert got["plain"]["num_correct"] == ref["plain"] and 0 < ref["plain"] < 12
    assert got["strict"]["num_correct"] == ref["strict"]
    assert got["plain"]["accuracy"] == ref["plain"] / 12


def test_several_micro_batches_per_schedule_run(single, capsys):
    """--global-batch-size 9 with --micro-batch-size 3: three micro-batches per schedule
    run, the last run filled up with unscored micro-batches; same numbers."""
    for name in ("wiki", "plain"):
        res = evaluate.main(single["runs"][name] + ["--global-batch-size", "9"])
        for key, value in single["got"][name].items():
            assert res[key] == pytest.approx(value, rel=REL)
    assert "> working on iteration: 0" in capsys.readouterr().out


def _layout_worker(rank, world_size, runs, layout):
    from megatron import arguments_checkpoint

    real, reads = arguments_checkpoint.read_checkpoint_args, []
    arguments_checkpoint.read_checkpoint_args = lambda load: reads.append(load) or real(load)
    out = {name: evaluate.main(argv + layout, rank, world_size) for name, argv in runs.items()}
    return {**out, "checkpoint_reads": len(reads)}


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
     "--global-batch-size", "6"],
    ["--use-checkpoint-args"],  # dp = 2, the model shape from the checkpoint
], ids=["tp2", "pp2", "pp2vp2", "dp2"])
def test_parallel_layouts_match_single_process(single, layout):
    runs = single["runs"]
    if layout == ["--use-checkpoint-args"]:  # drop the model shape flags
        shape = {"--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings"}
        runs = {k: [a for i, a in enumerate(v) if a not in shape and v[i - 1] not in shape]
                for k, v in runs.items()}
    results = run_distributed(_layout_worker, 2, runs, layout)
    if layout == ["--use-checkpoint-args"]:  # read by rank 0, handed to rank 1
        assert [r["checkpoint_reads"] for r in results] == [len(runs), 0]
    for res in results:  # every rank returns the all-reduced numbers
        assert res["wiki"]["avg_loss"] == pytest.approx(single["got"]["wiki"]["avg_loss"], rel=REL)
        assert res["strict"] == single["got"]["strict"]
        assert res["plain"] == single["got"]["plain"]


# --------------------------------------------------------------------- the command line
def test_cli_prints_megatrons_report(single, trained):
    """tasks/main.py as Megatron's script runs it (--batch-size, --no-load-*): the report
    block and the progress lines, with the in-process numbers."""
    argv = [a if a != "--micro-batch-size" else "--batch-size" for a in single["runs"]["wiki"]]
    proc = forked_script.run([sys.executable, str(ROOT / "tasks" / "main.py"), *argv],
                             cwd=ROOT, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    wiki = single["got"]["wiki"]
    text = (f" validation results on WIKITEXT103 | avg loss: {wiki['avg_loss']:.4E} | ppl: "
            f"{wiki['ppl']:.4E} | adjusted ppl: {wiki['adjusted_ppl']:.4E} | token ratio: "
            f"{wiki['token_ratio']} |")
    i = lines.index(text)
    assert lines[i - 1] == lines[i + 1] == "-" * (len(text) + 1)
    assert "> working on iteration: 0" in lines and "> working on iteration: 5" in lines
    assert "> working on iteration: 1" not in lines


def test_another_tokenizer_file_than_the_checkpoints_warns(single, trained, tmp_path, capsys):
    """A merge file other than the one the checkpoint was trained with (same vocabulary
    size) was evaluated in silence: the warning a resume prints was left out for an
    evaluation-only load, and the dry run too. Now one line, in both; none for the
    checkpoint's own files."""
    merges = tmp_path / "merges.txt"
    lines = Path(trained["tok_flags"][3]).read_text().splitlines()
    merges.write_text("\n".join(lines[:-1]) + "\n")  # one merge fewer: other token ids
    argv = [str(merges) if a == trained["tok_flags"][3] else a for a in single["runs"]["plain"]]
    warning = (f"WARNING: this run's tokenizer is likely not the one the checkpoint in "
               f"{trained['ckpt']}/iter_0000004 was trained with: --merge-file {merges} differs "
               f"from the file the checkpoint was trained with, {trained['tok_flags'][3]}; the "
               "model reads other token ids than it learned")
    evaluate.main(argv)
    assert capsys.readouterr().out.count(warning) == 1
    assert warning in _dry(argv, capsys)[1]
    evaluate.main(single["runs"]["plain"])
    assert "WARNING: this run's tokenizer" not in capsys.readouterr().out


def _error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        evaluate.main(argv)
    assert e.value.code != 0
    return str(e.value) + capsys.readouterr().err


NULL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]


def test_errors(tmp_path, capsys):
    assert "unknown --task SQUAD; the supported tasks are WIKITEXT103 and LAMBADA" in \
        _error_of(["--task", "SQUAD", "--valid-data", "x"] + NULL, capsys)
    assert "--task RACE is one of Megatron-LM's BERT tasks" in \
        _error_of(["--task", "RACE", "--valid-data", "x"] + NULL, capsys)
    assert "--task is required" in _error_of(NULL, capsys)
    # a mistyped flag is named first, as pretrain_gpt.py does (it said "--task is required",
    # "--task WIKITEXT103 needs --valid-data FILE")
    assert "unrecognized arguments: --tsk (did you mean --task?) WIKITEXT103" in \
        _error_of(["--tsk", "WIKITEXT103", "--valid-data", "x"] + NULL, capsys)
    assert "unrecognized arguments: --valid-dta (did you mean --valid-data?) x" in \
        _error_of(["--task", "WIKITEXT103", "--valid-dta", "x"] + NULL, capsys)
    assert "--task LAMBADA needs --valid-data FILE" in _error_of(["--task", "LAMBADA"] + NULL,
                                                                capsys)
    # one report per file: a second file is refused (Megatron-LM asserts one), not dropped
    assert ("--valid-data names 2 files (wiki.valid.tokens wiki.test.tokens); --task "
            "WIKITEXT103 reports on one file: run tasks/main.py once per file") in _error_of(
        ["--task", "WIKITEXT103", "--valid-data", "wiki.valid.tokens", "wiki.test.tokens"]
        + NULL, capsys)
    missing = str(tmp_path / "wiki.tokens")
    assert f"--valid-data {missing}: file not found" in \
        _error_of(["--task", "WIKITEXT103", "--valid-data", missing] + NULL, capsys)
    (tmp_path / "empty.txt").write_text("  \n")
    assert "is empty" in _error_of(["--task", "WIKITEXT103", "--valid-data",
                                    str(tmp_path / "empty.txt")] + NULL, capsys)
    (tmp_path / "l.jsonl").write_text('{"text": "1 2 3"}\n{"txt": "1 2"}\n')
    assert 'line 2: no "text" field' in _error_of(
        ["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl")] + NULL, capsys)
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": " ".join(["7"] * 30)}) + "\n")
    assert ("line 1 (30 tokens); the longest needs --seq-length 29, beyond the model's "
            "--max-position-embeddings 16: remove or shorten") in _error_of(
        ["--task", "LAMBADA", "--valid-data", str(tmp_path / "long.jsonl")] + NULL, capsys)
    # a flag Megatron-LM removed before 23.05 is refused as pretrain_gpt.py refuses it
    assert "--activations-checkpoint-method was removed" in _error_of(
        ["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl"),
         "--activations-checkpoint-method", "uniform"] + NULL, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--task", "SQUAD", "--valid-data", "x"], "error: unknown --task SQUAD"),
    (["--task", "LAMBADA", "--valid-data", "x", "--activations-checkpoint-method", "uniform"],
     "error: --activations-checkpoint-method was removed"),
    (["--task", "LAMBADA", "--valid-data", "x", "--num-layers", "two"], "error: "),
])
def test_errors_name_the_program_as_megatrons_tasks_main_does(flags, message, capsys,
                                                                monkeypatch):
    """Megatron-LM's tasks/main.py reports a flag error through argparse, which names the
    program by the script's basename: `main.py: error: ...`. The tasks flags' errors said
    `tasks/main.py: error:`, pretrain_gpt.py's flags' `main.py: error:`."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "tasks" / "main.py"), *flags, *NULL])
    with pytest.raises(SystemExit):  # the error goes to stderr once
        evaluate.main(flags + NULL)
    err = capsys.readouterr().err
    assert err.startswith(f"main.py: {message}") and err.count("error: ") == 1, err


def test_finetuning_flags_warn(tmp_path, capsys):
    (tmp_path / "l.jsonl").write_text('{"text": "1 2 3"}\n')
    res = evaluate.main(["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl"),
                         "--epochs", "3", "--train-data", "a", "b", "--keep-last"] + NULL)
    out = capsys.readouterr().out
    assert f"> building lambada dataset from {tmp_path / 'l.jsonl'} ...\n > found 1 samples." in out
    assert "--epochs has no effect" in out and "--train-data has no effect" in out
    assert "no --load: evaluating a randomly initialised model" in out
    assert res["num_examples"] == 1


def test_load_without_a_checkpoint_is_refused(tmp_path, capsys):
    """A --load that names no checkpoint (a mistyped path) is an error, not a randomly
    initialised model's numbers reported as the checkpoint's."""
    (tmp_path / "l.jsonl").write_text('{"text": "1 2 3"}\n')
    base = ["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl")] + NULL
    missing = str(tmp_path / "no_such_ckpt")
    msg = _error_of(base + ["--load", missing], capsys)
    assert f"--load {missing} does not exist: there is no checkpoint to evaluate" in msg
    (tmp_path / "empty_dir").mkdir()
    msg = _error_of(base + ["--load", str(tmp_path / "empty_dir")], capsys)
    assert "has no latest_checkpointed_iteration.txt" in msg and "--save wrote" in msg
    (tmp_path / "ck" / "iter_0000005").mkdir(parents=True)  # an iteration dir given
    msg = _error_of(base + ["--load", str(tmp_path / "ck" / "iter_0000005")], capsys)
    assert f"--load takes the directory above it: --load {tmp_path / 'ck'}" in msg


def test_valid_data_warnings(tmp_path):
    """WikiText's tokenized text under a path that does not select the WikiText
    detokenizer (scored as written), and a JSON-lines file given to WIKITEXT103, each get
    a warning naming the file."""
    assert datasets.wikitext_warnings("data/wikitext-103/wiki.test.tokens", WIKI) == []
    assert datasets.wikitext_warnings("data/wiki.test.tokens", WIKI) == []
    assert datasets.wikitext_warnings("plain.txt", "To be , or not to be .\n") == []
    (msg,) = datasets.wikitext_warnings("data/test.tokens", " the well @-@ known \n")
    assert "data/test.tokens" in msg and "does not select the WikiText detokenizer" in msg
    (msg,) = datasets.wikitext_warnings("wikitext_lambada.jsonl", '\n{"text": "a b c"}\n')
    assert "looks like JSON lines" in msg and "--task LAMBADA" in msg
    path = tmp_path / "test.tokens"  # tmp_path holds the test's name: no "wiki"
    path.write_text(" a @-@ b c d \n")
    words = type("Words", (), {"eod": 0, "tokenize": staticmethod(str.split)})
    said = []
    data = datasets.build_wikitext_data(str(path), words, 4, 4, warn=said.append)
    assert data.num_tokenized_tokens == 5 and len(said) == 1 and str(path) in said[0]


def test_file_warnings_printed_once_under_a_launcher(trained, tmp_path):
    """The --valid-data and --overlapping-eval warnings come before the process group:
    rank 0 prints them under torchrun (each rank printed its own copy)."""
    path = tmp_path / "test.tokens"  # no "wiki": WikiText's text scored as written
    path.write_text(WIKI)
    argv = ["--task", "WIKITEXT103", "--valid-data", str(path), "--overlapping-eval", "40",
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", *MODEL,
            *trained["tok_flags"]]
    proc = forked_script.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-port", str(free_port()),
                              str(ROOT / "tasks" / "main.py"), *argv],
                             cwd=ROOT, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("WARNING: --overlapping-eval 40 is larger than --seq-length 16") == 1, out
    assert out.count("does not select the WikiText detokenizer") == 1, out
    assert out.count(" validation results on WIKITEXT103 | ") == 1, out
    # Megatron's line on the file read, with the counts of the token ratio
    assert out.count(" > number of original tokens: 60, number of detokenized tokens: ") == 1


# tasks/main.py with rank 1's 10th all-reduce (mid-evaluation, at tp 2) raising.
FAULT_WRAPPER = """
import os, runpy, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
original, calls = dist.all_reduce, [0]

def faulty(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 10 and os.environ["RANK"] == "1":
        raise RuntimeError("injected failure mid-evaluation")
    return original(*args, **kwargs)

dist.all_reduce = faulty
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_a_rank_that_fails_is_named_in_one_line_by_the_others(trained, tmp_path):
    """Rank 1 fails mid-evaluation: rank 0's collective then failed with gloo's
    'Connection closed by peer' traceback; now it prints one line naming rank 1 and its
    error (megatron/rank_failure.py, as pretrain_gpt.py and tools/generate.py do). Rank 1
    runs under a second torchrun (two nodes on this host), where the line matters: on one
    node, torchrun ends rank 0 (SIGTERM) as soon as it sees rank 1 fail, before rank 0
    may have printed (seen under load), and its own summary names rank 1."""
    wrapper = tmp_path / "fault.py"
    wrapper.write_text(FAULT_WRAPPER.format(root=str(ROOT),
                                            script=str(ROOT / "tasks" / "main.py")))
    argv = ["--task", "WIKITEXT103", "--valid-data", str(trained["dir"] / "wikitext_sample.tokens"),
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--load",
            trained["ckpt"], *MODEL, *trained["tok_flags"]]
    port, logs = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"]
    pids = [forked_script.start_command(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(wrapper), *argv], cpu_env(PYTHONUNBUFFERED="1"), log, cwd=ROOT)
        for node, log in enumerate(logs)]
    statuses = forked_script.wait(pids, 300)
    node0, node1 = (log.read_text() for log in logs)
    assert statuses[0] != 0 and statuses[1] != 0, (statuses, node0[-3000:])
    assert "RuntimeError: injected failure mid-evaluation" in node1  # rank 1's own traceback
    assert "[rank0]:" not in node0, node0[-3000:]  # no traceback of rank 0
    lines = [line for line in node0.splitlines() if line.startswith("[rank 0]")]
    assert len(lines) == 1, node0[-3000:]
    assert lines[0].startswith("[rank 0] stopped during the zero-shot evaluation: a collective "
                               "failed ("), lines
    assert lines[0].endswith("because rank 1 stopped first, during the zero-shot evaluation, "
                             "with RuntimeError: injected failure mid-evaluation -- its "
                             f"traceback is in {logs[1]} on {socket.gethostname()}"), lines


# tasks/main.py at dp 2 with rank 1 stuck in its first evaluation batch and the collective
# timeout shortened to seconds.
HANG_WRAPPER = """
import dataclasses, os, runpy, sys, time
sys.path.insert(0, {root!r})
import megatron.arguments as arguments
import megatron.train_step as train_step
_parse, _run = arguments.parse_and_validate, train_step.run_schedule

def parse_and_validate(*args, **kwargs):
    config = _parse(*args, **kwargs)
    config.parallel = dataclasses.replace(config.parallel, distributed_timeout_minutes=0.05)
    return config

def run_schedule(*args, **kwargs):
    if os.environ["RANK"] == "1":
        time.sleep(300)
    return _run(*args, **kwargs)

arguments.parse_and_validate, train_step.run_schedule = parse_and_validate, run_schedule
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_stuck_rank_is_named_and_every_rank_ends(trained, tmp_path):
    """Rank 1 hangs mid-evaluation while rank 0 waits in the data-parallel sum: rank 0
    waited for the process group's own timeout (--distributed-timeout-minutes + 1) and
    died with a backend error naming no rank; now its watchdog names rank 1 after
    --distributed-timeout-minutes and both ranks end with the watchdog's status."""
    wrapper = tmp_path / "hang.py"
    wrapper.write_text(HANG_WRAPPER.format(root=str(ROOT),
                                           script=str(ROOT / "tasks" / "main.py")))
    argv = ["--task", "WIKITEXT103", "--valid-data", str(trained["dir"] / "wikitext_sample.tokens"),
            "--micro-batch-size", "2", "--load", trained["ckpt"], *MODEL, *trained["tok_flags"]]
    started = time.monotonic()
    proc = forked_script.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-port", str(free_port()), str(wrapper), *argv],
                             cwd=ROOT, env=cpu_env(), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(r"\[watchdog rank 0\] collective evaluation sum all-reduce \(data-parallel "
                     r"group\) did not complete within 3 s during the zero-shot evaluation; "
                     r"ranks that did not arrive: \[1\]", out), out[-3000:]
    assert "time.sleep(300)" in out  # rank 1 says where it is stuck
    assert time.monotonic() - started < 60


def test_other_tasks_flags_and_overlapping_eval_below_one_warn():
    """--strict-lambada on WIKITEXT103 and --overlapping-eval on LAMBADA have no effect;
    --overlapping-eval 0 is taken as 1 (a window per token): each says so."""
    def warnings(argv):
        said = []
        ns, _ = evaluate.split_args(argv)
        evaluate.check_task_args(ns, warn=said.append)
        return ns, " | ".join(said)

    ns, said = warnings(["--task", "WIKITEXT103", "--valid-data", "w", "--strict-lambada"])
    assert "--strict-lambada has no effect on --task WIKITEXT103" in said
    assert ns.overlapping_eval == 32  # Megatron-LM's default
    ns, said = warnings(["--task", "LAMBADA", "--valid-data", "l", "--overlapping-eval", "64"])
    assert "--overlapping-eval has no effect on --task LAMBADA" in said
    ns, said = warnings(["--task", "WIKITEXT103", "--valid-data", "w", "--overlapping-eval", "0"])
    assert "--overlapping-eval 0 is taken as 1" in said and ns.overlapping_eval == 0
    assert warnings(["--task", "LAMBADA", "--valid-data", "l", "--strict-lambada"])[1] == ""


def _dry(argv, capsys):
    """(exit status, printed report) of tasks/main.py --dry-run."""
    try:
        evaluate.main(argv + ["--dry-run"])
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().out


def test_dry_run_checks_what_the_evaluation_reads(trained, capsys, tmp_path):
    """The checkpoint is read as the evaluation reads it (weights only: no --no-load-optim
    needed), the --valid-data file and tokenizer files are checked, the memory is a
    forward-only estimate, and a problem exits 1."""
    wiki = trained["dir"] / "wikitext_sample.tokens"
    argv = ["--task", "WIKITEXT103", "--valid-data", str(wiki), "--load", trained["ckpt"],
            "--micro-batch-size", "3", *MODEL, *trained["tok_flags"]]
    status, out = _dry(argv, capsys)
    assert status == 0, out
    assert out.startswith("dry run: zero-shot evaluation resolved, nothing launched\n")
    assert f"  task: WIKITEXT103 on {wiki}, sequence length 16, micro batch 3, windows " \
           "every 16 tokens (--overlapping-eval)" in out  # 32 (default) > 16
    assert "memory per GPU, estimate (forward only):" in out and "+ optimizer" not in out
    assert "all input files found" in out
    assert (f"checkpoint (--load {trained['ckpt']}):\n  evaluates the weights of iteration 4 "
            f"({trained['ckpt']}/iter_0000004)") in out
    assert "training" not in out and "resumes" not in out

    missing = tmp_path / "wiki.tokens"
    bad = list(argv)
    bad[bad.index(str(wiki))] = str(missing)
    bad[bad.index(trained["ckpt"])] = str(tmp_path / "ckpt_typo")
    status, out = _dry(bad, capsys)
    assert status == 1
    assert f"missing inputs:\n  {missing} (--valid-data)" in out
    assert f"--load {tmp_path / 'ckpt_typo'} does not exist: there is no checkpoint to " \
           "evaluate" in out

    status, out = _dry(argv + ["--num-layers", "2"], capsys)
    assert status == 1 and "--num-layers: checkpoint 4, this run 2" in out
    assert out.rstrip().endswith("the evaluation would stop when it loads the checkpoint")


def test_dry_run_reads_the_valid_data_as_the_evaluation_does(trained, capsys, tmp_path):
    """A --valid-data file that exists but that the evaluation would stop on (a LAMBADA
    line that is not JSON, a passage longer than --seq-length + 1 tokens) fails the dry
    run with the evaluation's own message, status 1; a good file reports its samples."""
    argv = ["--task", "LAMBADA", "--load", trained["ckpt"], "--micro-batch-size", "2",
            *MODEL, *trained["tok_flags"]]
    good = tmp_path / "lambada_good.jsonl"
    good.write_text(json.dumps({"text": "the quick brown fox"}) + "\n"
                    + json.dumps({"text": "jumps over the lazy dog"}) + "\n")
    status, out = _dry(argv + ["--valid-data", str(good)], capsys)
    assert status == 0, out
    assert f"--valid-data {good}: 2 LAMBADA passages" in out

    long = tmp_path / "lambada_long.jsonl"
    long.write_text(json.dumps({"text": "the quick brown fox"}) + "\n"
                    + json.dumps({"text": " ".join(["fox"] * 40)}) + "\n")
    status, out = _dry(argv + ["--valid-data", str(long)], capsys)
    assert status == 1, out
    assert f"--valid-data {long}: 1 of 2 passage(s) are longer than the 17 tokens" in out
    assert "that --seq-length 16 holds: line 2 (" in out

    bad = tmp_path / "lambada_bad.jsonl"
    bad.write_text("not json\n")
    status, out = _dry(argv + ["--valid-data", str(bad)], capsys)
    assert status == 1 and f"--valid-data {bad} line 1: not JSON" in out

    wiki = trained["dir"] / "wikitext_sample.tokens"
    status, out = _dry(["--task", "WIKITEXT103", "--valid-data", str(wiki), "--load",
                        trained["ckpt"], "--micro-batch-size", "2", *MODEL,
                        *trained["tok_flags"]], capsys)
    assert status == 0, out
    assert f"--valid-data {wiki}: " in out and " windows of 16 tokens" in out


def test_evaluation_memory_estimate_is_forward_only():
    """Weights alone as model state (16-bit with --bf16), one layer's activations, the
    last stage's logits: below the training estimate of the same configuration."""
    from megatron.arguments import parse_and_validate
    from megatron.memory_estimate import estimate_evaluation_memory, estimate_memory

    argv = NULL + ["--lr", "0", "--skip-train", "--bf16", "--global-batch-size", "8"]
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    train, ev = estimate_memory(cfg), estimate_evaluation_memory(cfg)
    assert ev["weights"] == train["weights"]  # bf16 weights, 2 bytes each
    assert ev["logits"] == train["logits"]
    layers = cfg.model.num_layers
    assert ev["activations"] < train["activations"] / layers * 1.5
    assert ev["allocated"] == ev["weights"] + ev["activations"] + ev["logits"]
    assert ev["total"] < train["total"] and "optimizer" not in ev
