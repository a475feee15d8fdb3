#!/usr/bin/env python
"""Talk to tools/run_text_generation_server.py from a terminal.

    python tools/text_generation_cli.py localhost:5000     (or http://localhost:5000/api)

Asks for a prompt and a number of tokens (empty: 64), PUTs them to http://HOST:PORT/api
and prints the text the server returns (the prompt and its continuation), in a loop. End
of input (Ctrl-D) or Ctrl-C ends it. An unreachable server is an error (exit 1); a request
the server refuses prints its message and the loop goes on (also the HTTP 200 plain-text
refusals of Megatron-LM's own server).
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Optional, Tuple

DEFAULT_TOKENS = 64


def put(url: str, body: dict, timeout: Optional[float] = None) -> Tuple[int, str]:
    """(HTTP status, response text) of PUT `url` with `body` as JSON. URLError when the
    server cannot be reached."""
    req = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"), method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", errors="replace")


def api_url(address: str) -> str:
    """http://HOST:PORT/api for HOST:PORT, also when given as the server's URL
    (http://HOST:PORT, or with /api: what curl is given; Megatron's client appended a
    second /api, which the server answers with 404). An https:// URL (the server behind a
    TLS proxy) keeps its scheme."""
    scheme = "https" if address.startswith("https://") else "http"
    address = address.removeprefix(f"{scheme}://").rstrip("/")
    return f"{scheme}://{address.removesuffix('/api').rstrip('/')}/api"


def _ask_tokens() -> int:
    """The number of tokens to generate, asked again until it is an integer >= 1 (the
    server takes 0 only with logprobs, which this client does not ask for)."""
    while True:
        text = input(f"Tokens to generate [{DEFAULT_TOKENS}]: ").strip()
        if not text:
            return DEFAULT_TOKENS
        if text.isascii() and text.isdigit():  # "²" is a digit, not an int
            try:
                number = int(text)
            except ValueError:  # over Python's int-string limit (4300 digits)
                print(f"  {_brief(text)} is too large a number of tokens; give fewer")
                continue
            if number > 0:
                return number
        print(f"  {_brief(text)} is not a whole number >= 1")


def _brief(text: str) -> str:
    """`text` as a message shows it: its repr, cut when long (a line may hold 5000 digits)."""
    shown = repr(text)
    return shown if len(shown) <= 60 else f"{shown[:40]}... ({len(text)} characters)"


def _answer(status: int, text: str) -> str:
    """What to print for a response: the first text of a JSON answer, else the server's
    message. Megatron-LM's own server answers most bad requests with HTTP 200 and the
    message as a plain-text body, which is printed as an error too (not a traceback)."""
    if status == 200:
        try:
            return json.loads(text)["text"][0]
        except (ValueError, TypeError, KeyError, IndexError):
            pass
    return f"server error {status}: {text}"


def _unreachable(url: str, exc: Exception) -> int:
    reason = getattr(exc, "reason", exc)
    print(f"error: cannot reach the text generation server at {url} ({reason}); is "
          "tools/run_text_generation_server.py running there, on that host and port?",
          file=sys.stderr)
    return 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="HOST:PORT of the server, e.g. localhost:5000 (its "
                                    "URL http://localhost:5000/api works too)")
    a = ap.parse_args(argv)
    url = api_url(a.address)
    try:
        while True:
            prompt = input("Prompt: ")
            body = {"prompts": [prompt], "tokens_to_generate": _ask_tokens()}
            try:
                status, text = put(url, body)
            except (urllib.error.URLError, OSError) as exc:
                return _unreachable(url, exc)
            print(_answer(status, text))
    except (EOFError, KeyboardInterrupt):
        print()
        return 0


if __name__ == "__main__":
    sys.exit(main())
