"""The checks that run before anything else at start-up: several `srun` tasks without
torchrun's variables, and launcher variables that are no numbers. They import nothing
heavy, so that the mistake (and `--help`, and a mistyped flag, which come after it) is
reported before torch is imported."""
from __future__ import annotations

from typing import List, Mapping, Tuple


def srun_tasks_without_launcher(env: Mapping[str, str], script: str = "pretrain_gpt.py",
                                alone: str = "would train alone as a one-process run, all "
                                             "of them writing the same --save") -> str | None:
    """The error for a process that `srun` started as one of several tasks of a step
    (SLURM_STEP_NUM_TASKS > 1) without torchrun's variables (RANK, WORLD_SIZE): each task
    `alone` ...; else None. Slurm sets SLURM_STEP_NUM_TASKS for the tasks of an `srun`
    step only (a batch script's own shell, one process, is not one)."""
    try:
        tasks = int(env.get("SLURM_STEP_NUM_TASKS", "") or 1)
    except ValueError:
        return None
    if tasks <= 1 or env.get("RANK") or env.get("WORLD_SIZE"):
        return None
    return (f"error: this process is task {env.get('SLURM_PROCID', '?')} of the {tasks} that "
            f"srun started (SLURM_STEP_NUM_TASKS={tasks}), but RANK and WORLD_SIZE are not "
            f"set: each task {alone}. Start one torchrun per node instead: srun "
            "--ntasks-per-node=1 python -m torch.distributed.run --nnodes $SLURM_NNODES "
            "--node-rank $SLURM_NODEID --nproc-per-node <GPUs per node> --master-addr <first "
            f"node> --master-port <port> {script} ... (scripts/slurm/pretrain_gpt.sbatch does)")


def launcher_variable_problems(env: Mapping[str, str]) -> List[str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE that are set but not whole numbers
    (sizes: at least 1), each named with its value."""
    out = []
    for var, least in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1),
                       ("LOCAL_WORLD_SIZE", 1)):
        value = env.get(var, "").strip()
        if value and not (value.isascii() and value.isdigit() and int(value) >= least):
            out.append(f"{var}={env[var]!r} is not a whole number >= {least}: the launcher "
                       f"(torchrun, srun, a script) sets it; unset it or fix the script "
                       "that sets it")
    return out


def launcher_ranks(env: Mapping[str, str]) -> Tuple[int, int, int]:
    """(rank, world_size, local_rank) from RANK, WORLD_SIZE, LOCAL_RANK as torchrun sets
    them (unset or empty: 0, 1, 0); a value that is no whole number stops the process with
    one line naming it (SystemExit, status 1), not a ValueError traceback."""
    bad = launcher_variable_problems(env)
    if bad:
        raise SystemExit("error: " + "\nerror: ".join(bad))
    return (int(env.get("RANK") or 0), int(env.get("WORLD_SIZE") or 1),
            int(env.get("LOCAL_RANK") or 0))
