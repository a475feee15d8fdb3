"""--dry-run: the parameter counts (whole model and per pipeline stage), the report and its
missing inputs, and what the checkpoint that --load names would give the run."""
from __future__ import annotations

import shutil

import pytest
import torch

from megatron.arguments import count_parameters, dry_run_report, run_dry_run
from megatron.config import ModelConfig
from tests.args_helpers import BASE, error_of, run, without

# --------------------------------------------------------------- dry run / param counts


def _gpt2(vocab, **kw):
    return ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                       padded_vocab_size=vocab, seq_length=1024, max_position_embeddings=1024, **kw)


def test_param_count_gpt2_124m():
    assert count_parameters(_gpt2(50257)).total == 124_439_808  # Hugging Face GPT-2 count
    counts = count_parameters(_gpt2(50304))  # what this framework builds (padded vocab)
    assert counts.total == 124_439_808 + 47 * 768 and counts.per_stage == [counts.total]
    per_layer_sharded = 12 * 768 * 768 + 3 * 768 + 4 * 768  # qkv/fc1 biases split too
    tp2 = count_parameters(_gpt2(50304), tp_size=2).per_stage[0]
    replicated = 1024 * 768 + 12 * (4 * 768 + 2 * 768) + 2 * 768
    assert tp2 == 50304 * 768 // 2 + replicated + 12 * per_layer_sharded // 2


def test_param_count_variants_by_hand():
    cfg = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=4, padded_vocab_size=16,
                      seq_length=4, max_position_embeddings=4, num_query_groups=2,
                      ffn_hidden_size=12, activation="swiglu", normalization="RMSNorm",
                      add_bias_linear=False, position_embedding_type="rope",
                      untie_embeddings_and_output_weights=True)
    layer = (4 + 2 * 2) * 2 * 8 + 8 * 8 + 2 * 12 * 8 + 12 * 8 + 2 * 8
    assert count_parameters(cfg).total == 16 * 8 * 2 + 2 * layer + 8


def test_rotary_alone_adds_learned_positions_as_megatron(caplog):
    """Megatron-LM 23.05: --use-rotary-position-embeddings without --no-position-embedding
    builds both the learned position table and rotary attention (no warning here); with
    --no-position-embedding, or as --position-embedding-type rope, rotary only (also with
    --no-position-embedding, as later Megatron-LM scripts spell it)."""
    both = run("--use-rotary-position-embeddings")
    m = both.model
    assert (m.position_embedding_type, m.add_position_embedding,
            m.use_rotary_position_embeddings) == ("rope+learned", True, True)
    assert both.args["add_position_embedding"] and both.args["use_rotary_position_embeddings"]
    assert "position" not in caplog.text
    for extra in ("--use-rotary-position-embeddings --no-position-embedding",
                  "--position-embedding-type rope",
                  "--position-embedding-type rope --use-rotary-position-embeddings",
                  "--position-embedding-type rope --no-position-embedding",
                  "--position-embedding-type rope --use-rotary-position-embeddings "
                  "--no-position-embedding"):
        rope = run(extra)
        assert rope.model.position_embedding_type == "rope", extra
        assert not rope.args["add_position_embedding"], extra
    assert "contradicts the legacy flags (which give rope+learned)" in error_of(
        "--position-embedding-type learned_absolute --use-rotary-position-embeddings")
    assert "contradicts the legacy flags (which give none)" in error_of(
        "--position-embedding-type learned_absolute --no-position-embedding")
    # --dry-run's count: the learned table (max positions x hidden) on top of rotary only
    assert count_parameters(m).total == count_parameters(rope.model).total + 32 * 64
    from megatron.core.models.gpt.gpt_model import GPTModel

    built = GPTModel(m)
    assert sum(p.numel() for p in built.parameters()) == count_parameters(m).total


@pytest.mark.parametrize("pp,standalone,untied", [(2, False, False), (2, True, False),
                                                   (3, True, True), (4, False, True)])
