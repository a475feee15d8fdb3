"""megatron/checkpoint_model_args.py: the checkpoint's model arguments against the run's (Megatron's
check_checkpoint_args, plus every argument that shapes or lays out a weight). Plain dicts, as
the checkpoints store them; the end-to-end exits are in tests/test_exact_resume.py."""
from __future__ import annotations

import pytest

from megatron.checkpoint_model_args import check_checkpoint_args, checkpoint_arg_mismatches

SAVED = {
    "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
    "kv_channels": 16, "group_query_attention": False, "num_query_groups": None,
    "swiglu": False, "untie_embeddings_and_output_weights": False, "normalization": "LayerNorm",
    "add_bias_linear": True, "apply_layernorm_1p": False, "num_experts": None,
    "apply_residual_connection_post_layernorm": False,
    "position_embedding_type": "learned_absolute", "add_position_embedding": True,
    "use_rotary_position_embeddings": False, "rotary_percent": 1.0, "rotary_base": 10000.0,
    "max_position_embeddings": 64, "tensor_model_parallel_size": 1, "padded_vocab_size": 384,
    "vocab_size": 256, "vocab_extra_ids": 0, "make_vocab_size_divisible_by": 128,
    "tokenizer_type": "NullTokenizer", "vocab_file": None, "seq_length": 64,
}


def _names(run_changes, finetune=False, saved_changes=None):
    saved = {**SAVED, **(saved_changes or {})}
    return [m.name for m in checkpoint_arg_mismatches(saved, {**SAVED, **run_changes}, finetune)]


def test_same_arguments_and_free_ones_pass():
    assert _names({}) == []
    # parallel sizes and everything that does not touch the weights may change
    assert _names({"tensor_model_parallel_size": 2, "padded_vocab_size": 512,
                   "seq_length": 32, "hidden_dropout": 0.0}) == []


@pytest.mark.parametrize("changes,name", [
    ({"num_layers": 3}, "--num-layers"),
    ({"swiglu": True}, "--swiglu"),
    ({"normalization": "RMSNorm"}, "--normalization"),
    ({"add_bias_linear": False}, "--disable-bias-linear"),
    ({"untie_embeddings_and_output_weights": True}, "--untie-embeddings-and-output-weights"),
    ({"apply_layernorm_1p": True}, "--apply-layernorm-1p"),
    # same shapes, another model: every residual sum starts from the norm's output
    ({"apply_residual_connection_post_layernorm": True},
     "--apply-residual-connection-post-layernorm"),
    ({"max_position_embeddings": 128}, "--max-position-embeddings"),  # learned table rows
    ({"padded_vocab_size": 512}, "padded vocabulary size (rows of the word embedding)"),
    ({"position_embedding_type": "rope"}, "--position-embedding-type"),
])
@pytest.mark.parametrize("finetune", [False, True])
def test_shape_and_layout_arguments_are_checked_even_with_finetune(changes, name, finetune):
    assert _names(changes, finetune) == [name]


def test_query_groups_compare_by_layout():
    gqa = {"group_query_attention": True, "num_query_groups": 2}
    assert _names(gqa) == ["query groups (--group-query-attention --num-query-groups)"]
    assert _names(gqa, finetune=True) != []
    # one group per head is the plain attention's layout
    assert _names({"group_query_attention": True, "num_query_groups": 4}) == []
    # heads alone: reported once, as the heads (and the derived head size)
    assert _names({"num_attention_heads": 8, "kv_channels": 8}) == ["--num-attention-heads",
                                                                     "--kv-channels"]


