"""The text generation server across ranks and signals, without a checkpoint: followers
survive a failed request and stop quietly on Ctrl-C/SIGTERM, rank 0 answers the request in
hand before it stops, a broken rank ends serving with an error, and a replica's answer
reaches the client."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tools import run_text_generation_server as server_mod
from tools import text_generation_ranks as ranks_mod
from tools.text_generation_cli import put


def test_a_follower_survives_a_failed_request(monkeypatch, capsys):
    """Under torchrun a request that fails in generation on every rank (rank 0 answers 500
    and goes on) must not end the other ranks: they follow the next request."""
    from types import SimpleNamespace

    messages = iter([("request", "bad"), ("idle", None), ("request", "good"), ("stop", None)])
    ran = []

    def run(engine, req):
        ran.append(req)
        if req == "bad":
            raise OverflowError("Numerical result out of range")

    monkeypatch.setattr(ranks_mod, "_broadcast", lambda message, group, src=0: next(messages))
    monkeypatch.setattr(ranks_mod, "run_request", run)
    engine = SimpleNamespace(runtime=SimpleNamespace(control_group=None,
                                                     ps=SimpleNamespace(rank=1, dp_rank=0)))
    assert server_mod.follow_requests(engine) == 2
    assert ran == ["bad", "good"]
    assert "rank 1: the request failed too (OverflowError" in capsys.readouterr().out


def _follower(monkeypatch, messages, run):
    """follow_requests on a fake rank 1 whose rank 0 sends `messages` (callables: one per
    broadcast) and whose requests run `run`."""
    from types import SimpleNamespace

    feed = iter(messages)
    monkeypatch.setattr(ranks_mod, "_broadcast", lambda message, group, src=0: next(feed)())
    monkeypatch.setattr(ranks_mod, "run_request", run)
    engine = SimpleNamespace(runtime=SimpleNamespace(control_group=None,
                                                     ps=SimpleNamespace(rank=1, dp_rank=0)))
    return server_mod.follow_requests(engine)


def _sigint_then(value):
    def deliver():
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before returning
        if isinstance(value, Exception):
            raise value
        return value
    return deliver


@pytest.mark.parametrize("rank0_after_sigint", [
    ("stop", None), RuntimeError("Connection closed by peer")])
def test_ctrl_c_ends_a_waiting_follower_quietly(monkeypatch, rank0_after_sigint):
    """A terminal's Ctrl-C reaches every rank; a follower waiting for rank 0 printed a
    KeyboardInterrupt traceback (and rank 0 could not tell it to stop): now it waits for
    rank 0's stop, or ends quietly when rank 0 has gone."""
    previous = signal.getsignal(signal.SIGINT)
    served = _follower(monkeypatch, [lambda: ("idle", None), _sigint_then(rank0_after_sigint)],
                       lambda engine, req: None)
    assert served == 0
    assert signal.getsignal(signal.SIGINT) is previous  # restored


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_a_request_lets_the_follower_finish_it(monkeypatch, signum):
    """Ctrl-C mid-request: the follower finishes the request (rank 0 is inside its
    collectives too) and ends at rank 0's stop. Before, it left mid-request, and a rank 0
    waiting in one of the request's collectives never got to broadcast the stop: both
    hung until torchrun's SIGKILL. SIGTERM alike (torchrun sends it to every rank when it
    is stopped): before, the follower died at once and the request in flight got a 500."""
    finished = []

    def run(engine, req):
        os.kill(os.getpid(), signum)  # Python runs the handler before returning
        time.sleep(0.1)
        finished.append(req)

    def not_the_followers(signum, frame):  # pytest's process must survive without the fix
        finished.append("signal reached the test's handler")

    previous = signal.signal(signal.SIGTERM, not_the_followers)
    try:
        messages = [lambda: ("request", "r"), lambda: ("stop", None)]
        assert _follower(monkeypatch, messages, run) == 1
        assert signal.getsignal(signal.SIGTERM) is not_the_followers  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert finished == ["r"]


class _OneRequest:
    """A pending-request queue holding `requests`; once they are taken, `get` raises
    `after`."""

    def __init__(self, requests, after: BaseException):
        self.requests, self.after = requests, after

    def get(self, timeout):
        for item in self.requests:
            return item
        raise self.after

    def empty(self):
        return True


