"""When one rank stops, the others say so in one line, naming it, instead of a traceback each.

A rank that fails (an exception, an out-of-memory error, SIGKILL, a lost node) leaves the
others in their next collective, which fails with the backend's error: gloo's "Connection
closed by peer" or "Connection reset by peer", a timeout, an NCCL error. Each of those
ranks used to print a long traceback of that error, naming neither the rank that stopped
nor what the run was doing, and burying the one traceback that matters.

`record_failure` leaves the failing rank's error under FAILURES_KEY in the job's store (the
rendezvous TCPStore: torchrun's agent hosts it, so it outlives the rank) before its
connections close. A rank whose collective failed for lack of a peer (`peer_failure`)
prints `peer_failure_message` instead of a traceback, e.g.

    [rank 0] stopped while saving the checkpoint of iteration 6: a collective failed
    (Connection reset by peer [10.0.0.2]:3490) because rank 1 stopped first, while saving
    the checkpoint of iteration 6, with RuntimeError: disk quota exceeded -- its traceback
    is in /logs/run/attempt_0/1/stderr.log on node7; the last checkpoint is
    /ckpt/iter_0000003: relaunch with --load /ckpt to resume from it

and exits with status 1. A rank killed outright records nothing: the line then says that
none reported an error and where the launcher names it. pretrain_gpt.py calls
`stopped_by_peer` itself; the other torchrun entry points (tools/generate.py, the text
server, tasks/main.py) run inside `process_group_closed`. The line is printed by the first
rank of each host that meets it (a count in the store; when the store is gone with its
host, by rank 0 and each node's first process), the others exit with the same status in
silence: at a thousand ranks it was a thousand copies of one line.

A failure every rank meets alike (an error raised with the same message everywhere, an
out-of-memory error on every GPU) is printed by the first rank that reports it
(`first_to_report`: an atomic count in the store): `repeated_failure` silences the same
error on the other ranks, which leave with status 1. The store calls run in a helper
thread with a short deadline: a store that does not answer (its host gone) costs seconds,
never the collective timeout; without an answer every rank prints, as before.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import threading
from typing import Callable, Iterator, Mapping, Optional

import torch.distributed as dist

FAILURES_KEY = "megatron-rank-failures"
REPORTS_KEY = "megatron-first-reports"  # + /<topic>/count, /<topic>/rank
STORE_DEADLINE_S = 3.0  # a store call that takes longer is given up
WAIT_FOR_RECORD_S = 1.0  # how long a survivor waits for the failing rank's record

# What the backends say when a collective fails for lack of a peer (lower case).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "timed out waiting", "communicator was aborted", "nccl error",
              "watchdog caught collective operation timeout")
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def peer_failure(exc: BaseException) -> Optional[str]:
    """The backend's words when `exc` is a collective failing because another rank
    stopped or hangs (a torch.distributed DistError, or a RuntimeError from gloo/NCCL
    saying so): its first line without the source location and gloo's advice; else None."""
    if not isinstance(exc, RuntimeError):
        return None
    line = first_line(exc)
    if not (isinstance(exc, dist.DistError) or any(m in line.lower() for m in _PEER_GONE)):
        return None
    line = _SOURCE_PREFIX.sub("", line)
    return line.split(". This is typically caused")[0].rstrip(". ")


