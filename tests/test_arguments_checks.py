"""Command lines that used to pass validation (and --dry-run) but failed later, or failed
with a misleading message: each must fail early with exit status 2 and a message that
names the value and the fix, or run as Megatron-LM 23.05 runs it."""
from __future__ import annotations

import os

import pytest

from megatron.arguments import ArgumentsError, dry_run_report, parse_and_validate

B = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
     "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
     "--train-iters 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 100").split()


def without(*flags, base=B):
    """`base` minus each flag and its value (if it takes one)."""
    out = list(base)
    for flag in flags:
        i = out.index(flag)
        has_value = i + 1 < len(out) and not out[i + 1].startswith("--")
        del out[i:i + 1 + has_value]
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


def test_a_warmup_not_shorter_than_the_decay_names_the_flags_in_their_units(tmp_path):
    """llama-7b.yaml's lr-warmup-iters 2000 under a `--train-iters 4` try-out, a warmup
    past --lr-decay-iters or --lr-decay-samples: the message names the flags that set the
    two lengths with the values typed, and a warmup that fits. It named only samples the
    user never typed ('warmup (16000 samples) ... decay (32 samples)') and every flag."""
    preset = os.path.join(os.path.dirname(__file__), "..", "configs", "llama-7b.yaml")
    msg = error_of(f"--config {preset} --train-iters 4 --global-batch-size 8", world_size=4,
                   base=without("--train-iters", "--global-batch-size"))
    assert msg == ("--lr-warmup-iters 2000 is not shorter than the 4 iterations the learning "
                   "rate decays over (--train-iters 4): pass a smaller --lr-warmup-iters "
                   "(e.g. 0), or a longer --train-iters")
    msg = error_of("--lr-warmup-iters 20 --lr-decay-iters 5")
    assert msg.startswith("--lr-warmup-iters 20 is not shorter than the 5 iterations the "
                          "learning rate decays over (--lr-decay-iters 5)")
    assert msg.endswith("or a longer --lr-decay-iters")
    msg = error_of("--train-samples 400 --lr-decay-samples 50 --lr-warmup-samples 60",
                   base=without("--train-iters"))
    assert msg == ("--lr-warmup-samples 60 is not shorter than the 50 samples the learning "
                   "rate decays over (--lr-decay-samples 50): pass a smaller "
                   "--lr-warmup-samples (e.g. 5), or a longer --lr-decay-samples")


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


# ------------------------------------------------------------------- value ranges


@pytest.mark.parametrize("extra, expected", [
    ("--log-interval 0", "--log-interval 0 must be >= 1 (iterations between log lines)"),
    ("--tensorboard-log-interval 0 --tensorboard-dir tb", "--tensorboard-log-interval 0 must "
                                                          "be >= 1"),
    ("--hidden-dropout 1.5", "--hidden-dropout 1.5 must be <= 1 (a probability)"),
    ("--attention-dropout -0.1", "--attention-dropout -0.1 must be >= 0 (a probability)"),
    ("--num-workers -1", "--num-workers -1 must be >= 0"),
    ("--eval-interval -5", "--eval-interval -5 must be >= 0 (iterations between evaluations; "
                            "0: no evaluation, during or after training)"),
    ("--eval-iters -1", "--eval-iters -1 must be >= 0"),
    ("--save x --save-interval -2", "--save-interval -2 must be >= 0"),
    ("--exit-interval -1", "--exit-interval -1 must be >= 0"),
    ("--distributed-timeout-minutes 0", "--distributed-timeout-minutes 0 must be >= 1"),
    ("--train-iters 0", "--train-iters 0 must be >= 1 (pass --skip-train to only evaluate)"),
    ("--lr-decay-iters 0", "--lr-decay-iters 0 must be >= 1"),
    ("--lr-warmup-fraction 1.0", "--lr-warmup-fraction 1.0 must be < 1"),
    ("--lr -1", "--lr -1.0 must be >= 0"),
    ("--weight-decay -0.1", "--weight-decay -0.1 must be >= 0"),
    ("--adam-beta2 1.0", "--adam-beta2 1.0 must be < 1"),
    # Megatron-LM accepts it: the momentum buffer then grows geometrically and the loss
    # diverges within a few steps
    ("--optimizer sgd --sgd-momentum 1.5", "--sgd-momentum 1.5 must be <= 1 (SGD's momentum"),
    ("--loss-scale -8", "--loss-scale -8.0 must be >= 0"),
    ("--vocab-size 0", "--vocab-size 0 must be >= 1 (NullTokenizer's token ids)"),
    # the rotary table's torch.arange raised a traceback at model build
    ("--use-rotary-position-embeddings --rotary-percent -0.5", "--rotary-percent -0.5 must be "
                                                               ">= 0"),
    ("--fp16 --hysteresis 0", "--hysteresis 0 must be >= 1"),
    ("--fp16 --loss-scale-window 0", "--loss-scale-window 0.0 must be >= 1"),
    ("--fp16 --min-loss-scale 0", "--min-loss-scale 0.0 must be > 0"),
    ("--fp16 --min-loss-scale 8 --initial-loss-scale 4", "--min-loss-scale 8.0 must be <= "
     "--initial-loss-scale 4.0 (the dynamic scale starts at the initial one and never drops "
     "below the minimum); pass --min-loss-scale 4 or --initial-loss-scale 8"),
    # the default --min-loss-scale 1 under a smaller --initial-loss-scale: the fix is named
    ("--fp16 --initial-loss-scale 0.5", "pass --min-loss-scale 0.5 or --initial-loss-scale 1"),
    # a float32 loss scale above its largest value is inf, which never backs off
    ("--fp16 --initial-loss-scale 1e40", "--initial-loss-scale 1e+40 must be <= 3.40282e+38"),
    ("--fp16 --loss-scale 1e39", "--loss-scale 1e+39 must be <= 3.40282e+38"),
    # below the smallest normal float32 the scale rounds to 0 (or 1/scale to inf): the
    # grads unscale to NaN after the overflow check and the step wrote NaN weights
    ("--fp16 --initial-loss-scale 1e-50 --min-loss-scale 1e-60",
     "--initial-loss-scale 1e-50 must be >= 1.17549e-38"),
    ("--fp16 --min-loss-scale 1e-50", "--min-loss-scale 1e-50 must be >= 1.17549e-38"),
    ("--fp16 --loss-scale 1e-40", "--loss-scale 1e-40 must be >= 1.17549e-38"),
    ("--bf16 --loss-scale 1e-50", "--loss-scale 1e-50 must be >= 1.17549e-38"),
    ("--fp16 --loss-scale-window 2.5", "--loss-scale-window 2.5 must be a whole number of "
                                       "iterations"),
    ("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler",
     "--override-opt_param-scheduler (take the schedule from the command line) and "
     "--use-checkpoint-opt_param-scheduler"),
    # raised a ValueError traceback at the first training step, after the whole setup
    ("--profile --profile-step-start 5 --profile-step-end 5", "--profile-step-end 5 must be "
                                                              "greater than --profile-step-start 5"),
])
def test_values_no_run_can_use_fail_in_validation(extra, expected):
    base = without("--train-iters") if "--train-iters" in extra else B
    assert expected in error_of(extra, base=base)