def test_activation_is_checked_unless_finetune():
    gelu = {"squared_relu": False, "openai_gelu": False, "swiglu": False}
    relu2 = {**gelu, "squared_relu": True}
    name = "MLP activation (--squared-relu, else GeLU)"
    assert _names(relu2, saved_changes=gelu) == [name]
    assert _names(gelu, saved_changes=relu2) == [name]
    assert _names(relu2, finetune=True, saved_changes=gelu) == []
    # --openai-gelu is the tanh form of the same GeLU; it also wins over --squared-relu
    assert _names({**gelu, "openai_gelu": True}, saved_changes=gelu) == []
    assert _names({**relu2, "openai_gelu": True}, saved_changes=gelu) == []
    # --swiglu changes fc1's shape: reported once, as --swiglu
    assert _names({**gelu, "swiglu": True}, saved_changes=relu2) == ["--swiglu"]
    with pytest.raises(SystemExit, match=r"(?s)checkpoint gelu, this run squared_relu.*"
                                         r"no --squared-relu"):
        check_checkpoint_args({**SAVED, **gelu}, {**SAVED, **relu2}, "ck/iter_0000010")


def test_rope_ignores_max_positions_unless_vocab_file_given():
    rope = {"position_embedding_type": "rope", "add_position_embedding": False,
            "use_rotary_position_embeddings": True}
    assert _names({**rope, "max_position_embeddings": 128}, saved_changes=rope) == []
    vocab_file = {**rope, "max_position_embeddings": 128, "vocab_file": "v.json"}
    assert _names(vocab_file, saved_changes=rope) == ["--max-position-embeddings"]
    assert _names(vocab_file, finetune=True, saved_changes=rope) == []


def test_other_arguments_are_skipped_with_finetune():
    rope = {"position_embedding_type": "rope", "add_position_embedding": False,
            "use_rotary_position_embeddings": True}
    changes = {**rope, "vocab_size": 300, "rotary_base": 500000.0}
    assert _names(changes, saved_changes=rope) == ["--vocab-size", "--rotary-base"]
    assert _names(changes, finetune=True, saved_changes=rope) == []
    # Megatron's --vocab-file items
    changes = {"vocab_file": "v.json", "make_vocab_size_divisible_by": 256,
               "tokenizer_type": "GPT2BPETokenizer", "tensor_model_parallel_size": 2,
               "padded_vocab_size": 512}
    assert _names(changes) == ["--make-vocab-size-divisible-by", "--tokenizer-type"]
    assert _names({**changes, "vocab_file": None}) == []


def test_vocab_divisor_may_change_with_tp_where_the_padded_rows_stay():
    """README: parity across tp sizes starts from one padded size -- 128 at tp 1 pads 384
    rows, and so does 64 at tp 2. With --vocab-file (Megatron's divisor check) that load
    was refused, and its fix (the checkpoint's 128) re-pads to 512 rows at tp 2."""
    same_rows = {"vocab_file": "v.json", "make_vocab_size_divisible_by": 64,
                 "tensor_model_parallel_size": 2, "padded_vocab_size": 384}
    assert _names(same_rows) == []
    # at the same tp size, or where the rows differ, Megatron's check stands
    assert _names({**same_rows, "tensor_model_parallel_size": 1}) == [
        "--make-vocab-size-divisible-by"]
    assert _names({**same_rows, "padded_vocab_size": 448}) == [
        "--make-vocab-size-divisible-by"]


@pytest.mark.parametrize("run_type", ["learned_absolute", "none", "rope"])
def test_rotary_flags_are_compared_only_when_both_models_rotate(run_type):
    """A checkpoint trained without rotary positions, resumed with a --rotary-percent /
    --rotary-base the model never reads (left in a launch script), was refused for those
    flags; a rope run on it is refused for its position type alone."""
    saved = {**SAVED, "position_embedding_type": "none", "add_position_embedding": False}
    run = {**saved, "position_embedding_type": run_type, "rotary_percent": 0.5,
           "rotary_base": 500.0}
    expected = [] if run_type == "none" else ["--position-embedding-type"]
    assert [m.name for m in checkpoint_arg_mismatches(saved, run)] == expected
    assert _names({"rotary_percent": 0.5, "rotary_base": 500.0}) == []  # both learned
    both = {"position_embedding_type": "rope+learned", "use_rotary_position_embeddings": True}
    assert _names({**both, "rotary_percent": 0.5}, saved_changes=both) == ["--rotary-percent"]


