#!/usr/bin/env python
"""Pretrain a GPT model: parse -> validate -> initialise -> build -> train.

Takes Megatron-LM 23.05's command line, e.g.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 16 \
        --lr 3e-4 --train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024

`--dry-run` validates the configuration for $WORLD_SIZE processes and exits.
"""
from __future__ import annotations

import os
import signal
import sys
import time


def _launcher_env() -> tuple:
    """(rank, world_size, local_rank) as torchrun sets them; a value that is no whole
    number stops the process naming it (megatron.srun_tasks.launcher_ranks)."""
    from megatron.srun_tasks import launcher_ranks

    return launcher_ranks(os.environ)


def _check_srun_tasks(env) -> None:
    """Several srun tasks without torchrun's variables: one error, printed by task 0 (the
    others wait for it under Slurm, then exit with status 1)."""
    from megatron.arguments import exit_before_group
    from megatron.srun_tasks import srun_tasks_without_launcher

    message = srun_tasks_without_launcher(env)
    if message is not None:
        task = int(env.get("SLURM_PROCID", "0") or 0)
        raise exit_before_group(SystemExit(message), task, int(env["SLURM_STEP_NUM_TASKS"]),
                                env, machine=False)


def _check_same_arguments(config, job) -> None:
    """A rank whose settings are not rank 0's (a node started with another command line)
    stops before the process group: printed by each such node's first process."""
    import datetime

    from megatron.arguments import exit_before_group
    from megatron.startup_store import check_same_arguments

    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes,
                                 seconds=60)
    try:
        check_same_arguments(job, config.args, timeout)
    except SystemExit as e:
        raise exit_before_group(e, job.rank, job.world_size, os.environ) from None


def tokenizer_vocab_size(args) -> int:
    """Unpadded vocabulary size of the run's tokenizer (`run_tokenizer`)."""
    return run_tokenizer(args).vocab_size


class KeptTokenizer:
    """A `vocab_size_fn` for parse_and_validate that keeps the tokenizer it builds
    (`.tokenizer`; None until called) for the run's data: each rank reads the tokenizer's
    files (vocab and merges, a sentencepiece model) from the shared file system once."""

    def __init__(self):
        self.tokenizer = None

    def __call__(self, args) -> int:
        self.tokenizer = run_tokenizer(args)
        return self.tokenizer.vocab_size


def run_tokenizer(args):
    """The run's tokenizer (built from its local files). A tokenizer that cannot be built,
    or lacks the end-of-document id that a flag needs, is a configuration error (exit
    status 2)."""
    from megatron.arguments_common import ArgumentsError
    from megatron.arguments_inputs import check_eod_flags
    from megatron.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                              merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                              vocab_size=args.vocab_size, vocab_extra_ids=args.vocab_extra_ids)
    except (OSError, ValueError, RuntimeError) as e:
        raise ArgumentsError(f"cannot build the {args.tokenizer_type}: {e}") from None
    check_eod_flags(args, tok)
    return tok


def main(argv=None) -> int:
    """Run with `argv` (None: sys.argv[1:]); the exit status. Callable more than once in
    one process: the environment variables, warnings hooks, signal handlers and process
    group it changes come back as the caller had them (README's "In-process use")."""
    return _run_main(argv, command_line=False)


def _run_main(argv, command_line: bool) -> int:
    """main; `command_line` (pretrain_gpt.py run as a script): after a Ctrl-C with a
    background checkpoint writer still running, the process ends at once (`_interrupted`)."""
    from megatron.entry_state import entry_point_changes_undone

    with entry_point_changes_undone(os.environ):
        return _main(argv, command_line)


def _main(argv, command_line: bool = False) -> int:
    start = time.time()
    from megatron.interrupt import InterruptWatch, RunProgress

    progress, config, signals = RunProgress(), None, None  # Ctrl-C: one line, not tracebacks
    with InterruptWatch() as watch:
        try:
            from megatron.arguments import parse_and_validate

            _check_srun_tasks(os.environ)
            from megatron.startup_store import JobStore

            rank, world, local_rank = _launcher_env()
            kept = KeptTokenizer()
            job = JobStore(os.environ, rank, world)  # rank 0 reads for all before the group
            config = parse_and_validate(sys.argv[1:] if argv is None else argv,
                                        world_size=world, vocab_size_fn=kept, job_store=job)
            # (not for --dry-run: a SIGTERM sent to stop it must stop it)
            signals = None if config.args.get("dry_run") else _exit_signal_handler(config)
            _check_same_arguments(config, job)
            if config.args.get("dry_run"):  # under torchrun: one report per node
                return _dry_run(config, job, local_rank)
            return _train(config, (rank, world, local_rank), start, progress, watch,
                          kept.tokenizer, job.store, signals)
        except BaseException as e:
            if not watch.explains(e):
                raise
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process is ending
        finally:
            if signals is not None:  # an in-process caller gets its own handlers back
                signals.restore()
    rank, _, local_rank = _launcher_env()
    return _interrupted(config, rank == 0 or local_rank == 0, progress, command_line)


def _exit_signal_handler(config):
    """With --exit-signal-handler, the SIGTERM/SIGUSR1 handler, installed once the
    arguments are read (where Megatron installs its own): a signal during the rest of
    the start-up (rendezvous, data, model, --load) is noted, and the first iteration
    saves and exits, instead of the signal ending the process. Kept until `main`
    returns. None without the flag."""
    from megatron.signals import SignalHandler

    return SignalHandler() if config.training.exit_signal_handler else None


