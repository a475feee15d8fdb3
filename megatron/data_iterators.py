"""Batch iterators over a run's datasets: the sampler of a DP rank, an in-process reader
thread or DataLoader worker processes prefetching into pinned memory, what the run does
when a worker dies or cannot start, and the tensors one micro-batch needs (`get_batch`).

The datasets and samplers themselves are built in `megatron.data_loading`.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import gc
import multiprocessing.util
import queue
import re
import signal
import sys
import threading
import time
import weakref
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from megatron.config import Config
from megatron.core.datasets.gpt_dataset import BadTokenError
from megatron.core.datasets.indexed_dataset import DataFileChangedError
from megatron.core.datasets.samplers import PretrainingSampler
from megatron.core.datasets.utils import get_ltor_masks_and_position_ids
from megatron.data_loading import CyclicSampler


def _collate(samples: List[dict]) -> Dict[str, torch.Tensor]:
    return {key: _stacked([s[key] for s in samples]) for key in samples[0]}


def _stacked(values: list, as_numpy: bool = False):
    """One key's values of the samples stacked along a new first dimension: a tensor, or
    with `as_numpy` a numpy array sharing its memory where numpy has its dtype."""
    if isinstance(values[0], np.ndarray):
        stacked = np.stack(values)
        return stacked if as_numpy else torch.from_numpy(stacked)
    stacked = torch.stack(values) if torch.is_tensor(values[0]) else torch.tensor(values)
    if as_numpy and not stacked.requires_grad:
        try:
            return stacked.numpy()
        except TypeError:  # a dtype numpy lacks
            pass
    return stacked


class _WorkerBatch:
    """A loader worker's micro-batch on its way to the training process, its values numpy
    arrays where numpy has their dtype: those travel by value through the worker's pipe. A tensor
    crosses through a shared-memory file descriptor instead, each one a connection to the
    worker's resource sharer (an authenticated handshake and a context switch): about
    three times the cost of the pipe for a small micro-batch, and still more for one of
    512 KiB (measured on CPU). The DataLoader's pin-memory thread calls `pin_memory`;
    without pinning `_WorkerIterator` calls `tensors`."""

    def __init__(self, values: dict):
        self.values = values

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in self.values.items()}

    def pin_memory(self, device=None) -> Dict[str, torch.Tensor]:
        return {k: v.pin_memory() for k, v in self.tensors().items()}


def _collate_in_worker(samples: List[dict]) -> _WorkerBatch:
    """`_collate` for a DataLoader worker: the same values as numpy arrays where numpy
    has their dtype (`_WorkerBatch.tensors` makes them the same tensors again)."""
    return _WorkerBatch({key: _stacked([s[key] for s in samples], as_numpy=True)
                         for key in samples[0]})


def _put(q: "queue.Queue", item, stop: threading.Event) -> bool:
    """Put `item` unless `stop` is set first (checked every 0.1 s); False when stopped."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(dataset, sampler, pin: bool, q: "queue.Queue", stop: threading.Event) -> None:
    try:
        for indices in sampler:
            batch = _collate([dataset[i] for i in indices])
            if pin:
                batch = {k: v.pin_memory() for k, v in batch.items()}
            if not _put(q, batch, stop):
                return
    except BaseException as e:  # hand the error to the consumer
        _put(q, e, stop)
    _put(q, StopIteration(), stop)


