"""The sample counts of a run resumed from a checkpoint: Megatron-LM's rule for counters a
checkpoint lacks (`assumed_counters`) and the warning when a sample-based run resumed at
another global batch size will not end at --train-samples (`sample_budget_message`).
Used by the load (megatron/trainer_checkpoint.py) and its preflight
(megatron/checkpoint_preflight.py)."""
from __future__ import annotations

from typing import Optional, Tuple

from megatron.microbatches import rampup_span, samples_of_steps, whole_steps_within


def sample_budget_warning(tr) -> Optional[str]:
    """`sample_budget_message` for the trainer's resumed state. Under
    --use-checkpoint-opt_param-scheduler the checkpoint's run length (the schedule's
    weight-decay length, kept from the checkpoint) is a goal too: the --train-samples the
    warning suggests reaches it."""
    goal = None
    if tr.config.optimizer.use_checkpoint_opt_param_scheduler:
        goal = getattr(tr.scheduler, "wd_incr_steps", None)
    return sample_budget_message(tr.config, tr.state.iteration,
                                 tr.state.consumed_train_samples, goal)


def sample_budget_message(config, iteration: int, consumed: int,
                          goal: Optional[int] = None) -> Optional[str]:
    """A WARNING when a sample-based run resumed at another global batch size (or with a
    --rampup-batch-size the checkpoint's batches did not follow) will not end at
    --train-samples (nor at `goal`, the checkpoint's run length in samples under
    --use-checkpoint-opt_param-scheduler). Its iterations are Megatron-LM's count:
    train_samples // global batch, as if every batch had had this size (with ramp-up: the
    ramp's steps from sample 0, then whole final-size batches); the checkpoint's `consumed`
    samples came in `iteration` batches of other sizes, so the run stops short (or has
    nothing to train) or goes past it. None for iteration-based runs, a start from
    iteration 0, a checkpoint whose batches had these sizes (the count is exact), or a
    difference below one batch (the partial last batch Megatron drops)."""
    t, d = config.training, config.data
    if not t.train_samples or iteration == 0:
        return None
    rampup = tuple(d.rampup_batch_size) if d.rampup_batch_size else None
    gbs = (d.target_global_batch_size or d.global_batch_size) if rampup else d.global_batch_size
    if consumed == samples_of_steps(0, iteration, rampup, gbs):
        return None
    more = max(0, t.train_iters - iteration)
    ends_at = consumed + samples_of_steps(consumed, more, rampup, gbs)
    if any(g and abs(ends_at - g) < gbs for g in (t.train_samples, goal)):
        return None
    goal = t.train_samples
    remaining = max(0, goal - consumed)
    # the --train-samples whose count is this run's iteration plus the whole steps that fit
    ramp_steps, ramp_samples = rampup_span(rampup, gbs)
    iters = iteration + whole_steps_within(consumed, remaining, rampup, gbs)
    fix = ramp_samples + (iters - ramp_steps) * gbs
    if rampup:
        count = (f"with --rampup-batch-size {' '.join(str(v) for v in rampup)} makes "
                 f"{t.train_iters} iterations (Megatron-LM's count: the ramp from sample 0, "
                 f"then batches of {gbs}), but the checkpoint consumed {consumed} samples in "
                 f"{iteration} iterations, not the {samples_of_steps(0, iteration, rampup, gbs)}"
                 " this ramp takes")
    else:
        count = (f"at global batch size {gbs} makes {t.train_iters} iterations (Megatron-LM's "
                 f"count: as if every batch had {gbs} samples), but the checkpoint consumed "
                 f"{consumed} samples in {iteration} iterations of another batch size")
    text = (f"WARNING: --train-samples {t.train_samples} {count}: this run trains {more} "
            f"more and ends at {ends_at} samples, not {goal}.")
    if fix <= 0:
        return text
    return (f"{text} To train the {remaining} left (in whole batches), pass --train-samples "
            f"{fix} with --use-checkpoint-opt_param-scheduler (the learning-rate schedule "
            "keeps the checkpoint's lengths)")


def assumed_counters(config, iteration: int, consumed_train: int,
                     consumed_valid: int) -> Tuple[int, int, Optional[str]]:
    """Megatron-LM's rule for a checkpoint past iteration 0 whose consumed-sample counters
    are 0 (an old one, or one a conversion tool wrote with the counters reset): iteration
    x global batch training samples (the ramp-up's count with --rampup-batch-size) and,
    for an iteration-based run, (iteration // --eval-interval) x --eval-iters x global
    batch validation samples count as consumed, so the resumed run reads on from there.
    Returns (train, valid, a note when the training count was assumed)."""
    if iteration <= 0:
        return consumed_train, consumed_valid, None
    from megatron.microbatches import rampup_consumed_samples

    t, d = config.training, config.data
    gbs = d.target_global_batch_size or d.global_batch_size
    note = None
    if consumed_train == 0:
        rampup = d.rampup_batch_size
        consumed_train = (rampup_consumed_samples(iteration, tuple(rampup), gbs) if rampup
                          else iteration * gbs)
        how = (f"the --rampup-batch-size {' '.join(map(str, rampup))} batches of its "
               f"{iteration} iterations" if rampup else f"its iterations x global batch {gbs}")
        note = (f" > the checkpoint at iteration {iteration} counts no consumed samples (an "
                f"old or converted checkpoint): taking {consumed_train} training samples "
                f"({how}) as consumed, as Megatron-LM does")
    if consumed_valid == 0 and t.eval_interval and not t.train_samples:
        consumed_valid = (iteration // t.eval_interval) * t.eval_iters * gbs
    return consumed_train, consumed_valid, note