def _dry_run(config, job, local_rank: int) -> int:
    """The --dry-run report's exit status on every rank. Each node's first process makes
    the checks (its files, the checkpoint under --load, the data samples) and prints the
    report; the node's other processes take its status through the job's store instead of
    reading the same files again in silence (each makes the checks when there is none)."""
    import datetime

    from megatron.arguments import run_dry_run
    from megatron.startup_store import from_node_first

    show = job.rank == 0 or local_rank == 0
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes,
                                 seconds=60)
    return from_node_first(job, local_rank, "dry_run",
                           lambda: run_dry_run(config, job.world_size, show=show),
                           timeout, "the dry run's inputs")


def _train(config, ranks: tuple, start: float, progress, watch, tokenizer=None,
           store=None, signals=None) -> int:
    """Initialise the process group (through `store`, the job's store when the argument
    checks connected it), then pretrain (with `tokenizer`, the one the argument checks
    built; None: pretrain builds it); the exit status (0, or an OOM exit's).
    The group is left as it is after an out-of-memory error, an interrupt or another
    rank's failure (megatron/rank_failure.py: one line, from the first such rank of each
    host): its teardown may wait for ranks still in a collective (the launcher ends
    those). A process group the caller made before (in-process use) is kept: the caller
    ends it. An error another rank has printed already is not printed again. `signals`:
    the --exit-signal-handler handler installed at start-up (None without the flag)."""
    import torch.distributed as dist

    from megatron.agreed_exit import silent_ranks_wait
    from megatron.arguments import format_args_dump, wait_for_printing_rank
    from megatron.data_loading import check_data_files
    from megatron.initialize import initialize_entry_point, left_by_earlier_run, set_random_seed
    from megatron.interrupt import last_checkpoint_text
    from megatron.logging_utils import print_rank_0
    from megatron.oom_report import OutOfMemoryExit
    from megatron.rank_failure import record_failure, repeated_failure, stopped_by_peer
    from megatron.training import pretrain, print_datetime

    rank, world, local_rank = ranks
    # a group the caller made is the caller's to end; one an earlier run left is not
    made_here = not dist.is_initialized() or left_by_earlier_run()
    rt = initialize_entry_point(config.parallel, config.args["cublas_workspace"], rank, world,
                                local_rank, os.environ, store=store)
    if rank == 0:
        print(format_args_dump(config.args), flush=True)
    set_random_seed(config.training.seed, rt, config.training.data_parallel_random_init)
    print_rank_0(f"time to initialize megatron (seconds): {time.time() - start:.3f}")
    print_datetime("after megatron is initialized", rt.control_group)
    leave_group = False
    with silent_ranks_wait(os.environ):  # rank 0 prints errors
        try:
            check_data_files(config, rt.control_group)  # before the model is built
            pretrain(config, rt, process_start_time=start, progress=progress,  # exits too
                     tokenizer=tokenizer, signals=signals)
        except OutOfMemoryExit as e:  # reported already
            leave_group = True
            record_failure(rank, "out of memory (a memory report with it)", progress.where())
            if e.first is not None:  # the whole report is another rank's: let it print
                wait_for_printing_rank(world, os.environ)
            return e.code
        except BaseException as e:
            leave_group = watch.explains(e)
            lost = None if leave_group else stopped_by_peer(
                e, rank, progress.where(), last_checkpoint_text(config.checkpoint.save),
                prints=rt.speaks_for_node, env=os.environ)
            if lost is not None:  # one line naming the rank that stopped, no traceback
                leave_group = True
                raise lost from None
            again = None if leave_group else repeated_failure(e, rank, world, os.environ)
            if again is not None:  # another rank printed this same error
                raise again from None
            raise
        finally:
            if made_here and dist.is_initialized() and not leave_group:
                dist.destroy_process_group()
    return 0


def _interrupted(config, prints: bool, progress, command_line: bool = False) -> int:
    """After Ctrl-C (`config`: None when it came before the command line was read):
    abandon a background save in flight (never published from now on), print where the
    run stopped and the checkpoint to resume from (rank 0, and the first process of each
    node), and return 130. When a background writer (a non-daemon thread) still runs:
    from the command line the process exits at once with 130 (its save is abandoned, and
    the interpreter's exit would wait for the thread); called in-process (a notebook,
    whose kernel that exit would end) the call waits for the writer to stop instead, so
    that the next call never meets it still writing under --save; a second Ctrl-C stops
    that wait (KeyboardInterrupt to the caller; the writer then ends on its own)."""
    from megatron.interrupt import INTERRUPTED_STATUS, interrupt_message

    abandoned = progress.abandon_save()
    if prints and config is None:  # while reading the command line
        print("interrupted during start-up (SIGINT, e.g. Ctrl-C)", flush=True)
    elif prints:
        print(interrupt_message(progress, config.checkpoint.save, abandoned), flush=True)
    if progress.writer_running() and command_line:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED_STATUS)
    if progress.writer_running():
        if prints:
            print("waiting for the background checkpoint writer to stop (its save is "
                  "abandoned; Ctrl-C again stops waiting)", flush=True)
        progress.wait_for_writer()
    return INTERRUPTED_STATUS


if __name__ == "__main__":
    from megatron.process_exit import run

    # sys.exit(main()) without the interpreter's teardown (about a second)
    run(lambda: _run_main(None, command_line=True))