def test_param_count_per_stage_equals_the_stages_the_model_builds(pp, standalone, untied):
    """Per-stage counts (the --dry-run report, the memory estimate) equal the parameters of
    the stages built on the meta device, also with --standalone-embedding-stage (stage 0:
    the embedding only), which the count used to ignore."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.stages import stage_layout

    cfg = ModelConfig(num_layers=6 if pp == 3 else 4, hidden_size=16, num_attention_heads=4,
                      padded_vocab_size=64, seq_length=8, max_position_embeddings=8,
                      untie_embeddings_and_output_weights=untied)
    counts = count_parameters(cfg, pp_size=pp, standalone_embedding_stage=standalone)
    built = []
    for stage in range(pp):
        (spec,) = stage_layout(cfg.num_layers, pp, stage, standalone_embedding_stage=standalone)
        model = GPTModel(cfg, pre_process=spec.pre_process, post_process=spec.post_process,
                         num_layers=spec.num_layers, layer_offset=spec.layer_offset,
                         device="meta")
        built.append(sum(p.numel() for p in model.parameters()))
    assert counts.per_stage == built


def test_param_count_1_3b_shape():
    cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                      padded_vocab_size=50304, seq_length=2048, max_position_embeddings=2048)
    counts = count_parameters(cfg, tp_size=2)
    assert 1.30e9 < counts.total < 1.33e9
    assert 0.49 < counts.per_stage[0] / counts.total < 0.51


def test_dry_run_reports_data_files_the_run_would_refuse(tmp_path):
    """Files that exist but that the dataset builder refuses -- a .bin cut short by an
    interrupted copy, an .idx of another preprocessing, token ids beyond the padded
    vocabulary -- fail the dry run with the builder's message (it said 'all input files
    found' and exited 0; the real run then stopped)."""
    from tests.test_gpt_dataset import make_corpus

    good, _ = make_corpus(tmp_path / "good", [20] * 30, vocab=100)
    short, _ = make_corpus(tmp_path / "short", [20] * 30, vocab=100)
    with open(short + ".bin", "r+b") as f:
        f.truncate(1000)
    wide, _ = make_corpus(tmp_path / "wide", [20] * 30, vocab=1000)
    data = without("--mock-data")
    cfg = run(f"--dry-run --data-path 0.5 {good} 0.5 {good}", base=data)
    assert "refuse" not in dry_run_report(cfg, 1) and run_dry_run(cfg, 1) == 0
    cfg = run(f"--dry-run --data-path 0.5 {short} 0.5 {wide}", base=data)
    text = dry_run_report(cfg, 1)
    assert "data the run would refuse:" in text
    assert f"{short}.bin: truncated data file: 1000 bytes" in text
    assert f"{wide}.bin: token id" in text and "padded vocabulary of 128 ids" in text
    assert run_dry_run(cfg, 1) == 1


def test_dry_run_reports_splits_the_run_would_refuse_or_never_evaluate(tmp_path):
    """The builder's document checks, before any index is built: a --split that leaves
    training nothing, a blend with a dataset too small for a split the run reads (it
    passed the dry run; the run stopped), and the run's never-evaluates warning."""
    from tests.test_gpt_dataset import make_corpus

    big, _ = make_corpus(tmp_path / "big", [20] * 200, vocab=100)
    small, _ = make_corpus(tmp_path / "small", [20] * 10, vocab=100)
    data = without("--mock-data")
    cfg = run(f"--dry-run --data-path 0.5 {big} 0.5 {small} --split 90,8,2 --eval-iters 1",
              base=data)
    text = dry_run_report(cfg, 1)
    assert ("data the run would refuse:\n  --data-path (test): --split '90,8,2' leaves this "
            f"split no documents of {small} (10 documents)") in text
    assert run_dry_run(cfg, 1) == 1
    cfg = run(f"--dry-run --data-path 0.5 {big} 0.5 {small} --split 90,8,2 --eval-iters 0",
              base=data)
    assert "refuse" not in dry_run_report(cfg, 1)  # no test samples read: no test blend
    cfg = run(f"--dry-run --data-path {big} --split 0,100,0", base=data)
    assert "gives the train split no documents" in dry_run_report(cfg, 1)
    cfg = run(f"--dry-run --data-path {big} --split 100,0,0 --eval-iters 1", base=data)
    text = dry_run_report(cfg, 1)
    assert "WARNING: --split '100,0,0' leaves the validation split no documents" in text
    assert run_dry_run(cfg, 1) == 0
    # Only evaluating, over 3 documents that --split 0,1,1 cannot cut (the report stopped
    # on the ValueError of the never-evaluates check)
    three, _ = make_corpus(tmp_path / "three", [20] * 3, vocab=100)
    cfg = run(f"--dry-run --data-path {three} --split 0,1,1 --skip-train --eval-iters 1",
              base=data)
    assert ("data the run would refuse:\n  --split '0,1,1' over 3 documents rounds to 0 + 2 + "
            "2 = 4 documents") in dry_run_report(cfg, 1)
    assert run_dry_run(cfg, 1) == 1