def test_profile_ranks_outside_the_world_are_refused_naming_its_size():
    msg = error_of("--profile --profile-ranks 0 5", world_size=2)
    assert "--profile-ranks 0 5: rank(s) 5 not in this run of world size 2" in msg
    assert "pass ranks from 0 to 1" in msg
    assert "rank(s) -1 not in" in error_of("--profile --profile-ranks -1", world_size=2)
    assert run("--profile --profile-ranks 0 1", world_size=2).args["profile_ranks"] == [0, 1]
    assert run("--profile-ranks 5", world_size=2)  # no --profile: the ranks are not read


@pytest.mark.parametrize("value", ["-0.5", "-3"])
def test_a_negative_warmup_is_refused_under_its_own_name(value):
    msg = error_of(f"--warmup {value}")
    assert f"--warmup {value} is negative" in msg and "--lr-warmup-iters" in msg


def test_values_megatron_reads_as_off_stay_valid():
    cfg = run("--eval-iters 0 --eval-interval 0 --exit-interval 0 --num-workers 0 "
              "--save x --save-interval 0 --tensorboard-log-interval 0 --hidden-dropout 1.0 "
              "--hysteresis 0 --loss-scale 0")  # no tensorboard dir, no --fp16: unused
    assert run("--fp16 --loss-scale-window 500.0").optimizer.loss_scale_window == 500
    assert cfg.training.eval_iters == 0 and cfg.checkpoint.save_interval == 0
    assert run("--train-iters 0 --skip-train", base=without("--train-iters")).training.skip_train
    assert run("--profile-step-start 5 --profile-step-end 5").args["profile_step_end"] == 5


def test_negative_clip_grad_means_no_clipping_as_in_megatron(caplog):
    assert run("--clip-grad -1").optimizer.clip_grad == 0.0
    assert "--clip-grad -1.0: gradients are not clipped" in caplog.text


def test_adam_eps_zero_is_taken_with_a_warning_naming_the_nan_it_risks(caplog):
    """--adam-eps 0 (accepted by Megatron-LM) divides by sqrt(v) alone: a gradient element
    that is exactly 0 at its first step (the attention key biases' often are) makes its
    weight 0/0 = NaN and the run stops at the next step's NaN loss, with no word on why.
    It can run (a model without biases may have no zero gradient), so it stays valid."""
    assert run("--adam-eps 0").optimizer.adam_eps == 0.0
    assert ("--adam-eps 0: Adam divides by the root of the second moment alone" in caplog.text
            and "pass e.g. --adam-eps 1e-8" in caplog.text)
    caplog.clear()
    run("--adam-eps 1e-30")
    run("--optimizer sgd --sgd-momentum 1.0")
    assert "--adam-eps" not in caplog.text


def test_a_loss_scale_without_fp16_or_bf16_is_warned(caplog):
    run("--fp16 --loss-scale 128 --initial-loss-scale 4294967296")
    assert "has no effect" not in caplog.text
    run("--loss-scale 128")
    assert ("--loss-scale 128 has no effect without --fp16 or --bf16: fp32 training scales "
            "no loss") in caplog.text
    caplog.clear()
    run("--loss-scale 128 --use-distributed-optimizer")
    assert ("--loss-scale 128 has no effect without --fp16 or --bf16: the distributed "
            "optimizer scales the loss and unscales the gradients again") in caplog.text


