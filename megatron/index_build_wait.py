"""The other ranks' wait for global rank 0's dataset index build, however long it takes.

Global rank 0 builds the missing GPT index files while the other ranks wait. At hundreds
of millions of samples that takes minutes, and a barrier waiting for it was bounded by
--distributed-timeout-minutes: a healthy run died in its watchdog ("ranks that did not
arrive: [0]") because the build outlasted the timeout. Here the waiting ranks wait on a
key of the job's store instead, which rank 0 sets when its build is done, and rank 0's
helper thread publishes a heartbeat (a count in the store, every `heartbeat_s`) while it
builds. A waiting rank leaves with a SystemExit naming global rank 0 when

* rank 0 recorded a failure in the store (megatron/rank_failure.py `record_failure`);
* the store stops answering (rank 0 hosted it: it is gone);
* the heartbeat stopped for `stale_s` (rank 0 killed, or stopped beating: the caller
  gives --distributed-timeout-minutes, the same bound a collective waits; numpy's
  shuffles hold the interpreter lock, so a beat may come tens of seconds late at scale).

The barrier that follows (`after`) then meets every rank at once.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

KEY_PREFIX = "megatron/dataset-index-build/"
HEARTBEAT_S = 2.0  # how often the builder rank publishes its heartbeat
POLL_S = 2.0  # how often a waiting rank looks at the store (3 requests: thousands of ranks)


class IndexBuildWait:
    """One build's wait, made by every rank at the same point (the n-th of each rank
    pairs with the others' n-th). On the builder: `start()` before the build, then
    `barrier()` after it; on the others: `barrier()` alone. `after` (e.g. a watched
    `dist.barrier`) runs on every rank once the build is done."""

    def __init__(self, store, rank: int, stale_s: float, after: Callable[[], None],
                 heartbeat_s: Optional[float] = None, poll_s: Optional[float] = None):
        self.store, self.rank, self.stale_s, self.after = store, rank, stale_s, after
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.poll_s = POLL_S if poll_s is None else poll_s
        call = int(store.add(f"{KEY_PREFIX}calls/{rank}", 1))
        self.done_key = f"{KEY_PREFIX}{call}/done"
        self.beat_key = f"{KEY_PREFIX}{call}/heartbeat"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Builder: publish the heartbeat from a daemon thread until `stop`/`barrier`."""
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="index-build-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self.beat_key, 1)
            except Exception:  # the store is gone: the waiting ranks see that themselves
                return
            self._stop.wait(self.heartbeat_s)

    def stop(self) -> None:
        """Builder: stop the heartbeat (also when the build failed before `barrier`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def barrier(self) -> None:
        """The builder says it is done; the others wait for that (`wait`); then `after`."""
        if self.rank == 0:
            self.stop()
            self.store.set(self.done_key, b"1")
        else:
            self.wait()
        self.after()

    def wait(self) -> None:
        """Until the builder's done key is set; SystemExit when it cannot come."""
        from megatron.rank_failure import FAILURES_KEY, first_line

        beats, since = -1, time.monotonic()
        delay = min(0.05, self.poll_s)  # a cached index is done at once: look soon, then
        while True:                      # back off to poll_s (few requests while it builds)
            try:
                if self.store.check([self.done_key]):
                    return
                failed = self.store.check([f"{FAILURES_KEY}/1"])
                count = int(self.store.add(self.beat_key, 0))
            except Exception as exc:  # DistStoreError, a closed connection
                raise SystemExit(self._gone(f"the job's store stopped answering ("
                                            f"{first_line(exc)}): global rank 0 hosted it "
                                            "and has stopped")) from None
            if failed:
                raise SystemExit(self._gone("a rank recorded a failure (global rank 0's "
                                            "output has its traceback)"))
            now = time.monotonic()
            if count != beats:
                beats, since = count, now
            elif now - since > self.stale_s:
                raise SystemExit(self._gone(
                    f"its heartbeat stopped {now - since:.0f} s ago (bound: "
                    "--distributed-timeout-minutes): it was killed (SIGKILL, the out-of-memory "
                    "killer), lost with its node, or hangs"))
            time.sleep(delay)
            delay = min(2 * delay, self.poll_s)

    def _gone(self, why: str) -> str:
        return (f"error: [rank {self.rank}] stopped waiting for global rank 0 to build the "
                f"dataset index files: {why}; global rank 0's output says why. A healthy "
                "build is waited for however long it takes")