def test_dry_run_reports_output_directories_the_run_would_refuse(tmp_path, monkeypatch):
    """--save and --tensorboard-dir that cannot be created or written (an existing file, a
    file on the way, a parent without write permission), and a --data-cache-path where
    the index caches must be built: the dry run said nothing and exited 0, the run then
    refused at start-up (or at its dataset build). Nothing is created by the check."""
    import os

    from tests.test_gpt_dataset import make_corpus

    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = run(f"--dry-run --save {afile}/ck --save-interval 5 --tensorboard-dir {afile}")
    text = dry_run_report(cfg, 1)
    assert (f"output directories the run would refuse:\n  --save {afile}/ck cannot be used: "
            f"{afile} is a file, not a directory, so it cannot be created; pass a directory "
            "that can be created and written to") in text
    assert f"--tensorboard-dir {afile} cannot be used: it is an existing file" in text
    assert run_dry_run(cfg, 1) == 1
    ok = run(f"--dry-run --save {tmp_path}/a/b --save-interval 5 --tensorboard-dir {tmp_path}/tb")
    assert "refuse" not in dry_run_report(ok, 1) and run_dry_run(ok, 1) == 0
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "tb")
    from megatron import arguments_report  # a read-only parent (the tests may run as root)

    real_probe = arguments_report.write_probe_error
    monkeypatch.setattr(arguments_report, "write_probe_error",
                        lambda d: OSError(13, "read-only") if d == str(tmp_path / "ro")
                        else real_probe(d))
    (tmp_path / "ro").mkdir()
    cfg = run(f"--dry-run --save {tmp_path}/ro/ck --save-interval 5")
    assert f"this user cannot create it in {tmp_path}/ro" in dry_run_report(cfg, 1)
    data = without("--mock-data")
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "corpus", [20] * 30, vocab=100)
    cfg = run(f"--dry-run --data-path {prefix} --data-cache-path {afile}/cache", base=data)
    assert f"--data-cache-path {afile}/cache cannot be used" in dry_run_report(cfg, 1)
    assert run_dry_run(cfg, 1) == 1
    (tmp_path / "data" / "index-cache").mkdir()  # the caches may be there: a warning
    text = dry_run_report(cfg, 1)
    assert f"WARNING: --data-cache-path {afile}/cache cannot be used" in text
    assert run_dry_run(cfg, 1) == 0
    mock = run(f"--dry-run --data-cache-path {afile}/cache")  # mock data: never used
    assert "data-cache-path" not in dry_run_report(mock, 1)


def test_dry_run_probes_output_directories_by_writing(tmp_path):
    """os.access says yes to root and on some file systems: `--save /proc/x` passed the
    dry run and the run then stopped at start-up. The check now creates (and removes) a
    temporary file, so it refuses such a directory and leaves nothing in a usable one."""
    import os

    cfg = run("--dry-run --save /proc/ck --save-interval 5 --tensorboard-dir /proc")
    text = dry_run_report(cfg, 1)
    assert ("--save /proc/ck cannot be used: this user cannot create it in /proc (no write "
            "permission or read-only); pass a directory") in text
    assert "--tensorboard-dir /proc cannot be used: this user cannot write into it" in text
    assert run_dry_run(cfg, 1) == 1
    ok = run(f"--dry-run --save {tmp_path} --save-interval 5")
    assert "refuse" not in dry_run_report(ok, 1)
    assert os.listdir(tmp_path) == []