def test_keys_an_older_checkpoint_lacks_are_skipped():
    old = {k: SAVED[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                 "add_position_embedding")}
    run = {**SAVED, "swiglu": True, "padded_vocab_size": 512, "num_query_groups": 2,
           "group_query_attention": True}
    assert checkpoint_arg_mismatches(old, run) == []
    # Megatron 23.05 names: rotary on with the learned table is both (rope+learned)
    legacy = {**old, "use_rotary_position_embeddings": True}
    assert [(m.name, m.saved) for m in checkpoint_arg_mismatches(legacy, SAVED)] == \
        [("--position-embedding-type", "rope+learned")]
    assert checkpoint_arg_mismatches(legacy, {**SAVED, "position_embedding_type":
                                              "rope+learned"}) == []
    check_checkpoint_args(None, SAVED, "somewhere")  # no args at all: nothing to check


def test_message_names_values_and_fix():
    run = {**SAVED, "num_attention_heads": 8, "kv_channels": 8, "swiglu": True,
           "add_bias_linear": False}
    with pytest.raises(SystemExit) as err:
        check_checkpoint_args(SAVED, run, "ck/iter_0000010")
    msg = str(err.value)
    assert msg.startswith("error: the checkpoint in ck/iter_0000010 was saved with other model "
                          "arguments than this run's:\n")
    assert "\n  --num-attention-heads: checkpoint 4, this run 8\n" in msg
    assert "\n  --swiglu: checkpoint False, this run True\n" in msg
    assert ("(--num-attention-heads 4; --kv-channels 16; no --swiglu; no --disable-bias-linear)"
            in msg)
    assert "--use-checkpoint-args" in msg and "--finetune" not in msg
    with pytest.raises(SystemExit, match="--finetune does not skip these"):
        check_checkpoint_args(SAVED, run, "ck/iter_0000010", finetune=True)


def test_use_checkpoint_args_takes_every_checked_argument(monkeypatch, tmp_path):
    """The mismatch message names --use-checkpoint-args as the fix, so that flag must take
    every argument checked here from the checkpoint (a --num-experts checkpoint loaded
    with --use-checkpoint-args and no --num-experts was refused with that very advice)."""
    from megatron import arguments_checkpoint
    from megatron.arguments import parse_args

    saved = {**SAVED, "num_layers": 3, "swiglu": True, "num_experts": 4, "vocab_extra_ids": 2,
             "group_query_attention": True, "num_query_groups": 2, "rotary_base": 500.0,
             "apply_residual_connection_post_layernorm": True,
             "tokenizer_type": "GPT2BPETokenizer", "vocab_file": "vocab.json"}
    monkeypatch.setattr(arguments_checkpoint, "read_checkpoint_args", lambda load: saved)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")  # a checkpoint is there
    ns, explicit = parse_args(["--load", str(tmp_path), "--use-checkpoint-args",
                               "--vocab-file", "vocab.json", "--merge-file", "merges.txt"])
    arguments_checkpoint.apply_checkpoint_args(ns, explicit, warn=print)
    assert [m.name for m in checkpoint_arg_mismatches(saved, vars(ns))] == []
    assert ns.num_experts == 4 and ns.vocab_extra_ids == 2
    assert ns.apply_residual_connection_post_layernorm


@pytest.mark.parametrize("kind, saved_files, given, message", [
    ("SentencePieceTokenizer", {"tokenizer_model": "data/spm.model"}, [],
     "--tokenizer-model is not given; pass it (the checkpoint was saved with "
     "--tokenizer-model data/spm.model)"),
    ("GPT2BPETokenizer", {"vocab_file": "v.json", "merge_file": "m.txt"}, [],
     "--vocab-file and --merge-file are not given; pass them (the checkpoint was saved with "
     "--vocab-file v.json --merge-file m.txt)"),
    ("GPT2BPETokenizer", {}, ["--vocab-file", "v.json"], "--merge-file is not given; pass it"),
    ("SentencePieceTokenizer", {}, ["--tokenizer-model", "spm.model"], None),
])
def test_use_checkpoint_args_names_the_tokenizer_files_it_does_not_take(
        monkeypatch, tmp_path, kind, saved_files, given, message):
    """--use-checkpoint-args takes the checkpoint's --tokenizer-type, not its files (as
    Megatron-LM): the run then stopped with '--tokenizer-type SentencePieceTokenizer needs
    --tokenizer-model', a tokenizer the user never named (e.g. following from-hf's advice
    'train from it with pretrain_gpt.py --load DIR --use-checkpoint-args')."""
    from megatron import arguments_checkpoint
    from megatron.arguments import ArgumentsError, parse_args

    saved = {**SAVED, "tokenizer_type": kind, **saved_files}
    monkeypatch.setattr(arguments_checkpoint, "read_checkpoint_args", lambda load: saved)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    ns, explicit = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", *given])
    if message is None:
        arguments_checkpoint.apply_checkpoint_args(ns, explicit, warn=print)
        return
    with pytest.raises(ArgumentsError) as err:
        arguments_checkpoint.apply_checkpoint_args(ns, explicit, warn=print)
    assert err.value.message == (f"--use-checkpoint-args takes the checkpoint's "
                                 f"--tokenizer-type {kind} but not its files, and {message}")