class PrefetchIterator:
    """Reads micro-batches in a background thread (up to `depth` ahead), pinned when the
    run is on CUDA, so the step never waits for sample assembly or a pageable copy."""

    def __init__(self, dataset, sampler, pin: bool, depth: int = 4):
        self.q: "queue.Queue" = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_produce, args=(dataset, sampler, pin, self.q, self.stop),
                                       daemon=True)
        self.thread.start()
        # An iterator dropped without close() (a library caller, a test) stops its thread
        # when it is collected; the thread itself holds no reference to the iterator.
        weakref.finalize(self, self.stop.set)

    def __iter__(self):
        return self

    join_timeout_s = 30.0  # a sample read stuck on a stalled file system must not hang exit

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self.stop.is_set():
            raise StopIteration  # closed
        item = self.q.get()
        if isinstance(item, StopIteration):  # the reader is done: the end stays (a later
            self.stop.set()  # next() would wait on the empty queue for ever)
            raise StopIteration
        if isinstance(item, _DATA_ERRORS):
            raise _data_error_exit(item) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the reader thread and wait for it: it notices within 0.1 s, or when the
        sample it is assembling is done. A read that takes longer than `join_timeout_s`
        (a stalled file system) is left behind with a warning: the thread is a daemon, and
        every exit path (a signal, an error) comes through here."""
        self.stop.set()
        self.thread.join(self.join_timeout_s)
        if self.thread.is_alive():
            print(f"WARNING: the data reader thread did not stop within "
                  f"{self.join_timeout_s:g} s (a sample read is stuck, e.g. on a stalled "
                  "file system); leaving it behind", file=sys.stderr, flush=True)


# what a sample read raises that the run reports in one line: a token id outside the
# vocabulary, a data file cut short while the run reads it
_DATA_ERRORS = (BadTokenError, DataFileChangedError)


def _data_error_exit(error: ValueError) -> SystemExit:
    """The run's exit for a `_DATA_ERRORS` error: its message (file, what is wrong and the
    fix) on one line, without the reader's traceback. A DataLoader worker's error comes
    back with the worker's traceback quoted before it."""
    text = str(error)
    marker = f"{type(error).__name__}: "
    if "Original Traceback" in text and marker in text:
        text = text.rsplit(marker, 1)[1]
    return SystemExit(f"error: {text.strip()}")


# torch's RuntimeError for a loader worker that died: from its SIGCHLD handler (raised
# wherever the training process is at that moment) or from the wait for a batch
_WORKER_DIED = re.compile(r"DataLoader worker \(pid\(?s?\)? ([\d, ]+)\) (?:is killed by signal: "
                          r"([^.]+)|exited unexpectedly(?: with exit code (-?\d+))?)")


def loader_worker_exit(error: BaseException, num_workers: int, iteration: int,
                       resume: str) -> Optional[SystemExit]:
    """The run's exit when `error` is torch's report of a DataLoader worker process that
    died (None for any other error): one line naming the worker, how it ended, the likely
    cause and what to do, instead of a RuntimeError whose traceback runs through whatever
    code the training process was in when the worker went (a gradient hook, a collective).
    `resume`: where to resume from (`megatron.interrupt.last_checkpoint_text`)."""
    found = _WORKER_DIED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    pids, signal_text, code = found.groups()
    if signal_text:
        how = f"was killed by signal {signal_text.strip()!r}"
    else:
        how = "exited unexpectedly" + (f" with exit code {code}" if code else "")
    if signal_text and signal_text.strip() == "Killed":
        cause = ("A SIGKILL most often comes from the kernel's out-of-memory killer (dmesg "
                 "says): fewer --num-workers (0 reads the data in the training process) take "
                 "less host memory")
    elif signal_text and signal_text.strip() == "Bus error":
        cause = ("A bus error in a worker is most often a full shared-memory file system "
                 "(/dev/shm; in a container raise its --shm-size)")
    else:
        cause = "--num-workers 0 reads the data in the training process, with its traceback"
    return SystemExit(f"error: data loader worker process {pids.strip()} (--num-workers "
                      f"{num_workers}) {how} at iteration {iteration}, so the run stops"
                      f"{resume}. {cause}")


def open_files_exit(num_workers: int) -> SystemExit:
    """The run's exit when starting the DataLoader workers ran out of file descriptors
    (each worker takes pipes and queues; EMFILE), instead of an OSError traceback from
    multiprocessing: the limit, and the two ways out."""
    try:
        import resource

        limit = f" (this process may open {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    except (ImportError, OSError):  # pragma: no cover - not POSIX
        limit = ""
    return SystemExit(f"error: starting {num_workers} data loader worker process(es) "
                      f"(--num-workers {num_workers}) failed: too many open files{limit}. "
                      "Raise the open-files limit before the launch (ulimit -n 65536; in a "
                      "container --ulimit nofile=65536:65536), or pass fewer --num-workers "
                      "(0 reads the data in the training process)")