def test_dry_run_report_and_missing_inputs(tmp_path, capsys):
    cfg = run("--dry-run", world_size=2)
    text = dry_run_report(cfg, 2)
    assert "world size 2 = tensor 1 x pipeline 1 x data 2" in text
    assert "parameters:" in text and "all input files found" in text
    assert run_dry_run(cfg, 2) == 0
    prefix = tmp_path / "corpus_text_document"
    (tmp_path / "corpus_text_document.idx").write_bytes(b"")
    cfg = run(f"--data-path 1.0 {prefix} --load {tmp_path}/none --exit-on-missing-checkpoint",
              base=without("--mock-data"))
    text = dry_run_report(cfg, 1)
    assert f"{prefix}.bin (--data-path)" in text and f"{prefix}.idx" not in text
    assert f"{tmp_path}/none (--load" in text
    assert run_dry_run(cfg, 1) == 1
    cfg = run(f"--data-path {prefix}.idx", base=without("--mock-data"))
    assert (f"{prefix}.idx.bin and {prefix}.idx.idx (--data-path: a dataset is named by its "
            f"prefix without .bin/.idx: pass {prefix})") in dry_run_report(cfg, 1)


def test_dry_run_of_skip_train_reports_no_schedule():
    """--skip-train trains nothing: the training line said '10 iterations ... decay 20
    samples' with --train-iters, and without it 'decay 1 samples' (a placeholder)."""
    for base in (without("--train-iters"), BASE):
        text = dry_run_report(run("--dry-run --skip-train", base=base), 1)
        assert "  training: none (--skip-train: evaluation only)\n" in text, text
        assert "decay" not in text
    assert "decay" in dry_run_report(run("--dry-run --train-iters 10"), 1)


def test_dry_run_model_line_names_every_setting_that_changes_the_model():
    """A ported configuration is checked on the model line: each non-default setting that
    makes another model is named there, and the default GPT's line names none of them."""
    def model_line(extra):
        text = dry_run_report(run("--dry-run " + extra), 1)
        return next(line for line in text.splitlines() if line.startswith("  model:"))

    plain = model_line("")
    line = model_line("--kv-channels 32 --use-rotary-position-embeddings --rotary-percent 0.5 "
                      "--rotary-base 500000 --layernorm-epsilon 1e-6 --apply-layernorm-1p "
                      "--apply-residual-connection-post-layernorm --disable-bias-linear "
                      "--untie-embeddings-and-output-weights --swiglu "
                      "--group-query-attention --num-query-groups 2")
    named = ("kv channels 32", "rotary percent 0.5", "rotary base 500000",
             "layernorm epsilon 1e-06", "layernorm 1p", "residual after the layernorm",
             "no linear biases", "untied output weights", "(SwiGLU)", "2 query groups")
    for part in named:
        assert part in line and part not in plain, part
    assert "rotary" not in model_line("--rotary-percent 0.5")  # no rotary: not used
    assert "kv channels" not in model_line("--kv-channels 16")  # = hidden / heads
    # the default's fused bias-GeLU computes the tanh form; without the fusion, erf
    assert "(GeLU, tanh form)" in plain
    assert "(GeLU, erf form)" in model_line("--no-bias-gelu-fusion")