class _IdleServer:
    """An HTTP server stand-in that serves nothing and stops at once."""

    def serve_forever(self):
        pass

    shutdown = server_close = serve_forever


def test_ctrl_c_during_a_request_on_rank0_answers_it_then_stops(monkeypatch, capsys):
    """Rank 0 interrupted mid-request finishes it (its client gets the answer; the other
    ranks finish it too), then tells them to stop."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    sent, done = [], Future()
    requests = iter([("r", done)])

    def run(engine, req):
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before returning
        time.sleep(0.1)
        return {"text": ["answer"]}

    monkeypatch.setattr(ranks_mod, "_broadcast",
                        lambda message, group, src=0: sent.append(message))
    monkeypatch.setattr(ranks_mod, "run_request", run)
    lockstep = server_mod.Lockstep(SimpleNamespace(runtime=SimpleNamespace(control_group=None)))
    lockstep.pending = _OneRequest(requests, AssertionError("serving went on after Ctrl-C"))
    previous = signal.getsignal(signal.SIGINT)
    lockstep.serve(_IdleServer())
    assert signal.getsignal(signal.SIGINT) is previous
    assert done.result(timeout=0) == {"text": ["answer"]}
    assert sent == [("request", "r"), ("stop", None)]
    assert "stopping once the running request is answered" in capsys.readouterr().out


def test_without_sigint_a_lost_rank0_is_an_error(monkeypatch):
    def closed():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed"):
        _follower(monkeypatch, [closed], lambda engine, req: None)


class _Exited(Exception):
    pass


def _rank0_stop(monkeypatch, again, after_s):
    """Lockstep.serve on a fake rank 0 interrupted while idle, whose server.shutdown gets
    signal `again` `after_s` seconds after the first: (what broadcast, exit status or None)."""
    from types import SimpleNamespace

    sent = []

    def exit_now(code):
        raise _Exited(code)

    class Server:
        def serve_forever(self):
            pass

        def shutdown(self):
            time.sleep(after_s)
            os.kill(os.getpid(), again)  # Python runs the handler before returning

        def server_close(self):
            sent.append("closed")

    class Interrupted:
        def get(self, timeout):
            raise KeyboardInterrupt  # Ctrl-C while idle

        def empty(self):
            return True

    monkeypatch.setattr(ranks_mod, "_broadcast",
                        lambda message, group, src=0: sent.append(message))
    monkeypatch.setattr(server_mod.os, "_exit", exit_now)
    monkeypatch.setattr(ranks_mod.InterruptWatch, "FORWARDED_WITHIN_S", 0.2)
    engine = SimpleNamespace(runtime=SimpleNamespace(control_group=None))
    lockstep = server_mod.Lockstep(engine)
    lockstep.pending = Interrupted()
    previous = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    signal.signal(signal.SIGTERM, server_mod._interrupt)  # as main installs it
    try:
        lockstep.serve(Server())
        status = None
    except _Exited as exc:
        status = exc.args[0]
    except KeyboardInterrupt:  # out of main: a traceback
        status = "KeyboardInterrupt"
    finally:
        for s, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
            signal.signal(s, handler)
    return sent, status


@pytest.mark.parametrize("again", [signal.SIGINT, signal.SIGTERM])
def test_a_second_ctrl_c_while_rank0_stops_exits_at_once(monkeypatch, capsys, again):
    """Rank 0 under torchrun stops by telling the other ranks, then closing the server
    (up to 0.5 s); a second Ctrl-C meanwhile (torchrun turns its own second one into
    SIGTERM) printed a KeyboardInterrupt traceback: now one line and status 130."""
    sent, status = _rank0_stop(monkeypatch, again, after_s=0.3)
    assert status == 130
    assert sent == [("stop", None)]  # the other ranks were told first
    assert capsys.readouterr().out == (f"run_text_generation_server.py: interrupted again "
                                       f"while stopping ({again.name}): exiting at once\n")


def test_the_same_ctrl_c_forwarded_does_not_cut_the_stop_short(monkeypatch, capsys):
    """A launcher may forward the terminal's Ctrl-C to a rank it reached already: that
    SIGINT right after the first is ignored, and the stop completes."""
    sent, status = _rank0_stop(monkeypatch, signal.SIGINT, after_s=0.0)
    assert status is None and sent == [("stop", None), "closed"]
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("error, stops", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                  "waiting 66000ms for recv operation to complete"), True),
    (OverflowError("Numerical result out of range"), False)])
def test_rank0_stops_serving_when_another_rank_broke_a_request(monkeypatch, error, stops):
    """A request whose collective another rank broke (gone, or stuck past the timeout) is
    answered 500 and ends rank 0's serving, without the stop broadcast a stuck rank would
    never take (rank 0 waited a second timeout there): the ranks are out of step, and
    before, every later request waited for the whole timeout again. A request failing
    alike on every rank (a 500) leaves the server serving."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    sent, done = [], Future()
    requests = iter([("r", done)])

    def run(engine, req):
        raise error

    monkeypatch.setattr(ranks_mod, "_broadcast",
                        lambda message, group, src=0: sent.append(message))
    monkeypatch.setattr(ranks_mod, "run_request", run)
    lockstep = server_mod.Lockstep(SimpleNamespace(runtime=SimpleNamespace(control_group=None)))
    lockstep.pending = _OneRequest(requests, KeyboardInterrupt())  # Ctrl-C once served
    if stops:
        with pytest.raises(RuntimeError, match="Timed out"):
            lockstep.serve(_IdleServer())
        assert sent == [("request", "r")]
    else:
        lockstep.serve(_IdleServer())
        assert sent == [("request", "r"), ("stop", None)]
    assert done.exception() is error  # the handler answers 500


