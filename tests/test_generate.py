"""tools/generate.py: checkpoints written by the trainer (tp 1, tp 2, pp 2) load as one
model that computes the same loss, greedy generation equals a plain argmax loop, sampling
options behave, and shards of any tp x pp x virtual-stage layout merge back exactly."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from megatron.arguments import parse_and_validate
from megatron.checkpointing import MODEL_FILENAME, rank_dir_name
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.stages import stage_layout
from megatron.core.tensor_parallel import shard_of_full_weight
from tests.dist_utils import run_distributed
from tests.gpt_helpers import cli_trainer, train_steps
from tools import generate
from tools.generate_prompts import file_prompts

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 "
        "--train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
        "--hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization --save-interval 3")


def _train(save_dir, extra="", world_size=1, rank=0, steps=3):
    """Train a tiny model for `steps` steps, save it, then the loss of the NEXT global batch
    (forward only, all micro-batches) and those micro-batches."""
    from megatron.train_step import forward_backward
    from megatron.trainer_checkpoint import save_trainer_checkpoint
    from megatron.training import data_iterator

    cfg, rt, tr = cli_trainer(f"{TINY} --save {save_dir} {extra}".split(), world_size, rank)
    data = data_iterator(cfg, rt, "train", 0)
    train_steps(tr, data, steps)
    save_trainer_checkpoint(tr)
    batches = [next(data) for _ in range(cfg.data.num_micro_batches)]
    loss = forward_backward(tr, iter(batches), len(batches), forward_only=True)
    return tr, float(loss), [b["text"] for b in batches]


def _loss_of(model, batches) -> float:
    with torch.no_grad():
        losses = [model(t[:, :-1], labels=t[:, 1:]).float().mean() for t in batches]
    return float(sum(losses) / len(losses))


def _run_cli(*argv) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert generate.main([*argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_greedy_equals_argmax_loop_and_sampling(tmp_path, capsys):
    tr, loss, batches = _train(tmp_path)
    model, config, iteration = generate.load_model(str(tmp_path))
    assert iteration == 3 and config.model.activation == "openai_gelu"  # biases: tanh form
    assert _loss_of(model, batches) == pytest.approx(loss, rel=1e-6)
    out = _run_cli("--load", str(tmp_path), "--prompt-ids", "5,6,7", "--max-new-tokens", "12",
                   "--greedy", "--no-stop-at-eod")
    ref, ids = tr.model.module.eval(), [5, 6, 7]
    with torch.no_grad():
        for _ in range(12):  # direct argmax over the trained model, vocab limited to 101
            logits = ref(torch.tensor([ids[-16:]]))[0, -1, :101]
            ids.append(int(logits.argmax()))
    assert out["generated_ids"] == ids[3:] and out["prompt_ids"] == [5, 6, 7]
    # the load of a large model takes minutes: announced first, on stderr (not --json's)
    assert f"loading the checkpoint under {tmp_path} ..." in capsys.readouterr().err
    # the text the new ids add to the prompt's "5 6 7": NullTokenizer's space included
    assert out["generated_text"] == " " + " ".join(map(str, ids[3:]))
    assert _run_cli("--load", str(tmp_path), "--prompt", "5 6 7", "--max-new-tokens", "12",
                    "--greedy", "--no-stop-at-eod")["generated_ids"] == ids[3:]
    sampled = [_run_cli("--load", str(tmp_path), "--prompt-ids", "5,6,7", "--seed", str(s),
                        "--temperature", "1.5", "--max-new-tokens", "8",
                        "--no-stop-at-eod")["generated_ids"] for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    top1 = _run_cli("--load", str(tmp_path), "--prompt-ids", "5,6,7", "--top-k", "1",
                    "--max-new-tokens", "12", "--no-stop-at-eod")["generated_ids"]
    assert top1 == ids[3:]
    past_max = [_run_cli("--load", str(tmp_path), "--prompt-ids", "5,6,7", "--seed", "2",
                         "--max-new-tokens", "20", "--no-stop-at-eod", *flags)["generated_ids"]
                for flags in ([], ["--no-kv-cache"])]  # 23 tokens: past the 16 positions
    assert past_max[0] == past_max[1] and len(past_max[0]) == 20


def test_generation_past_the_positions_says_so(tmp_path, capsys):
    """The context is cut to the last --max-position-embeddings tokens: said on stderr
    (before: silently, a long prompt's start was dropped), stdout's JSON left alone."""
    assert generate.window_note(3, 14, 16) is None  # the 14th token sees 16 tokens
    assert "from new token 15 on, each sees only the last 16" in generate.window_note(3, 15, 16)
    assert generate.window_note(20, 0, 16) is None  # scores nothing, generates nothing
    _train(tmp_path, steps=1)
    capsys.readouterr()
    out = _run_cli("--load", str(tmp_path), "--prompt-ids", ",".join(["5"] * 20),
                   "--max-new-tokens", "2", "--greedy")
    assert len(out["prompt_ids"]) == 20
    assert ("note: the prompt has 20 tokens, more than the model's 16 positions "
            "(--max-position-embeddings): only its last 16 are seen") in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 6\n" + "7 " * 20 + "\n")
    assert generate.main(["--load", str(tmp_path), "--prompt-file", str(prompts),
                          "--max-new-tokens", "2", "--greedy"]) == 0
    err = capsys.readouterr().err
    assert "note: [1] the prompt has 20 tokens" in err and "[0]" not in err


def test_bf16_checkpoint_loads_in_any_dtype(tmp_path):
    """A --bf16 run's checkpoint decodes in fp32 (the CPU default), bf16 and fp16: the model
    config's params_dtype follows the weights, so the embeddings are cast to match them."""
    _train(tmp_path, "--bf16", steps=1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model, config, _ = generate.load_model(str(tmp_path), dtype=dtype)
        assert config.model.params_dtype == dtype == model.config.params_dtype
        assert {p.dtype for p in model.parameters()} == {dtype}
    for flags in ([], ["--dtype", "fp32"], ["--dtype", "bf16"], ["--dtype", "fp16"]):
        out = _run_cli("--load", str(tmp_path), "--prompt-ids", "1,2", "--greedy",
                       "--max-new-tokens", "3", "--no-stop-at-eod", *flags)
        assert len(out["generated_ids"]) == 3, flags


def test_seeded_samples_do_not_depend_on_the_vocabulary_padding(tmp_path):
    """The same weights resharded to tp 2 (vocabulary padded to 256 rows, not 128) give the
    same seeded samples: only the tokenizer's 101 ids are drawn from."""
    from tools.checkpoint_convert import reshard

    _train(tmp_path / "tp1", steps=1)
    reshard(str(tmp_path / "tp1"), str(tmp_path / "tp2"), 2, 1)
    assert generate.load_model(str(tmp_path / "tp2"))[1].model.padded_vocab_size == 256
    out = [_run_cli("--load", str(tmp_path / name), "--prompt-ids", "5,6,7", "--seed", "3",
                    "--temperature", "2", "--max-new-tokens", "12", "--no-stop-at-eod")
           for name in ("tp1", "tp2")]
    assert out[0]["generated_ids"] == out[1]["generated_ids"]


def test_sample_next_filters():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    g = torch.Generator().manual_seed(0)
    assert generate.sample_next(logits, greedy=True) == 1
    assert generate.sample_next(logits, temperature=0) == 1
    assert {generate.sample_next(logits, top_p=0.01, generator=g) for _ in range(20)} == {1}
    assert {generate.sample_next(logits, top_k=2, generator=g) for _ in range(200)} == {1, 2}
    p = torch.softmax(logits, 0)  # top-p 0.9: ids 1 and 2 hold 0.90 of the mass -> + id 0
    assert p[1] + p[2] < 0.9 < p[1] + p[2] + p[0]
    assert {generate.sample_next(logits, top_p=0.9, generator=g) for _ in range(300)} == {0, 1, 2}
    for tiny in (1e-40, 5e-324):  # logits / temperature overflow: the argmax, no nan
        assert {generate.sample_next(logits, temperature=tiny, generator=g) for _ in range(5)} \
            == {1}
        assert generate.sample_next(logits, temperature=tiny, top_p=0.5, top_k=2,
                                    generator=g) == 1


def test_sample_next_top_p_is_megatrons_nucleus():
    """An id is kept when the more likely ids hold at most top_p (Megatron's shifted
    cumulative sum, `> top_p` dropped): at a boundary mass equal to top_p the next id
    stays (probabilities 1/2, 1/4, 1/8, 1/8 at top_p 0.75: ids 0, 1 and 2, where the
    filter kept 0 and 1), and top_p 0 keeps the most likely id (no NaN)."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    g = torch.Generator().manual_seed(0)
    assert {generate.sample_next(logits, top_p=0.75, generator=g) for _ in range(300)} \
        == {0, 1, 2}
    assert {generate.sample_next(logits, top_p=0.5, generator=g) for _ in range(200)} == {0, 1}
    assert {generate.sample_next(logits, top_p=0.0, generator=g) for _ in range(20)} == {0}


def _tp_pp_worker(rank, world_size, save_dir, extra):
    _, loss, batches = _train(save_dir, extra, world_size=world_size, rank=rank, steps=2)
    return loss, batches


@pytest.mark.parametrize("extra", [
    "--tensor-model-parallel-size 2 --swiglu --group-query-attention --num-query-groups 2 "
    "--untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope",
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--pipeline-model-parallel-size 2",
], ids=["tp2-swiglu-gqa", "tp2-sp", "pp2-tied"])
def test_parallel_checkpoint_loads_as_one_model(tmp_path, extra):
    results = run_distributed(_tp_pp_worker, 2, str(tmp_path), extra)
    loss, batches = results[0]
    model, config, _ = generate.load_model(str(tmp_path))
    assert config.parallel.tp_size == 1 and config.model.sequence_parallel is False
    assert _loss_of(model, batches) == pytest.approx(loss, rel=1e-5)
    out = _run_cli("--load", str(tmp_path), "--prompt-ids", "1,2", "--greedy",
                   "--max-new-tokens", "4", "--no-stop-at-eod")
    assert len(out["generated_ids"]) == 4 and all(0 <= i < 101 for i in out["generated_ids"])


def _write_synthetic(root, full_model, args, tp, pp, vpp):
    """Split `full_model`'s weights the way tp x pp x vpp training holds them; write them."""
    params = dict(full_model.named_parameters())
    full = full_model.state_dict()
    iter_dir = root / "iter_0000007"
    for p in range(pp):
        specs = stage_layout(args["num_layers"], pp, p, vpp)
        for t in range(tp):
            chunks = []
            for spec in specs:
                sd = {}
                for key, value in full.items():
                    local = _local_key(key, spec)
                    if local is None:
                        continue
                    prm = params[key]
                    if getattr(prm, "tensor_model_parallel", False):
                        value = shard_of_full_weight(value, prm.partition_dim,
                                                     prm.partition_stride, t, tp)
                    sd[local] = value.clone()
                if spec.post_process and not spec.pre_process:  # the tied output copy
                    sd["word_embeddings_for_head.weight"] = torch.zeros(3)
                chunks.append(sd)
            state = {"args": args, "iteration": 7}
            state.update({"model": chunks[0]} if len(chunks) == 1 else
                         {f"model{i}": c for i, c in enumerate(chunks)})
            path = iter_dir / rank_dir_name(t, p, pp)
            path.mkdir(parents=True)
            torch.save(state, path / MODEL_FILENAME)
    (root / "latest_checkpointed_iteration.txt").write_text("7")


def _local_key(key, spec):
    if key.startswith("language_model.encoder.layers."):
        i = int(key.split(".")[3])
        if not spec.layer_offset <= i < spec.layer_offset + spec.num_layers:
            return None
        parts = key.split(".")
        parts[3] = str(i - spec.layer_offset)
        return ".".join(parts)
    if key.startswith("language_model.embedding."):
        return key if spec.pre_process else None
    return key if spec.post_process else None  # final norm, output layer


@pytest.mark.parametrize("tp,pp,vpp", [(2, 1, None), (4, 2, None), (2, 2, 2), (1, 4, None)])
def test_synthetic_layouts_merge_back_exactly(tmp_path, tp, pp, vpp):
    argv = (f"{TINY} --num-layers 8 --hidden-size 64 --num-attention-heads 8 --swiglu "
            "--group-query-attention --num-query-groups 4 --untie-embeddings-and-output-weights"
            ).split()
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    args = dict(cfg.args, virtual_pipeline_model_parallel_size=vpp,  # as a tp x pp save
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    full = GPTModel(cfg.model)
    _write_synthetic(tmp_path, full, args, tp, pp, vpp)
    model, _, iteration = generate.load_model(str(tmp_path))
    assert iteration == 7
    for key, value in full.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an MPS device")
def test_a_device_this_machine_lacks_is_an_error_not_a_traceback():
    """`--device mps` (a Mac user's guess; or a CPU-only torch build) ended in torch's
    RuntimeError traceback from deep inside loading the model."""
    for name in ("mps", "mps:0"):
        with pytest.raises(SystemExit, match=rf"--device {name}: this machine has no usable "
                                             r"mps device \(.+\); use --device cpu"):
            generate._device(name)
    assert generate._device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature inf must be a finite number >= 0"),
    (["--temperature", "-1", "--top-k", "-2"],
     "--temperature -1.0 must be a finite number >= 0 (0: greedy, as --greedy); --top-k -2 "
     "must be an integer >= 0"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--max-new-tokens", "-3"], "--max-new-tokens -3 must be an integer >= 0"),
    (["--seed", str(2**64)], f"--seed {2**64} must be in 1..4294967295 (as pretrain_gpt.py"),
    (["--seed", "4294967296"], "--seed 4294967296 must be in 1..4294967295"),
    (["--seed", "0"], "--seed 0 must be in 1..4294967295"),
])
def test_bad_sampling_flags_are_named(tmp_path, capsys, flags, message):
    """A nan --temperature passed the range check (a comparison with nan is false) and
    ended in torch.multinomial's traceback after loading the model, an inf one sampled
    uniformly; the one message for all four flags named neither the flag nor its value.
    A --seed >= 2**64 was torch's RuntimeError after the checkpoint had loaded (the
    directory here is empty: these errors come before any loading)."""
    with pytest.raises(SystemExit) as exc:
        generate.parse_args(["--load", str(tmp_path), "--prompt-ids", "1", *flags])
    assert exc.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("1,,2", "--prompt-ids '1,,2': item 2 is empty"),
    ("1,2,", "--prompt-ids '1,2,': item 3 is empty"),
    ("5, ,6", "--prompt-ids '5, ,6': item 2 is empty"),
    ("1,x", "item 2 'x' is not an integer"),
])
def test_prompt_ids_items_are_all_integers(text, message):
    """(An empty item was dropped: 1,,2 read as 1,2.)"""
    from tools.generate_prompts import prompt_ids

    with pytest.raises(SystemExit, match=re.escape(message)):
        prompt_ids(argparse.Namespace(prompt_ids=text), None, None)
    assert prompt_ids(argparse.Namespace(prompt_ids=" 1, 2 "), None, None) == [1, 2]


