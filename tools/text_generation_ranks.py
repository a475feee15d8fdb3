"""The text generation server's ranks under torchrun (tools/run_text_generation_server.py
serves HTTP on rank 0; this is how the other ranks take part). Rank 0 broadcasts each
request to the other ranks of its replica (`Lockstep`; a heartbeat while idle, a stop at
the end) and they generate it with it (`follow_requests`). With data-parallel replicas
(world size D x tp x pp) rank 0's `Dispatcher` hands a request to an idle replica, whose
leader takes it over a gloo pair group, broadcasts it to its replica's ranks and sends the
answer back (`ServingGroups`, `lead_replica`). Every message is a Python object broadcast
over a gloo group (`_broadcast`)."""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/text_generation_ranks.py is a library module (the text generation "
                     "server's ranks under torchrun); run python "
                     "tools/run_text_generation_server.py --help")

import datetime
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Tuple

import torch.distributed as dist

from megatron.interrupt import INTERRUPTED_STATUS, InterruptWatch, SigintHandler
from megatron.rank_failure import peer_failure
from tools.text_generation_api import Engine, RequestError, fixed_seed, run_request

_PROG = "run_text_generation_server.py"
HEARTBEAT_S = 30.0  # rank 0's idle broadcast under torchrun
# After each request the ranks of a replica meet once more (`finished`), on a group of
# their own with this timeout: a rank that failed alone (out of memory on one GPU) has left
# the others waiting in a collective of the model, and its leader, told so within this
# time, stops serving (the next request would have waited there, and Ctrl-C with it).
FINISHED_WAIT_S = 60.0


# ------------------------------------------------------- tensor / pipeline parallelism
_IDLE, _REQUEST, _STOP = "idle", "request", "stop"


def _broadcast(message, group, src: int = 0):
    """`message` from global rank `src` to every rank of `group` (gloo); what `src` sent."""
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def finished(group) -> None:
    """Every rank of a replica, after each request (served or failed): wait for the other
    ranks to be done with it too (`group`: ServingGroups.done; None: no wait). RuntimeError
    (timed out) on the ranks still there when one is stuck in the request's collectives."""
    if group is not None:
        dist.barrier(group=group)


def control_group(engine: Engine):
    """The gloo group the request messages travel on at dp 1: the runtime's CPU group
    beside NCCL, else the default (gloo) group (at dp > 1: ServingGroups)."""
    return engine.runtime.control_group


class _FollowerSigint(SigintHandler):
    """SIGINT or SIGTERM on a rank that follows rank 0 (a terminal's Ctrl-C reaches every
    rank of the job; torchrun passes its SIGTERM on to every rank) is only noted: rank 0,
    interrupted too, finishes the running request (the ranks are inside its collectives:
    a rank leaving one mid-request left the others waiting in it until torchrun's SIGKILL,
    or, on SIGTERM, broke the request: a 500), then broadcasts stop, and every rank ends
    quietly. Installed in the main thread only."""

    signals = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = False

    def _handle(self, signum, frame) -> None:
        self.received = True


def follow_requests(engine: Engine, group=None, src: int = 0, done=None) -> int:
    """A rank other than its replica's leader (global rank `src`; 0 at dp 1): generate each
    request the leader broadcasts over `group` (default: control_group), in lockstep with
    it, until the leader broadcasts stop; returns the number of requests. A request that
    fails its checks fails alike on every rank (rank 0 answers 400), before any collective;
    one that fails in generation (rank 0 answers 500 and goes on serving) fails here too,
    and this rank goes on following (a rank that left would stop the whole server). Ctrl-C
    ends it without a traceback (see _FollowerSigint); so does the leader leaving after
    one."""
    group, served = control_group(engine) if group is None else group, 0
    with _FollowerSigint() as sigint:
        while True:
            try:
                kind, req = _broadcast(None, group, src)
            except RuntimeError:  # the leader left: after Ctrl-C that is the stop
                if sigint.received:
                    return served
                raise
            if kind == _STOP:
                return served
            if kind != _REQUEST:
                continue
            served += 1
            try:
                run_request(engine, req)
            except RequestError:
                pass
            except Exception as exc:  # rank 0 prints the traceback and answers 500
                print(f"rank {engine.runtime.ps.rank}: the request failed too ("
                      f"{type(exc).__name__}: {exc}); following the next one", flush=True)
            try:
                finished(done)
            except RuntimeError:  # the leader left: after Ctrl-C that is the stop
                if sigint.received:
                    return served
                raise