@pytest.mark.parametrize("extra, expected", [
    ("--bf16 --initial-loss-scale 1024 --hysteresis 4",
     "--initial-loss-scale 1024.0, --hysteresis 4 have no effect: bf16 trains without loss "
     "scaling; only --fp16 without --loss-scale has a dynamic loss scale"),
    ("--fp16 --loss-scale 128 --min-loss-scale 2 --loss-scale-window 100",
     "--min-loss-scale 2.0, --loss-scale-window 100.0 have no effect: the loss scale is the "
     "constant --loss-scale 128; only --fp16 without --loss-scale has a dynamic loss scale "
     "(Megatron-LM ignores them too)"),
    ("--hysteresis 8", "--hysteresis 8 has no effect: fp32 training scales no loss; only "
     "--fp16 without --loss-scale has a dynamic loss scale (Megatron-LM ignores it too)"),
    ("--optimizer sgd --adam-beta2 0.95 --adam-eps 1e-6",
     "--adam-beta2 0.95, --adam-eps 1e-06 have no effect: this run uses --optimizer sgd"),
    ("--sgd-momentum 0.5", "--sgd-momentum 0.5 has no effect: this run uses --optimizer adam"),
    ("--weight-decay 0.1 --weight-decay-incr-style linear --start-weight-decay 0 "
     "--end-weight-decay 0.2", "--weight-decay 0.1 has no effect: with "
     "--weight-decay-incr-style linear the weight decay goes from --start-weight-decay to "
     "--end-weight-decay"),
    ("--lr-decay-style constant --min-lr 1e-4 --lr-decay-iters 8",
     "--min-lr 0.0001, --lr-decay-iters 8 have no effect: --lr-decay-style constant keeps "
     "--lr after the warmup"),
    ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler has no "
     "effect: there is no --load, so the schedule comes from the command line"),
    ("--override-opt_param-scheduler --load x --finetune", "--override-opt_param-scheduler "
     "has no effect: --finetune loads no schedule"),
    ("--override-opt_param-scheduler --load x --no-load-optim", "--no-load-optim loads no "
     "schedule"),
    # a script that forgot its rotary switch trains learned positions only
    ("--rotary-percent 0.5 --rotary-base 500000", "--rotary-percent 0.5, --rotary-base "
     "500000.0 have no effect: the positions are learned_absolute, without rotary embeddings; "
     "add --use-rotary-position-embeddings (or --position-embedding-type rope) to rotate"),
    ("--no-position-embedding --rotary-percent 0.5", "--rotary-percent 0.5 has no effect: "
     "the positions are none"),
    ("--use-rotary-position-embeddings --rotary-percent 0.5 --rotary-base 500000", None),
    ("--position-embedding-type rope --rotary-percent 0.5", None),
    # Xavier draws every weight: the std tuned beside it changes nothing
    ("--init-method-xavier-uniform --init-method-std 0.006", "--init-method-std 0.006 has no "
     "effect: --init-method-xavier-uniform draws every weight matrix from U(-a, a), a = "
     "sqrt(6 / (fan_in + fan_out)); drop one of the two (Megatron-LM ignores it too)"),
    ("--init-method-xavier-uniform --init-method-std 0.02", None),
    ("--init-method-std 0.006", None),
    # a script that forgot --recompute-granularity full recomputes nothing
    ("--recompute-method uniform", "--recompute-method uniform has no effect: nothing is "
     "recomputed without --recompute-granularity; add --recompute-granularity full"),
    ("--recompute-method block --recompute-num-layers 2", "--recompute-method block, "
     "--recompute-num-layers 2 have no effect: nothing is recomputed"),
    ("--recompute-activations --recompute-num-layers 2", "--recompute-num-layers 2 has no "
     "effect: --recompute-granularity selective recomputes the attention core only"),
    # a script that lost its --tensorboard-dir
    ("--log-timers-to-tensorboard --tensorboard-log-interval 5 "
     "--no-log-learnig-rate-to-tensorboard", "--tensorboard-log-interval 5, "
     "--log-timers-to-tensorboard, --no-log-learnig-rate-to-tensorboard have no effect "
     "without --tensorboard-dir (nothing is written to TensorBoard; Megatron-LM ignores them "
     "too); add --tensorboard-dir DIR"),
    # an evaluation-only run writes no TensorBoard scalar (Megatron-LM: not even the
    # validation loss), whatever the --log-*-to-tensorboard flags ask for
    ("--skip-train --tensorboard-dir tb", "--skip-train writes no scalars to "
     "--tensorboard-dir tb, not even the validation and test losses (as in Megatron-LM): "
     "only the arguments go there, the losses are printed"),
    ("--skip-train --tensorboard-dir tb --log-validation-ppl-to-tensorboard",
     "the losses are printed; --log-validation-ppl-to-tensorboard has no effect"),
    # a script that lost its --save writes no checkpoint; one that lost its --load starts
    # from scratch, --exit-on-missing-checkpoint or not
    ("--save-interval 5 --no-save-optim --async-save", "--save-interval 5, --no-save-optim, "
     "--async-save have no effect without --save (no checkpoint is written); add --save DIR"),
    ("--exit-on-missing-checkpoint --finetune", "--finetune, --exit-on-missing-checkpoint "
     "have no effect without --load (the run starts from freshly initialised weights, "
     "loading nothing); add --load DIR"),
    ("--no-load-rng", "--no-load-rng has no effect without --load"),
    # said by the flag checks, so that --dry-run says it too (it was the run alone)
    ("--exit-signal-handler", "--exit-signal-handler without --save: on SIGTERM/SIGUSR1 "
     "the run will exit without saving a checkpoint"),
    # an evaluation-only run saves nothing (Megatron-LM: silently), whatever --save says
    ("--skip-train --save s --save-interval 5", "--save s: --skip-train only evaluates and "
     "writes no checkpoint (as in Megatron-LM, which saves only after training); drop "
     "--skip-train to train and save"),
    ("--save s --save-interval 5 --no-save-rng --load s --no-load-optim "
     "--exit-on-missing-checkpoint", None),
    # --eval-interval 0 turns the final evaluation off too: the --eval-iters asked for
    # would score nothing, silently
    ("--eval-interval 0 --eval-iters 10", "--eval-iters 10 has no effect: --eval-interval 0 "
     "turns evaluation off, during and after training (no validation or test loss is "
     "printed); pass --eval-interval N to evaluate every N iterations, or one above "
     "--train-iters to evaluate only at the end"),
    ("--eval-interval 0", None),  # the default --eval-iters: evaluation is just off
    ("--eval-interval 0 --eval-iters 0", None),
    ("--eval-interval 0 --eval-iters 10 --skip-train", None),  # evaluates at the end
    # what the run reads, and defaults spelled out, are not warned
    ("--tensorboard-dir tb --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard",
     None),
    ("--tensorboard-log-interval 1 --tensorboard-queue-size 1000", None),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 2", None),
    ("--recompute-num-layers 1 --checkpoint-activations", None),
    ("--override-opt_param-scheduler --load x", None),
    ("--lr-decay-style cosine --min-lr 1e-4 --lr-decay-iters 8", None),
    ("--fp16 --initial-loss-scale 1024 --hysteresis 4 --adam-beta2 0.95 --weight-decay 0.1",
     None),
    ("--bf16 --initial-loss-scale 4294967296 --hysteresis 2 --optimizer sgd --adam-beta2 "
     "0.999", None),
])
def test_tuning_flags_the_run_never_reads_are_warned(caplog, extra, expected):
    """Megatron-LM ignores these silently: a bf16 run 'tuned' with --hysteresis, or an SGD
    run with --adam-beta2, trains exactly as without them."""
    run(extra)
    if expected is None:
        assert "has no effect" not in caplog.text
    else:
        assert expected in caplog.text


