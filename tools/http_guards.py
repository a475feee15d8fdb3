"""Guards of the text generation server's HTTP side (tools/run_text_generation_server.py)
against clients that hold it up or that a browser page drives: a read deadline for a
request's head and body, a canned answer for a connection refused before any handler runs,
and the Host check of a server bound to a loopback address (DNS rebinding)."""
from __future__ import annotations

if __name__ == "__main__":
    raise SystemExit("tools/http_guards.py is a library module (the text generation server's "
                     "HTTP guards); run python tools/run_text_generation_server.py --help")

import io
import ipaddress
import re
import select
import socket
import time
from typing import List, Optional

HEADER_TIMEOUT_S = 20.0  # request line and headers, from the connection's start
BODY_TIMEOUT_S = 60.0  # the whole body, from the end of the headers
MAX_CONNECTIONS = 64  # connections served at once; more are answered 503
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_MAX_LINE = 4096  # bytes of a chunk-size or trailer line
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class DeadlineReader(io.RawIOBase):
    """A connection's socket as a raw stream whose reads end at `deadline` (monotonic
    seconds; None: none) and wait at most `idle` seconds for a byte: a client that sends
    one byte now and then otherwise keeps its thread as long as it likes. TimeoutError
    when either runs out; `expired` then says it was the deadline."""

    def __init__(self, sock: socket.socket, idle: Optional[float]) -> None:
        super().__init__()
        self._sock, self.idle = sock, idle
        self.deadline: Optional[float] = None
        self.expired = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        wait = self.idle
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.expired = True
                raise TimeoutError("the read deadline passed")
            wait = left if wait is None else min(wait, left)
        self._sock.settimeout(wait)
        try:
            return self._sock.recv_into(buf)
        except TimeoutError:
            self.expired = self.deadline is not None and time.monotonic() >= self.deadline
            raise
        finally:
            self._sock.settimeout(self.idle)  # writes keep the idle timeout


def canned(status: int, reason: str, text: str) -> bytes:
    """A whole HTTP/1.0 answer with a plain-text body, for a connection no handler answers."""
    data = text.encode("utf-8")
    return (f"HTTP/1.0 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def refuse(sock: socket.socket, answer: bytes, wait_s: float = 0.1) -> None:
    """Send `answer` on a connection the server will not serve, without blocking: what the
    client sent within `wait_s` is read first (a socket closed with its request unread
    resets the connection, and the client saw that instead of the answer)."""
    try:
        sock.setblocking(False)
        if select.select([sock], [], [], wait_s)[0]:
            for _ in range(16):
                if not sock.recv(65536):
                    break
    except OSError:  # nothing more to read now (BlockingIOError), or the client left
        pass
    try:
        sock.send(answer)
    except OSError:
        pass


def is_loopback(host: str) -> bool:
    """Whether the bound address `host` (an IP) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> Optional[str]:
    """The name of a Host header ("name", "name:port", "[v6]" or "[v6]:port"), lower
    case without a trailing dot; None when it is not one."""
    value = value.strip()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep:
            return None
    else:
        name, _, port = value.partition(":")
        rest = f":{port}" if ":" in value else ""
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name.lower().rstrip(".")


def host_refusal(values: List[str], bound: str, port: int) -> Optional[str]:
    """Why a request with Host header(s) `values` to a server bound to the loopback
    address `bound` (the --host given) is refused, or None: the names allowed are
    localhost, a loopback IP and `bound`, with any port. Another name is what a browser
    page sends after DNS rebinding (its own name resolved to 127.0.0.1); no Host (an
    HTTP/1.0 client) passes."""
    if not values:
        return None
    if len(values) > 1:
        return f"the request has {len(values)} Host headers: send one"
    name = _host_name(values[0])
    if name is not None and (name in _LOCAL_NAMES or name == bound.lower() or
                             is_loopback(name)):
        return None
    return (f"Host {values[0]!r} is not this server's: it listens on {bound} (this machine "
            f"only) and answers requests to localhost or 127.0.0.1 (http://127.0.0.1:{port}"
            "/api); a page of another site reaches it by that name (DNS rebinding). To "
            "serve other machines under other names, start it with --host 0.0.0.0")


class BadBody(ValueError):
    """A request body that is not framed as its headers say (the message says how)."""


def _line(rfile) -> bytes:
    line = rfile.readline(_MAX_LINE + 1)
    if not line.endswith(b"\n"):
        raise BadBody("the chunked body ended before its last (zero-size) chunk"
                      if len(line) <= _MAX_LINE else
                      f"a line of the chunked body is over {_MAX_LINE} bytes")
    return line.rstrip(b"\r\n")


def read_chunked(rfile, limit: int) -> tuple:
    """(the body, its whole size) of a `Transfer-Encoding: chunked` request body (what
    `curl -T -` and `requests.put(url, data=generator)` send; werkzeug, Megatron-LM's
    server, reads it), read to its end: past `limit` bytes the rest is read and dropped,
    so the client reads the answer instead of a reset. BadBody when it is not chunked
    framing; the reader's deadlines bound the time (TimeoutError)."""
    parts, total = [], 0
    while True:
        head = _line(rfile).split(b";", 1)[0].strip()  # a chunk extension is ignored
        if not _CHUNK_SIZE.fullmatch(head):
            raise BadBody(f"the chunk size {head[:40]!r} of the chunked body is not a "
                          "hexadecimal number")
        size = int(head, 16)
        if size == 0:
            while _line(rfile):  # trailer fields, then the empty line
                pass
            return b"".join(parts), total
        while size > 0:  # in pieces: one read of a huge announced size would allocate it
            piece = rfile.read(min(size, 1 << 20))
            if not piece:
                raise BadBody("the chunked body ended inside a chunk")
            size -= len(piece)
            total += len(piece)
            if total <= limit:
                parts.append(piece)
        if _line(rfile):
            raise BadBody("a chunk of the chunked body is longer than its size says")


def json_hint(content_type: str, content_encoding: str) -> str:
    """What to change when a body with these headers is not JSON ("" when they look
    right): a form (`requests.put(url, data=dict)`) or a compressed body."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if content_encoding.strip().lower() not in ("", "identity"):
        return (f" (its Content-Encoding is {content_encoding.strip()!r}, which this server "
                "does not decode, nor does Megatron-LM's: send the JSON uncompressed)")
    if kind in ("application/x-www-form-urlencoded", "multipart/form-data"):
        return (f" (its Content-Type is {kind}: send the fields as JSON, e.g. "
                "requests.put(url, json={...}) instead of data={...}, or curl -H "
                "'Content-Type: application/json' -d '{...}')")
    return ""