class _StopSignals(SigintHandler):
    """`with _StopSignals():` while rank 0 stops (after Ctrl-C or SIGTERM). SIGINT within
    `InterruptWatch.FORWARDED_WITHIN_S` of the start is the same Ctrl-C again (a launcher
    forwarding it to a worker the terminal reached too) and is ignored; any later SIGINT
    or SIGTERM (Ctrl-C pressed again; torchrun's SIGTERM after its own second Ctrl-C) ends
    the process at once: one line, status 130, no traceback. os._exit, not SystemExit:
    the process group is still open, and a gloo group left to the interpreter's exit can
    abort the process after its output. Main thread only."""

    signals = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._start = time.monotonic()

    def _handle(self, signum, frame) -> None:
        if (signum == signal.SIGINT and
                time.monotonic() - self._start < InterruptWatch.FORWARDED_WITHIN_S):
            return
        self.exit_now(signum)

    @staticmethod
    def exit_now(signum) -> None:
        print(f"{_PROG}: interrupted again while stopping ({signal.Signals(signum).name}): "
              "exiting at once", flush=True)
        sys.stderr.flush()
        os._exit(INTERRUPTED_STATUS)



class _DeferSignals(_StopSignals):
    """`with _DeferSignals() as deferred:` around the request rank 0 runs: SIGINT or
    SIGTERM there is noted (`deferred.received`) and serving stops once the request is
    answered, as the other ranks finish it too; a second one, not the same Ctrl-C
    forwarded by the launcher, exits at once as _StopSignals does (its __enter__/__exit__
    install and restore the handlers). Main thread only."""

    def __init__(self) -> None:
        self.received, self._first = False, 0.0

    def _handle(self, signum, frame) -> None:
        if not self.received:
            self.received, self._first = True, time.monotonic()
            print(f"{_PROG}: stopping once the running request is answered (Ctrl-C again "
                  "to exit at once)", flush=True)
            return
        if signum == signal.SIGINT and \
                time.monotonic() - self._first < InterruptWatch.FORWARDED_WITHIN_S:
            return
        _StopSignals.exit_now(signum)


