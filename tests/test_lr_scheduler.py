"""OptimizerParamScheduler against hand-computed Megatron formulas (steps are samples)."""
import math

import pytest
import torch

from megatron.core.config import OptimizerConfig
from megatron.core.optimizer import OptimizerParamScheduler

MAX_LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-5, 100, 1000


def _optimizer():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([
        {"params": [w], "wd_mult": 1.0, "lr_mult": 1.0},
        {"params": [b], "wd_mult": 0.0, "lr_mult": 0.5},
    ], lr=0.0)


def _config(**kw):
    base = dict(lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
                lr_decay_style="linear", weight_decay=0.1, wd_incr_steps=1000)
    base.update(kw)
    return OptimizerConfig(**base)


def _lr_at(sched, n):
    sched.step(n - sched.num_steps)
    return sched.get_lr()


def _expected_lr(style, n):
    if n <= WARMUP:
        return MAX_LR * n / WARMUP
    if style == "constant":
        return MAX_LR
    if n > DECAY:
        return MIN_LR
    if style == "inverse-square-root":
        return max(MIN_LR, MAX_LR * math.sqrt(WARMUP) / math.sqrt(n))
    r = (n - WARMUP) / (DECAY - WARMUP)
    coeff = 1 - r if style == "linear" else 0.5 * (math.cos(math.pi * r) + 1)
    return MIN_LR + (MAX_LR - MIN_LR) * coeff


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_styles_match_formulas(style):
    sched = OptimizerParamScheduler(_optimizer(), _config(lr_decay_style=style))
    for n in [0, 1, 50, 100, 101, 250, 550, 999, 1000, 1001, 5000]:
        assert _lr_at(sched, n) == pytest.approx(_expected_lr(style, n), rel=1e-12, abs=0)


def test_hand_computed_values():
    sched = OptimizerParamScheduler(_optimizer(), _config(lr_decay_style="cosine"))
    assert _lr_at(sched, 50) == pytest.approx(5e-4)
    assert _lr_at(sched, 550) == pytest.approx(MIN_LR + (MAX_LR - MIN_LR) * 0.5)  # r = 0.5
    sched = OptimizerParamScheduler(_optimizer(), _config(lr_decay_style="inverse-square-root"))
    assert _lr_at(sched, 400) == pytest.approx(MAX_LR * 10 / 20)


def test_no_warmup_inverse_sqrt_and_step_zero():
    sched = OptimizerParamScheduler(
        _optimizer(), _config(lr_warmup_steps=0, lr_decay_style="inverse-square-root"))
    assert sched.get_lr() == pytest.approx(MAX_LR)  # max(warmup,1)/max(0,1) = 1
    assert _lr_at(sched, 4) == pytest.approx(MAX_LR / 2)


def test_group_multipliers_and_increment():
    opt = _optimizer()
    sched = OptimizerParamScheduler(opt, _config(lr_decay_style="constant", lr_warmup_steps=0))
    assert opt.param_groups[0]["lr"] == pytest.approx(MAX_LR)
    assert opt.param_groups[1]["lr"] == pytest.approx(MAX_LR * 0.5)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    sched.step(32)
    sched.step(32)
    assert sched.num_steps == 64


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style):
    opt = _optimizer()
    sched = OptimizerParamScheduler(opt, _config(
        weight_decay_incr_style=style, start_weight_decay=0.01, end_weight_decay=0.1,
        wd_incr_steps=200))
    for n in [0, 50, 100, 200, 201, 1000]:
        sched.step(n - sched.num_steps)
        if n > 200:
            expected = 0.1
        else:
            r = n / 200
            coeff = r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
            expected = 0.01 + coeff * 0.09
        assert sched.get_wd() == pytest.approx(expected, rel=1e-12)
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(expected, rel=1e-12)
        assert opt.param_groups[1]["weight_decay"] == 0.0


def test_constant_weight_decay_uses_weight_decay():
    sched = OptimizerParamScheduler(_optimizer(), _config(weight_decay=0.05))
    assert (sched.start_wd, sched.end_wd) == (0.05, 0.05)
    sched.step(500)
    assert sched.get_wd() == 0.05


@pytest.mark.parametrize("kw, match", [
    (dict(min_lr=-1.0), "min_lr"),
    (dict(lr=1e-6, min_lr=1e-5), "min_lr"),
    (dict(lr_decay_steps=0), "decay"),
    (dict(lr_warmup_steps=1000), "warmup"),
    (dict(lr_decay_style="step"), "lr_decay_style"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=0.1), "end-weight-decay"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=0.2, end_weight_decay=0.1),
     "end weight decay"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=-0.1, end_weight_decay=0.1),
     "start weight decay"),
    (dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
     "mutually exclusive"),
])
def test_validation_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimizerParamScheduler(_optimizer(), _config(**kw))