def test_empty_unused_memory_level_without_cuda_is_warned(caplog):
    """It empties the CUDA caching allocator: on a CPU run it did nothing, silently."""
    run("--empty-unused-memory-level 2")
    assert ("--empty-unused-memory-level 2 has no effect without CUDA (it returns the CUDA "
            "caching allocator's unused memory to the driver)") in caplog.text
    caplog.clear()
    run("--empty-unused-memory-level 2", cuda_available=True)
    run("--empty-unused-memory-level 1 --dry-run")  # a GPU job planned on a login node
    run("--empty-unused-memory-level 0")
    assert "--empty-unused-memory-level" not in caplog.text


def test_a_log_interval_longer_than_the_run_is_warned(caplog):
    """The iteration line comes at multiples of --log-interval (Megatron's rule): a 10-
    iteration run with the default 100 printed no loss at all, silently."""
    run("--log-interval 100")  # B: --train-iters 4
    assert ("--log-interval 100 is larger than the run's 4 training iterations: no "
            "iteration line (loss, learning rate, progress) will be printed; pass a "
            "--log-interval of at most 4 (e.g. 1) to see them") in caplog.text
    caplog.clear()
    run("--log-interval 4")
    run("--log-interval 100 --skip-train")
    run(["--train-samples", "800", "--log-interval", "100"],
        base=without("--train-iters"))  # 200 iterations of 4 samples
    assert "--log-interval" not in caplog.text


def test_a_run_that_ends_inside_the_lr_warmup_is_warned(caplog):
    """A run shorter than its warmup never trains at --lr (a --config preset's warmup kept
    under a short --train-samples try-out): Megatron's warmup is lr * n / W after n samples,
    so the last step's lr is lr * trained / W. Said, with the lr the run ends at."""
    lr, gbs = 1e-3, 4  # B: --lr 1e-3, micro batch 2 x 2 micro-batches, --train-iters 4
    run("--lr-warmup-iters 8 --lr-decay-iters 100")
    trained, warmup = 4 * gbs, 8 * gbs
    assert (f"--lr-warmup-iters 8 makes a learning-rate warmup of {warmup} samples, but the "
            f"run trains only {trained} (4 iterations): the learning rate ends at "
            f"{lr * trained / warmup:.3E}, 50% of --lr 0.001, and never decays; shorten the "
            "warmup or lengthen the run") in caplog.text
    caplog.clear()  # sample-based, and a fraction of a decay longer than the run
    run(["--train-samples", "40", "--lr-decay-samples", "1000", "--lr-warmup-fraction",
         "0.1"], base=without("--train-iters"))
    assert ("--lr-warmup-fraction 0.1 makes a learning-rate warmup of 100 samples, but the "
            f"run trains only 40 (10 iterations): the learning rate ends at {lr * 40 / 100:.3E}"
            ) in caplog.text
    caplog.clear()  # a warmup the run completes (at its last step), or --skip-train
    run("--lr-warmup-iters 4 --lr-decay-iters 100")
    run("--lr-warmup-iters 8 --lr-decay-iters 100 --skip-train")
    assert "warmup" not in caplog.text


def test_a_ramped_run_with_a_warmup_is_checked_not_crashed(caplog):
    """--rampup-batch-size with --lr-warmup-samples (GPT-3's recipe) crashed validation with
    a TypeError: the warmup check counted the ramp's samples on the namespace's strings."""
    ramped = without("--train-iters") + ["--train-samples", "20", "--rampup-batch-size", "2",
                                         "2", "8", "--lr-decay-samples", "100"]
    cfg = run(["--lr-warmup-samples", "10"], base=ramped)  # the ramp trains 20 in 7 steps
    assert cfg.training.train_iters == 7 and "warmup" not in caplog.text
    run(["--lr-warmup-samples", "40"], base=ramped)
    assert ("--lr-warmup-samples 40 makes a learning-rate warmup of 40 samples, but the run "
            "trains only 20 (7 iterations): the learning rate ends at 5.000E-04") in caplog.text