class _Lost:
    """Lockstep.pending's item that ends serving: another replica's failure `exc`."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Lockstep:
    """Rank 0 under torchrun: the HTTP threads (at dp > 1 the Dispatcher) `submit` requests;
    `serve`, on the main thread, broadcasts each to the other ranks of rank 0's replica
    (`group`) and runs it (a heartbeat while idle, to the other replicas too), and
    broadcasts stop when it ends (then stops the other replicas)."""

    def __init__(self, engine: Engine, heartbeat_s: Optional[float] = None,
                 group=None, done=None) -> None:
        self.engine, self.done = engine, done  # done: ServingGroups.done (`finished`)
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.group = control_group(engine) if group is None else group  # rank 0's replica
        self.pending: "queue.Queue" = queue.Queue()
        self.broken = False  # another rank broke a collective: the others cannot be told
        self.lost: Optional[BaseException] = None  # another replica's failure (`fail`)
        # the other replicas (Dispatcher): their heartbeat while idle, their stop
        self.heartbeat_replicas: Callable[[], None] = lambda: None
        self.stop_replicas: Callable[[], None] = lambda: None
        self.current: Optional[Future] = None  # the future of the request serve runs

    def fail(self, exc: BaseException) -> None:
        """Stop serving because another replica broke (`serve` raises `exc`); any thread."""
        self.pending.put((_Lost(exc), None))

    def submit(self, req):
        """The response of `req` (an HTTP thread waits here); its exception re-raised."""
        done: Future = Future()
        self.pending.put((req, done))
        return done.result()

    def stop_others(self) -> None:
        _broadcast((_STOP, None), self.group)

    def serve(self, server) -> None:
        """Serve `server` in a thread until KeyboardInterrupt (SIGINT; SIGTERM is turned
        into one by main), then tell the other ranks to stop and close the server (a
        second signal meanwhile exits at once: _StopSignals). A request whose collective
        another rank broke (gone, or stuck past the timeout) is answered 500 and ends the
        serving the same way, then the process with one line naming that rank (main's
        process_group_closed): the ranks are out of step, and a stuck rank would make
        every later request wait for the timeout again."""
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            while True:
                try:
                    req, done = self.pending.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    _broadcast((_IDLE, None), self.group)
                    self.heartbeat_replicas()
                    continue
                if isinstance(req, _Lost):
                    self.lost = req.exc
                    raise req.exc
                self.current = done
                with _DeferSignals() as deferred:  # Ctrl-C: stop after this request
                    _broadcast((_REQUEST, req), self.group)
                    self._run(req, done)
                if deferred.received:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        except Exception as exc:
            self.broken = peer_failure(exc) is not None and exc is not self.lost
            raise
        finally:
            with _StopSignals():  # Ctrl-C again: exit at once (server.shutdown takes 0.5 s)
                self._stop(server)

    def _run(self, req, done: Future) -> None:
        """Run `req` and set its future (the HTTP thread answers it); a failure that put
        the ranks out of step is raised (see serve)."""
        try:
            done.set_result(run_request(self.engine, req))
        except Exception as exc:  # the handler answers 400 / 500
            done.set_exception(exc)
            if peer_failure(exc) is not None:  # out of step: each request would
                raise  # wait for the collective timeout again; stop serving
        finished(self.done)  # a failure here alone: the others wait in it; stop serving

    def _stop(self, server) -> None:
        if self.current is not None and not self.current.done():  # interrupted in it (off
            # the main thread, or before its deferral): answer it (500), else its HTTP
            # thread waits for ever, and server_close with it
            self.current.set_exception(RuntimeError("the server was stopped (Ctrl-C or "
                                                    "SIGTERM) during this request"))
        try:
            if not self.broken:  # else a stuck rank's broadcast would wait for the timeout
                self.stop_others()
        except RuntimeError as exc:  # a rank that failed cannot be told; close anyway
            print(f"note: the other ranks could not be told to stop: {exc}", flush=True)
        server.shutdown()
        server.server_close()
        self.stop_replicas()
        while not self.pending.empty():
            done = self.pending.get()[1]
            if done is not None:
                done.set_exception(RuntimeError("the server is stopping"))


# ------------------------------------------------------------- data-parallel replicas
class ServingGroups:
    """Where this rank's request messages travel (tools/generate_tp.py's rank order): its
    replica's tp x pp ranks (`replica`, from the replica's `leader`, its tp 0 / pp 0 rank)
    and, on rank 0 and the other replicas' leaders, the pair group [0, leader] of each
    replica d > 0 (`links[d]`: requests there, answers back), and `done`, the replica's
    ranks with FINISHED_WAIT_S's timeout (`finished`). At dp 1 the replica group is
    control_group and there are no links. The groups are gloo with ANSWERS_WAIT's timeout:
    a replica waits for its next request, and rank 0 for a replica's answer, as long as it
    takes (a rank that is gone breaks them at once). Collective: every rank builds them."""

    def __init__(self, engine: Engine) -> None:
        from tools.generate_tp import ANSWERS_WAIT

        ps = engine.runtime.ps
        self.leaders = [ps.grid.rank_of(0, d, 0) for d in range(ps.dp_size)]
        self.leader, self.links = self.leaders[ps.dp_rank], {}
        self.replica = control_group(engine)
        for d in range(ps.dp_size):  # every rank makes every group, in the same order
            ranks = sorted(ps.grid.rank_of(t, d, p) for t in range(ps.tp_size)
                           for p in range(ps.pp_size))
            done = dist.new_group(ranks, backend="gloo",
                                  timeout=datetime.timedelta(seconds=FINISHED_WAIT_S))
            group = None if ps.dp_size == 1 else dist.new_group(ranks, backend="gloo",
                                                                timeout=ANSWERS_WAIT)
            if d == ps.dp_rank:
                self.done = done
                self.replica = self.replica if group is None else group
        if ps.dp_size == 1:
            return
        for d in range(1, ps.dp_size):
            group = dist.new_group([0, self.leaders[d]], backend="gloo", timeout=ANSWERS_WAIT)
            if ps.rank in (0, self.leaders[d]):
                self.links[d] = group
        # connected now, while every rank is here: gloo connects a pair at its first
        # message (TORCH_GLOO_LAZY_INIT, which the entry points export) and waits up to the
        # group's timeout for a peer that never comes, so a rank that died idle would have
        # held rank 0's next message for ANSWERS_WAIT instead of breaking it at once
        _broadcast(None, self.replica, self.leader)
        for link in self.links.values():  # rank 0: in replica order; a leader: its own
            _broadcast(None, link)


def _answer_of(run: Callable[[], dict]) -> Tuple[tuple, Optional[BaseException]]:
    """(what a replica's leader sends rank 0, the exception that stops it): ("ok",
    response), or ("error", RequestError?, text, broke) where broke says another rank of
    the replica broke the request's collective (the replica is out of step)."""
    try:
        return ("ok", run()), None
    except Exception as exc:
        broke = peer_failure(exc) is not None
        text = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        return ("error", isinstance(exc, RequestError), text, broke), exc if broke else None


def _run_finished(engine: Engine, req, done) -> dict:
    """run_request on a replica's leader, then `finished` (its failure raised first)."""
    try:
        out = run_request(engine, req)
    except Exception as exc:
        if peer_failure(exc) is None:  # else out of step already: the replica stops
            finished(done)
        raise
    finished(done)
    return out


