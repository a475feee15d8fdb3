"""--nan-loss-policy: what the training loop does with a non-finite loss. `stop` (the
default) checks the losses at log intervals and before saves (no host sync per step) and
ends the run on every rank, printed once; `rollback` reloads the last checkpoint of --save
and skips the batches since it, giving up after MAX_ROLLBACKS_WITHOUT_PROGRESS rollbacks
in a row that do not get further; either way rank 0 names the data-parallel replicas
whose own loss was non-finite in one line (`report_nan`). `skip` is the loop's: the step
is not applied."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from megatron import trainer_checkpoint
from megatron.agreed_exit import exit_on_every_rank
from megatron.checkpoint_dirs import iteration_dir_name, read_tracker
from megatron.interval_log import (
    IntervalStats,
    log_interval,
    nonfinite_origin_line,
    nonfinite_origins,
    to_float,
)
from megatron.logging_utils import print_rank_0

if TYPE_CHECKING:
    from megatron.training import Trainer


def report_nan(tr: Trainer, iteration: int, local: Optional[torch.Tensor]) -> str:
    """Print once (rank 0) which data-parallel replicas produced the non-finite loss, not
    one line per replica (a collective: every rank calls it at the same point); return
    the message for all ranks."""
    line = nonfinite_origin_line(nonfinite_origins(tr, local), iteration)
    if line is not None and tr.rt.ps.rank == 0:
        print(line, flush=True)
    return f"NaN/Inf loss at iteration {iteration}"


def check_pending_nan(tr: Trainer, stats: IntervalStats) -> None:
    """Policy 'stop': losses are checked at log intervals and before saves (no per-step
    host sync); a non-finite one stops the run naming its iteration."""
    for r in stats.records:
        if not math.isfinite(to_float(r.loss)):
            msg = report_nan(tr, r.iteration, r.local_loss)
            log_interval(tr, stats)
            raise exit_on_every_rank(  # printed once (rank 0)
                f"error: {msg}; stopping (--nan-loss-policy stop). {_resume_hint(tr)}, or "
                "use --nan-loss-policy skip|rollback", tr.rt.control_group)


def _resume_hint(tr: Trainer) -> str:
    """Which checkpoint a resume after a NaN stop would start from: the one --save's
    tracker names now, or that there is none (the advice used to be "resume from the last
    checkpoint" even when the run had written none). A background save in flight
    (--async-save) is waited for first: the process's exit waits for it anyway, and once
    published it is the checkpoint to resume from (this rank's own wait: no collective)."""
    ck = tr.config.checkpoint
    failed = _finish_async_save(tr)
    if not ck.save:
        if ck.load and tr.start_iteration:
            return (f"Resume from --load {ck.load} (iteration {tr.start_iteration}, where "
                    "this run started: it writes no checkpoint, no --save)")
        return "There is no checkpoint to resume from (no --save); start again"
    try:
        iteration, release = read_tracker(ck.save)
    except ValueError:  # a damaged tracker: the load names the problem
        iteration, release = None, False
    if iteration is None:
        return f"--save {ck.save} holds no checkpoint yet to resume from{failed}; start again"
    name = os.path.join(ck.save, iteration_dir_name(iteration, release))
    return f"Resume from the last checkpoint, {name} (--load {ck.save}){failed}"


def _finish_async_save(tr: Trainer) -> str:
    """Wait for this rank's background save, if any; '' when there was none or it was
    published, else ' (<why it failed>)' for the message (the tracker kept its checkpoint)."""
    saver = getattr(tr, "async_saver", None)
    if saver is None:
        return ""
    try:
        saver.wait()
    except RuntimeError as exc:
        return f" ({exc})"
    return ""


# --nan-loss-policy rollback gives up after this many rollbacks in a row that do not get
# past the iteration where the previous NaN appeared (a divergence, not one bad batch).
MAX_ROLLBACKS_WITHOUT_PROGRESS = 3


def rollback(tr: Trainer, iteration: int) -> None:
    """Reload the last checkpoint of --save, when this run saved it or resumed from it
    (`trainer_checkpoint.rollback_iteration`); keep the training data position, so the
    batches since that checkpoint (the offending one included) are skipped. The validation
    position is the checkpoint's (`ValidationData.rewind`): an evaluation re-run after the
    rollback reads the samples it reads after a plain resume from that checkpoint (kept,
    the re-runs read past what the set is sized for: a StopIteration at the last one)."""
    target, origin = trainer_checkpoint.rollback_iteration(tr, iteration)
    furthest, streak = tr.rollback_streak
    streak = streak + 1 if iteration <= furthest else 1
    tr.rollback_streak = (max(furthest, iteration), streak)
    if streak > MAX_ROLLBACKS_WITHOUT_PROGRESS:
        raise exit_on_every_rank(
            f"error: NaN/Inf loss at iteration {iteration} again: {streak - 1} rollbacks to "
            f"the checkpoint at iteration {target} in a row have not got past iteration "
            f"{max(furthest, iteration)}, so this is not one bad batch. Stopping; lower --lr "
            "(or raise the warmup), check the data, or resume from an earlier checkpoint",
            tr.rt.control_group)
    keep = (tr.state.consumed_train_samples, tr.state.skipped_iters, tr.state.nan_iters)
    saved = tr.config.checkpoint
    tr.config.checkpoint = dataclasses.replace(saved, load=saved.save, finetune=False,
                                               no_load_optim=saved.no_save_optim,
                                               no_load_rng=saved.no_save_rng)
    try:
        trainer_checkpoint.load_trainer_checkpoint(tr, rollback=True)
    finally:
        tr.config.checkpoint = saved
    tr.state.consumed_train_samples, tr.state.skipped_iters, tr.state.nan_iters = keep
    print_rank_0(f" > rolled back from iteration {iteration} to {tr.state.iteration} ({origin}); "
                 f"continuing at sample {tr.state.consumed_train_samples}")
    last = last_served_iteration(tr)
    if last is not None and last < tr.config.training.train_iters:
        print_rank_0(f"WARNING: {_data_end(tr, last)}; the run will save a checkpoint and stop "
                     "there")


def last_served_iteration(tr: Trainer) -> Optional[int]:
    """The last iteration the train set can serve from the consumed samples (None: no
    limit known, or the `cyclic` loader, which starts another epoch). Only a rollback,
    which skips the batches since its checkpoint, gets there before --train-iters: the
    set is sized for --train-iters x --global-batch-size (a blend holds barely more)."""
    size, d = tr.train_set_size, tr.config.data
    if size is None or d.dataloader_type == "cyclic":
        return None
    left = max(size - tr.state.consumed_train_samples, 0)
    return tr.state.iteration + left // d.global_batch_size


def _data_end(tr: Trainer, last: int) -> str:
    return (f"the train set has {tr.train_set_size} samples, sized for --train-iters "
            f"{tr.config.training.train_iters}, and the rollbacks skipped the batches since "
            f"their checkpoints (consumed_train_samples {tr.state.consumed_train_samples} at "
            f"iteration {tr.state.iteration}): it serves iterations up to {last}")


def train_data_used_up(tr: Trainer) -> Optional[str]:
    """The error when the next iteration would read past the train set (after rollbacks,
    see `last_served_iteration`), else None. The same on every rank: no collective."""
    last = last_served_iteration(tr)
    if last is None or tr.state.iteration < last or last >= tr.config.training.train_iters:
        return None
    return (f"error: {_data_end(tr, last)}, not --train-iters "
            f"{tr.config.training.train_iters}. Stopping at iteration {last} with a checkpoint "
            "in --save. To train on, resume with --load and a larger --train-iters (or "
            "--train-samples); --dataloader-type cyclic starts another epoch instead")


class ValidationData:
    """The validation iterator of a run (`make(consumed)` builds one that starts at that
    many samples), which a rollback rewinds to the checkpoint's consumed_valid_samples.
    Other attributes are the current iterator's."""

    def __init__(self, make: Callable[[int], Iterator[dict]], consumed: int):
        self._make = make
        self._it = make(consumed)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._it)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_it"], name)

    def rewind(self, consumed: int) -> None:
        self._it.close()
        self._it = self._make(consumed)

    def close(self) -> None:
        self._it.close()


__all__ = ["MAX_ROLLBACKS_WITHOUT_PROGRESS", "ValidationData", "check_pending_nan",
           "last_served_iteration", "report_nan", "rollback", "train_data_used_up"]