def _with_deadline(call: Callable[[], object], deadline_s: float = STORE_DEADLINE_S):
    """`call()` in a helper thread; its result, or None when it failed or took longer
    than `deadline_s` (the thread is left to finish on its own: a daemon)."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except Exception:
            pass

    thread = threading.Thread(target=run, daemon=True, name="rank-failure-store")
    thread.start()
    thread.join(deadline_s)
    return box[0] if box else None


def _default_store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def describe_failure(exc: BaseException) -> Optional[str]:
    """What `record_failure` says of `exc`, or None for an exit that is no failure of this
    rank alone (status 0, an `AgreedExit` every rank raised together, Ctrl-C)."""
    from megatron.agreed_exit import AgreedExit

    if isinstance(exc, (AgreedExit, KeyboardInterrupt)):
        return None
    if isinstance(exc, SystemExit):
        if exc.code is None or exc.code == 0:
            return None
        return first_line(exc) if not isinstance(exc.code, int) else f"exit status {exc.code}"
    return f"{type(exc).__name__}: {first_line(exc)}"


def output_place(fd: int = 2, host: Optional[str] = None) -> str:
    """Where this process's stderr (`fd`), and so its traceback, goes, as the other ranks'
    line says it: a file (torchrun --redirect / --tee / --log-dir, srun --error, a shell's
    `2>`) by its path; /dev/null (torchrun --local-ranks-filter drops the other ranks'
    console output) as lost, with the flags that keep it; else (a terminal, a pipe to the
    launcher) its host. The file is named as this process sees it."""
    host = host or socket.gethostname()
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc (not Linux)
        return "its traceback is in its output"
    if target == os.devnull:
        return ("its traceback was not kept: its stderr is /dev/null (torchrun's "
                "--local-ranks-filter drops the other ranks' output; add --log-dir DIR "
                "--redirect 3 to keep each rank's in a file)")
    if os.path.isfile(target):
        return f"its traceback is in {target} on {host}"
    return f"its traceback is in its output (stderr on {host})"


def record_failure(rank: int, what: str, where: str = "", store=None) -> None:
    """Leave this rank's failure in the job's store (default: the default group's), for
    the other ranks' `peer_failure_message`, with where its traceback is
    (`output_place`). Best effort, within STORE_DEADLINE_S."""
    store = store if store is not None else _default_store()
    if store is None:
        return
    line = f"{rank}\t{output_place()}\t{where}\t{what}"

    def record() -> None:
        index = int(store.add(f"{FAILURES_KEY}/count", 1))
        store.set(f"{FAILURES_KEY}/{index}", line)

    _with_deadline(record)


def first_failure(store=None, wait_s: Optional[float] = None) -> Optional[str]:
    """The first failure another rank recorded ("rank R stopped first, <where>, with
    <error> -- its traceback is in <file> on <host>": `output_place`),
    waiting up to `wait_s` (default WAIT_FOR_RECORD_S, as it is when called) for one to
    come; else the line of a watchdog that fired; None when neither."""
    from megatron.watchdog import ABORT_KEY

    wait_s = WAIT_FOR_RECORD_S if wait_s is None else wait_s
    store = store if store is not None else _default_store()
    if store is None:
        return None

    def read() -> Optional[str]:
        import time

        until = time.monotonic() + wait_s
        while True:
            if store.check([f"{FAILURES_KEY}/1"]):
                rank, place, where, what = store.get(f"{FAILURES_KEY}/1").decode(
                    errors="replace").split("\t", 3)
                return (f"rank {rank} stopped first{', ' + where if where else ''}, with "
                        f"{what} -- {place}")
            if store.check([ABORT_KEY]):
                return store.get(ABORT_KEY).decode(errors="replace")
            if time.monotonic() >= until:
                return None
            time.sleep(0.1)

    return _with_deadline(read, wait_s + STORE_DEADLINE_S)


def _report_count(topic: str, store) -> tuple:
    """(the store key of `topic`, how many reports of it there are with this one: 1 for
    the first; None when the store does not answer within STORE_DEADLINE_S)."""
    key = f"{REPORTS_KEY}/{hashlib.sha1(topic.encode()).hexdigest()}"
    if store is None:
        return key, None
    return key, _with_deadline(lambda: int(store.add(f"{key}/count", 1)))


def first_to_report(topic: str, rank: int, store=None) -> Optional[int]:
    """None when this rank is the first to report `topic` (an atomic count in the job's
    store, default the default group's), or when the store cannot tell (no group, no
    answer within STORE_DEADLINE_S): then it reports. Else the rank that was first (-1
    when it has not said yet)."""
    store = store if store is not None else _default_store()
    key, count = _report_count(topic, store)
    if count is None or count == 1:
        if count == 1:
            _with_deadline(lambda: store.set(f"{key}/rank", str(rank)))
        return None

    def first() -> int:
        import time

        until = time.monotonic() + WAIT_FOR_RECORD_S  # the first one sets it right after
        while not store.check([f"{key}/rank"]):
            if time.monotonic() >= until:
                return -1
            time.sleep(0.05)
        return int(store.get(f"{key}/rank"))

    found = _with_deadline(first)
    return -1 if found is None else found


def _failure_text(exc: BaseException) -> Optional[str]:
    """What an uncaught `exc` shows after its traceback (a SystemExit: its message), or
    None when it shows nothing or is reported elsewhere (a status, an `AgreedExit`, an
    out-of-memory exit, Ctrl-C)."""
    from megatron.agreed_exit import AgreedExit
    from megatron.oom_report import OutOfMemoryExit

    if isinstance(exc, (AgreedExit, OutOfMemoryExit, KeyboardInterrupt)):
        return None
    if isinstance(exc, SystemExit):
        return None if exc.code is None or isinstance(exc.code, int) else str(exc.code)
    return f"{type(exc).__name__}: {exc}"


def repeated_failure(exc: BaseException, rank: int, world_size: int,
                     env: Mapping[str, str], store=None) -> Optional[SystemExit]:
    """For an entry point's `except`, after the process group exists: SystemExit(1) to
    raise instead of `exc` when another rank already reported the same error (the same
    message, and for an exception the same type: e.g. a check every rank makes alike);
    this rank then waits for that rank to print under a launcher
    (`wait_for_printing_rank`) and leaves in silence. None when `exc` is to be raised as
    it is: this rank is the first, or its error is its own, or not one that prints."""
    text = _failure_text(exc)
    if text is None or world_size <= 1:
        return None
    if first_to_report("failure\t" + text, rank, store) is None:
        return None
    from megatron.arguments import wait_for_printing_rank

    wait_for_printing_rank(world_size, env)
    return SystemExit(1)


def peer_failure_message(rank: int, reason: str, where: str, first: Optional[str],
                         resume: str) -> str:
    """The line of a rank whose collective failed (`reason`: `peer_failure`'s words)
    `where` the run was, naming the rank that stopped first (`first`: `first_failure`),
    then `resume` (megatron.interrupt.last_checkpoint_text)."""
    timed_out = "timed out" in reason.lower()
    text = (f"[rank {rank}] stopped{' ' + where if where else ''}: a collective "
            f"{'timed out' if timed_out else 'failed'} ({reason})")
    if first is not None and first.startswith("[watchdog rank"):
        text += f" after another rank's watchdog fired: {first}"
    elif first is not None:
        text += f" because {first}"
    elif timed_out:
        text += (": another rank did not take part in time (stuck, or in another collective; "
                 "its own output says where)")
    else:
        text += (" because another rank stopped first, and none reported an error: it was "
                 "killed (SIGKILL, the out-of-memory killer), lost with its node, or left "
                 "without an error; the launcher names it (torchrun: 'Root Cause' on that "
                 "rank's node)")
    return text + resume


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def launcher_node(env: Optional[Mapping[str, str]]) -> str:
    """The node whose first rank prints a peer failure's line: the host, and under torchrun
    its agent (GROUP_RANK, the node rank). Two agents of one job can share a host (two
    `torchrun --nnodes 2` on one machine, pods on the host's network): on the host name
    alone, a rank of the agent whose worker died took the count and was ended by that agent
    before it printed, and the other agent's ranks left in silence after
    SILENT_EXIT_DELAY_S."""
    env = os.environ if env is None else env
    agent = env.get("GROUP_RANK", "")
    return socket.gethostname() + (f" agent {agent}" if agent else "")


def stopped_by_peer(exc: BaseException, rank: int, where: str,
                    resume: str = "", prints: bool = True,
                    env: Optional[Mapping[str, str]] = None) -> Optional[SystemExit]:
    """For an entry point's `except`: the SystemExit (status 1) carrying
    `peer_failure_message` (ending with `resume`) when `exc` is a collective failing
    because another rank stopped (the process group is broken: do not destroy it) -- the
    line is the same on every rank, so only the first such rank of each node
    (`launcher_node`; a count in the job's store) carries it, the others' exit has no
    message; when the store does not answer (it was on the host that was lost), the
    ranks that `prints`. A rank leaving the line to another waits for it under a
    launcher (`env`: the process environment; `wait_for_printing_rank`): exiting at once,
    it would have the launcher end the rank that prints first. Else None, after recording `exc` as this rank's own failure for
    the others (`record_failure`)."""
    reason = peer_failure(exc)
    if reason is None:
        what = describe_failure(exc)
        if what is not None:
            record_failure(rank, what, where)
        return None
    _, count = _report_count(f"stopped by a peer\t{launcher_node(env)}", _default_store())
    if not (prints if count is None else count == 1):
        if env is not None:
            from megatron.arguments import wait_for_printing_rank

            wait_for_printing_rank(_world_size(), env)
        return SystemExit(1)
    return SystemExit(peer_failure_message(rank, reason, where, first_failure(), resume))


@contextlib.contextmanager
def process_group_closed(where: str = "during generation",
                         env: Optional[Mapping[str, str]] = None) -> Iterator[None]:
    """Around a torchrun entry point's run (generation, the text server, zero-shot
    evaluation): destroy the default process group the run made (not one its caller had
    made) when the run returns or every rank exits together (an AgreedExit). A gloo group
    left to the interpreter's exit can abort the process after its output ('terminate
    called without an active exception', SIGABRT: about one generate.py run in six at tp 2
    on 2 CPU cores), and torchrun then reports the run as failed. After another failure,
    where a rank may be gone, the group is left as it is; when that failure is a
    collective another rank broke, one line says so `where` the run was and names that
    rank (status 1, `stopped_by_peer`; `env`, the process environment, lets a rank that
    leaves that line to another wait for it under a launcher), instead of a traceback;
    this rank's own failure is recorded for the others' lines. The watchdog the run started (`build_watchdog`), if
    any, is closed."""
    from megatron.agreed_exit import AgreedExit
    from megatron.initialize import left_by_earlier_run
    from megatron.watchdog import close_current

    made_here, closes = not dist.is_initialized() or left_by_earlier_run(), False
    try:
        yield
        closes = True
    except AgreedExit:
        closes = True
        raise
    except BaseException as exc:
        lost = None
        if made_here and dist.is_initialized():
            lost = stopped_by_peer(exc, dist.get_rank(), where, env=env)
        if lost is not None:
            raise lost from None
        raise
    finally:
        close_current()
        if closes and made_here and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["describe_failure", "first_failure", "first_to_report", "peer_failure",
           "peer_failure_message", "process_group_closed", "record_failure",
           "repeated_failure", "stopped_by_peer"]
