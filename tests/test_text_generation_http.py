"""The HTTP side of tools/run_text_generation_server.py against a tiny checkpoint: other
paths and methods, bodies it cannot read (a 400 naming the fix), chunked and
Expect: 100-continue bodies, clients that stall, trickle or leave, the connection limit
and the Host names a loopback server answers. Generation itself, the request fields and
the CLI: tests/test_text_generation_server.py."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from tests import test_text_generation_server as server_tests
from tools import run_text_generation_server as server_mod
from tools.text_generation_cli import put

ckpt, served = server_tests.ckpt, server_tests.served  # the module-scoped fixtures
_ok, _engine = server_tests._ok, server_tests._engine


def test_other_paths_and_methods(served):
    import urllib.error
    import urllib.request

    url = served[0]
    status, text = put(url.replace("/api", "/generate"), {"prompts": ["5"]})
    assert status == 404 and "the endpoint is PUT /api" in text
    for method in ("GET", "POST", "HEAD", "OPTIONS"):
        with pytest.raises(urllib.error.HTTPError) as err:
            data = None if method == "HEAD" else b"{}"
            urllib.request.urlopen(urllib.request.Request(url, data=data, method=method))
        assert err.value.code == 405 and err.value.headers["Allow"] == "PUT", method
        assert (err.value.read() == b"") == (method == "HEAD"), method
    req = urllib.request.Request(url, data=b"{not json", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "the body is not JSON" in err.value.read().decode()


def _put_bytes(url, data: bytes):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="PUT"),
                                    timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("data, message", [
    (b'{"prompts": ' + b"[" * 100000 + b"]" * 100000 + b"}",
     "the body is not JSON this server reads: nested too deeply"),
    (b'{"prompts": ["5"], "random_seed": ' + b"7" * 5000 + b"}",
     "the body is not JSON: Exceeds the limit (4300 digits)"),
], ids=["nested", "long-integer"])
def test_bodies_json_cannot_read_are_400(served, capsys, data, message):
    """A body nested 100000 deep (RecursionError) or holding an integer of 5000 digits
    (ValueError) was answered 500 'generation failed', with a traceback on the server."""
    status, text = _put_bytes(served[0], data)
    assert status == 400 and message in text, text
    assert "Traceback" not in capsys.readouterr().err
    assert _ok(served[0], {"prompts": ["5"], "tokens_to_generate": 1})["text"]


def test_a_refused_request_cannot_forge_log_lines(served):
    """A field name holding a newline was written to the server's log as it came, so a
    client could add lines of its choosing (a fake request line); a huge refused value
    was logged whole. The log line is now one line, escaped and bounded."""
    url, lines = served
    fake = "2026-01-01 00:00:00 PUT /api from 10.0.0.1: 1 prompt(s)"
    status, text = put(url, {"prompts": ["5"], f"x\n{fake}": 1}, timeout=60)
    assert status == 400 and "unknown field(s)" in text
    assert "\n" not in lines[-1] and f"x\\n{fake}" in lines[-1], lines[-1]
    status, _ = put(url, {"prompts": ["5"], "temperature": "t" * 100000}, timeout=60)
    assert status == 400 and len(lines[-1]) < 1000 and "characters)" in lines[-1]


def test_a_body_over_the_limit_is_a_400_the_client_reads(served):
    """A body over 16 MiB is answered 400 naming the limit; before, the server closed the
    connection with the body unread, and the client, still sending it, got a broken pipe
    (no answer)."""
    data = json.dumps({"prompts": ["5 " * (9 * 1024 * 1024)]}).encode()
    status, text = _put_bytes(served[0], data)
    assert status == 400 and f"the body must be at most {16 * 1024 * 1024} bytes (got " \
        f"{len(data)})" in text, text
    assert _ok(served[0], {"prompts": ["5"], "tokens_to_generate": 1})["text"]


def test_a_client_that_stalls_mid_body_is_let_go(served, monkeypatch):
    """A client that announces a longer body than it sends held its server thread (and
    socket) for good: the connection is now closed after the handler's timeout."""
    import socket
    from urllib.parse import urlsplit

    url, lines = served
    monkeypatch.setattr(server_mod._Handler, "timeout", 0.5)
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(b"PUT /api HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"pro")
        sock.settimeout(30)
        assert sock.recv(100) == b"", "closed by the server"
    assert "no byte of the body for 0.5 s; the connection was closed" in lines[-1]
    assert _ok(url, {"prompts": ["5"], "tokens_to_generate": 1})["text"]


def _trickle(url, head: bytes, pause: float, limit: float) -> bytes:
    """Send `head` one byte every `pause` seconds (a slowloris client) until the server
    answers or closes the connection, or `limit` seconds pass; what the server sent."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    got, end = b"", time.monotonic() + limit
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.settimeout(pause)
        for byte in head * 100:
            if time.monotonic() > end:
                break
            try:
                sock.sendall(bytes([byte]))
                got = sock.recv(1000)
                break  # an answer, or b"": closed
            except TimeoutError:
                pass
            except OSError:  # a reset once the server has closed
                break
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while got and (more := sock.recv(1000)):
                got += more
    return got


def test_a_client_that_trickles_its_headers_is_let_go(served, monkeypatch):
    """A client sending its headers one byte at a time, each within the idle timeout,
    held its thread (and socket) for as long as it liked: the request line and headers
    must now come within `header_timeout` of connecting, else a 408 and the connection
    is closed."""
    url, lines = served
    monkeypatch.setattr(server_mod._Handler, "timeout", 0.5)
    monkeypatch.setattr(server_mod._Handler, "header_timeout", 1.0, raising=False)
    head = b"PUT /api HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200
    got = _trickle(url, head, 0.1, limit=15)
    assert got.startswith(b"HTTP/1.0 408 ") and b"within 1 s of connecting" in got, got
    assert "no whole request line and headers within 1 s; answered 408" in lines[-1]
    assert _ok(url, {"prompts": ["5"], "tokens_to_generate": 1})["text"]


def test_a_client_that_trickles_its_body_is_let_go(served, monkeypatch):
    """The same for a body sent one byte at a time: it must come within `body_timeout`."""
    url, lines = served
    monkeypatch.setattr(server_mod._Handler, "timeout", 0.5)
    monkeypatch.setattr(server_mod._Handler, "body_timeout", 1.0, raising=False)
    head = b"PUT /api HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 300\r\n\r\n"
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(head)
        end, closed = time.monotonic() + 15, False
        sock.settimeout(0.1)
        while time.monotonic() < end and not closed:
            try:
                sock.sendall(b" ")
                closed = sock.recv(100) == b""
            except TimeoutError:
                pass
            except OSError:
                closed = True
    assert closed, "the server kept the connection"
    assert "not all of the body within 1 s; the connection was closed" in lines[-1]
    assert _ok(url, {"prompts": ["5"], "tokens_to_generate": 1})["text"]


def test_connections_beyond_the_limit_are_503(ckpt):
    """Idle connections (a client that opens many, or slow ones) each held a thread with
    no limit, so a flood of them exhausted the node's threads and memory: beyond
    max_connections open at once a connection is now answered 503 at once, one log line
    says so, and a freed connection serves again."""
    import socket

    lines = []
    server = server_mod.build_server(_engine(ckpt), "127.0.0.1", 0, log=lines.append)
    server.max_connections = 2
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api"
    body = {"prompts": ["5"], "tokens_to_generate": 1}
    try:
        idle = [socket.create_connection(server.server_address[:2]) for _ in range(2)]
        time.sleep(0.5)  # both accepted
        status, text = put(url, body, timeout=30)
        assert status == 503 and "2 connections open, its limit" in text, (status, text)
        assert "answered 503: 2 connections are open, the limit (1 refused" in lines[-1]
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 10
        while put(url, body, timeout=30)[0] == 503 and time.monotonic() < deadline:
            time.sleep(0.1)  # the handler threads see the closes
        assert _ok(url, body)["text"]
    finally:
        server.shutdown()
        server.server_close()


def _put_host(url, host):
    """(status, text) of a PUT with Host header `host` (None: none, as HTTP/1.0 clients)."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    body = json.dumps({"prompts": ["5"], "tokens_to_generate": 1})
    conn.putrequest("PUT", "/api", skip_host=True)
    if host is not None:
        conn.putheader("Host", host)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body.encode())
    answer = conn.getresponse()
    try:
        return answer.status, answer.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("host", [None, "localhost", "LOCALHOST:8000", "127.0.0.1",
                                  "127.0.0.1:5000", "[::1]", "[::1]:5000", "localhost.",
                                  "127.0.0.2:80"])