def lead_replica(engine: Engine, groups: ServingGroups) -> int:
    """The leader of replica d > 0: take each request rank 0 sends over links[d],
    broadcast it to the replica's other ranks (follow_requests), generate it with them and
    send rank 0 the answer, until rank 0 sends stop (passed on to the replica); returns
    the number of requests. Ctrl-C as on a follower (_FollowerSigint). A request another
    rank of the replica broke is answered, then this rank stops (process_group_closed's
    line): rank 0 stops serving on that answer."""
    link, me, served = groups.links[engine.runtime.ps.dp_rank], groups.leader, 0
    with _FollowerSigint() as sigint:
        while True:
            try:
                kind, req = _broadcast(None, link)
            except RuntimeError:  # rank 0 left: after Ctrl-C that is the stop
                if sigint.received:
                    return served
                raise
            _broadcast((kind, req), groups.replica, me)
            if kind == _STOP:
                return served
            if kind != _REQUEST:
                continue
            served += 1
            answer, broke = _answer_of(lambda: _run_finished(engine, req, groups.done))
            _broadcast(answer, link, me)
            if broke is not None:
                raise broke


class Dispatcher:
    """Rank 0 at dp > 1: `submit` (an HTTP thread) runs a request on an idle replica,
    replica 0 (`lockstep`, on the main thread) when it is idle, else the lowest other
    one (sent over its link; this thread waits for the answer), else waits for one. The
    request is checked and its unseeded draw made here first (fixed_seed), in arrival
    order: any replica answers it as a one-replica server would have."""

    def __init__(self, lockstep: Lockstep, groups: ServingGroups) -> None:
        self.lockstep, self.groups = lockstep, groups
        self.idle, self.gone = set(range(len(groups.leaders))), set()
        self.stopping, self.cond, self.seeds = False, threading.Condition(), threading.Lock()
        lockstep.stop_replicas = self.stop_replicas
        lockstep.heartbeat_replicas = self.heartbeat

    def _take(self, d: Optional[int] = None) -> Optional[int]:
        """An idle replica, marked busy: `d` if idle (else None), or else the lowest idle
        one, waiting for one (RuntimeError once stopping)."""
        with self.cond:
            if d is not None:
                if d not in self.idle:
                    return None
            else:
                self.cond.wait_for(lambda: self.idle or self.stopping)
                if self.stopping:
                    raise RuntimeError("the server is stopping")
                d = min(self.idle)
            self.idle.remove(d)
            return d

    def _give(self, d: int) -> None:
        with self.cond:
            self.idle.add(d)
            self.cond.notify_all()

    def heartbeat(self) -> None:
        """(main thread, while replica 0 is idle) an idle message to each idle replica's
        leader, passed on to its ranks: a replica whose rank is gone is found while no
        request runs (RuntimeError: serving stops). A busy replica is skipped: its
        answer, or its broken link, will tell."""
        for d, link in self.groups.links.items():
            if self._take(d) is None:
                continue
            try:
                _broadcast((_IDLE, None), link)
            except RuntimeError as exc:
                self.gone.add(d)
                self.lockstep.lost = exc
                raise
            finally:
                self._give(d)

    def submit(self, req):
        with self.seeds:
            req = fixed_seed(self.lockstep.engine, req)  # RequestError: 400, not dispatched
        d = self._take()
        try:
            return self.lockstep.submit(req) if d == 0 else self._remote(d, req)
        finally:
            self._give(d)

    def _remote(self, d: int, req):
        link = self.groups.links[d]
        try:
            _broadcast((_REQUEST, req), link)
            answer = _broadcast(None, link, self.groups.leaders[d])
        except RuntimeError as exc:  # the leader is gone: stop serving (the job ends)
            self.gone.add(d)
            self.lockstep.fail(exc)
            raise
        if answer[0] == "ok":
            return answer[1]
        _, bad_request, text, broke = answer
        if bad_request:
            raise RequestError(text)
        error = RuntimeError(f"replica {d} (rank {self.groups.leaders[d]}): {text}")
        if broke:  # its leader stops; so does rank 0
            self.gone.add(d)
            self.lockstep.fail(error)
        raise error

    def stop_replicas(self) -> None:
        """Once serving ends (main thread): let the other replicas' running requests finish,
        then tell each leader to stop."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.idle >= set(self.groups.links))
        for d, link in self.groups.links.items():
            if d in self.gone:
                continue
            try:
                _broadcast((_STOP, None), link)
            except RuntimeError as exc:
                print(f"note: replica {d} could not be told to stop: {exc}", flush=True)