def test_state_dict_round_trip(tmp_path):
    sched = OptimizerParamScheduler(_optimizer(), _config(lr_decay_style="cosine"))
    sched.step(320)
    sd = sched.state_dict()
    assert set(sd) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style",
                       "lr_decay_steps", "min_lr", "start_wd", "end_wd", "wd_incr_style",
                       "wd_incr_steps"}
    torch.save(sd, tmp_path / "s.pt")
    opt2 = _optimizer()
    sched2 = OptimizerParamScheduler(opt2, _config(lr_decay_style="cosine"))
    sched2.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert sched2.num_steps == 320 and sched2.get_lr() == sched.get_lr()
    assert opt2.param_groups[1]["lr"] == pytest.approx(sched.get_lr() * 0.5)
    sched.step(64)
    sched2.step(64)
    assert sched2.get_lr() == sched.get_lr()


def test_mismatch_raises_naming_key():
    sd = OptimizerParamScheduler(_optimizer(), _config()).state_dict()
    sched = OptimizerParamScheduler(_optimizer(), _config(min_lr=2e-5))
    with pytest.raises(ValueError, match="min_lr"):
        sched.load_state_dict(sd)


def test_check_state_dict_lists_every_difference_and_changes_nothing():
    """--dry-run's check: every value load_state_dict would stop on, the notes it would
    return, and the scheduler left as it was; load_state_dict's error names them all."""
    sd = OptimizerParamScheduler(_optimizer(), _config(lr=2e-3)).state_dict()
    sched = OptimizerParamScheduler(_optimizer(), _config(lr_decay_steps=2 * DECAY))
    notes, errors = sched.check_state_dict(sd)
    assert notes == [] and len(errors) == 2
    assert errors[0].startswith("optimizer-parameter-scheduler value 'max_lr' (--lr) from "
                                "the checkpoint (0.002) differs from the command line (0.001)")
    assert "'lr_decay_steps' (--lr-decay-iters/-samples, else --train-iters/-samples; in samples: " \
           "iterations x global batch size) from the checkpoint (1000) differs from the command line (2000)" in errors[1]
    assert sched.max_lr == MAX_LR and sched.lr_decay_steps == 2 * DECAY
    with pytest.raises(ValueError) as err:  # the real load names both, changes nothing
        sched.load_state_dict(sd)
    assert str(err.value) == ("2 optimizer-parameter-scheduler values differ from the "
                              "checkpoint:\n  " + "\n  ".join(errors))
    assert sched.max_lr == MAX_LR and sched.lr_decay_steps == 2 * DECAY
    keep = OptimizerParamScheduler(_optimizer(), _config(override_opt_param_scheduler=True))
    assert keep.check_state_dict(sd) == ([
        "max_lr (--lr): using the command line's 0.001, not the checkpoint's 0.002 "
        "(--override-opt_param-scheduler)"], [])
    assert keep.max_lr == MAX_LR
    assert sched.check_state_dict({"max_lr": MAX_LR})[1] == [
        "optimizer-parameter-scheduler checkpoint has no 'min_lr'"]


def test_override_and_use_checkpoint_flags():
    old = OptimizerParamScheduler(_optimizer(), _config(lr=2e-3))
    old.step(200)
    sd = old.state_dict()
    keep = OptimizerParamScheduler(_optimizer(), _config(override_opt_param_scheduler=True))
    keep.load_state_dict(sd)
    assert keep.max_lr == MAX_LR and keep.num_steps == 200
    take = OptimizerParamScheduler(
        _optimizer(), _config(use_checkpoint_opt_param_scheduler=True))
    take.load_state_dict(sd)
    assert take.max_lr == 2e-3 and take.get_lr() == old.get_lr()


