"""The check that runs before anything else at start-up: several `srun` tasks without
torchrun's variables. It imports nothing heavy, so that the mistake (and `--help`, and a
mistyped flag, which come after it) is reported before torch is imported."""
from __future__ import annotations

from typing import Mapping


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
