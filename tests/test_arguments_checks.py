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