# ------------------------------------------------------------------- data inputs

DATA = without("--mock-data", base=B)


@pytest.mark.parametrize("extra, expected", [
    ("--data-path Z --split a,b", "--split 'a,b': expected numbers like '969,30,1'"),
    ("--data-path Z --split 0,0,0", "--split '0,0,0': weights must be finite numbers >= 0 with a positive sum"),
    ("--data-path X X", "--data-path: data path ['X', 'X']: weights must be numbers"),
    ("--data-path 0.5 X 0.5", "--data-path: data path ['0.5', 'X', '0.5'] must be one "
                              "prefix or pairs 'weight prefix weight prefix ...'"),
    ("--train-data-path 1 X Y", "--train-data-path: data path ['1', 'X', 'Y']"),
])
def test_data_path_and_split_syntax_fail_in_validation(extra, expected):
    assert expected in error_of(extra, base=DATA)


def test_a_blend_of_more_datasets_than_a_byte_can_index_fails_in_validation():
    """255 shards in --data-path stopped the run only after every member's index was built
    (510 here, hours for a large corpus), with 'at most 254 blended datasets are supported'
    naming neither the flag nor the fix; 254 are fine."""
    pairs = " ".join(f"1 shard{i}" for i in range(255))
    msg = error_of(f"--data-path {pairs}", base=DATA)
    assert msg.startswith("--data-path: data path of 255 'weight prefix' pairs: at most 254 "
                          "datasets can be blended")
    assert "tools/merge_datasets.py" in msg
    msg = error_of(f"--train-data-path {pairs}", base=DATA)
    assert msg.startswith("--train-data-path: data path of 255")
    run("--data-path " + " ".join(f"1 shard{i}" for i in range(254)), base=DATA)


def test_a_blend_in_one_argument_names_the_fix(tmp_path):
    """--data-path "$DATA_PATH" with DATA_PATH="0.3 a 0.7 b": one prefix '0.3 a 0.7 b'
    that was reported missing at the data check, as a file."""
    msg = error_of(["--data-path", "0.3 a 0.7 b"], base=DATA)
    assert msg == ("--data-path '0.3 a 0.7 b' is one argument holding 'weight prefix' pairs: "
                   "pass its words as separate arguments (--data-path 0.3 a 0.7 b), e.g. an "
                   "unquoted $DATA_PATH in a shell script")
    assert "--valid-data-path '1 v'" in error_of(["--valid-data-path", "1 v"], base=DATA)
    # a prefix with a space in it, or a file of that name, is a prefix
    assert run(["--data-path", "my corpus"], base=DATA).data.data_path == ["my corpus"]
    odd = tmp_path / "1 x"
    (tmp_path / "1 x.idx").touch()
    assert run(["--data-path", str(odd)], base=DATA).data.data_path == [str(odd)]
    a, b = tmp_path / "a", tmp_path / "b"  # "$A $B": two datasets, no weights
    (tmp_path / "a.idx").touch()
    assert run(["--data-path", f"{a} {tmp_path / 'c'}"], base=DATA).data.data_path  # no c.idx
    (tmp_path / "b.idx").touch()
    assert error_of(["--data-path", f"{a} {b}"], base=DATA) == (
        f"--data-path '{a} {b}' is one argument holding 2 dataset prefixes: a blend takes "
        f"'weight prefix' pairs as separate arguments, e.g. --data-path 1 {a} 1 {b}")


def test_a_quoted_blend_of_prefixes_with_spaces_names_the_fix(tmp_path):
    """--data-path "0.5 /my data/a 0.5 /my data/b" (prefixes holding spaces, in one quoted
    argument) was taken as one prefix and reported as missing files '0.5 /my data/a ...'."""
    blend = f"0.5 {tmp_path}/my data/a 0.5 {tmp_path}/my data/b"
    assert error_of(["--data-path", blend], base=DATA) == (
        f"--data-path '{blend}' is one argument that starts with a weight: a blend takes "
        "'weight prefix' pairs as separate arguments, and a prefix holding spaces cannot be "
        "told apart from its neighbours in one argument: quote each such prefix on its own "
        "(--data-path 0.5 '/my data/a' 0.5 b), or list the pairs under data-path: in a "
        "--config YAML file (read as one prefix, it names no .bin/.idx either)")
    pairs = ["0.5", f"{tmp_path}/my data/a", "0.5", f"{tmp_path}/my data/b"]
    assert run(["--data-path", *pairs], base=DATA).data.data_path == pairs
    (tmp_path / "c.yaml").write_text("data-path:\n" + "".join(f"  - '{p}'\n" for p in pairs))
    assert run(["--config", str(tmp_path / "c.yaml")], base=DATA).data.data_path == pairs


def test_a_prefix_with_spaces_split_into_words_is_named(tmp_path):
    """DATA_PATH="/my data/x" split into words (an unquoted $DATA_PATH, or
    scripts/pretrain_gpt.sh) ended with only 'weights must be numbers'."""
    (tmp_path / "my data é").mkdir()
    prefix = f"{tmp_path}/my data é/x y"
    (tmp_path / "my data é" / "x y.idx").touch()
    words = prefix.split()
    msg = error_of(["--data-path", *words], base=DATA)
    assert msg.startswith("--data-path: data path [") and "weights must be numbers" in msg
    assert msg.endswith(f"; the words {words} are the dataset prefix '{prefix}', which holds "
                        "spaces and was split into words (an unquoted $DATA_PATH, or a launch "
                        "script that splits DATA_PATH): pass it as one quoted argument, list "
                        "it under data-path: in a --config YAML file, or use a symlink to it "
                        "whose path has no spaces")
    assert run(["--data-path", prefix], base=DATA).data.data_path == [prefix]
    assert "the words" not in error_of(["--data-path", "1", "a", "b"], base=DATA)


