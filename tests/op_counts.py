"""Count what a run asks of the rendezvous store and of torch.distributed, per rank.

For the tests that pin how start-up, a step, a save and a load grow with the world size
(tests/test_scale_costs.py): a cost that grows with the number of ranks on every rank
adds up to N^2 over a job of thousands of GPUs, which a handful of CPU processes never
shows in time, only in counts.

    counter = OpCounter.install(store_port)  # inside a run_distributed worker
    ...                                      # the code under test
    counter.report()                         # {"store": {...}, "collectives": {...}}

`install` re-creates the default process group (gloo) on a `CountingStore` (a Python
Store forwarding to a TCPStore), so every store call is counted, torch's own (gloo's
connections, new_group) included, and wraps the torch.distributed functions the project
calls, counting the outermost call only (all_gather_object's inner all_gather is part of
it), by function and group size.
"""
from __future__ import annotations

import collections
import datetime
import functools
import threading
from typing import Dict, Optional

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
               "reduce_scatter_tensor", "reduce_scatter", "gather_object", "scatter_object_list",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group")


class CountingStore(dist.Store):
    """A Store that forwards every call to `inner` and counts it by (operation, key kind):
    the key up to its first '/' or ':' (digits dropped), e.g. 'collective-watchdog'
    (`counts`: one per key a call names), and by operation (`requests`: one per call, as
    the store's server sees them: a `multi_get` of 8 keys is one request)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.counts: collections.Counter = collections.Counter()
        self.requests: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, op: str, keys) -> None:
        keys = [keys] if isinstance(keys, str) else list(keys or [""])
        with self._lock:
            self.requests[op] += 1
            for key in keys:
                self.counts[op, key_kind(key)] += 1

    def set(self, key, value):
        self._count("set", key)
        return self.inner.set(key, value)

    def get(self, key):
        self._count("get", key)
        return self.inner.get(key)

    def add(self, key, value):
        self._count("add", key)
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._count("compare_set", key)
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._count("check", keys)
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count("wait", keys)
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        self._count("delete_key", key)
        return self.inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys", "")
        return self.inner.num_keys()

    def multi_set(self, keys, values):
        self._count("multi_set", keys)
        return self.inner.multi_set(keys, values)

    def multi_get(self, keys):
        self._count("multi_get", keys)
        return self.inner.multi_get(keys)

    def append(self, key, value):
        self._count("append", key)
        return self.inner.append(key, value)

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    @property
    def timeout(self):
        return self.inner.timeout


def key_kind(key: str) -> str:
    """'collective-watchdog/checkins/...' -> 'collective-watchdog'; gloo's and new_group's
    keys (a group name or a rank number first) -> 'torch'."""
    head = key.replace(":", "/").split("/", 1)[0]
    head = "".join(c for c in head if not c.isdigit()).strip("_-")
    return head or "torch"


class OpCounter:
    """The store and collective counts of this process since `install` (or `reset`)."""

    def __init__(self, store: Optional[CountingStore] = None) -> None:
        self.store = store
        self.collectives: collections.Counter = collections.Counter()
        self._depth = threading.local()
        self._originals: Dict[str, object] = {}

    @classmethod
    def install(cls, store_port: int, timeout_s: float = 300) -> "OpCounter":
        """Replace the worker's default group (run_distributed's) by one on a counting
        store listening on `store_port` (rank 0 hosts it), and count collectives."""
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=timeout_s)
        inner = dist.TCPStore("127.0.0.1", store_port, world, is_master=rank == 0,
                              timeout=timeout)
        store = CountingStore(inner)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        counter = cls(store)
        counter._wrap()
        store.counts.clear()  # the rendezvous of the default group itself: not the code's
        return counter

    @classmethod
    def collectives_only(cls) -> "OpCounter":
        """Count the torch.distributed calls of this process (no store counts)."""
        counter = cls()
        counter._wrap()
        return counter

    def _wrap(self) -> None:
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._counted(name, original))

    def _counted(self, name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.collectives[name, _group_size(name, args, kwargs)] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return call

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def reset(self) -> None:
        if self.store is not None:
            self.store.counts.clear()
        self.collectives.clear()

    def report(self) -> dict:
        """{"store": {(op, key kind): n}, "collectives": {(function, group size): n}}."""
        store = {} if self.store is None else dict(self.store.counts)
        return {"store": store, "collectives": dict(self.collectives)}


class FsCounter:
    """Counts os.listdir / os.scandir / os.stat calls (os.path.isfile and isdir stat) on
    paths under `root` in this process, by function, while installed."""

    NAMES = ("listdir", "scandir", "stat")

    def __init__(self, root: str) -> None:
        import os

        self.root = os.path.abspath(root)
        self.counts: collections.Counter = collections.Counter()
        self._originals = {name: getattr(os, name) for name in self.NAMES}
        for name, fn in self._originals.items():
            setattr(os, name, self._counted(name, fn))

    def _counted(self, name: str, fn):
        import os

        @functools.wraps(fn)
        def call(path=".", *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and \
                    os.path.abspath(os.fspath(path)).startswith(self.root):
                self.counts[name] += 1
            return fn(path, *args, **kwargs)

        return call

    def uninstall(self) -> None:
        import os

        for name, fn in self._originals.items():
            setattr(os, name, fn)


def _group_size(name: str, args, kwargs) -> Optional[int]:
    if name == "new_group":
        ranks = kwargs.get("ranks", args[0] if args else None)
        return dist.get_world_size() if ranks is None else len(ranks)
    group = kwargs.get("group")
    if group is None:
        return dist.get_world_size()
    try:
        return dist.get_world_size(group)
    except Exception:  # not a member
        return None


def total(counts: dict, op: Optional[str] = None, kind: Optional[str] = None) -> int:
    """Sum of `counts` entries (keys (op, kind)) matching `op` and `kind` (None: any)."""
    return sum(n for (o, k), n in counts.items()
               if (op is None or o == op) and (kind is None or k == kind))


# A tiny model on mock data for whole runs of pretrain_gpt.py (`count_pretrain_runs`);
# the run adds --global-batch-size (one sample per data-parallel rank and micro-batch).
TINY_RUN = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--lr", "1e-3", "--lr-decay-iters", "100", "--override-opt_param-scheduler",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--eval-iters", "0", "--log-interval", "1000"]


def count_pretrain_runs(rank: int, world_size: int, store_port: int, runs: dict,
                        fs_root: Optional[str] = None) -> dict:
    """A run_distributed worker: `pretrain_gpt.main(TINY_RUN + argv)` for each (name, argv)
    of `runs` in turn, in this process, on one counting default group (the runs leave it
    in place); returns {name: OpCounter.report() of that run}, with its "files" (FsCounter
    counts under `fs_root`) when given."""
    import contextlib
    import io
    import os

    import pretrain_gpt

    counter = OpCounter.install(store_port)
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # the next run reuses it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    out = {}
    try:
        for name, argv in runs.items():
            dist.barrier()
            counter.reset()
            files = FsCounter(fs_root) if fs_root is not None else None
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    status = pretrain_gpt.main(TINY_RUN + list(argv))
            finally:
                if files is not None:
                    files.uninstall()
            if status != 0:
                raise RuntimeError(f"run {name} ended with status {status}")
            out[name] = counter.report()
            if files is not None:
                out[name]["files"] = dict(files.counts)
            dist.barrier()
    finally:
        dist.destroy_process_group = destroy
        counter.uninstall()
    return out


def difference(a: dict, b: dict, times: int = 1) -> dict:
    """Counts of `a` minus `times` x those of `b` (the non-zero ones)."""
    keys = set(a) | set(b)
    return {k: a.get(k, 0) - times * b.get(k, 0) for k in keys
            if a.get(k, 0) - times * b.get(k, 0)}
