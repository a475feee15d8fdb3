"""A mistyped flag is answered with the closest known one, in every tool's command line
(megatron/cli_suggest.py), not only pretrain_gpt.py's: argparse alone says
'unrecognized arguments', or names a required flag without the typo beside it."""
from __future__ import annotations

import pytest

from megatron.cli_suggest import SuggestingParser


def _error(capsys, parse, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_unknown_flag_names_the_close_one(capsys):
    p = SuggestingParser(prog="tool.py", allow_abbrev=False)
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int)
    err = _error(capsys, p.parse_args, ["--append-eos", "--workers", "2", "--zzz"])
    assert err == ("tool.py: error: unrecognized arguments: --append-eos (did you mean "
                   "--append-eod?) --zzz")


def test_a_flag_typed_in_another_case_or_with_hyphens_names_megatrons_spelling():
    """`--ddp-impl local` was answered with 'did you mean --data-impl?' (nearer by letters
    than Megatron's `--DDP-impl`), a flag that then refuses the value `local`."""
    from megatron.arguments import parse_args
    from megatron.arguments_common import ArgumentsError

    with pytest.raises(ArgumentsError) as exc:
        parse_args(["--ddp-impl", "local"])
    assert str(exc.value).endswith(
        "unrecognized arguments: --ddp-impl (did you mean --DDP-impl?) local")
    with pytest.raises(ArgumentsError) as exc:
        parse_args(["--use-checkpoint-opt-param-scheduler", "--No-Barrier-With-Level-1-Timing"])
    assert str(exc.value).endswith(
        "unrecognized arguments: --use-checkpoint-opt-param-scheduler (did you mean "
        "--use-checkpoint-opt_param-scheduler?) --No-Barrier-With-Level-1-Timing (did you "
        "mean --no-barrier-with-level-1-timing?)")


def test_missing_required_flag_names_its_misspelling(capsys):
    p = SuggestingParser(prog="tool.py")
    p.add_argument("--load", required=True)
    p.add_argument("--output", required=True)
    err = _error(capsys, p.parse_args, ["--load", "x", "--ouptut=y"])
    assert err == ("tool.py: error: the following arguments are required: --output; "
                   "--ouptut is not a flag: did you mean --output?")
    # an abbreviation argparse accepts is no typo
    err = _error(capsys, p.parse_args, ["--lo", "x"])
    assert err == "tool.py: error: the following arguments are required: --output"


def test_sub_commands_suggest_their_own_flags(capsys):
    from tools.checkpoint_convert import build_parser

    err = _error(capsys, build_parser().parse_args,
                 ["to-hf", "--load", "c", "--ouptut", "o"])
    assert err.endswith("required: --output; --ouptut is not a flag: did you mean --output?")
    err = _error(capsys, build_parser().parse_args,
                 ["to-hf", "--load", "c", "--output", "o", "--verfy"])
    assert err.endswith("unrecognized arguments: --verfy (did you mean --verify?)")


def test_tools_suggest(capsys):
    from tools import generate, preprocess_data

    err = _error(capsys, generate.parse_args, ["--load", "c", "--prompt", "x",
                                               "--max-new-tokns", "5"])
    assert "--max-new-tokns (did you mean --max-new-tokens?) 5" in err
    err = _error(capsys, generate.parse_args, ["--load", "c", "--promt", "x"])
    assert err.endswith("--promt is not a flag: did you mean --prompt?")
    err = _error(capsys, preprocess_data.main, ["--input", "a.jsonl", "--output-prefix", "o",
                                                "--tokenizer-type", "NullTokenizer",
                                                "--workers", "1", "--append-eos"])
    assert "--append-eos (did you mean --append-eod?)" in err


def test_server_suggests_its_own_flags_too():
    """The server's unknown flags reach Megatron's parser, which suggested only Megatron's
    flags: --prot got 'did you mean --profile?'."""
    from tools.run_text_generation_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--load", "c", "--prot", "5001"])
    assert "--prot (did you mean --port?) 5001" in str(exc.value.code)