def test_split_is_not_checked_where_megatron_ignores_it(caplog):
    cfg = run("--train-data-path X --split a,b", base=DATA)
    assert cfg.data.train_data_path == ["X"]
    assert ("--split 'a,b' ignored: without --data-path, the documents of --train-data-path "
            "are used whole") in caplog.text


def test_what_megatron_ignores_of_the_two_data_flag_sets_is_warned(caplog):
    """Megatron-LM builds from --data-path when it is given, silently dropping
    --train/valid/test-data-path; and ignores --split without --data-path."""
    cfg = run("--data-path Z --valid-data-path V --test-data-path T", base=DATA)
    assert cfg.data.data_path == ["Z"] and cfg.data.valid_data_path == ["V"]
    assert ("--valid-data-path, --test-data-path ignored: --data-path is given, and its "
            "--split '969, 30, 1' makes the train, validation and test sets") in caplog.text
    caplog.clear()
    run("--train-data-path X --valid-data-path V", base=DATA)  # the default --split: silent
    run("--data-path Z --split 90,10,0", base=DATA)
    assert "ignored" not in caplog.text


def test_a_blend_member_of_weight_0_is_warned_once(caplog):
    """Megatron-LM accepts weight 0 in silence; its blending still draws one sample from
    a first member of weight 0 (the tie at sample 1), so the warning says 'at most one'."""
    cfg = run("--data-path 0 A 0.5 B 0.0 C 0.5 D", base=DATA)
    assert cfg.data.data_path == ["0", "A", "0.5", "B", "0.0", "C", "0.5", "D"]
    assert [r.getMessage() for r in caplog.records if "weight 0" in r.getMessage()] == [
        "--data-path: weight 0 for A, C (accepted, as in Megatron-LM): the blend draws at most "
        "one sample from each; give them a positive weight to train on them, or drop the pairs"]
    caplog.clear()
    run("--train-data-path 1 X 0 Y", base=DATA)
    assert "--train-data-path: weight 0 for Y (accepted, as in Megatron-LM): the blend draws " \
        "at most one sample from it" in caplog.text
    caplog.clear()
    run("--data-path 0.3 A 0.7 B", base=DATA)
    assert "weight 0" not in caplog.text


def test_a_dataset_given_twice_in_a_blend_is_warned(caplog, tmp_path, monkeypatch):
    """The copies of one dataset share its index, so they draw the same samples in the
    same order: each sample is trained on twice. Spellings of one file count as one (a
    relative path, a link); another dataset does not."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.bin").write_bytes(b"")
    (tmp_path / "link.bin").symlink_to(tmp_path / "a.bin")
    run(f"--data-path 1 a 0.5 b 2 {tmp_path}/a", base=DATA)
    assert (f"--data-path: {tmp_path}/a and a are one dataset given 2 times (weights 1, 2): "
            "each copy is indexed from the same documents with the same --seed, so the "
            "copies draw the same samples in the same order") in caplog.text
    assert "with the weights summed (3) to draw distinct samples instead" in caplog.text
    caplog.clear()
    run("--train-data-path 1 link 1 a 1 b", base=DATA)
    assert "--train-data-path: a and link are one dataset given 2 times" in caplog.text
    caplog.clear()
    run("--data-path 1 a 1 b", base=DATA)
    run("--data-path a", base=DATA)
    assert "given" not in caplog.text


def test_split_numbers_past_the_third_are_warned(caplog):
    """Megatron-LM reads train, validation and test shares and drops the rest silently."""
    cfg = run("--data-path Z --split 80,10,5,5", base=DATA)
    assert cfg.data.split == "80,10,5,5"
    assert ("--split '80,10,5,5': only the first three numbers (train, validation, test) are "
            "read; 5 ignored") in caplog.text
    caplog.clear()
    run("--data-path Z --split 98/1/1", base=DATA)
    assert "--split" not in caplog.text


# ---------------------------------------------------------------------- tokenizer

TOKENIZER = without("--tokenizer-type", "--vocab-size")


def test_an_unexpanded_tilde_is_named_with_the_fix(tmp_path, monkeypatch):
    """`--save "~/ckpt"` (quoted, `--save=~/ckpt`, a --config value) made a directory named
    '~' in the working directory; a missing input named '~/...' said only 'check the path'."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/me")
    fix = ("'~' was not expanded to a home directory (the shell does that only for an "
           "unquoted ~ starting a word, not in --flag=~/... or a --config file): write "
           "/home/me/ckpt, or ./~/ckpt for a directory really named '~'")
    for flag in ("--save=~/ckpt --save-interval 5", "--tensorboard-dir ~/ckpt",
                 "--data-cache-path ~/ckpt"):
        assert error_of(flag) == (f"{flag.split()[0].split('=')[0]} ~/ckpt: would "
                                  f"create a directory named '~' in {tmp_path}; {fix}")
    (tmp_path / "config.yaml").write_text("save: ~/ckpt\nsave-interval: 5\n")
    assert fix in error_of("--config config.yaml")
    assert not (tmp_path / "~").exists()
    (tmp_path / "~").mkdir()  # a directory really named '~' is used
    assert run("--save ~/ckpt --save-interval 5").checkpoint.save == "~/ckpt"
    msg = error_of("--vocab-file ~/ckpt --merge-file ~/m", base=TOKENIZER + ["--tokenizer-type",
                   "GPT2BPETokenizer"], vocab_size_fn=lambda a: 1)
    assert msg == f"--vocab-file ~/ckpt: file not found (looked for {tmp_path}/~/ckpt); {fix}"
    from megatron.arguments_report import missing_data_files
    assert missing_data_files({"data_path": ["~/ckpt"]})[0].endswith(
        f"looked for {tmp_path}/~/ckpt.*; {fix})")