def _shutdown_workers(holder: list) -> None:
    """Shut down the DataLoader iterator in `holder` (once; later calls do nothing)."""
    if holder:
        holder.pop()._shutdown_workers()


def _shutdown_unfinished_loader(tb) -> None:
    """Shut down the workers of a DataLoader iterator whose construction raised (found in
    the frames of traceback `tb`). It starts its workers, then asks the sampler for the
    first indices: an error there (the cyclic sampler of a set too large to permute) left
    workers that nothing shut down while the error was kept (a report holds its
    traceback), and that ignore SIGTERM: multiprocessing's exit handler then waited for
    them for ever, and the run hung after printing its error."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    while tb is not None:
        unfinished = tb.tb_frame.f_locals.get("self")
        if isinstance(unfinished, _MultiProcessingDataLoaderIter):
            if hasattr(unfinished, "_workers_status"):
                unfinished._shutdown_workers()
                return
            # it failed while starting its workers (out of file descriptors): torch's
            # shutdown needs state set after that; stop the ones already started (they
            # ignore SIGTERM) and mark it shut down for its __del__
            unfinished._shutdown = True
            for worker in getattr(unfinished, "_workers", []):
                worker.kill()
                worker.join(5)
            return
        tb = tb.tb_next


class _WorkerIterator:
    """A DataLoader iterator whose workers are shut down in order at close(), when the
    iterator is collected, or at exit.

    The workers ignore SIGTERM (see `_ignore_preemption_signals`), so they must not be left
    to multiprocessing's exit handler, which terminates daemonic children and joins them: it
    would wait forever. The shutdown is registered twice, neither registration holding the
    iterator itself (it would then never be collected, and a caller that drops it without
    close() would keep its workers until exit): as a weakref finalizer, which also runs at a
    normal interpreter exit, and as a multiprocessing finalizer with a priority, which that
    exit handler runs before it terminates children (a forked process leaves through
    os._exit and never runs atexit)."""

    # How long the first batch waits for every worker to have started (its worker_init_fn
    # run) before the workers are started again.
    START_S = 60.0

    def __init__(self, make_loader: Callable[[Callable[[int], None]], object], workers: int):
        self._make_loader, self._workers = make_loader, workers
        self._holder = [self._start()]
        self._at_exit = weakref.finalize(self, _shutdown_workers, self._holder)
        self._finalizer = multiprocessing.util.Finalize(self, _shutdown_workers,
                                                        args=(self._holder,), exitpriority=100)
        self._checked = False

    def _start(self):
        """A new DataLoader iterator whose workers each mark `_started` once they run."""
        try:
            self._started = multiprocessing.RawArray("b", self._workers)
            with frozen_for_fork():
                return iter(self._make_loader(functools.partial(_worker_started,
                                                                self._started)))
        except BaseException as e:
            _shutdown_unfinished_loader(e.__traceback__)
            if isinstance(e, OSError) and e.errno == errno.EMFILE:
                raise open_files_exit(self._workers) from None
            raise

    def _check_started(self, attempts: int = 3) -> None:
        """A worker forked while another thread of this process held the interpreter's
        thread-list lock never gets past the fork (CPython 3.11 takes that lock again in
        the child; gloo's threads take it briefly to touch Python objects): the first
        batch then waited for it for ever (seen once in a CI run, a tp2-pp2 resume). Give
        the workers START_S to start, else start them again (the sampler restarts from the
        same consumed samples: the same batches)."""
        for _ in range(attempts):
            deadline = time.monotonic() + self.START_S
            while not all(self._started) and time.monotonic() < deadline:
                time.sleep(0.01)
            if all(self._started):
                return
            workers = getattr(self._holder[0], "_workers", [])
            stuck = [w for w, ok in zip(workers, self._started) if not ok]
            print(f"warning: data loader worker process(es) {[w.pid for w in stuck]} did "
                  f"not start within {self.START_S:g} s (a fork that hung); starting the "
                  "workers again", file=sys.stderr, flush=True)
            _shutdown_workers(self._holder)  # its SIGTERM may not reach a hung fork
            for w in stuck:
                if w.is_alive():
                    w.kill()
                    w.join(5.0)
            self._holder.append(self._start())

    def __iter__(self):
        return self

    def __next__(self):
        if not self._holder:
            raise StopIteration  # closed
        if not self._checked:
            self._check_started()
            self._checked = True
        try:
            batch = next(self._holder[0])
        except _DATA_ERRORS as e:
            raise _data_error_exit(e) from None
        return batch.tensors() if isinstance(batch, _WorkerBatch) else batch  # else pinned

    def close(self) -> None:
        self._at_exit()  # runs the shutdown once and unregisters it
        self._finalizer.cancel()


def close_iterators(iterators) -> None:
    """Stop the reader threads and loader worker processes of `iterators` (any may be
    None). pretrain() calls this when it returns: otherwise every call left its loaders
    running until the interpreter exits (a thread each, or --num-workers processes each)."""
    for it in iterators:
        if it is not None:
            it.close()


@contextlib.contextmanager
def frozen_for_fork() -> Iterator[None]:
    """Fork inside: the objects of this process are moved to the collector's permanent
    generation while the children are forked, so that a child never collects what it
    inherited. A garbage TCPStore server inherited that way, collected in the child,
    joins its daemon thread -- which exists in the parent only -- for ever (a forked test
    rank hung so in a CI run). It also spares the pages the collector would touch."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _ignore_preemption_signals(_worker_id: int) -> None:
    """Loader workers ignore SIGTERM/SIGUSR1 (slurm and torchrun signal the whole process
    group): the training process decides, saves and exits; its workers end with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _worker_started(started, worker_id: int) -> None:
    """A loader worker's init: ignore the preemption signals, mark itself started."""
    _ignore_preemption_signals(worker_id)
    if started is not None:
        started[worker_id] = 1


def make_iterator(config: Config, dataset, consumed: int, dp_rank: int, dp_size: int,
                  pin: bool) -> Optional[Iterator[dict]]:
    """Micro-batches of this DP rank starting at `consumed` samples (None without data).

    `--num-workers N` > 0: a torch DataLoader with N worker processes, pinned memory and
    prefetching; 0: one background thread in this process (also pinned and prefetching)."""
    if dataset is None:
        return None
    d = config.data
    if d.dataloader_type == "cyclic":
        sampler = CyclicSampler(len(dataset), consumed, d.micro_batch_size, dp_rank, dp_size,
                                data_sharding=d.data_sharding)
    else:
        sampler = PretrainingSampler(len(dataset), consumed, d.micro_batch_size, dp_rank,
                                     dp_size)
    if d.num_workers == 0:
        return PrefetchIterator(dataset, sampler, pin)
    # Own generator: creating the loader must not draw from the (checkpointed) default RNG,
    # or a resumed run would see different dropout masks than an uninterrupted one.
    return _WorkerIterator(lambda init: torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=d.num_workers, pin_memory=pin,
        collate_fn=_collate_in_worker, persistent_workers=True, prefetch_factor=4,
        worker_init_fn=init, generator=torch.Generator().manual_seed(d.seed)), d.num_workers)


def get_batch(micro: dict, device: torch.device, eod: Optional[int], flags) -> dict:
    """Model inputs from a {'text': [b, s+1]} micro-batch: tokens, labels, loss_mask,
    position_ids and (only with --reset-attention-mask) attention_mask (True = masked).
    A micro-batch that brings its own 'loss_mask' [b, s] (the zero-shot evaluations) keeps
    it instead of the one the flags would make."""
    text = micro["text"].to(device, non_blocking=True).long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    needs_eod = flags.reset_position_ids or flags.reset_attention_mask or flags.eod_mask_loss
    if eod is None or not needs_eod:
        batch = {"tokens": tokens, "labels": labels, "position_ids": None,
                 "attention_mask": None, "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
    else:
        mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, eod, flags.reset_position_ids, flags.reset_attention_mask, flags.eod_mask_loss)
        batch = {"tokens": tokens, "labels": labels, "position_ids": position_ids,
                 "attention_mask": mask, "loss_mask": loss_mask.float()}
    if "loss_mask" in micro:
        batch["loss_mask"] = micro["loss_mask"].to(device, non_blocking=True).float()
    return batch