def test_user_errors(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint under --load"):
        generate.load_model(str(tmp_path))
    _train(tmp_path, steps=1)
    with pytest.raises(SystemExit, match=r"outside the vocabulary \[0, 101\)"):
        generate.main(["--load", str(tmp_path), "--prompt-ids", "1,101"])  # padded: 128
    with pytest.raises(SystemExit, match="'abc': NullTokenizer expects space-separated"):
        generate.main(["--load", str(tmp_path), "--prompt", "abc"])
    for empty in (["--prompt", ""], ["--prompt-ids", ""]):
        with pytest.raises(SystemExit, match="the prompt is empty"):
            generate.main(["--load", str(tmp_path), *empty])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: this machine has 0 usable CUDA"):
            generate.main(["--load", str(tmp_path), "--prompt", "1", "--device", "cuda"])
    with pytest.raises(SystemExit, match="--device 'gpu0'"):
        generate.main(["--load", str(tmp_path), "--prompt", "1", "--device", "gpu0"])
    it_dir = tmp_path / "iter_0000001"
    with pytest.raises(SystemExit, match=f"--load {tmp_path} --iteration 1$"):
        generate.main(["--load", str(it_dir), "--prompt", "1"])
    with pytest.raises(SystemExit, match="expected comma-separated integers"):
        generate.main(["--load", str(tmp_path), "--prompt-ids", "a,b"])
    with pytest.raises(SystemExit, match="--prompt needs the checkpoint's tokenizer"):
        generate.main(["--load", str(tmp_path), "--prompt", "hello",
                       "--tokenizer-type", "GPT2BPETokenizer"])
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(SystemExit, match="it holds iter_0000001: pass --iteration N"):
        generate.main(["--load", str(tmp_path), "--prompt", "1"])


def test_a_tokenizer_that_does_not_fit_the_checkpoint(tmp_path, capsys):
    """Tokenizer files given again (--vocab-file/--merge-file) that are not the model's:
    more ids than the model's vocabulary rows used to end in an IndexError inside the
    embedding (a device-side assert on CUDA); now the tokenizer is refused with the
    reason, and --prompt-ids still generate. Fewer ids that pad to another size than
    the model's at any tensor-parallel size: used, with a warning naming both sizes."""
    from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

    vocab, merges = write_bpe_files(tmp_path, *train_tiny_bpe(TRAIN_TEXT, 300, False))
    bpe = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    small, large = tmp_path / "small", tmp_path / "large"
    _train(small, steps=1)  # NullTokenizer --vocab-size 100: 128 rows
    with pytest.raises(SystemExit, match=r"--prompt needs the checkpoint's tokenizer, which "
                                         r"cannot be built: tokenizer GPT2BPETokenizer: the "
                                         r"tokenizer has 557 ids, more than the 128 "
                                         r"vocabulary rows of the checkpoint's model.*trained "
                                         r"with --tokenizer-type NullTokenizer, --vocab-size 100"):
        generate.main(["--load", str(small), "--prompt", "the fox", *bpe])
    out = _run_cli("--load", str(small), "--prompt-ids", "5,6", "--max-new-tokens", "2", *bpe)
    assert len(out["generated_ids"]) == 2 and out["generated_text"] is None
    _train(large, "--vocab-size 10000", steps=1)  # 10112 rows: 79 x 128
    capsys.readouterr()
    out = _run_cli("--load", str(large), "--prompt", "the fox", "--max-new-tokens", "2", *bpe)
    assert isinstance(out["generated_text"], str)
    assert re.search(r"WARNING: tokenizer GPT2BPETokenizer: the tokenizer's 557 ids do not pad "
                     r"to the 10112 rows of the checkpoint's model at any tensor-parallel size "
                     r"up to 64 \(--make-vocab-size-divisible-by 128; at tp 1: 640\)",
                     capsys.readouterr().err)


def test_tokenizer_flags_other_than_the_checkpoints_are_warned(tmp_path, capsys):
    """--tokenizer-type or a tokenizer file that is not the checkpoint's, with as many ids
    (padded to the same rows): generation ran in silence with other ids and another
    end-of-document id. Now a WARNING names the flag, both values and the fix; the
    checkpoint's own file given again, or a copy of it (moved files), is not warned."""
    from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    vocab, merges = write_bpe_files(tmp_path / "a", *train_tiny_bpe(TRAIN_TEXT, 300, False))
    other, _ = write_bpe_files(tmp_path / "b", *train_tiny_bpe(TRAIN_TEXT, 300, True))
    copy = tmp_path / "copy.json"
    copy.write_bytes(Path(vocab).read_bytes())
    ckpt = tmp_path / "ckpt"
    _train(ckpt, f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} "
                 f"--merge-file {merges}", steps=1)
    run = ("--load", str(ckpt), "--prompt", "the fox", "--max-new-tokens", "1")
    capsys.readouterr()
    _run_cli(*run, "--vocab-file", vocab)
    _run_cli(*run, "--vocab-file", str(copy))
    assert "WARNING" not in capsys.readouterr().err
    _run_cli(*run, "--vocab-file", other)
    assert (f"WARNING: --vocab-file {other} differs from the file the checkpoint was trained "
            f"with, {vocab}; leave --vocab-file out to use the checkpoint's") in capsys.readouterr().err
    _run_cli("--load", str(ckpt), "--prompt", "5 6", "--max-new-tokens", "1",
             "--tokenizer-type", "NullTokenizer")
    assert ("WARNING: --tokenizer-type NullTokenizer is not the checkpoint's GPT2BPETokenizer"
            in capsys.readouterr().err)