def test_missing_tokenizer_files_fail_in_validation(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    msg = error_of("--tokenizer-type GPT2BPETokenizer", base=TOKENIZER)
    assert "needs --vocab-file and --merge-file" in msg and "NullTokenizer" in msg
    msg = error_of(f"--vocab-file {tmp_path}/nope.json --merge-file {merges}", base=TOKENIZER,
                   vocab_size_fn=lambda a: 1)
    assert msg == f"--vocab-file {tmp_path}/nope.json: file not found; check the path"
    msg = error_of(f"--vocab-file data/nope.json --merge-file {merges}", base=TOKENIZER,
                   vocab_size_fn=lambda a: 1)
    assert msg == ("--vocab-file data/nope.json: file not found (looked for "
                   f"{os.path.join(os.getcwd(), 'data', 'nope.json')}); check the path")
    assert "(the default) needs --merge-file (" in error_of(f"--vocab-file {merges}",
                                                            base=TOKENIZER)
    msg = error_of("--tokenizer-type SentencePieceTokenizer", base=TOKENIZER,
                   vocab_size_fn=lambda a: 1)
    assert msg == "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model"


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_tokenizer_types_are_refused_before_anything_prints(tmp_path, capsys, kind):
    """Megatron 23.05's BERT WordPiece types were refused only when pretrain_gpt.py built
    the tokenizer (after the layout lines), in other words than tools/preprocess_data.py's;
    now the argument checks refuse them first, in preprocess_data.py's words."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[CLS]\n[SEP]\n[MASK]\na\n")
    built = []
    msg = error_of(f"--tokenizer-type {kind} --vocab-file {vocab}", base=TOKENIZER,
                   vocab_size_fn=lambda a: built.append(a) or 1)
    assert msg == (f"--tokenizer-type {kind} is not supported: it has no end-of-document "
                   "token, which GPT pretraining needs; use GPT2BPETokenizer, "
                   "SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer "
                   "or NullTokenizer")
    assert built == [] and capsys.readouterr().out == ""


def test_a_missing_tokenizer_type_is_named_when_another_tokenizers_flag_is_given():
    """--tokenizer-model or --vocab-size without --tokenizer-type: the default GPT-2 BPE
    asked for its two files, not saying which type reads the flag that was given."""
    msg = error_of("--tokenizer-model sp.model", base=TOKENIZER)
    assert msg == ("--tokenizer-type GPT2BPETokenizer (the default) needs --vocab-file and "
                   "--merge-file; --tokenizer-model sp.model is given but only the SentencePiece "
                   "and HuggingFace tokenizers read it: pass --tokenizer-type "
                   "SentencePieceTokenizer, GPTSentencePieceTokenizer or HuggingFaceTokenizer")
    msg = error_of("--vocab-size 1000", base=TOKENIZER)
    assert msg.endswith("; --vocab-size 1000 is given but only NullTokenizer reads it: pass "
                        "--tokenizer-type NullTokenizer")


def test_tokenizer_files_the_tokenizer_type_does_not_read_are_warned(tmp_path, caplog):
    """A SentencePiece --tokenizer-model under the default GPT-2 BPE (a script that forgot
    --tokenizer-type) trained with the GPT-2 vocabulary in silence, as in Megatron-LM."""
    vocab, merges, spm = (tmp_path / n for n in ("vocab.json", "merges.txt", "sp.model"))
    for path in (vocab, merges, spm):
        path.write_text("x")
    files = f"--vocab-file {vocab} --merge-file {merges}"
    run(f"{files} --tokenizer-model {spm}", base=TOKENIZER, vocab_size_fn=lambda a: 1)
    assert (f"--tokenizer-model {spm} is not read by --tokenizer-type GPT2BPETokenizer (the "
            f"default), which takes its vocabulary from --vocab-file {vocab} and --merge-file "
            f"{merges}; pass the --tokenizer-type that reads it, or drop it (Megatron-LM "
            "ignores it too)") in caplog.text
    caplog.clear()
    run(files)  # BASE: NullTokenizer --vocab-size 100
    assert (f"--vocab-file {vocab}, --merge-file {merges} are not read by --tokenizer-type "
            "NullTokenizer, which takes its vocabulary from --vocab-size 100") in caplog.text
    caplog.clear()
    run(f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {spm}", base=TOKENIZER,
        vocab_size_fn=lambda a: 1)
    run(f"{files} --tokenizer-type GPT2BPETokenizer", base=TOKENIZER, vocab_size_fn=lambda a: 1)
    assert "not read by" not in caplog.text


def test_a_tokenizer_that_cannot_be_built_exits_2(tmp_path, capsys):
    import pretrain_gpt

    (tmp_path / "vocab.json").write_text("{not json")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(TOKENIZER + ["--vocab-file", str(tmp_path / "vocab.json"),
                                       "--merge-file", str(tmp_path / "merges.txt"), "--dry-run"])
    assert info.value.code == 2
    assert "error: cannot build the GPT2BPETokenizer: " in capsys.readouterr().err


# ------------------------------------------------------------- contiguous buffers


def test_no_contiguous_buffers_is_one_coherent_message(caplog):
    msg = error_of("--bf16 --no-contiguous-buffers-in-local-ddp")
    assert msg.startswith("--no-contiguous-buffers-in-local-ddp cannot be used with --bf16")
    assert "drop --no-contiguous-buffers-in-local-ddp" in msg and "(got local)" not in msg
    assert "has no effect" not in caplog.text
    assert "--DDP-impl local (got torch)" in error_of("--bf16 --DDP-impl torch")
    assert "cannot be used with --use-distributed-optimizer" in error_of(
        "--use-distributed-optimizer --no-contiguous-buffers-in-local-ddp")
    run("--no-contiguous-buffers-in-local-ddp")  # fp32, replicated optimizer: accepted
    assert "--no-contiguous-buffers-in-local-ddp has no effect here" in caplog.text


# ----------------------------------------------------------------- arguments dump


def test_dump_shows_megatrons_counters_and_fixed_lengths():
    from megatron.arguments import format_args_dump

    args = run().args
    assert (args["consumed_train_samples"], args["consumed_valid_samples"]) == (0, 0)
    assert args["variable_seq_lengths"] is False
    dump = format_args_dump(args).splitlines()
    assert "  consumed_train_samples " + "." * 26 + " 0" in dump
    assert "  variable_seq_lengths " + "." * 28 + " False" in dump


def test_dump_shows_torch_ddp_without_contiguous_buffers():
    """Megatron-LM's validate_args turns use_contiguous_buffers_in_local_ddp off for
    --DDP-impl torch (there is no local DDP to keep buffers), before the arguments dump."""
    assert run("--DDP-impl torch").args["use_contiguous_buffers_in_local_ddp"] is False
    assert run().args["use_contiguous_buffers_in_local_ddp"] is True


def test_rollback_nan_policy_needs_save():
    """Without --save a rollback has nothing to reload: refused before training, not at the
    first NaN."""
    assert error_of("--nan-loss-policy rollback") == (
        "--nan-loss-policy rollback reloads the last checkpoint that --save wrote, and there "
        "is no --save; add --save DIR --save-interval N, or use --nan-loss-policy skip")
    assert run("--nan-loss-policy rollback --save x --save-interval 2").training \
        .nan_loss_policy == "rollback"
    assert run("--nan-loss-policy skip").training.nan_loss_policy == "skip"


# -------------------------------------------------- kernels this machine cannot run
def test_kernels_the_cpu_cannot_run_are_refused_before_training(monkeypatch):
    """--attention-backend flash with attention dropout, --adam-kernel triton and
    --cross-entropy-kernel triton on a CPU machine passed validation, then every rank
    stopped at the first step with a traceback ('No available kernel', 'ValueError:
    --adam-kernel triton cannot be used')."""
    from megatron.core import fused_cross_entropy
    from megatron.core.optimizer import multi_tensor_adam

    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", False)
    monkeypatch.setattr(fused_cross_entropy, "INTERPRET_ON_CPU", False)
    msg = error_of("--attention-backend flash")
    assert msg == ("--attention-backend flash: the CPU's flash kernel has no dropout, and "
                   "--attention-dropout is 0.1; use --attention-dropout 0, or "
                   "--attention-backend auto or math")
    assert run("--attention-backend flash --attention-dropout 0")
    assert error_of("--adam-kernel triton") == (
        "--adam-kernel triton cannot be used: Triton cannot run here (it needs CUDA and the "
        "triton package); use --adam-kernel auto or torch")
    assert "it steps AdamW, not --optimizer sgd" in error_of("--adam-kernel triton "
                                                             "--optimizer sgd")
    assert error_of("--cross-entropy-kernel triton") == (
        "--cross-entropy-kernel triton cannot be used: Triton cannot run on this device; use "
        "--cross-entropy-kernel auto or torch")
    # evaluation only (--skip-train, tasks/main.py): no dropout, no optimizer step
    assert run(without("--train-iters") + ["--skip-train", "--attention-backend", "flash",
                                           "--adam-kernel", "triton"], base=[])
    # where Triton runs (its CPU interpreter in tests) the kernels are accepted
    if multi_tensor_adam.triton is None:
        return
    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fused_cross_entropy, "INTERPRET_ON_CPU", True)
    assert run("--adam-kernel triton --cross-entropy-kernel triton")


def test_a_split_with_mock_data_is_warned(caplog):
    """`--split 100,0,0` to train without validation did nothing with --mock-data: every
    split is random tokens of its own."""
    run("--split 100,0,0")  # B: --mock-data
    assert ("--split 100,0,0 has no effect: --mock-data gives each split (train, validation, "
            "test) random tokens of its own") in caplog.text
    caplog.clear()
    run("")
    assert "--split" not in caplog.text


@pytest.mark.parametrize("flags", ["--record-memory-history", "--cuda-graph-step on",
                                   "--attention-backend cudnn", "--adam-kernel triton",
                                   "--gemm-algorithms table.json"])
def test_a_dry_run_without_cuda_notes_cuda_only_choices(caplog, flags):
    """A GPU job planned with --dry-run on a login node (no CUDA) was refused for its
    CUDA-only flags; the run itself (on its GPUs) still refuses them where CUDA is absent."""
    assert "CUDA" in error_of(flags)
    caplog.clear()
    run(flags + " --dry-run")
    assert "not checked on this machine, which has no CUDA (the run checks it on its GPUs): --" \
        in caplog.text