def test_dry_run_lists_missing_tokenizer_files_with_the_other_inputs(tmp_path, capsys):
    """A tokenizer file that does not exist stopped the dry run at validation (status 2)
    before its report: now the report lists every one beside the missing data files, goes
    on with an assumed vocabulary (said in the model line) and exits 1. Without --dry-run
    the run still stops at start-up naming the first file."""
    gpt2 = f"--vocab-file {tmp_path}/vocab.json --merge-file {tmp_path}/merges.txt"
    argv = without("--vocab-size", without("--tokenizer-type", without("--mock-data")))
    cfg = run(f"{gpt2} --data-path {tmp_path}/corpus --dry-run", base=argv)
    assert run_dry_run(cfg, 1) == 1
    text = capsys.readouterr().out
    missing = text[text.index("missing inputs:"):].splitlines()
    assert missing[1:4] == [f"  {tmp_path}/corpus.bin and {tmp_path}/corpus.idx (--data-path)",
                            f"  --vocab-file {tmp_path}/vocab.json: file not found; check the path",
                            f"  --merge-file {tmp_path}/merges.txt: file not found; check the path"]
    assert "vocab 50304 (padded from an assumed 50257 tokens: the tokenizer files are missing)" in text
    sentencepiece = run(f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "
                        f"{tmp_path}/t.model --dry-run", base=without("--tokenizer-type"))
    assert run_dry_run(sentencepiece, 1) == 1
    assert f"  --tokenizer-model {tmp_path}/t.model: file not found" in capsys.readouterr().out
    assert error_of(f"{gpt2} --data-path {tmp_path}/corpus", base=argv) == (
        f"--vocab-file {tmp_path}/vocab.json: file not found; check the path")


def test_dry_run_with_an_assumed_vocabulary_checks_no_vocabulary(capsys, tmp_path):
    """The assumed vocabulary is no real one: the rows of a checkpoint saved with the
    (now missing) tokenizer files and the data's token ids are not compared with it."""
    from megatron.trainer_checkpoint import save_trainer_checkpoint
    from tests.gpt_helpers import cli_trainer
    from tests.test_gpt_dataset import make_corpus
    from tests.test_tokenizer import write_bpe_files

    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    vocab["<|endoftext|>"] = len(vocab)  # 95 tokens: 128 rows
    gpt2 = " ".join(["--vocab-file", *write_bpe_files(tmp_path, vocab, [])[:1],
                     "--merge-file", str(tmp_path / "merges.txt")])
    argv = without("--vocab-size", without("--tokenizer-type"))
    _, _, tr = cli_trainer(argv + f"{gpt2} --save {tmp_path}/ck --save-interval 5".split())
    tr.state.iteration = 5
    save_trainer_checkpoint(tr)
    (tmp_path / "vocab.json").unlink()
    wide, _ = make_corpus(tmp_path / "wide", [20] * 30, vocab=60000)  # beyond GPT-2's 50257
    cfg = run(f"{gpt2} --data-path {wide} --load {tmp_path}/ck --dry-run",
              base=without("--mock-data", argv))
    assert run_dry_run(cfg, 1) == 1
    text = capsys.readouterr().out
    assert f"--vocab-file {tmp_path}/vocab.json: file not found" in text
    assert "checkpoint problems" not in text and "would refuse" not in text, text


# ------------------------------------------------ dry run: the checkpoint --load would read
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of BASE's model at iteration 10 (20 samples): "full" (optimizer and RNG
    states), "bare" (--no-save-optim --no-save-rng), "dist" (bf16, distributed optimizer:
    distrib_optim.pt beside the rank file); "tp2" and "dist-tp2" (full's / dist's shard
    duplicated as tp rank 1 and its args saying tp 2: the layout is all the dry run reads)."""
    from megatron.trainer_checkpoint import save_trainer_checkpoint
    from tests.gpt_helpers import cli_trainer

    root = tmp_path_factory.mktemp("ckpt")
    for name, extra in (("full", []), ("bare", ["--no-save-optim", "--no-save-rng"]),
                        ("dist", DIST)):
        _, _, tr = cli_trainer(BASE + ["--save", str(root / name), "--save-interval", "10"] + extra)
        tr.state.iteration, tr.state.consumed_train_samples = 10, 20
        tr.scheduler.step(20)
        save_trainer_checkpoint(tr)
    for name in ("full", "dist"):
        _as_tp2(root / name, root / ("tp2" if name == "full" else "dist-tp2"))
    return root


DIST = ["--bf16", "--use-distributed-optimizer"]


def _as_tp2(src, dst) -> None:
    """A copy of `src` whose rank 0 files also stand as tp rank 1, its args saying tp 2."""
    from megatron.checkpoint_files import load_checkpoint_file

    it = dst / "iter_0000010"
    shutil.copytree(src, dst)
    shutil.copytree(it / "mp_rank_00", it / "mp_rank_01")
    state = load_checkpoint_file(str(it / "mp_rank_00" / "model_optim_rng.pt"))
    state["args"]["tensor_model_parallel_size"] = 2
    torch.save(state, it / "mp_rank_00" / "model_optim_rng.pt")


def dry(capsys, extra):
    """(exit status, printed report) of pretrain_gpt.py's --dry-run path."""
    status = run_dry_run(run(extra), 1)
    return status, capsys.readouterr().out


