"""Command lines that used to pass validation (and --dry-run) but failed later, or failed
with a misleading message: each must fail early with exit status 2 and a message that
names the value and the fix, or run as Megatron-LM 23.05 runs it."""
from __future__ import annotations

import pytest

from megatron.arguments import ArgumentsError, dry_run_report, parse_and_validate

B = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
     "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
     "--train-iters 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 100").split()


def without(*flags, base=B):
    """`base` minus each flag and its value."""
    out = list(base)
    for flag in flags:
        i = out.index(flag)
        del out[i:i + 2]
    return out


def run(extra="", base=B, world_size=1, **kw):
    argv = list(base) + (extra.split() if isinstance(extra, str) else list(extra))
    kw.setdefault("cuda_available", False)
    return parse_and_validate(argv, world_size=world_size, env={}, **kw)


def error_of(extra="", base=B, **kw) -> str:
    with pytest.raises(ArgumentsError) as info:
        run(extra, base, **kw)
    assert info.value.code == 2
    return info.value.message


# ------------------------------------------------------------------ fractional warmup


def test_warmup_fraction_is_kept_fractional_and_printed_rounded():
    cfg = run("--train-iters 3 --lr-warmup-fraction 0.3", base=without("--train-iters"))
    assert cfg.optimizer.lr_warmup_steps == pytest.approx(3.6)
    assert "warmup 3.6 / decay 12 samples" in dry_run_report(cfg, 1)
    cfg = run("--train-iters 6 --lr-warmup-fraction 0.01", base=without("--train-iters"))
    assert cfg.optimizer.lr_warmup_steps == pytest.approx(0.24)


# --------------------------------------------------- iteration- vs sample-based flags


def test_warmup_fraction_with_a_warmup_count_names_the_real_rule():
    msg = error_of("--lr-warmup-fraction 0.1 --lr-warmup-iters 1")
    assert msg.startswith("--lr-warmup-fraction 0.1 and --lr-warmup-iters 1 both set the warmup")
    assert "with --lr-warmup-fraction set, --lr-warmup-iters must be 0" in msg
    msg = error_of("--train-samples 400 --lr-warmup-fraction 0.1 --lr-warmup-samples 8",
                   base=without("--train-iters"))
    assert "with --lr-warmup-fraction set, --lr-warmup-samples must be 0" in msg


def test_wrong_mode_flags_name_the_mode_and_what_to_use():
    msg = error_of("--lr-warmup-samples 8")
    assert msg == ("--lr-warmup-samples 8 cannot be used in an iteration-based run "
                   "(--train-iters 4); use --lr-warmup-iters or --lr-warmup-fraction")
    assert "use --lr-decay-samples" in error_of("--train-samples 400 --lr-decay-iters 5",
                                                base=without("--train-iters"))


def test_deprecated_warmup_is_named_as_typed():
    msg = error_of("--train-samples 400 --warmup 3", base=without("--train-iters"))
    assert msg.startswith("--warmup 3 (deprecated; read as --lr-warmup-iters 3) cannot be used "
                          "in a sample-based run (--train-samples 400)")
    msg = error_of("--warmup 0.1 --lr-warmup-iters 1")
    assert msg.startswith("--warmup 0.1 (deprecated; read as --lr-warmup-fraction 0.1) and "
                          "--lr-warmup-iters 1")


# ------------------------------------------------------------------------- ramp-up


def test_rampup_longer_than_the_run_is_allowed_with_a_warning(caplog):
    """Megatron only asks start > 0, incr > 0 and (GBS - start) % incr == 0; the iteration
    count is Megatron's: the ramp 2, 2, 3, 3 passes 8 samples after 4 steps, then
    (8 - 10) // 4 = -1 takes one back."""
    cfg = run("--micro-batch-size 1 --train-samples 8 --rampup-batch-size 2 1 8",
              base=without("--train-iters", "--micro-batch-size"))
    assert cfg.training.train_iters == 3 and cfg.data.rampup_batch_size == [2, 1, 8]
    assert "the run ends during the ramp-up, after 3 iterations (7 samples" in caplog.text
    cfg = run("--train-samples 8 --rampup-batch-size 2 2 8", base=without("--train-iters"))
    assert cfg.training.train_iters == 4  # 2, 2, 2, 2 (the step to 4 comes after 8 samples)
