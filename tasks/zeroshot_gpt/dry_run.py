"""`tasks/main.py ... --dry-run`: what a zero-shot evaluation would do, checked without
launching it -- the layout and model, a forward-only memory estimate, every input file
(tokenizer files; the --valid-data file read, tokenized and cut into samples as the
evaluation does, so a malformed LAMBADA line or a passage longer than --seq-length + 1
fails here too) and the checkpoint under --load as the evaluation reads it (the weights
only: no optimizer, learning-rate schedule or RNG state is needed). Exit status 1 when
the evaluation would stop on any of them."""
from __future__ import annotations

import dataclasses
import os
from typing import List, Tuple

from megatron.config import Config

# pretrain_gpt.py's data flags: an evaluation reads --valid-data instead
_TRAINING_DATA = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def evaluation_dry_run(task_ns, config: Config, world_size: int, show: bool = True) -> int:
    """Print the report (unless not `show`); return the exit status (1: the evaluation
    would stop)."""
    from megatron.arguments_report import (
        find_missing_inputs,
        memory_lines,
        missing_input_lines,
        setup_lines,
    )

    world, model = setup_lines(config, world_size)
    lines = ["dry run: zero-shot evaluation resolved, nothing launched", world,
             _task_line(task_ns, config)] + model
    lines += memory_lines(config, evaluation=True)
    args = {**config.args, "skip_train": True, **dict.fromkeys(_TRAINING_DATA)}
    missing = find_missing_inputs(args)
    path = task_ns.valid_data[0]
    if not os.path.isfile(path):
        missing.insert(0, f"{path} (--valid-data)")
    lines += missing_input_lines(missing)
    data_lines, data_fails = ([], False) if missing else _data_lines(task_ns, config)
    load_lines, load_fails = _load_lines(config)
    if show:
        print("\n".join(lines + data_lines + load_lines), flush=True)
    return 1 if missing or data_fails or load_fails else 0


def node_dry_run(task_ns, config: Config, job, local_rank: int) -> int:
    """`evaluation_dry_run`'s status on every rank: each node's first process makes the
    checks and prints the report (rank 0 and one per node, not one per process), the
    node's other processes take its status through the job's store (a
    megatron.startup_store.JobStore) instead of reading the same files again; each makes
    the checks in silence when the launch has no store."""
    import datetime

    from megatron.startup_store import from_node_first

    show = job.rank == 0 or local_rank == 0
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes,
                                 seconds=60)
    return from_node_first(
        job, local_rank, "evaluation_dry_run",
        lambda: evaluation_dry_run(task_ns, config, job.world_size, show=show), timeout,
        "the dry run's inputs")


def _data_lines(task_ns, config: Config) -> Tuple[List[str], bool]:
    """(the --valid-data lines, whether the evaluation would stop on the file): the file
    read as the evaluation reads it (`evaluate.build_data`, the same tokenizer), with its
    warnings and what it holds, or the error it stops on. Only once every input file was
    found (the tokenizer's among them)."""
    from megatron.data_loading import build_tokenizer_for
    from tasks.zeroshot_gpt.evaluate import build_data

    path = task_ns.valid_data[0]
    said: List[str] = []
    try:
        data = build_data(task_ns, config, build_tokenizer_for(config), say=said.append)
    except SystemExit as exc:
        data, error = None, str(exc.code)
    lines = [f"  {line}" for line in said if line.startswith("WARNING")]
    if data is None:
        return lines + ["--valid-data problem (the evaluation would stop here):",
                        f"  {error}"], True
    count = len(data["samples"])
    if task_ns.task == "LAMBADA":
        return [f"--valid-data {path}: {count} LAMBADA passages"] + lines, False
    return [f"--valid-data {path}: {data['num_tokenized']} tokens ({data['num_original']} "
            f"words), {count} windows of {config.data.seq_length} tokens"] + lines, False


def _task_line(task_ns, config: Config) -> str:
    d = config.data
    text = (f"  task: {task_ns.task} on {task_ns.valid_data[0]}, sequence length "
            f"{d.seq_length}, micro batch {d.micro_batch_size}")
    if task_ns.task == "LAMBADA":
        return text + (", strict (whole last word)" if task_ns.strict_lambada else "")
    stride = min(max(1, task_ns.overlapping_eval or 0), d.seq_length)
    return text + f", windows every {stride} tokens (--overlapping-eval)"


def _load_lines(config: Config) -> Tuple[List[str], bool]:
    """(the checkpoint lines, whether the evaluation would stop on it): the real run's
    `check_load_dir`, then the checkpoint read as an evaluation reads it."""
    from megatron.arguments_report import checkpoint_lines
    from tasks.zeroshot_gpt.evaluate import check_load_dir

    load = config.checkpoint.load
    if not load:
        return ["no --load: evaluates a randomly initialised model"], False
    try:
        check_load_dir(load)
    except SystemExit as exc:
        return [f"checkpoint (--load {load}):", f"  {exc.code}"], True
    weights_only = dataclasses.replace(config, checkpoint=dataclasses.replace(
        config.checkpoint, no_load_optim=True, no_load_rng=True))
    return checkpoint_lines(weights_only, evaluation=True)