def test_dry_run_resumes_from_the_checkpoint(saved, capsys, tmp_path):
    status, out = dry(capsys, f"--load {saved}/full")
    assert status == 0 and "checkpoint problems" not in out
    assert (f"checkpoint (--load {saved}/full):\n  resumes from iteration 10 ({saved}/full/"
            "iter_0000010), consumed samples 20\n  loads: model weights, optimizer and "
            "learning-rate schedule, RNG states\n  layout: saved with tp 1, pp 1, fp32 "
            "optimizer; each rank reads its own shard") in out
    status, out = dry(capsys, f"--load {tmp_path}")
    assert status == 0 and (f"no checkpoint ({tmp_path}/latest_checkpointed_iteration.txt "
                            "does not exist): starts from scratch") in out
    status, out = dry(capsys, f"--load {saved}/full --finetune --lr 5e-4 --no-load-rng")
    assert status == 0 and f"finetune: weights only from {saved}/full/iter_0000010, " \
                           "iteration 0" in out


def test_dry_run_refuses_a_load_file_as_the_run_does(saved, capsys, tmp_path):
    """--load on a checkpoint file (or any other file) stops the run with the directory to
    pass; the dry run said the directory did not exist and training would start from
    scratch, with status 0."""
    shard = f"{saved}/full/iter_0000010/mp_rank_00/model_optim_rng.pt"
    status, out = dry(capsys, f"--load {shard}")
    assert status == 1 and "would start from scratch" not in out
    assert (f"error: --load {shard} is a file inside a checkpoint; --load takes the directory "
            f"above the iteration directories (the one --save wrote): --load {saved}/full") in out
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    status, out = dry(capsys, f"--load {notes}")
    assert status == 1 and f"error: --load {notes} is a file; --load takes the directory" in out


def test_dry_run_lists_every_schedule_mismatch(saved, capsys):
    """The real run stops at max_lr; the dry run names max_lr and the decay length (in
    samples: --train-iters changed it) with the flags that settle them."""
    status, out = dry(capsys, f"--load {saved}/full --lr 5e-4 --train-iters 40")
    assert status == 1 and "checkpoint problems (3; the real run stops at the first)" in out
    assert (f"error: loading {saved}/full/iter_0000010: optimizer-parameter-scheduler value "
            "'max_lr' (--lr) from the checkpoint (0.001) differs from the command line (0.0005); pass "
            "--override-opt_param-scheduler to use the command line or "
            "--use-checkpoint-opt_param-scheduler to use the checkpoint") in out
    assert ("'lr_decay_steps' (--lr-decay-iters/-samples, else --train-iters/-samples; in "
            "samples: iterations x global batch size) from the checkpoint (20) differs from "
            "the command line (80)") in out
    assert out.rstrip().endswith("the run would stop when it loads the checkpoint")
    status, out = dry(capsys, f"--load {saved}/full --lr 5e-4 --override-opt_param-scheduler")
    assert status == 0 and "learning-rate schedule: max_lr (--lr): using the command line's " \
                           "0.0005, not the checkpoint's 0.001" in out
    assert dry(capsys, f"--load {saved}/full --lr 5e-4 "
                       "--use-checkpoint-opt_param-scheduler")[0] == 0