@pytest.mark.parametrize("world, sizes, warned", [
    (4, (2, 2, 1), None),  # the checkpoint's layout fits: taken as it is, in silence
    (8, (2, 2, 1), None),  # data-parallel replicas of it
    # fewer processes: clamped as Megatron-LM clamps, the virtual stages of the old
    # pipeline size dropped, and one warning that says whose sizes they were
    (2, (2, 1, None), "--use-checkpoint-args: the checkpoint's layout "
     "(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
     "--num-layers-per-virtual-pipeline-stage 1) does not fit world size 2; using "
     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 (clamped"),
    (1, (1, 1, None), "using --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1"),
])
def test_use_checkpoint_args_layout_on_another_world_size(monkeypatch, tmp_path, caplog,
                                                          world, sizes, warned):
    """A tp2 x pp2 checkpoint with virtual stages resumed on fewer processes with
    --use-checkpoint-args: the clamp warning and an error about
    --num-layers-per-virtual-pipeline-stage named flags the user never typed, and the
    run stopped although the checkpoint reshards to any layout."""
    from megatron import arguments_checkpoint
    from tests.args_helpers import BASE, run, without

    saved = {**SAVED, "num_layers": 4, "tensor_model_parallel_size": 2,
             "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}
    monkeypatch.setattr(arguments_checkpoint, "read_checkpoint_args", lambda load: saved)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    base = without("--num-layers", BASE) + ["--load", str(tmp_path), "--use-checkpoint-args",
                                            "--global-batch-size", "16"]
    cfg = run(world_size=world, base=base)
    p = cfg.parallel
    assert (p.tp_size, p.pp_size, p.virtual_pp_size) == (
        sizes[0], sizes[1], None if sizes[2] is None else 2)
    if warned is None:
        assert "does not fit" not in caplog.text
    else:
        assert warned in caplog.text and "--num-layers-per-virtual-pipeline-stage 1 needs" \
            not in caplog.text


def test_use_checkpoint_args_layout_that_cannot_divide_the_world(monkeypatch, tmp_path):
    from megatron import arguments_checkpoint
    from tests.args_helpers import error_of, run

    saved = {**SAVED, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    monkeypatch.setattr(arguments_checkpoint, "read_checkpoint_args", lambda load: saved)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    msg = error_of(["--load", str(tmp_path), "--use-checkpoint-args"], world_size=3)
    assert msg.startswith("--use-checkpoint-args: the checkpoint's layout "
                          "(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1) "
                          "does not fit world size 3; launch a multiple of 2 processes"), msg
    # with the layout given, any world size the flags divide
    assert run(["--load", str(tmp_path), "--use-checkpoint-args",
                "--tensor-model-parallel-size", "1"], world_size=3).parallel.dp_size == 3


def test_max_positions_fix_names_the_sequence_length_it_needs():
    """A run at --seq-length 128 --max-position-embeddings 128 from a 64-position checkpoint:
    the fix '--max-position-embeddings 64' alone is refused by the argument check (64 is
    below --seq-length 128), so it names the length too; with rotary positions (compared
    only without --finetune, as Megatron does with --vocab-file) it names --finetune."""
    longer = {"seq_length": 128, "max_position_embeddings": 128}
    with pytest.raises(SystemExit) as err:
        check_checkpoint_args(SAVED, {**SAVED, **longer}, "ck/iter_0000010", finetune=True)
    assert "(--max-position-embeddings 64 with --seq-length at most 64)" in str(err.value)
    rope = {"position_embedding_type": "rope", "add_position_embedding": False,
            "use_rotary_position_embeddings": True}
    with pytest.raises(SystemExit) as err:
        check_checkpoint_args({**SAVED, **rope}, {**SAVED, **rope, **longer,
                                                  "vocab_file": "v.json"}, "ck/iter_0000010")
    assert ("(--max-position-embeddings 64 with --seq-length at most 64, or --finetune to train "
            "these rotary weights at --seq-length 128)" in str(err.value))
    # at the checkpoint's length or shorter the checkpoint's value is the whole fix
    [item] = checkpoint_arg_mismatches(SAVED, {**SAVED, "max_position_embeddings": 128}, True)
    assert item.fix == "--max-position-embeddings 64"


def test_a_resume_with_another_tokenizer_names_the_checkpoints_tokenizer():
    """A GPT2BPETokenizer checkpoint resumed with NullTokenizer --vocab-size 50257 (same
    padded rows) was refused as '--vocab-size: checkpoint None' with the fix 'no
    --vocab-size', which NullTokenizer refuses: the tokenizer type, the real difference,
    went unnamed. The item now names it and the checkpoint's tokenizer flags."""
    bpe = {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": None, "padded_vocab_size": 50304,
           "vocab_file": "/d/gpt2-vocab.json", "merge_file": "/d/gpt2-merges.txt"}
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 50257, "padded_vocab_size": 50304,
            "vocab_file": None, "merge_file": None}
    items = checkpoint_arg_mismatches({**SAVED, **bpe}, {**SAVED, **null})
    assert [(m.name, m.saved, m.run) for m in items] == [
        ("--tokenizer-type", "GPT2BPETokenizer", "NullTokenizer")]
    assert items[0].fix == ("--tokenizer-type GPT2BPETokenizer --vocab-file /d/gpt2-vocab.json "
                            "--merge-file /d/gpt2-merges.txt")
    back = checkpoint_arg_mismatches({**SAVED, **null}, {**SAVED, **bpe})
    assert [(m.name, m.fix) for m in back] == [
        ("--tokenizer-type", "--tokenizer-type NullTokenizer --vocab-size 50257")]
    # one tokenizer type: a --vocab-size difference is still that
    assert _names({"vocab_size": 300}) == ["--vocab-size"]


def test_a_tokenizer_of_another_vocabulary_is_refused_at_another_tp_size():
    """A checkpoint of a 1000-token tokenizer (1024 rows at tp 2) evaluated at tp 1 with a
    1200-token one (1280 rows) loaded silently: the embedding was re-padded, ids 1024..1199
    read copies of a padding row. The same tokenizer at another tp size still loads."""
    saved = {**SAVED, "tokenizer_type": "GPTSentencePieceTokenizer", "vocab_size": None,
             "tokenizer_model": "old.model", "tensor_model_parallel_size": 2,
             "padded_vocab_size": 1024}
    run = {**saved, "tokenizer_model": "new.model", "tensor_model_parallel_size": 1}
    assert checkpoint_arg_mismatches(saved, {**run, "padded_vocab_size": 1024}) == []
    for rows in (1280, 768):  # 1153..1280 tokens, or 641..768: none pads to 1024 at tp 2
        (item,) = checkpoint_arg_mismatches(saved, {**run, "padded_vocab_size": rows})
        assert item.name == "tokenizer vocabulary size"
        assert item.saved.startswith("769..1024 tokens (padded to 1024 rows at tensor-parallel")
        assert item.run.startswith(f"{rows - 127}..{rows} tokens")
        assert "--tokenizer-model old.model" in item.fix
    # --finetune may change the tokenizer on purpose
    assert checkpoint_arg_mismatches(saved, {**run, "padded_vocab_size": 1280}, True) == []