def test_ctrl_c_during_a_request_answers_it_and_rank0_stops(monkeypatch):
    """Ctrl-C reaching rank 0 under torchrun while it generates a request: the request's
    client gets a 500 and serving ends. Before, the request was never answered: its HTTP
    thread waited for ever, server_close waited for that thread, and rank 0 hung until
    torchrun killed it (SIGKILL after 30 s; the client got an empty reply)."""
    from types import SimpleNamespace

    sent, started = [], threading.Event()

    def run(engine, req):
        started.set()
        raise KeyboardInterrupt  # the signal arrives mid-generation

    monkeypatch.setattr(ranks_mod, "_broadcast",
                        lambda message, group, src=0: sent.append(message))
    monkeypatch.setattr(ranks_mod, "run_request", run)
    engine = SimpleNamespace(runtime=SimpleNamespace(control_group=None))
    lockstep = server_mod.Lockstep(engine)
    server = server_mod.build_server(engine, "127.0.0.1", 0, log=lambda line: None,
                                     run=lockstep.submit)
    url = f"http://127.0.0.1:{server.server_address[1]}/api"
    serving = threading.Thread(target=lockstep.serve, args=(server,), daemon=True)
    serving.start()
    status, text = put(url, {"prompts": ["Hello"], "tokens_to_generate": 2}, timeout=20)
    serving.join(timeout=20)
    assert started.is_set() and not serving.is_alive()
    assert status == 500 and "stopped" in text
    assert sent[-1] == ("stop", None)  # the other ranks were told


def test_closing_the_server_waits_for_the_request_being_answered():
    """Ctrl-C of the one-process server while it generates: closing waits for that
    request's answer. Before, server_close did not wait for the (daemon) handler thread:
    the client got an empty reply and the interpreter's exit aborted the generating
    thread ('terminate called without an active exception')."""
    from types import SimpleNamespace

    started, finished, answers = threading.Event(), [], []

    def run(req):
        started.set()
        time.sleep(0.5)
        finished.append(req.prompts)
        return {"text": ["answer"], "segments": [["answer"]], "logprobs": None}

    server = server_mod.build_server(SimpleNamespace(), "127.0.0.1", 0, log=lambda line: None,
                                     run=run)
    url = f"http://127.0.0.1:{server.server_address[1]}/api"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = threading.Thread(target=lambda: answers.append(put(url, {"prompts": ["Hi"]})),
                              daemon=True)
    client.start()
    assert started.wait(20)
    server.shutdown()  # what Ctrl-C does to serve_forever
    server.server_close()
    assert finished == [["Hi"]]  # the request ran to its end before the close returned
    client.join(20)
    assert answers and answers[0][0] == 200