def test_prompt_file_equals_one_prompt_at_a_time(tmp_path):
    """--prompt-file: each line's answer equals --prompt with --seed + its index, sampled
    (batched through the cache, and one by one with --no-kv-cache); a bad line is named."""
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=1)
    lines = ["5 6 7", "", "9", "11 12 13 14 15"]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    common = ["--load", str(ckpt), "--max-new-tokens", "6", "--temperature", "0.8",
              "--no-stop-at-eod", "--json"]
    for extra in ([], ["--no-kv-cache"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert generate.main([*common, *extra, "--prompt-file", str(tmp_path / "p.txt"),
                                  "--seed", "40"]) == 0
        got = [json.loads(line) for line in buf.getvalue().splitlines()]
        assert [g["index"] for g in got] == [0, 1, 2]
        for i, text in enumerate(t for t in lines if t):
            one = _run_cli(*common[:-1], "--prompt", text, "--seed", str(40 + i))
            assert got[i]["prompt_ids"] == one["prompt_ids"]
            assert got[i]["generated_ids"] == one["generated_ids"], (extra, i)
    (tmp_path / "bad.txt").write_text("5 6\nabc\n")
    with pytest.raises(SystemExit, match=r"NullTokenizer expects .*prompt 2\)"):
        generate.main(["--load", str(ckpt), "--prompt-file", str(tmp_path / "bad.txt")])
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(SystemExit, match="has no prompt: write one per line"):
        generate.main(["--load", str(ckpt), "--prompt-file", str(tmp_path / "empty.txt")])


def _only_rank_0_prints(argv, text, capsys):
    """Under torchrun (2 ranks) generate.py exits with status 1 on each rank and only rank 0
    prints `text`."""
    for rank, printed in ((0, True), (1, False)):
        with pytest.raises(SystemExit) as exc:
            generate.main(argv, environ={"RANK": str(rank), "WORLD_SIZE": "2",
                                         "LOCAL_RANK": str(rank)})
        assert exc.value.code == 1
        assert (text in capsys.readouterr().err) is printed, rank


def test_prompt_file_is_read_before_the_model(tmp_path, monkeypatch, capsys):
    """A missing --prompt-file stops generate.py before the model loads (minutes for a big
    one); under torchrun rank 0 prints it and the other ranks of the node exit in silence."""
    monkeypatch.setattr(generate, "_load", lambda *a: pytest.fail("the model was loaded"))
    argv = ["--load", str(tmp_path), "--prompt-file", str(tmp_path / "missing.txt")]
    with pytest.raises(SystemExit, match="--prompt-file .*missing.txt: .*No such file"):
        generate.main(argv, environ={})
    _only_rank_0_prints(argv, "missing.txt", capsys)


@pytest.mark.parametrize("ids, message", [("1,x", "item 2 'x' is not an integer"),
                                          ("", "the prompt is empty")])
def test_prompt_ids_are_checked_before_the_model(tmp_path, monkeypatch, capsys, ids, message):
    """A --prompt-ids typo stops generate.py before the model loads, as a missing
    --prompt-file does (it cost the load first): with a --load that does not exist, the
    error is the prompt's; under torchrun rank 0 prints it."""
    monkeypatch.setattr(generate, "_load", lambda *a: pytest.fail("the model was loaded"))
    argv = ["--load", str(tmp_path / "no_such_dir"), "--prompt-ids", ids]
    with pytest.raises(SystemExit, match=re.escape(message)):
        generate.main(argv, environ={})
    _only_rank_0_prints(argv, message, capsys)


def test_continuation_text_joins_the_prompt(tmp_path):
    """generated_text is what the new tokens add to the prompt's text: with SentencePiece a
    continuation that starts a word keeps its space (decoded alone, '\u2581brown' loses
    it), so prompt text + generated_text is the whole text."""
    from megatron.tokenizer import build_tokenizer
    from tests.test_tokenizer import _train_sentencepiece
    from tools.generate_prompts import continuation_text

    tok = build_tokenizer("GPTSentencePieceTokenizer",
                          tokenizer_model=_train_sentencepiece(tmp_path))
    head, tail = tok.tokenize("the quick"), tok.tokenize("the quick brown fox")
    assert tail[:len(head)] == head
    new = tail[len(head):]
    assert tok.detokenize(new) == "brown fox"  # alone: the boundary is lost
    assert continuation_text(tok, head, new) == " brown fox"
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert continuation_text(null, [5, 6], [7, 8]) == " 7 8"


GPT2_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2"


@pytest.mark.skipif(not (GPT2_DIR / "gpt2-vocab.json").is_file(),
                    reason="needs ../shared/data/gpt2 (GPT-2 vocab and merges)")
def test_text_prompt_with_gpt2_bpe(tmp_path):
    vocab, merges = GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt"
    _train(tmp_path, f"--vocab-file {vocab} --merge-file {merges} --tokenizer-type "
                     "GPT2BPETokenizer", steps=1)
    out = _run_cli("--load", str(tmp_path), "--prompt", "Hello world", "--greedy",
                   "--max-new-tokens", "5", "--no-stop-at-eod")
    assert out["prompt_ids"] == [15496, 995]  # GPT-2's ids for "Hello", " world"
    assert len(out["generated_ids"]) == 5 and isinstance(out["generated_text"], str)


def test_prompt_file_byte_order_mark_is_not_prompt_text(tmp_path):
    """A --prompt-file saved as 'UTF-8 with BOM' (Windows Notepad): the mark is no part of
    the first prompt (it was tokenized as three junk bytes before it)."""
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfHello there\r\nSecond\r\n")
    assert file_prompts(str(path)) == ["Hello there", "Second"]