def test_flags_report_the_values_they_settle():
    """Megatron prints which value each flag kept; a --lr changed on resume under
    --use-checkpoint-opt_param-scheduler must not be dropped without a word."""
    old = OptimizerParamScheduler(_optimizer(), _config(lr=2e-3))
    sd = old.state_dict()
    keep = OptimizerParamScheduler(_optimizer(), _config(override_opt_param_scheduler=True))
    assert keep.load_state_dict(sd) == [
        "max_lr (--lr): using the command line's 0.001, not the checkpoint's 0.002 "
        "(--override-opt_param-scheduler)"]
    take = OptimizerParamScheduler(
        _optimizer(), _config(use_checkpoint_opt_param_scheduler=True))
    assert take.load_state_dict(sd) == [
        "max_lr (--lr): using the checkpoint's 0.002, not the command line's 0.001 "
        "(--use-checkpoint-opt_param-scheduler)"]
    same = OptimizerParamScheduler(_optimizer(), _config(use_checkpoint_opt_param_scheduler=True))
    assert same.load_state_dict(OptimizerParamScheduler(_optimizer(), _config()).state_dict()) \
        == []


def test_step_mismatch_says_it_counts_samples():
    """A resume with another --global-batch-size changes the warmup in samples: the error
    says what the numbers count."""
    sd = OptimizerParamScheduler(_optimizer(), _config()).state_dict()
    sched = OptimizerParamScheduler(_optimizer(), _config(lr_warmup_steps=2 * WARMUP))
    with pytest.raises(ValueError, match=r"'lr_warmup_steps' \(--lr-warmup-iters/-samples/-fraction; "
                                         r"in samples: iterations x global batch "
                                         r"size\) from the checkpoint \(100\)"):
        sched.load_state_dict(sd)


def test_legacy_keys_load():
    sched = OptimizerParamScheduler(_optimizer(), _config())
    legacy = {"start_lr": MAX_LR, "min_lr": MIN_LR, "warmup_iter": WARMUP,
              "end_iter": DECAY, "decay_style": "linear", "num_iters": 300}
    sched.load_state_dict(legacy)
    assert sched.num_steps == 300
    assert sched.get_lr() == pytest.approx(_expected_lr("linear", 300))


# Megatron keeps warmup = fraction * decay as a float: --lr-warmup-fraction 0.3 of 3
# iterations x 4 samples is 3.6 samples, not 3.
FRACTIONAL = dict(lr_warmup_steps=0.3 * 12, lr_decay_steps=12, min_lr=0.0)


def test_fractional_warmup_is_not_truncated():
    sched = OptimizerParamScheduler(_optimizer(), _config(**FRACTIONAL))
    assert sched.lr_warmup_steps == pytest.approx(3.6)
    assert _lr_at(sched, 4) == pytest.approx(9.5238095e-4)  # Megatron: 1e-3 * (1 - 0.4 / 8.4)
    assert _lr_at(sched, 8) == pytest.approx(4.7619048e-4)
    tiny = OptimizerParamScheduler(_optimizer(), _config(lr_warmup_steps=0.01 * 24,
                                                         lr_decay_steps=24))
    assert tiny.get_lr() == 0.0  # step 0 is inside the 0.24-sample warmup
    assert isinstance(OptimizerParamScheduler(_optimizer(), _config()).lr_warmup_steps, int)


def test_fractional_warmup_checkpoint_round_trip(tmp_path):
    sched = OptimizerParamScheduler(_optimizer(), _config(**FRACTIONAL))
    sched.step(4)
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    again = OptimizerParamScheduler(_optimizer(), _config(**FRACTIONAL))
    again.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert again.lr_warmup_steps == sched.lr_warmup_steps and again.get_lr() == sched.get_lr()


def test_checkpoint_with_truncated_warmup_still_resumes(caplog):
    """Checkpoints written before the fix stored int(3.6) = 3: they resume, keeping this
    run's 3.6 with a warning (or the stored 3 with --use-checkpoint-opt_param-scheduler);
    any other difference is still an error."""
    old = OptimizerParamScheduler(_optimizer(), _config(**FRACTIONAL)).state_dict()
    old.update(lr_warmup_steps=3, num_steps=4)
    sched = OptimizerParamScheduler(_optimizer(), _config(**FRACTIONAL))
    sched.load_state_dict(old)
    assert sched.lr_warmup_steps == pytest.approx(3.6) and sched.num_steps == 4
    assert "rounded down" in caplog.text and "--use-checkpoint-opt_param-scheduler" in caplog.text
    take = OptimizerParamScheduler(_optimizer(), _config(
        use_checkpoint_opt_param_scheduler=True, **FRACTIONAL))
    take.load_state_dict(old)
    assert take.lr_warmup_steps == 3
    old["lr_warmup_steps"] = 2
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        OptimizerParamScheduler(_optimizer(), _config(**FRACTIONAL)).load_state_dict(old)