def _dispatcher(monkeypatch, answer):
    """A Dispatcher over a fake replica 1 whose leader answers `answer`: (what was
    broadcast, the Lockstep, the Dispatcher)."""
    from types import SimpleNamespace

    sent = []

    def broadcast(message, group, src=0):
        sent.append((message, group, src))
        return answer if message is None else message

    monkeypatch.setattr(ranks_mod, "_broadcast", broadcast)
    monkeypatch.setattr(ranks_mod, "fixed_seed", lambda engine, req: req)
    lockstep = server_mod.Lockstep(SimpleNamespace(runtime=SimpleNamespace(control_group=None)))
    groups = SimpleNamespace(leaders=[0, 4], links={1: "link1"})
    dispatcher = server_mod.Dispatcher(lockstep, groups)
    dispatcher.idle.discard(0)  # replica 0 busy: the request goes to replica 1
    return sent, lockstep, dispatcher


@pytest.mark.parametrize("answer, error, stops", [
    (("ok", {"text": ["x"]}), None, False),
    (("error", True, "prompts[0] is empty", False), server_mod.RequestError, False),
    (("error", False, "OverflowError: out of range", False), RuntimeError, False),
    (("error", False, "RuntimeError: Connection closed by peer", True), RuntimeError, True)])
def test_another_replicas_answer_reaches_the_client(monkeypatch, answer, error, stops):
    """At dp > 1 a request run by another replica is answered as rank 0's replica answers
    it: the response, 400 for a request that fails its checks there, 500 otherwise; a
    request whose collective another rank of that replica broke also stops the server."""
    sent, lockstep, dispatcher = _dispatcher(monkeypatch, answer)
    if error is None:
        assert dispatcher.submit("req") == {"text": ["x"]}
    else:
        with pytest.raises(error, match=re.escape(answer[2])):
            dispatcher.submit("req")
    assert sent == [(("request", "req"), "link1", 0), (None, "link1", 4)]
    assert dispatcher.idle == {1}  # free for the next request
    assert (not lockstep.pending.empty()) == stops and (1 in dispatcher.gone) == stops
    dispatcher.stop_replicas()  # a replica that broke cannot be told
    assert sent[2:] == ([] if stops else [(("stop", None), "link1", 0)])


def test_a_replica_leader_passes_requests_on_and_answers(monkeypatch):
    """Another replica's leader (rank 4 here) passes rank 0's messages on to its replica
    and sends back each answer; a request another rank of its replica broke is answered,
    then the leader stops (raises) as a rank of rank 0's replica would."""
    from types import SimpleNamespace

    feed = iter([("idle", None), ("request", "ok"), ("request", "bad"), ("request", "lost"),
                 ("stop", None)])
    sent = []

    def broadcast(message, group, src=0):
        sent.append((message, group, src))
        return next(feed) if message is None else message

    def run(engine, req):
        if req == "bad":
            raise server_mod.RequestError("prompts[0] is empty")
        if req == "lost":
            raise RuntimeError("Connection closed by peer [127.0.0.1]:8093")
        return {"text": [req]}

    monkeypatch.setattr(ranks_mod, "_broadcast", broadcast)
    monkeypatch.setattr(ranks_mod, "run_request", run)
    engine = SimpleNamespace(runtime=SimpleNamespace(ps=SimpleNamespace(dp_rank=1)))
    groups = SimpleNamespace(links={1: "link"}, leader=4, replica="replica", done=None)
    with pytest.raises(RuntimeError, match="Connection closed"):
        server_mod.lead_replica(engine, groups)
    passed_on = [m for m, g, src in sent if g == "replica" and src == 4]
    answers = [m for m, g, src in sent if g == "link" and src == 4]
    assert passed_on == [("idle", None), ("request", "ok"), ("request", "bad"),
                         ("request", "lost")]
    assert answers == [("ok", {"text": ["ok"]}), ("error", True, "prompts[0] is empty", False),
                       ("error", False, "RuntimeError: Connection closed by peer "
                        "[127.0.0.1]:8093", True)]