@pytest.mark.parametrize("name", ["full", "dist"])
def test_dry_run_checks_the_optimizer_kind_and_hyperparameters(saved, capsys, name):
    extra = f"--load {saved}/{name} " + (" ".join(DIST) if name == "dist" else "")
    status, out = dry(capsys, extra + " --optimizer sgd")
    assert status == 1 and (f"error: loading {saved}/{name}/iter_0000010: the checkpoint's "
                            "optimizer state is --optimizer adam's but this run uses "
                            "--optimizer sgd") in out
    status, out = dry(capsys, extra + " --adam-beta2 0.95")
    assert status == 0 and ("optimizer: --adam-beta1/--adam-beta2: using the command line's "
                            "0.9 0.95, not the checkpoint's 0.9 0.999") in out


def test_dry_run_global_batch_size_changes_the_schedule(saved, capsys):
    status, out = dry(capsys, f"--load {saved}/full --global-batch-size 4")
    assert status == 1
    for name, flags in (("lr_decay_steps", "--lr-decay-iters/-samples, else "
                                           "--train-iters/-samples"),
                        ("wd_incr_steps", "--train-iters/-samples")):
        assert (f"'{name}' ({flags}; in samples: iterations x global batch size) from the "
                "checkpoint (20) differs from the command line (40)") in out


def test_dry_run_checkpoint_without_optimizer_or_rng(saved, capsys):
    status, out = dry(capsys, f"--load {saved}/bare")
    path = f"{saved}/bare/iter_0000010/mp_rank_00/model_optim_rng.pt"
    assert status == 1 and "checkpoint problems (2;" in out
    assert (f"error: unable to load optimizer from checkpoint {path}: it holds no optimizer "
            "state") in out and "Specify --no-load-optim or --finetune" in out
    assert f"error: unable to load rng state from checkpoint {path}" in out
    status, out = dry(capsys, f"--load {saved}/bare --no-load-optim --no-load-rng")
    assert status == 0 and "loads: model weights\n  --no-load-optim: the optimizer state " \
                           "and the learning-rate schedule start fresh" in out


def test_dry_run_model_shape_mismatch_names_every_argument(saved, capsys):
    status, out = dry(capsys, f"--load {saved}/full --hidden-size 128 --num-layers 3 "
                              "--vocab-size 300")
    assert status == 1
    for line in ("--num-layers: checkpoint 2, this run 3",
                 "--hidden-size: checkpoint 64, this run 128",
                 "padded vocabulary size (rows of the word embedding): checkpoint 128, this "
                 "run 384", "--vocab-size: checkpoint 100, this run 300"):
        assert f"\n    {line}\n" in out
    assert "or leave these flags out and pass --use-checkpoint-args" in out


def test_dry_run_bad_tracker(saved, capsys, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved / "full", root)
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_text("abc")
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: malformed checkpoint tracker file {tracker}: content " \
                           "'abc'" in out
    tracker.write_text("20")
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"{tracker} names 20, but the checkpoint directory " \
                           f"{root}/iter_0000020 does not exist" in out
    tracker.unlink()
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: --load {root} has no latest_checkpointed_iteration.txt " \
                           "but holds checkpoints" in out
    assert dry(capsys, f"--load {root} --exit-on-missing-checkpoint")[0] == 1


def _damaged_copy(capsys, saved, name: str, tmp_path, rank_dir: str, file: str,
                  flags: str = ""):
    """A copy of checkpoint `name` whose `rank_dir/file` is truncated; the dry run stops on
    it, then on its absence. Returns the copy's root."""
    root = tmp_path / "ck"
    shutil.copytree(saved / name, root)
    path = root / "iter_0000010" / rank_dir / file
    path.write_bytes(path.read_bytes()[:3000])
    status, out = dry(capsys, f"--load {root} {flags}")
    assert status == 1 and f"error: cannot read checkpoint file {path}" in out
    path.unlink()
    status, out = dry(capsys, f"--load {root} {flags}")
    assert status == 1 and (f"error: checkpoint {root / 'iter_0000010'} is incomplete: "
                            f"{rank_dir}/{file} is missing (the directories say tp ") in out
    return root


