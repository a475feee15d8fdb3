"""Pipeline parallelism: schedules as data (`schedules.py`), point-to-point transfers
(`p2p.py`), the executor that runs one rank's plan (`executor.py`) and the container of a
rank's model chunks (`model_chunks.py`). See README.md."""
from megatron.core.megatron_names import core_getattr
from megatron.core.pipeline_parallel.executor import (
    ScheduleExecutor,
    ScheduleResult,
    action_phase,
    transfer_name,
)
from megatron.core.pipeline_parallel.model_chunks import ModelChunks, unwrap
from megatron.core.pipeline_parallel.p2p import P2PCommunicator, PendingBatch, tensor_shape
from megatron.core.pipeline_parallel.schedules import (
    P2P,
    Action,
    ScheduleError,
    build_schedule,
    compute_order,
    compute_slots,
    max_in_flight,
    schedule_name,
    simulate,
)

__all__ = [
    "Action",
    "action_phase",
    "ModelChunks",
    "P2P",
    "P2PCommunicator",
    "PendingBatch",
    "ScheduleError",
    "ScheduleExecutor",
    "ScheduleResult",
    "build_schedule",
    "compute_order",
    "compute_slots",
    "max_in_flight",
    "schedule_name",
    "simulate",
    "tensor_shape",
    "transfer_name",
    "unwrap",
]

# Megatron-LM 23.05's get_forward_backward_func, p2p_communication: one clear ImportError
__getattr__ = core_getattr("megatron.core.pipeline_parallel")