def test_a_long_flag_typo_is_never_answered_with_help(capsys):
    p = SuggestingParser(prog="tool.py")
    p.add_argument("--input", required=True)
    p.add_argument("-x", "--exclude")
    err = _error(capsys, p.parse_args, ["--hf", "d"])
    assert err.endswith("required: --input; --hf is not a flag")  # was 'did you mean -h?'
    err = _error(capsys, p.parse_args, ["--input", "d", "--hepl"])
    assert "did you mean" not in err


def test_a_flag_that_begins_with_the_typed_words_is_suggested(capsys):
    """`--exit-signal` (a later Megatron flag) was answered with `--exit-interval`
    (nearer by letters alone) though `--exit-signal-handler` begins with it; a flag one
    letter off still wins over a longer one (`--gpu`: `--gpus`, not `--gpu-memory-gb`)."""
    p = SuggestingParser(prog="tool.py", allow_abbrev=False)
    for flag in ("--exit-interval", "--exit-signal-handler", "--gpus", "--gpu-memory-gb"):
        p.add_argument(flag)
    err = _error(capsys, p.parse_args, ["--exit-signal", "SIGUSR1"])
    assert "--exit-signal (did you mean --exit-signal-handler?)" in err
    err = _error(capsys, p.parse_args, ["--gpu", "8"])
    assert "--gpu (did you mean --gpus?)" in err


def test_the_opposite_switch_is_not_offered_as_the_fix(capsys):
    """`--apply-query-key-layer-scaling` (a later Megatron flag asking for 23.05's default)
    was answered with 'did you mean --no-query-key-layer-scaling?', `--bias-gelu-fusion`
    with `--no-bias-gelu-fusion` and `--no-sequence-parallel` with `--sequence-parallel`:
    following the hint turned the feature the other way. The message says the token asks
    for the default and names the opposite switch as such; other negations still get a
    'did you mean'."""
    from megatron.arguments import parse_args
    from megatron.arguments_common import ArgumentsError

    with pytest.raises(ArgumentsError) as exc:
        parse_args(["--apply-query-key-layer-scaling", "--bias-gelu-fusion",
                     "--no-sequence-parallel", "--add-bias-linear", "--no-position-embeddings"])
    assert str(exc.value).endswith(
        "unrecognized arguments: --apply-query-key-layer-scaling (not a flag: on by default, "
        "so drop it; --no-query-key-layer-scaling turns it off) --bias-gelu-fusion (not a "
        "flag: on by default, so drop it; --no-bias-gelu-fusion turns it off) "
        "--no-sequence-parallel (not a flag: off by default, so drop it; --sequence-parallel "
        "turns it on) --add-bias-linear (not a flag: on by default, so drop it; "
        "--disable-bias-linear turns it off) --no-position-embeddings (did you mean "
        "--no-position-embedding?)")
    p = SuggestingParser(prog="tool.py")
    p.add_argument("--input", required=True)
    p.add_argument("--no-append-eod", action="store_true")
    err = _error(capsys, p.parse_args, ["--append-eod"])
    assert err == ("tool.py: error: the following arguments are required: --input; "
                   "--append-eod is not a flag: on by default, so drop it; --no-append-eod "
                   "turns it off")


def test_megatrons_misspelt_learning_rate_switch_is_not_offered_as_the_fix():
    """Megatron spells the switch `--no-log-learnig-rate-to-tensorboard`. A user asking for
    the learning rate in TensorBoard with `--log-learning-rate-to-tensorboard` was told
    'did you mean --no-log-learnig-rate-to-tensorboard?', the flag that turns it off (the
    typo hid the opposite switch); `--log-loss-scale-to-tensorboard` got the right answer.
    The correctly spelt `--no-...` still gets a 'did you mean' to Megatron's spelling."""
    from megatron.arguments import parse_args
    from megatron.arguments_common import ArgumentsError

    with pytest.raises(ArgumentsError) as exc:
        parse_args(["--log-learning-rate-to-tensorboard",
                    "--no-log-learning-rate-to-tensorboard"])
    assert str(exc.value).endswith(
        "unrecognized arguments: --log-learning-rate-to-tensorboard (not a flag: on by "
        "default, so drop it; --no-log-learnig-rate-to-tensorboard turns it off) "
        "--no-log-learning-rate-to-tensorboard (did you mean "
        "--no-log-learnig-rate-to-tensorboard?)")