def test_dry_run_other_tensor_parallel_size_reshards(saved, capsys, tmp_path):
    status, out = dry(capsys, f"--load {saved}/tp2")
    assert status == 0 and ("resharded on load: saved with tp 2, pp 1, fp32 optimizer, this "
                            "run has tp 1, pp 1, fp32 optimizer; every rank reads all 2 shard "
                            "file(s) and takes its slice; RNG states start fresh") in out
    _damaged_copy(capsys, saved, "tp2", tmp_path, "mp_rank_01", "model_optim_rng.pt")


def test_dry_run_checks_distrib_optim_files_of_its_own_layout(saved, capsys, tmp_path):
    status, out = dry(capsys, f"--load {saved}/dist {' '.join(DIST)}")
    assert status == 0 and "layout: saved with tp 1, pp 1, distributed optimizer; each " \
                           "rank reads its own shard" in out
    _damaged_copy(capsys, saved, "dist", tmp_path, "mp_rank_00", "distrib_optim.pt",
                  " ".join(DIST))


def test_dry_run_resharding_checks_every_distrib_optim_file(saved, capsys, tmp_path):
    """Resharding reads every rank's distrib_optim.pt: a missing or truncated one is a
    problem the real run stops on, so the dry run names it."""
    status, out = dry(capsys, f"--load {saved}/dist-tp2 {' '.join(DIST)}")
    assert status == 0 and "resharded on load: saved with tp 2, pp 1, distributed " \
                           "optimizer" in out
    root = _damaged_copy(capsys, saved, "dist-tp2", tmp_path, "mp_rank_01",
                         "distrib_optim.pt", " ".join(DIST))
    # without the optimizer state, distrib_optim.pt is not read
    assert dry(capsys, f"--load {root} {' '.join(DIST)} --no-load-optim")[0] == 0


def test_dry_run_refuses_a_checkpoint_without_model_weights(saved, capsys, tmp_path):
    """A model_optim_rng.pt without its 'model' entry passed the dry run (status 0, "loads:
    model weights"); the run then stopped at the load. Read from the file's structure
    (memory-mapped), with the run's message; --finetune reads the weights too."""
    from megatron.checkpoint_files import load_checkpoint_file

    root = tmp_path / "nomodel"
    shutil.copytree(saved / "full", root)
    path = root / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_checkpoint_file(str(path))
    del state["model"]
    torch.save(state, path)
    for extra in ("", " --finetune"):
        status, out = dry(capsys, f"--load {root}{extra}")
        assert status == 1, out
        assert (f"error: checkpoint {root}/iter_0000010 holds no model weights (no 'model' "
                "entry; its entries: args, ") in out
    assert dry(capsys, f"--load {saved}/full")[0] == 0


# what a dry run without --load never uses: the model (whose fused cross entropy imports
# triton) and the optimizer (whose AdamW kernel does): ~0.4 s of a 2.7 s dry run's CPU
BUILD_ONLY_MODULES = ("megatron.core.models.gpt.gpt_model", "megatron.core.optimizer",
                      "megatron.checkpoint_preflight", "triton")


def test_a_dry_run_without_load_imports_neither_the_model_nor_the_optimizer():
    """A user iterating on flags with --dry-run waited for the model's and the optimizer's
    modules (and triton) to import, for a report that builds neither: `stage_layout` came
    with the model's module, the checkpoint preflight with the optimizer's."""
    import subprocess
    import sys

    from tests.dist_utils import ROOT, cpu_env

    code = ("import sys, pretrain_gpt; status = pretrain_gpt.main(sys.argv[1:]); "
            f"print(status, [m for m in {BUILD_ONLY_MODULES!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, *BASE, "--dry-run"], cwd=ROOT,
                         env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all input files found" in out.stdout
    assert out.stdout.splitlines()[-1] == "0 []"