def test_local_names_reach_a_loopback_server(served, host):
    assert _put_host(served[0], host)[0] == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:5000",
                                  "localhost.attacker.example", "127.0.0.1.nip.io",
                                  "localhost:x", "[::1"])
def test_other_host_names_are_refused_on_loopback(served, host):
    """A server bound to 127.0.0.1 answered any Host, so a page of another site, its
    name rebound to 127.0.0.1 (DNS rebinding), could drive it from the user's browser:
    such a request is now a 403 naming the Host and the fix, with one log line."""
    url, lines = served
    status, text = _put_host(url, host)
    assert status == 403 and f"Host {host!r} is not this server's" in text, (status, text)
    assert "--host 0.0.0.0" in text and "http://127.0.0.1:" in text
    assert "PUT /api from 127.0.0.1: 403 Host" in lines[-1]


def test_host_names_a_server_answers():
    from tools.http_guards import host_refusal, is_loopback

    assert host_refusal(["myname:5000"], "myname", 5000) is None  # --host myname
    assert "2 Host headers" in host_refusal(["localhost", "evil"], "127.0.0.1", 1)
    assert is_loopback("127.0.0.1") and not is_loopback("0.0.0.0")
    assert not is_loopback("10.1.2.3") and not is_loopback("localhost")


