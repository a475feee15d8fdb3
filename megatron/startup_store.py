"""The job's rendezvous store before the process group, and reads rank 0 makes for all.

What an entry point reads before `init_process_group` (the checkpoint's arguments for
`--use-checkpoint-args`: its tracker file, a listing of its iteration directory, rank 0's
model file) was read by every rank: at thousands of ranks on a shared file system
(Lustre, GPFS), thousands of reads of the same files at once. The rendezvous store
already exists then, or is about to: torchrun's agent hosts one for the whole job, and an
env:// launch (MASTER_ADDR, MASTER_PORT) has rank 0 host it. `JobStore` connects to it
early, and `from_rank_0` has rank 0 read and leave the result (or its error) under a key
that the other ranks wait for. The same store is handed to `init_process_group` after
(megatron/initialize.py), so rank 0 hosts one server, not two on one port. A rank 0 that
hosts the store waits until every rank has read its answer: it may exit right after (its
error, a dry run), and the store would go with it. `from_node_first` does the same per
node for checks of the machine's own files (`--dry-run`'s): each node's first process
reads, the node's other processes take its answer.

Entry points read the launcher's environment and pass it in; nothing here reads os.environ.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import signal
import socket
import threading
import time
from typing import Callable, Iterator, Mapping, Optional, TypeVar

T = TypeVar("T")

KEY_PREFIX = "megatron/startup/"  # under the start's namespace in torchrun's agent store


class JobStore:
    """The rendezvous store of a launch of `world_size` processes, connected on first use
    (`connect`) and kept for the process group (`store`: None until then). torchrun's
    agent store under this start's namespace (as `initialize_distributed` uses
    it); else, with MASTER_ADDR and MASTER_PORT, the TCPStore that rank 0 hosts (as
    env:// would make it) -- where the launcher named this process's RANK too, as env://
    needs: one process that checks a layout for $WORLD_SIZE ranks (`--dry-run`, RANK
    unset) would host it and wait for ranks that never come; the default group's store
    once a group exists; else none (a single process, or a launch that names no store:
    each rank reads for itself)."""

    def __init__(self, env: Mapping[str, str], rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._env = dict(env)
        self.store = None
        self.hosts = False  # whether this process hosts the store (rank 0 of an env:// launch)

    def connect(self, timeout: datetime.timedelta):
        """The store (connecting to it, or hosting it on rank 0, the first time); None when
        there is none to connect to."""
        if self.store is not None or self.world_size <= 1:
            return self.store
        import torch.distributed as dist  # here, not on import: `--help` needs no torch

        from megatron.initialize import agent_store_from_env, attempt_store

        if dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
        agent = agent_store_from_env(self._env)
        if agent is not None:
            self.store = attempt_store(agent, self.rank, self.world_size, timeout)
        elif self._env.get("MASTER_ADDR") and self._env.get("MASTER_PORT") and \
                self._env.get("RANK", "") != "":
            self.store = self._env_store(timeout)
            self.hosts = self.rank == 0
        return self.store

    def _env_store(self, timeout: datetime.timedelta):
        """The TCPStore rank 0 hosts on MASTER_ADDR:MASTER_PORT, as env:// would make it
        (multi_tenant: env://, had it run too, would share this server), once every rank
        has joined (`wait_for_ranks`). A failure is one line naming the address, the ranks
        and the fix (SystemExit), not the store's traceback."""
        import torch.distributed as dist

        from megatron.initialize import env_rendezvous_error

        addr, port = self._env["MASTER_ADDR"], self._env["MASTER_PORT"]
        where = f"MASTER_ADDR:MASTER_PORT ({addr}:{port})"
        try:
            socket.getaddrinfo(addr, None)
        except OSError as e:  # else the store retries the name for the whole timeout
            raise SystemExit(f"error: rank {self.rank} cannot resolve MASTER_ADDR={addr!r} "
                             f"({e.strerror or e}): set MASTER_ADDR to rank 0's host name or "
                             "address as the other nodes resolve it (under Slurm: $(scontrol "
                             "show hostnames $SLURM_JOB_NODELIST | head -n 1))") from None
        started = time.monotonic()
        try:
            with _sigint_ends_at_once(self.rank != 0):
                store = dist.TCPStore(addr, int(port), self.world_size,
                                      is_master=self.rank == 0, timeout=timeout,
                                      wait_for_workers=False, multi_tenant=True)
        except dist.DistError as e:  # a port in use, rank 0 not reached
            message = env_rendezvous_error(e, self._env, self.rank, self.world_size,
                                           time.monotonic() - started)
            if message is None:
                raise
            raise SystemExit(message) from None
        wait_for_ranks(store, self.rank, self.world_size, timeout, where)
        return store


def ranges_text(ranks) -> str:
    """Sorted whole numbers as ranges: [1, 2, 3, 5] -> "1-3, 5"."""
    out, ranks = [], sorted(ranks)
    for i, rank in enumerate(ranks):
        if i and rank == ranks[i - 1] + 1:
            out[-1] = (out[-1][0], rank)
        else:
            out.append((rank, rank))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def wait_for_ranks(store, rank: int, world_size: int, timeout: datetime.timedelta,
                   where: str) -> None:
    """Every rank marks itself joined in `store`; rank 0 (which hosts it) waits up to
    `timeout` for all of them and otherwise stops (SystemExit) naming the ranks that never
    joined, and `where` they were to connect: the store's own wait only said `1/2
    clients joined` in a traceback."""
    store.set(f"{KEY_PREFIX}joined/{rank}", b"")
    if store.add(KEY_PREFIX + "joined", 1) >= world_size:
        store.set(KEY_PREFIX + "all_joined", b"")
    if rank != 0:
        return
    if not _wait_interruptibly(store, KEY_PREFIX + "all_joined", timeout):
        missing = [r for r in range(world_size) if not store.check([f"{KEY_PREFIX}joined/{r}"])]
        raise SystemExit(
            f"error: rank 0 hosts the rendezvous store on {where} and waited "
            f"{timeout.total_seconds():.0f} s for the other ranks: {len(missing)} of "
            f"{world_size} never connected (rank(s) {ranges_text(missing)}). Their node was "
            "not launched (or is still starting), their processes failed before connecting "
            "(their output says why), or they were given another MASTER_ADDR, MASTER_PORT "
            "or WORLD_SIZE: start every rank with the same ones. The wait is "
            "--distributed-timeout-minutes (default 10) plus one minute") from None


POLL_S = 0.1  # how often rank 0 looks whether every rank has joined


def _wait_interruptibly(store, key: str, timeout: datetime.timedelta,
                        poll_s: float = POLL_S) -> bool:
    """Whether `key` was set in `store` within `timeout`, looked for every `poll_s`.
    The store's own wait blocks in C++ and retries through signals: Ctrl-C (SIGINT) on a
    rank 0 waiting for a late rank was not seen until the wait ended (the
    --distributed-timeout-minutes wait, 11 min by default); Python's handler runs
    between the looks (KeyboardInterrupt, the run's interrupt line, status 130). One
    process looks, rank 0, once a start."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


@contextlib.contextmanager
def _sigint_ends_at_once(active: bool = True) -> Iterator[None]:
    """SIGINT's default handling (the process ends, status 130 to a shell) for the block,
    where the process was handling it in Python (main thread only): a TCPStore client
    connecting to a rank 0 not up yet retries through the signal in C++ ("Interrupted
    system call"), so Ctrl-C on a rank started before its rank 0 was not seen for the
    whole --distributed-timeout-minutes wait. Nothing is written before the store exists:
    nothing to clean up. SIGINT ignored (nohup) stays ignored."""
    previous = None
    if active and threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if handler not in (signal.SIG_IGN, signal.SIG_DFL, None):
            previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


PER_RANK_ARGS = ("rank", "local_rank")  # the settings that differ between ranks of one run


def check_same_arguments(job: Optional[JobStore], args: Mapping, timeout: datetime.timedelta,
                         shown: int = 5) -> None:
    """SystemExit on a rank whose validated arguments (`args`, less PER_RANK_ARGS) are not
    rank 0's: a node started with another command line (its --train-iters, its layout)
    would otherwise fail later in a mismatched collective (gloo's `Received data size
    doesn't match expected size`, or a hang). The message names up to `shown` settings,
    with this rank's value and rank 0's. Rank 0 reads its own; without a store, nothing
    to compare."""
    mine = {key: value for key, value in args.items() if key not in PER_RANK_ARGS}
    theirs = from_rank_0(job, "arguments", lambda: mine, timeout, "its arguments")
    if job is None or job.store is None:
        return
    differ = sorted(key for key in mine.keys() | theirs.keys()
                    if repr(mine.get(key)) != repr(theirs.get(key)))
    listed = "; ".join(f"--{key.replace('_', '-')}: {mine.get(key)!r} here, "
                       f"{theirs.get(key)!r} on rank 0" for key in differ[:shown])
    more = f" (and {len(differ) - shown} more)" if len(differ) > shown else ""
    mine_text = f"rank {job.rank} was started with settings other than rank 0's: {listed}{more}"
    fix = ("every node of the job must run the same command line (flags and --config file): "
           "start them again with the same one")
    others, first = _count_over_ranks(job, KEY_PREFIX + "arguments/differ",
                                      mine_text if differ else None)
    if differ:
        raise SystemExit(f"error: {mine_text}; {fix}")
    if others:  # every rank stops, not only those that differ
        raise SystemExit(f"error: {others} rank(s) were started with settings other than "
                         f"rank 0's, the first to count: {first}; {fix}")


def _count_over_ranks(job: JobStore, prefix: str, mine: Optional[str]) -> tuple:
    """(how many ranks of the job gave a text `mine`, the first such text or None), once
    every rank has counted (a wait for all of them in the job's store)."""
    store = job.store
    if mine is not None and store.add(prefix + "/count", 1) == 1:
        store.set(prefix + "/first", mine.encode())
    _all_done(job, store, prefix, everyone=True)
    count = store.add(prefix + "/count", 0)
    return count, store.get(prefix + "/first").decode() if count else None


def _encode(kind: str, value) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"kind": kind, "value": value}, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _publish_outcome(store, key: str, read: Callable[[], T]) -> T:
    """Rank 0: `read()`, and its result or its error under `key` (then raised here too)."""
    from megatron.arguments_common import ArgumentsError

    try:
        value = read()
    except ArgumentsError as err:
        store.set(key, _encode("arguments", err.message))
        raise
    except SystemExit as exc:
        store.set(key, _encode("exit", exc.code if isinstance(exc.code, (int, str)) else 1))
        raise
    except BaseException as exc:
        store.set(key, _encode("failed", f"{type(exc).__name__}: {exc}"))
        raise
    store.set(key, _encode("value", value))
    return value


def from_rank_0(job: Optional[JobStore], name: str, read: Callable[[], T],
                timeout: datetime.timedelta, what: str) -> T:
    """`read()` on global rank 0 only; every other rank gets its result through the job's
    store, or raises the same error: an ArgumentsError of the same message (not marked
    `machine`: one rank read, so rank 0 alone prints it), a SystemExit of the same code.
    The result must survive torch.save / torch.load(weights_only=True) (plain data, as a
    checkpoint's `args`). Without a store (`job` None, one process, no rendezvous
    address) each rank calls `read()` itself. `what` names the read in the error of a
    rank whose answer never came (rank 0 gone before it wrote one)."""
    store = job.connect(timeout) if job is not None else None
    if store is None:
        return read()
    # the n-th such read of this rank pairs with rank 0's n-th (a store that outlives one
    # read: a process group's, made before)
    key = f"{KEY_PREFIX}{name}/{store.add(f'{KEY_PREFIX}{name}/reads/{job.rank}', 1)}"
    return _exchange(job, store, key, key, job.rank == 0, "rank 0", read,
                     f"{what} for every rank")


def from_node_first(job: Optional[JobStore], local_rank: int, name: str,
                    read: Callable[[], T], timeout: datetime.timedelta, what: str,
                    node: Optional[str] = None) -> T:
    """`read()` on each node's first process (LOCAL_RANK 0) only; the node's other
    processes get its result, or raise its error, through the job's store (as
    `from_rank_0`): for what depends on the machine (its files, its GPU), checked once
    per node, not once per process. A node is its host name (`node`, default
    socket.gethostname()): the processes of a node need not hold consecutive ranks (an
    `srun --distribution=cyclic` launch deals ranks round-robin over the nodes). Without
    a store each process calls `read()` itself. Once per process and job (a `name` read
    twice would get the first answer). A rank 0 that hosts the store waits until every
    process has its answer."""
    store = job.connect(timeout) if job is not None else None
    if store is None:
        return read()
    node = node if node is not None else socket.gethostname()
    # every process of the job counts done under one name (the nodes' keys differ)
    return _exchange(job, store, f"{KEY_PREFIX}{name}/node/{node}", f"{KEY_PREFIX}{name}",
                     local_rank == 0, f"the first process (LOCAL_RANK 0) of node {node}",
                     read, f"{what} for the processes of its node")


def _exchange(job: JobStore, store, key: str, done: str, source: bool, named: str,
              read: Callable[[], T], what: str) -> T:
    """`read()` where `source` (this process is the one that reads, `named` in errors),
    its outcome left under `key`; the other processes that take `key` get it from there
    (`_outcome`). Every rank of the job then counts itself done under `done`
    (`_all_done`: a rank 0 that hosts the store waits for all, and a failing wait there
    never hides its own error)."""
    try:
        if source:
            return _publish_outcome(store, key, read)
        try:
            outcome = _decode(store.get(key))
        except (RuntimeError, OSError) as exc:  # DistStoreError, a closed connection
            raise SystemExit(f"error: {named} reads {what}, and its answer did not "
                             f"come ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                             f"the output of {named} says why") from None
        return _outcome(outcome, named)
    finally:
        _all_done(job, store, done)


def _all_done(job: JobStore, store, prefix: str, everyone: bool = False) -> None:
    """Count this process done with `prefix`'s answers; the process that hosts the store
    waits for every one (the store ends with it), or, with `everyone`, every process
    does. A store gone: nothing to wait for."""
    try:
        if store.add(prefix + "/done", 1) == job.world_size:
            store.set(prefix + "/all_done", b"")
        if job.hosts or everyone:
            store.wait([prefix + "/all_done"])
    except (RuntimeError, OSError):
        pass


def _outcome(outcome: dict, named: str = "rank 0"):
    """What `named`'s `_publish_outcome` left: the value, or its error raised here."""
    from megatron.arguments_common import ArgumentsError

    kind, value = outcome["kind"], outcome["value"]
    if kind == "value":
        return value
    if kind == "arguments":
        raise ArgumentsError(value)
    if kind == "exit":
        raise SystemExit(value)
    raise SystemExit(f"error: {named} failed reading for other ranks ({value}); "
                     f"the output of {named} has its traceback")


__all__ = ["JobStore", "check_same_arguments", "from_node_first", "from_rank_0"]
