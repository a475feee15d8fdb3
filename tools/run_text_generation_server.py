#!/usr/bin/env python
"""Serve a checkpoint over HTTP for quick sanity checks, as Megatron-LM's server does.

    python tools/run_text_generation_server.py --load CKPT --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt [Megatron's model flags]
    curl -X PUT http://localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["Hello"], "tokens_to_generate": 32}'
    python tools/text_generation_cli.py localhost:5000

The command line is Megatron's: every Megatron-LM 23.05 flag parses. The model is rebuilt
from the checkpoint's stored arguments (in one process: tools/generate.py, any tp/pp layout
merges), so the model-shape flags are optional; one that is given and differs from the
checkpoint is an ERROR naming both values (the weights cannot take another shape, and a
silently preferred value would hide a wrong --load). The training and data flags have no
effect (one note lists them). --fp16/--bf16 pick the dtype (default: the checkpoint's on
CUDA, fp32 on CPU); unseeded requests draw from a generator seeded by --seed.

A model too big for one GPU is served tensor- and pipeline-parallel, as Megatron serves it:

    torchrun --nproc-per-node 8 tools/run_text_generation_server.py --load CKPT \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 [--tokenizer flags]

Every rank holds a 1/4 shard of its pipeline stage's layers, loaded through the training
loader from any saved layout (tools/generate_tp.py; at pp > 1 the tokens pass the stages in
order and the last stage's logits are broadcast to every rank). Rank 0 (the first stage's
first shard) listens on HTTP; for each request it broadcasts the parsed
request to the other ranks (a gloo group), all ranks generate it in lockstep (identical
full-vocabulary logits, same seeds, so the same tokens) and rank 0 answers. While idle,
rank 0 broadcasts a heartbeat every 30 s, so the waiting ranks never reach the process
group's timeout. When rank 0 stops (Ctrl-C, SIGTERM, a failure) it broadcasts a stop
message (after Ctrl-C or SIGTERM mid-request, once every rank has finished that request
and it is answered; one process, too, answers its running requests) and every rank exits (Ctrl-C again while it stops, or torchrun's SIGTERM after its
own second Ctrl-C: rank 0 exits at once with one line, status 130); a rank 0 killed
outright breaks the other ranks' broadcast, and they exit with one line naming it. A
request whose collective another rank broke (gone, or stuck past the process group's
timeout) is answered 500 and stops rank 0 with one line (megatron/rank_failure.py); a
rank stuck meanwhile ends when the job's store has gone (megatron/watchdog.py). After each
request the ranks meet once more, for at most 60 s: a request that failed on rank 0 alone
(out of memory on one GPU), leaving the others in its collectives, is answered 500 and
stops the server so within a minute (the next request waited for the process group's
timeout, and Ctrl-C with it).

A world size of D x tp x pp (`torchrun --nproc-per-node 8 ... --tensor-model-parallel-size
2`: D = 4) holds D data-parallel replicas of the model, which answer up to D requests side
by side (Megatron-LM accepts the world size and runs one request at a time); one start-up
line says so. Rank 0 keeps the HTTP threads and checks each request (the 400s above,
--max-tokens-to-oom) and, for an unseeded one, draws its base seed, in arrival order; then
the request goes to an idle replica, rank 0's own first (`Dispatcher`), so each answer is
the one a one-replica server gives for the same requests. Each replica's leader (its tp 0
/ pp 0 rank) takes its requests from rank 0 over a gloo group of the two, broadcasts each
to its replica's ranks as rank 0 does to its own, and sends the answer back; these groups
wait as long as a request takes (tools/generate_tp.py ANSWERS_WAIT; the ranks' side, `Lockstep`,
`Dispatcher`, `ServingGroups` and the followers, is tools/text_generation_ranks.py).
While idle, rank 0's heartbeat reaches every idle replica, so a rank that died there ends
the server as one of rank 0's replica does; a replica whose request broke answers 500 and
ends it too. When rank 0 stops, the requests other replicas run are finished and
answered, then every replica is told to stop. A world size that is not a multiple of tp x
pp is refused, and so is --num-layers-per-virtual-pipeline-stage at pp > 1; at pp > 1 the
cached one-token step runs eagerly (no CUDA graph: the captured step is one stage's).
The prompts of a request are generated together as one batch through a key/value cache
(tools/generate.py generate_batch); on CUDA each one-token step of the batch is one replay
of a CUDA graph (--decode-cuda-graph auto, the default; captured at the first request of a
batch size and reused by later ones: megatron/core/models/gpt/static_decode.py).
--no-kv-cache runs them one at a time, recomputing the whole context for every token
instead (the reference: same tokens, slower). A beam search request (beam_width B, one
prompt: tools/beam_search.py) decodes its B beams as one batch of B rows through the same
cache, reordered to follow the beams chosen at each step (its CUDA graph is the one for a
batch of B rows); --no-kv-cache recomputes every beam per token.

The request and response are described in tools/text_generation_api.py (Megatron's PUT /api
fields: sampling with top_p decay and prevent_newline_after_colon, beam search with
stop_token and length_penalty). Requests run one at a time (one per data-parallel
replica); each prints one line to stdout. Bad requests get HTTP
400 with a plain-text message, other paths 404, other methods on /api 405. (Megatron-LM
answers most bad requests with HTTP 200 and the message as the body; a client that tells
success from failure by the status works with both.) A body is at most 16 MiB; a
connection that sends nothing, or takes nothing of its answer, for 120 s is closed, and so
is one whose request line and headers take over 20 s (answered 408) or whose body takes
over 60 s (tools/http_guards.py). The body comes with a Content-Length or chunked (`curl -T
-`), and curl's `Expect: 100-continue` is answered at once, as werkzeug does. At most 64
connections are served at once; another is answered 503 at once (one log line per 10 s of
them).

--host defaults to 127.0.0.1, not Megatron's 0.0.0.0: the API has no authentication, so
reaching it from other machines is opt-in (--host 0.0.0.0). Bound to a loopback address, it answers
only requests whose Host is localhost, a loopback IP or the --host given (any port; a
request without Host passes); another is answered 403, as a browser page that rebinds its
own name to 127.0.0.1 (DNS rebinding) would otherwise drive it.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, List, Optional, Set, Tuple
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megatron.agreed_exit import silent_ranks_wait
from megatron.core.models.gpt.static_decode import MODES
from tools import http_guards
from tools.generate import (
    _device,
    build_decoder,
    build_tokenizer_from,
    load_model,
)
from tools.text_generation_api import (
    Engine,
    RequestError,
    parse_request,
    run_request,
)
from tools.text_generation_ranks import (
    Dispatcher,
    Lockstep,
    ServingGroups,
    _StopSignals,
    follow_requests,
    lead_replica,
)

_PROG = "run_text_generation_server.py"
LOCAL_ONLY = "127.0.0.1"  # the default --host
_MAX_BODY = 16 * 1024 * 1024
_DISCARD_S = 10.0  # how long a refused (too long) body is read and dropped
# flags of the model's shape: compared with the checkpoint when given
_SHAPE_DESTS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "swiglu", "untie_embeddings_and_output_weights",
                "normalization", "add_bias_linear", "apply_layernorm_1p", "num_experts",
                "vocab_size", "vocab_extra_ids", "rotary_percent", "rotary_base",
                "max_position_embeddings", "tokenizer_type", "group_query_attention",
                "num_query_groups", "position_embedding_type", "add_position_embedding",
                "use_rotary_position_embeddings")
_MAX_TOKENS = "--max-tokens-to-oom"
# flags the server uses
_USED_DESTS = ("load", "vocab_file", "merge_file", "tokenizer_model", "fp16", "bf16", "seed",
               "max_tokens_to_oom", "tensor_model_parallel_size", "pipeline_model_parallel_size")
CLIENT_TIMEOUT_S = 120.0  # a connection silent for this long is closed
_MAX_LOGGED = 500  # characters of a refusal's message on the server's log


# -------------------------------------------------------------------------- command line
def _server_parser() -> argparse.ArgumentParser:
    from megatron.cli_suggest import SuggestingParser

    ap = SuggestingParser(
        prog=_PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is one of Megatron-LM's (see pretrain_gpt.py --help).")
    ap.add_argument("--port", type=int, default=5000, help="default 5000 (0: any free port)")
    ap.add_argument("--host", default=LOCAL_ONLY,
                    help="address to bind; default 127.0.0.1 (this machine only; Megatron "
                         "binds 0.0.0.0: pass --host 0.0.0.0 to serve other machines)")
    ap.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--no-kv-cache", action="store_true",
                    help="generate a request's prompts one at a time, recomputing the "
                         "whole context for every token (as tools/generate.py "
                         "--no-kv-cache; slower, for checking)")
    ap.add_argument("--decode-cuda-graph", choices=MODES, default="auto",
                    help="replay each cached one-token step from a CUDA graph (as "
                         "tools/generate.py --decode-cuda-graph): auto (default) where it "
                         "can be captured (CUDA; NCCL under tensor parallelism; MoE "
                         "layers only as grouped GEMMs: bf16 on sm90/sm100), on: "
                         "insist, off: the eager cached step")
    for flag, kind in (("--temperature", float), ("--top_p", float), ("--top_k", int),
                       ("--out-seq-length", int)):  # Megatron's server flags: requests set these
        ap.add_argument(flag, type=kind, default=None, help="no effect: each request sets it")
    return ap


def parse_args(argv=None) -> Tuple[argparse.Namespace, argparse.Namespace, Set[str]]:
    """(server flags, Megatron namespace, Megatron dests given). SystemExit on a bad flag."""
    from megatron.arguments import ArgumentsError, apply_deprecated, check_not_supported
    from megatron.arguments import parse_args as parse_megatron
    from megatron.arguments_common import FLAG_SPECS
    from megatron.cli_suggest import option_strings

    server = _server_parser()
    a, rest = server.parse_known_args(argv)
    try:
        ns, explicit = parse_megatron(rest, extra_options=option_strings(server))
        # --max-tokens-to-oom is the server's (check_not_supported calls it idle elsewhere)
        max_tokens, ns.max_tokens_to_oom = ns.max_tokens_to_oom, FLAG_SPECS[_MAX_TOKENS].default
        check_not_supported(ns, apply_deprecated(ns, explicit))
        ns.max_tokens_to_oom = max_tokens
        if max_tokens < 1:
            raise ArgumentsError(f"{_MAX_TOKENS} {max_tokens} must be >= 1")
    except ArgumentsError as err:
        raise SystemExit(f"{_PROG}: {err}") from None
    if not ns.load:
        raise SystemExit(f"{_PROG}: error: --load DIR is required (the checkpoint to serve)")
    if not 0 <= a.port <= 65535:  # else bind's OverflowError, after loading the model
        raise SystemExit(f"{_PROG}: error: --port {a.port} is not a TCP port: pass one from "
                         "1 to 65535 (0: any free port)")
    return a, ns, explicit


def check_model_flags(ns, explicit: Set[str], saved: dict, where: str) -> List[str]:
    """SystemExit when a model-shape flag given on the command line differs from the
    checkpoint's `saved` args; else the given flags that have no effect here."""
    from megatron.arguments_common import flag_for_dest
    from megatron.checkpoint_model_args import checkpoint_arg_mismatches

    run = {d: getattr(ns, d) for d in explicit if d in _SHAPE_DESTS}
    run["vocab_file"] = True  # compare the tokenizer items too (Megatron's --vocab-file case)
    items = checkpoint_arg_mismatches(saved, run)
    if items:
        lines = "\n".join(f"  {m.name}: checkpoint {m.saved}, command line {m.run}"
                          for m in items)
        raise SystemExit(f"{_PROG}: error: the model's shape comes from the checkpoint in "
                         f"{where}, and the command line disagrees:\n{lines}\nLeave these "
                         f"flags out or give the checkpoint's values "
                         f"({'; '.join(m.fix for m in items)}).")
    return sorted(flag_for_dest(d) for d in explicit - set(_SHAPE_DESTS) - set(_USED_DESTS))