def test_a_client_that_leaves_is_one_log_line(served, capsys):
    """A client that closes its connection before the answer (a timeout, Ctrl-C in the
    CLI) gets a line in the server's log, not a BrokenPipeError traceback; the server
    answers the next request."""
    import socket
    import struct
    from urllib.parse import urlsplit

    url, lines = served
    where = urlsplit(url)
    body = json.dumps({"prompts": ["5 6 7"] * 2, "tokens_to_generate": 8}).encode()
    for _ in range(3):  # the reset reaches the server before its answer (not guaranteed)
        n = len(lines)
        with socket.create_connection((where.hostname, where.port)) as sock:
            sock.sendall(b"PUT /api HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        deadline = time.time() + 30  # closed with a reset; wait for the server's line
        while time.time() < deadline and len(lines) == n:
            time.sleep(0.05)
        if lines[n:] and "closed the connection" in lines[-1]:
            break
    assert any("the client closed the connection before the answer" in x for x in lines[-1:]), \
        lines[-3:]
    assert "Traceback" not in capsys.readouterr().err
    assert _ok(url, {"prompts": ["5"], "tokens_to_generate": 1})["text"]


def _raw(url, data: bytes, wait: float = 30) -> bytes:
    """Everything the server answers to the request bytes `data`, until it closes."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    got = b""
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(data)
        sock.settimeout(wait)
        while more := sock.recv(65536):
            got += more
    return got


_HEAD = b"PUT /api HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def test_a_chunked_body_is_read(served):
    """`curl -T -` and `requests.put(url, data=generator)` send the body chunked, without
    a Content-Length; werkzeug (Megatron-LM's server) reads it, this server answered 400
    'the request needs a Content-Length header'."""
    import http.client
    from urllib.parse import urlsplit

    url = served[0]
    want = _ok(url, {"prompts": ["5 6"], "tokens_to_generate": 2, "random_seed": 3})
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    conn.request("PUT", "/api", body=iter([b'{"prompts": ["5 6"], ', b'"tokens_to_generate"',
                                           b': 2, "random_seed": 3}']),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    answer = conn.getresponse()
    assert answer.status == 200 and json.loads(answer.read()) == want
    conn.close()
    body = json.dumps({"prompts": ["5 6"], "tokens_to_generate": 2, "random_seed": 3})
    framed = (b"Transfer-Encoding: Chunked\r\n\r\n5;ext=1\r\n" + body[:5].encode() +
              b"\r\n" + f"{len(body) - 5:X}\r\n".encode() + body[5:].encode() +
              b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
    got = _raw(url, _HEAD + framed)
    assert got.startswith(b"HTTP/1.0 200") and json.loads(got.split(b"\r\n\r\n", 1)[1]) == want


@pytest.mark.parametrize("framed, message", [
    (b"zz\r\n{}\r\n0\r\n\r\n", "the chunk size b'zz' of the chunked body is not a hexadecimal"),
    (b"2\r\n{}", "the chunked body ended before its last (zero-size) chunk"),
    (b"9\r\n{}", "the chunked body ended inside a chunk"),
    (b"1\r\n{}\r\n0\r\n\r\n", "a chunk of the chunked body is longer than its size says"),
], ids=["size", "no-last-chunk", "short-chunk", "long-chunk"])
def test_bad_chunked_bodies_are_400(served, framed, message):
    import socket

    data = _HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + framed
    if framed.endswith(b"{}"):  # the client stops sending: end its half of the connection
        from urllib.parse import urlsplit

        where = urlsplit(served[0])
        with socket.create_connection((where.hostname, where.port)) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(30)
            got = b""
            while more := sock.recv(65536):
                got += more
    else:
        got = _raw(served[0], data)
    assert got.startswith(b"HTTP/1.0 400") and message.encode() in got, got


def test_a_chunked_body_over_the_limit_is_a_400(served):
    """A chunked body past 16 MiB is read to its end and refused naming its size; the
    client, which sends all of it first, reads the 400."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(served[0])
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    piece = b" " * (1 << 20)
    conn.request("PUT", "/api", body=iter([b'{"prompts": ["5"]', *[piece] * 17, b"}"]),
                 encode_chunked=True)
    answer = conn.getresponse()
    size = 18 + 17 * len(piece)
    assert answer.status == 400
    assert f"at most {16 * 1024 * 1024} bytes (got {size}, chunked)" in answer.read().decode()
    conn.close()


def test_expect_100_continue_is_answered(served, monkeypatch):
    """curl sends `Expect: 100-continue` with a body over 1 MiB and waits up to 1 s for
    the interim answer before sending it; werkzeug sends it at once, this server never
    did (every such request took a second more). A body too large is refused at once,
    before the client sends it."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(served[0])
    body = json.dumps({"prompts": ["5"], "tokens_to_generate": 1}).encode()
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(_HEAD + f"Content-Length: {len(body)}\r\n".encode() +
                     b"Expect: 100-continue\r\n\r\n")
        sock.settimeout(0.9)  # curl's own wait is 1 s
        assert sock.recv(100) == b"HTTP/1.0 100 Continue\r\n\r\n"
        sock.sendall(body)
        sock.settimeout(30)
        assert sock.recv(100).startswith(b"HTTP/1.0 200")
    monkeypatch.setattr(server_mod._Handler, "body_timeout", 60.0)  # the slow alternative
    start = time.monotonic()
    got = _raw(served[0], _HEAD + b"Content-Length: 20000000\r\nExpect: 100-continue\r\n\r\n",
               wait=90)
    assert got.startswith(b"HTTP/1.0 400") and b"(got 20000000)" in got
    assert time.monotonic() - start < 20, "the 60 s wait for a body the client holds back"


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_a_json_body_with_a_bom_or_in_utf16_is_read(served, encoding):
    """Flask's get_json (Megatron-LM's server) reads a JSON body encoded in UTF-8 with a
    byte order mark (what Windows tools write) or in UTF-16/32; this server answered 400
    'Unexpected UTF-8 BOM'."""
    body = {"prompts": ["5 6"], "tokens_to_generate": 2, "random_seed": 3}
    status, text = _put_bytes(served[0], json.dumps(body).encode(encoding))
    assert status == 200 and json.loads(text) == _ok(served[0], body), text


def test_a_form_or_compressed_body_names_the_fix(served):
    """requests.put(url, data=dict) sends a form, not JSON: the 400 says so and how to send
    JSON; a gzip body names its Content-Encoding (neither server decodes it)."""
    import gzip
    import urllib.request

    url = served[0]
    req = urllib.request.Request(url, data=b"prompts=5&tokens_to_generate=1", method="PUT",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    assert "Content-Type is application/x-www-form-urlencoded" in err.value.read().decode()
    req = urllib.request.Request(url, data=gzip.compress(b'{"prompts": ["5"]}'), method="PUT",
                                 headers={"Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400 and "Content-Encoding is 'gzip'" in err.value.read().decode()


@pytest.mark.parametrize("data", [b'{"prompts": ["5", "5 \\ud800 6"]}',
                                  b'{"prompts": ["5", "5 \xed\xa0\x80 6"]}'],
                         ids=["escaped", "utf-8-encoded"])
def test_a_lone_surrogate_in_a_prompt_is_a_400(served, data):
    """A lone UTF-16 surrogate (JSON '\\ud800' without its pair) is no text: a
    SentencePiece tokenizer failed on it with a RuntimeError (a 500 and a traceback), GPT-2
    BPE with a codec message. It is now refused before any tokenizer sees it; a whole
    surrogate pair is one character, and passes."""
    from tools.text_generation_api import parse_request

    status, text = _put_bytes(served[0], data)
    assert status == 400, text
    assert "prompts[1] has a lone UTF-16 surrogate '\\ud800' at character 2" in text, text
    assert parse_request(json.loads(b'{"prompts": ["\\ud83d\\ude00"]}')).prompts == ["\U0001F600"]