def _load(a, ns, environ):
    """(model, Config, iteration, Runtime or None): the whole model in this process, or
    under torchrun this rank's share of a tensor x pipeline layout (tools/generate_tp.py).
    SystemExit for a layout the server does not run."""
    from tools.generate_tp import checked_launch, load_model_tp

    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    rank, world_size, local_rank = checked_launch(
        _PROG, environ, tp, pp, ns.num_layers_per_virtual_pipeline_stage, a.device)
    dtype = torch.float16 if ns.fp16 else torch.bfloat16 if ns.bf16 else None
    if world_size == 1:
        device = _device(a.device)
        dtype = dtype or (None if device.type == "cuda" else torch.float32)
        return (*load_model(ns.load, a.iteration, device, dtype), None)
    if dtype is None and not torch.cuda.is_available():
        dtype = torch.float32
    return load_model_tp(ns.load, tp, rank, local_rank, environ, a.iteration, dtype,
                         pp_size=pp, dp_size=world_size // (tp * pp))


def build_engine(a, ns, explicit: Set[str], environ=None) -> Tuple[Engine, int]:
    """(Engine, iteration) for the checkpoint under --load (under torchrun: this rank's
    tensor-parallel shard, `engine.runtime` set); SystemExit with the fix when the flags
    disagree with it or its tokenizer cannot be built."""
    environ = os.environ if environ is None else environ
    model, config, iteration, rt = _load(a, ns, environ)
    lead = rt is None or rt.ps.rank == 0
    idle = check_model_flags(ns, explicit, config.args, ns.load)
    idle += [f for f in ("--temperature", "--top_p", "--top_k", "--out-seq-length")
             if getattr(a, f.lstrip("-").replace("-", "_")) is not None]
    if idle and lead:
        print(f"note: no effect on the server: {', '.join(idle)} (the model comes from the "
              "checkpoint; each request sets its own sampling)")
    tokenizer, why_not = build_tokenizer_from(config.args, ns, show=lead)
    if tokenizer is None:
        raise SystemExit(f"{_PROG}: error: the server needs the checkpoint's tokenizer, which "
                         f"cannot be built: {why_not}; give --tokenizer-type and its files "
                         "(--vocab-file/--merge-file or --tokenizer-model)")
    engine = Engine(model, tokenizer, tokenizer.vocab_size,
                    config.model.max_position_embeddings,
                    torch.Generator().manual_seed(ns.seed), max_tokens=ns.max_tokens_to_oom,
                    use_kv_cache=not a.no_kv_cache, runtime=rt,
                    decoder=build_decoder(model, a.decode_cuda_graph, not a.no_kv_cache,
                                          _PROG))
    return engine, iteration


# ---------------------------------------------------------------------------------- HTTP
def log_safe(text: str) -> str:
    """`text` as one log line: control characters (a newline in a field name the client
    chose) escaped, so a request cannot forge lines of the log, and at most _MAX_LOGGED
    characters (the message of a refused 16 MiB value is for the client, not the log)."""
    if len(text) > _MAX_LOGGED:
        text = f"{text[:_MAX_LOGGED]}... ({len(text)} characters)"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Stalled(Exception):
    """The client sent no byte of its announced body for `_Handler.timeout` seconds, or
    not all of it within `_Handler.body_timeout` (the message says which)."""


class _Handler(BaseHTTPRequestHandler):
    """PUT /api; the engine, the log function and `run` (request -> response) are class
    attributes (see build_server)."""

    engine: Engine
    log: Callable[[str], None]
    run: Callable
    # seconds a connection may send nothing (request line, headers, body) or take nothing
    # of the answer: a stalled client otherwise holds its thread and socket for good
    timeout = CLIENT_TIMEOUT_S
    # seconds for the request line and headers (from the connection's start) and for the
    # body (from the headers): one byte now and then no longer keeps a thread for ever
    header_timeout = http_guards.HEADER_TIMEOUT_S
    body_timeout = http_guards.BODY_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's file, replaced by one that keeps the deadlines
        self._reader = http_guards.DeadlineReader(self.connection, self.timeout)
        self._reader.deadline = time.monotonic() + self.header_timeout
        self.rfile = io.BufferedReader(self._reader)

    def parse_request(self) -> bool:
        ok = super().parse_request()  # TimeoutError while the headers come
        self._head_read = True
        return ok and self._host_allowed()

    def _host_allowed(self) -> bool:
        """False (answered 403) for a Host a server bound to loopback does not answer:
        a browser page reaches such a server by DNS rebinding, and only that way."""
        bound, port = self.server.bound_host, self.server.server_address[1]
        if not http_guards.is_loopback(self.server.server_address[0]):
            return True  # --host 0.0.0.0 or an interface: any name may reach it
        why = http_guards.host_refusal(self.headers.get_all("Host") or [], bound, port)
        if why is None:
            return True
        self.log(f"{self.command} {log_safe(self.path)} from {self.client_address[0]}: 403 "
                 f"{log_safe(why)}")
        with contextlib.suppress(ValueError):
            self._discard(int(self.headers.get("Content-Length", "0")))
        self.close_connection = True
        self._reply(403, why)
        return False

    def handle_one_request(self) -> None:
        self._head_read = False
        super().handle_one_request()  # a read past its deadline closes the connection
        if self._reader.expired and not self._head_read:
            self.log(f"connection from {self.client_address[0]}: no whole request line and "
                     f"headers within {self.header_timeout:g} s; answered 408 and closed")
            with contextlib.suppress(OSError):
                self.wfile.write(http_guards.canned(
                    408, "Request Timeout", f"the request line and headers must arrive "
                    f"within {self.header_timeout:g} s of connecting"))

    def log_message(self, format, *args):  # noqa: A002 -- one line per request instead
        pass

    def _reply(self, status: int, text: str, content_type: str = "text/plain") -> bool:
        """Send the answer; False when the client has closed the connection (a timeout,
        Ctrl-C in the CLI): nothing to answer, and no traceback on the server's log."""
        data = text.encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", f"{content_type}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", "PUT")
            self.end_headers()
            if self.command != "HEAD":  # a HEAD answer has the headers only
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
            return False
        return True

    def _other(self) -> None:
        if urlsplit(self.path).path == "/api":
            self._reply(405, f"{self.command} is not allowed on /api: use PUT with a JSON body")
        else:
            self._reply(404, f"no such path {urlsplit(self.path).path}: the endpoint is PUT /api")

    # every other method (a load balancer's HEAD or OPTIONS probe included) gets the 405
    # on /api and the 404 elsewhere (BaseHTTPRequestHandler answered 501 and a page)
    do_GET = do_POST = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _other

    def _discard(self, length: int) -> None:
        """Read and drop a refused body, for up to _DISCARD_S seconds: a client sends all
        of it before it reads the answer, and a server that closed with it unread reset
        the connection (the client saw a broken pipe instead of the 400)."""
        self.close_connection = True
        end = self._reader.deadline = time.monotonic() + _DISCARD_S
        while length > 0 and time.monotonic() < end:
            try:
                chunk = self.rfile.read1(min(length, 1 << 20))
            except OSError:  # TimeoutError too
                return
            if not chunk:
                return
            length -= len(chunk)

    def _body(self):
        coding = self.headers.get("Transfer-Encoding", "").strip().lower()
        if coding and coding != "chunked":
            raise RequestError(f"Transfer-Encoding {coding!r} is not one this server reads: "
                               "send the body with a Content-Length, or chunked")
        if coding:
            data = self._read(self._chunked)
        else:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                raise RequestError("the request needs a Content-Length header (or "
                                   "Transfer-Encoding: chunked) and a JSON body") from None
            if not 0 <= length <= _MAX_BODY:
                if not self._expects_continue():  # else the client waits, sending nothing
                    self._discard(length)
                self.close_connection = True
                raise RequestError(f"the body must be at most {_MAX_BODY} bytes (got "
                                   f"{length})")
            data = self._read(lambda: self.rfile.read(length))
            if len(data) < length:
                raise RequestError(f"the body ended after {len(data)} of the {length} bytes "
                                   "its Content-Length announced")
        try:  # bytes: UTF-8 with or without a BOM, UTF-16 or UTF-32, as Flask's get_json
            return json.loads(data)
        except RecursionError:  # json's parser recurses once per nesting level
            raise RequestError("the body is not JSON this server reads: nested too "
                               "deeply") from None
        except ValueError as exc:  # not UTF-8, not JSON, an integer of > 4300 digits
            raise RequestError(f"the body is not JSON: {exc}" + http_guards.json_hint(
                self.headers.get("Content-Type", ""),
                self.headers.get("Content-Encoding", ""))) from None

    def _expects_continue(self) -> bool:
        return (self.headers.get("Expect", "").strip().lower() == "100-continue"
                and self.request_version >= "HTTP/1.1")

    def _read(self, read: Callable[[], bytes]) -> bytes:
        """`read()` of the body under the body deadline, after the interim 100 Continue
        the client waits for (curl sends `Expect: 100-continue` with a large body, and
        waited 1 s for it); _Stalled when the client stalls."""
        self._reader.deadline = time.monotonic() + self.body_timeout
        if self._expects_continue():
            with contextlib.suppress(OSError):
                self.send_response_only(100)
                self.end_headers()
        try:
            return read()
        except TimeoutError:  # `timeout` seconds without a byte, or past the deadline
            raise _Stalled(f"not all of the body within {self.body_timeout:g} s"
                           if self._reader.expired else
                           f"no byte of the body for {self.timeout:g} s") from None

    def _chunked(self) -> bytes:
        """A chunked body (`curl -T -`, `requests.put(url, data=generator)`), at most
        _MAX_BODY bytes (a larger one is read to its end and refused)."""
        try:
            data, size = http_guards.read_chunked(self.rfile, _MAX_BODY)
        except http_guards.BadBody as exc:
            raise RequestError(str(exc)) from None
        if size > _MAX_BODY:
            raise RequestError(f"the body must be at most {_MAX_BODY} bytes (got {size}, "
                               "chunked)")
        return data

    def do_PUT(self) -> None:
        with self.server.answering():
            self._put()

    def _put(self) -> None:
        if urlsplit(self.path).path != "/api":
            return self._other()
        start, req = time.perf_counter(), None
        try:
            req = parse_request(self._body())
            out = self.run(req)
        except _Stalled as exc:  # a client that stalls mid-body: let its thread go
            self.log(f"PUT /api from {self.client_address[0]}: {exc}; the connection was "
                     "closed")
            self.close_connection = True
            return
        except RequestError as exc:
            self.log(f"PUT /api from {self.client_address[0]}: 400 {log_safe(str(exc))}")
            self._reply(400, str(exc))
            return
        except Exception as exc:  # a failed forward must not leave the client hanging
            traceback.print_exc()
            self._reply(500, f"generation failed: {type(exc).__name__}: {exc}")
            return
        if not self._reply(200, json.dumps(out), "application/json"):
            self.log(f"PUT /api from {self.client_address[0]}: the client closed the "
                     f"connection before the answer ({time.perf_counter() - start:.2f} s); "
                     "the answer was dropped")
        elif not req.no_log:
            beams = "" if req.beam_width is None else f", beam width {req.beam_width}"
            self.log(f"PUT /api from {self.client_address[0]}: {len(req.prompts)} prompt(s), "
                     f"{req.tokens_to_generate} tokens to generate{beams}, "
                     f"{time.perf_counter() - start:.2f} s")


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer whose server_close waits for the PUTs being answered. Its
    handler threads are daemons, which server_close does not join: Ctrl-C during a
    request dropped the answer (an empty reply) and the interpreter's exit aborted the
    thread still generating ('terminate called without an active exception')."""

    max_connections = http_guards.MAX_CONNECTIONS  # more at once are answered 503
    bound_host = LOCAL_ONLY  # the --host given (a name allowed as Host)
    log: Callable[[str], None] = staticmethod(print)

    def __init__(self, *args, **kwargs) -> None:
        # before the bind: a failed one (port in use) calls server_close, which reads them
        self._puts, self._done = 0, threading.Condition()
        self._open, self._refused, self._noted = 0, 0, 0.0
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        """A thread for the connection, or, with max_connections open (idle or slow
        clients, a flood), a 503 at once: a thread each held every one of them."""
        with self._done:
            full = self._open >= self.max_connections
            self._open += not full
        if full:
            return self._refuse(request, client_address)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed_one()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed_one()

    def _closed_one(self) -> None:
        with self._done:
            self._open -= 1

    def _refuse(self, request, client_address) -> None:
        self._refused += 1
        if time.monotonic() - self._noted > 10:  # one line per 10 s of a flood
            self._noted = time.monotonic()
            self.log(f"connection from {client_address[0]} answered 503: {self.max_connections}"
                     f" connections are open, the limit ({self._refused} refused so far)")
        http_guards.refuse(request, http_guards.canned(
            503, "Service Unavailable", f"the server has {self.max_connections} connections "
            "open, its limit: try again when a request has been answered"))
        self.shutdown_request(request)

    @contextlib.contextmanager
    def answering(self):
        with self._done:
            self._puts += 1
        try:
            yield
        finally:
            with self._done:
                self._puts -= 1
                self._done.notify_all()

    def server_close(self) -> None:
        super().server_close()
        with self._done:
            self._done.wait_for(lambda: self._puts == 0)


def build_server(engine: Engine, host: str, port: int, log: Callable[[str], None] = print,
                 run: Optional[Callable] = None,
                 max_connections: int = http_guards.MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """A bound (not yet serving) HTTP server for `engine`; port 0 takes a free port.
    `run(request)` answers a request (default: run_request holding engine.lock; under
    torchrun Lockstep.submit, at dp > 1 Dispatcher.submit); beyond `max_connections` open
    at once a connection is answered 503."""
    def log_line(text: str) -> None:
        log(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}")
        sys.stdout.flush()

    def run_locked(req):
        with engine.lock:
            return run_request(engine, req)

    handler = type("Handler", (_Handler,), {"engine": engine, "log": staticmethod(log_line),
                                            "run": staticmethod(run or run_locked)})
    server = _Server((host, port), handler)
    server.max_connections, server.log, server.bound_host = max_connections, log_line, host
    return server


def _replicas_note(ps) -> str:
    """The start-up line of a world with data-parallel replicas."""
    return (f"note: world size {ps.world_size} holds {ps.dp_size} data-parallel replicas of "
            f"the model ({ps.tp_size} tensor x {ps.pp_size} pipeline ranks each): up to "
            f"{ps.dp_size} requests run at once, one per replica")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None, environ=None) -> int:
    """The command line; under torchrun (RANK / WORLD_SIZE in `environ`, default
    os.environ) rank 0 serves, each other replica's leader takes its requests, and the
    other ranks follow their replica's leader (see the module docstring). Callable more
    than once in one process: the variables the start-up sets in `environ` and the
    warnings hooks come back as they were, and the process group the run made is ended
    (one the caller made is kept)."""
    from megatron.entry_state import entry_point_changes_undone
    from megatron.initialize import announce_broken_triton
    from megatron.rank_failure import process_group_closed
    from megatron.srun_tasks import launcher_ranks

    a, ns, explicit = parse_args(argv)
    env = os.environ if environ is None else environ
    announce_broken_triton(launcher_ranks(env)[0])
    with entry_point_changes_undone(env), process_group_closed("while serving", env):
        return _serve(a, ns, explicit, environ, argv)


def _serve(a, ns, explicit: Set[str], environ, argv) -> int:
    """main after the command line: load, then serve (rank 0), lead a replica or follow
    its leader."""
    with silent_ranks_wait(os.environ if environ is None else environ):  # rank 0 prints
        engine, iteration = build_engine(a, ns, explicit, environ)  # a load error once
    rt = engine.runtime
    groups = None if rt is None else ServingGroups(engine)
    if rt is not None and rt.ps.rank != 0:
        if rt.ps.rank == groups.leader:
            lead_replica(engine, groups)
        else:
            follow_requests(engine, groups.replica, groups.leader, groups.done)
        return 0
    lockstep = None if rt is None else Lockstep(engine, group=groups.replica,
                                                done=groups.done)
    run = None if lockstep is None else lockstep.submit
    if rt is not None and rt.ps.dp_size > 1:
        run = Dispatcher(lockstep, groups).submit
    try:
        server = build_server(engine, a.host, a.port, run=run)
    except OSError as exc:
        if lockstep is not None:
            lockstep.stop_others()
            lockstep.stop_replicas()
        raise SystemExit(f"{_PROG}: error: cannot listen on {a.host}:{a.port}: {exc}; pick "
                         "another --port") from None
    host, port = server.server_address[:2]
    layout = "" if rt is None else (f", tensor-parallel over {rt.ps.tp_size} x pipeline "
                                    f"over {rt.ps.pp_size} ranks")
    print(f"serving {ns.load} (iteration {iteration}{layout}) at http://{host}:{port}/api "
          "(PUT); Ctrl-C stops", flush=True)
    if rt is not None and rt.ps.dp_size > 1:
        print(_replicas_note(rt.ps), flush=True)
    if a.host == LOCAL_ONLY and not any(x == "--host" or x.startswith("--host=")
                                        for x in (argv if argv is not None else sys.argv[1:])):
        print(f"note: listening on {LOCAL_ONLY} only (Megatron-LM listens on 0.0.0.0); pass "
              "--host 0.0.0.0 to serve other machines (the API has no authentication)",
              flush=True)
    # SIGTERM (a launcher's or orchestrator's stop) as Ctrl-C: the running requests are
    # answered first (its default action dropped them: the client's connection reset)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if lockstep is not None:
            lockstep.serve(server)
            return 0
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            with _StopSignals():  # Ctrl-C again while a request finishes: exit at once
                server.server_close()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
