"""tools/run_text_generation_server.py and tools/text_generation_cli.py against a tiny
checkpoint: the server's greedy and seeded text equal tools/generate.py's, log-probs have
one finite value per scored token, every bad request is a 400 naming the field, and the
CLI prints the server's text. The HTTP handling: tests/test_text_generation_http.py."""
from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import threading
import time

import pytest

from tests.test_generate import _run_cli, _train
from tools import run_text_generation_server as server_mod
from tools import text_generation_cli
from tools.text_generation_api import eol_stop
from tools.text_generation_cli import put


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    _train(path)
    return str(path)


@pytest.fixture(scope="module")
def served(ckpt):
    """(url, log lines) of a server on a free port, serving in a thread."""
    a, ns, explicit = server_mod.parse_args(["--load", ckpt, "--port", "0", "--seed", "5",
                                             "--max-tokens-to-oom", "40"])
    engine, _ = server_mod.build_engine(a, ns, explicit)
    lines = []
    server = server_mod.build_server(engine, "127.0.0.1", 0, log=lines.append)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api", lines
    server.shutdown()
    server.server_close()


def _ok(url, body) -> dict:
    status, text = put(url, body, timeout=60)
    assert status == 200, text
    return json.loads(text)


def _generate_py(ckpt, *flags) -> str:
    """prompt 5 6 7 -> the whole text generate.py makes (NullTokenizer: ids with spaces)."""
    out = _run_cli("--load", ckpt, "--prompt", "5 6 7", "--max-new-tokens", "10", *flags)
    return " ".join(map(str, out["prompt_ids"] + out["generated_ids"]))


def test_greedy_and_seeded_text_match_generate_py(ckpt, served):
    url, lines = served
    out = _ok(url, {"prompts": ["5 6 7"], "tokens_to_generate": 10, "top_k": 1})
    assert out["text"] == [_generate_py(ckpt, "--greedy")]
    assert out["segments"] == [out["text"][0].split(" ")]
    assert out["logprobs"] is None  # Megatron answers "logprobs": null when not asked
    body = {"prompts": ["5 6 7"], "tokens_to_generate": 10, "temperature": 1.5,
            "random_seed": 3}
    first, again = _ok(url, body), _ok(url, body)
    assert first == again
    assert first["text"] == [_generate_py(ckpt, "--seed", "3", "--temperature", "1.5")]
    nucleus = dict(body, top_p=0.9)
    assert _ok(url, nucleus)["text"] == [_generate_py(ckpt, "--seed", "3", "--temperature",
                                                      "1.5", "--top-p", "0.9")]
    assert lines[-1].endswith(" s") and "1 prompt(s), 10 tokens to generate" in lines[-1]
    n = len(lines)
    _ok(url, dict(body, no_log=True))
    assert len(lines) == n


def _engine(ckpt, *flags):
    a, ns, explicit = server_mod.parse_args(["--load", ckpt, *flags])
    return server_mod.build_engine(a, ns, explicit)[0]


def _record_calls(monkeypatch) -> list:
    """The [batch, tokens] shape of every cached model call (any thread)."""
    from tools import generate as generate_mod

    shapes = []
    real = generate_mod.forward_incremental
    monkeypatch.setattr(generate_mod, "forward_incremental", lambda model, ids, cache, **kw:
                        shapes.append(tuple(ids.shape)) or real(model, ids, cache, **kw))
    return shapes


def test_generation_uses_the_kv_cache(ckpt, monkeypatch):
    """A request's prompts generate together through the key/value cache: one call of
    every prompt up to the shortest, then one call per position with every prompt, not
    one per prompt and token; --no-kv-cache recomputes the context, one prompt at a time,
    and gives the same answer (same seed per prompt)."""
    from tools.text_generation_api import parse_request, run_request

    calls = _record_calls(monkeypatch)
    body = parse_request({"prompts": ["5 6 7", "1 2"], "tokens_to_generate": 6,
                          "temperature": 1.5, "random_seed": 4, "logprobs": True})
    answers = []
    for flags in ([], ["--no-kv-cache"]):
        engine = _engine(ckpt, *flags)
        assert engine.use_kv_cache is not bool(flags)
        calls.clear()
        answers.append(run_request(engine, body))
        if flags:
            assert calls == []
        else:  # EOD may end both prompts early
            assert calls[0] == (2, 2) and set(calls[1:]) == {(2, 1)}, calls
            assert len(calls) <= 3 + 6 - 2, calls
    assert answers[0]["text"] == answers[1]["text"]
    for got, want in zip(answers[0]["logprobs"], answers[1]["logprobs"]):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_batch_answers_as_one_prompt_at_a_time(ckpt, served, monkeypatch):
    """Prompts of 4, 1 and 3 tokens in one greedy request: the text, segments and
    log-probs (within 1e-5) of one prompt at a time without the cache (the reference),
    from one batch of 3 rows."""
    url, _ = served
    calls = _record_calls(monkeypatch)
    body = {"prompts": ["9 8 7 6", "1", "5 6 7"], "tokens_to_generate": 8, "top_k": 1,
            "logprobs": True}
    out = _ok(url, body)
    assert calls and {c[0] for c in calls} == {3}, calls
    from tools.text_generation_api import parse_request, run_request

    ref = run_request(_engine(ckpt, "--no-kv-cache"), parse_request(body))
    assert out["text"] == ref["text"] and out["segments"] == ref["segments"]
    assert [len(x) for x in out["logprobs"]] == [len(x) for x in ref["logprobs"]]
    for got, want in zip(out["logprobs"], ref["logprobs"]):
        assert got == pytest.approx(want, abs=1e-5)


def test_seeded_batch_is_deterministic(served):
    """The same seeded request twice gives the same answer; prompts[i] draws with seed
    random_seed + i, so it answers as a one-prompt request with that seed."""
    url, _ = served
    body = {"prompts": ["5 6 7", "1", "9 8 7 6"], "tokens_to_generate": 8,
            "temperature": 1.5, "random_seed": 3}
    first = _ok(url, body)
    assert _ok(url, body) == first
    alone = [_ok(url, dict(body, prompts=[p], random_seed=3 + i))["text"][0]
             for i, p in enumerate(body["prompts"])]
    assert first["text"] == alone


def test_logprobs_and_scoring(served):
    url, _ = served
    out = _ok(url, {"prompts": ["5 6 7", "1 2"], "tokens_to_generate": 4, "logprobs": True,
                    "top_k": 1})
    for text, logprobs in zip(out["text"], out["logprobs"]):
        assert len(logprobs) == len(text.split()) - 1
        assert all(math.isfinite(x) and x <= 0 for x in logprobs)
    scored = _ok(url, {"prompts": ["5 6 7"], "tokens_to_generate": 0, "logprobs": True})
    assert scored["text"] == ["5 6 7"]
    assert scored["logprobs"][0] == pytest.approx(out["logprobs"][0][:2], abs=1e-5)
    bos = _ok(url, {"prompts": [""], "tokens_to_generate": 2, "add_BOS": True, "top_k": 1})
    assert bos["segments"][0][0] == "100"  # NullTokenizer --vocab-size 100: EOD is id 100


def test_a_tiny_temperature_is_greedy(served):
    """temperature 5e-324 is a valid number > 0: the answer is the greedy one, not a 500
    from logits / temperature overflowing into nan probabilities."""
    url, _ = served
    body = {"prompts": ["5 6 7", "1"], "tokens_to_generate": 6, "random_seed": 1}
    greedy = _ok(url, dict(body, top_k=1))["text"]
    for tiny in (1e-40, 5e-324):
        assert _ok(url, dict(body, temperature=tiny))["text"] == greedy


@pytest.mark.parametrize("body,message", [
    ({}, "prompts must be a list of 1 to 128 strings (got None)"),
    ({"prompts": []}, "prompts must be a list of 1 to 128 strings (got [])"),
    ({"prompts": "5"}, "prompts must be a list of 1 to 128 strings"),
    ({"prompts": ["5"] * 129}, "prompts must be a list of 1 to 128 strings"),
    ({"prompts": [5]}, "prompts must be a list of 1 to 128 strings (got [5])"),
    ({"prompts": ["5"], "tokens_to_generate": -1},
     "tokens_to_generate must be an integer >= 0 (got -1)"),
    ({"prompts": ["5"], "tokens_to_generate": "8"},
     "tokens_to_generate must be an integer >= 0 (got '8')"),
    ({"prompts": ["5"], "temperature": 0},
     "temperature must be a number > 0 and <= 100 (got 0)"),
    ({"prompts": ["5"], "temperature": 101},
     "temperature must be a number > 0 and <= 100 (got 101)"),
    ({"prompts": ["5"], "top_k": -2},
     "top_k must be an integer from 0 to 1000 (0: off, 1: greedy) (got -2)"),
    ({"prompts": ["5"], "top_k": 1001},
     "top_k must be an integer from 0 to 1000 (0: off, 1: greedy) (got 1001)"),
    ({"prompts": ["5"], "tokens_to_generate": 0},
     "tokens_to_generate 0 only scores the prompts: set logprobs true"),
    ({"prompts": ["1 2 3"] * 4, "tokens_to_generate": 8},
     "too many tokens: 4 prompts x (longest prompt + tokens_to_generate) = 44, over the "
     "server's --max-tokens-to-oom 40"),
    ({"prompts": ["5"], "top_p": 1.5}, "top_p must be a number in [0, 1] (0: off) (got 1.5)"),
    ({"prompts": ["5"], "top_k": 5, "top_p": 0.5},
     "top_k (5) and top_p (0.5) cannot both be set: set one of them to 0"),
    ({"prompts": ["5"], "random_seed": -3},
     "random_seed must be an integer >= 0, or -1 (unseeded) (got -3)"),
    ({"prompts": ["5"], "random_seed": 2 ** 64},
     "random_seed must be below 2**64 = 18446744073709551616 (got 18446744073709551616)"),
    ({"prompts": ["5"], "logprobs": 1}, "logprobs must be true or false (got 1)"),
    ({"prompts": ["5"], "top_p_decay": 0.5},
     "top_p_decay needs top_p: it changes top_p after each token, and top_p is 0 (off)"),
    ({"prompts": ["5"], "top_p": 0.5, "top_p_decay": 1.5},
     "top_p_decay must be a number in [0, 1] (0: off) (got 1.5)"),
    ({"prompts": ["5"], "top_p": 0.5, "top_p_decay": "0.5"},
     "top_p_decay must be a number in [0, 1] (0: off) (got '0.5')"),
    ({"prompts": ["5"], "top_p_bound": 0.1}, "top_p_bound needs top_p"),
    ({"prompts": ["5"], "top_p": 0.5, "top_p_bound": 0.6},
     "top_p_bound must be a number in [0, top_p] = [0, 0.5] (got 0.6)"),
    ({"prompts": ["5"], "top_p": 0.5, "top_p_bound": -0.1},
     "top_p_bound must be a number in [0, top_p] (0: off) (got -0.1)"),
    ({"prompts": ["5"], "prevent_newline_after_colon": "yes"},
     "prevent_newline_after_colon must be true or false (got 'yes')"),
    ({"prompts": ["5"], "prevent_newline_after_colon": True, "tokens_to_generate": 2},
     "prevent_newline_after_colon: this tokenizer cannot spell ':'"),  # NullTokenizer
    ({"prompts": ["5"], "stop_on_eol": True, "tokens_to_generate": 2},  # would never stop
     "stop_on_eol: this tokenizer (NullTokenizer) has no token holding a newline"),
    ({"prompts": ["5"], "beam_width": 0},
     "beam_width must be an integer >= 1, or null (no beam search) (got 0)"),
    ({"prompts": ["5"], "beam_width": 2.0}, "beam_width must be an integer >= 1"),
    ({"prompts": ["5", "6"], "beam_width": 2},
     "beam_width: beam search takes exactly one prompt (got 2); send one request per prompt"),
    ({"prompts": ["5"], "beam_width": 2, "logprobs": True},
     "logprobs is not returned by beam search"),
    ({"prompts": ["5"], "beam_width": 2, "tokens_to_generate": 0},
     "beam search needs tokens_to_generate >= 1 (got 0)"),
    ({"prompts": ["5"], "beam_width": 2, "top_k": 1}, "top_k is not used by beam search"),
    ({"prompts": ["5"], "beam_width": 2, "top_p": 0.9}, "top_p is not used by beam search"),
    ({"prompts": ["5"], "beam_width": 2, "temperature": 0.5},
     "temperature is not used by beam search"),
    ({"prompts": ["5"], "beam_width": 2, "random_seed": 3},
     "random_seed is not used by beam search"),
    ({"prompts": ["5"], "beam_width": 2, "stop_on_double_eol": True},
     "stop_on_double_eol is not used by beam search"),
    ({"prompts": ["5 6"], "beam_width": 5, "tokens_to_generate": 7},
     "too many tokens: beam_width 5 x (prompt + tokens_to_generate) = 45, over the "
     "server's --max-tokens-to-oom 40"),
    ({"prompts": ["5"], "stop_token": 7},
     "stop_token is read by beam search only: set beam_width too, or leave stop_token out"),
    ({"prompts": ["5"], "length_penalty": 2}, "length_penalty is read by beam search only"),
    ({"prompts": ["5"], "beam_width": 2, "stop_token": -1},
     "stop_token must be an integer token id >= 0 (default 50256"),
    ({"prompts": ["5"], "beam_width": 2, "length_penalty": "1"},
     "length_penalty must be a finite number (got '1')"),
    # a JSON integer past float's range: 400 (was a 500 OverflowError), its digits cut short
    ({"prompts": ["5"], "beam_width": 2, "length_penalty": 10 ** 400},
     "length_penalty must be a finite number (got 1000000000000000000000000000000000000000"
     "... (401 characters))"),
    ({"prompts": ["5"], "temperature": -10 ** 400},
     "temperature must be a number > 0 and <= 100 (got -100000000000000000000000000000000"
     "000000... (402 characters))"),
    ({"prompts": ["5"], "prompt": "x"}, "unknown field(s) prompt; the fields are prompts,"),
    ({"sentences": ["5"], "tokens_to_generate": 2},
     "sentences is no longer a field (renamed by Megatron-LM): send prompts instead"),
    ({"prompts": ["5"], "max_len": 2},
     "max_len is no longer a field (renamed by Megatron-LM): send tokens_to_generate instead"),
    ([1], "the body must be a JSON object"),
    ({"prompts": [""]}, "prompts[0] is empty: give text, or set add_BOS true"),
    ({"prompts": ["5", "hello"], "tokens_to_generate": 2},
     "prompts[1] ('hello'): NullTokenizer expects space-separated integers"),
    ({"prompts": ["5 101"], "tokens_to_generate": 2}, "token ids [101] are outside the vocabulary [0, 101)"),
    ({"prompts": ["1 2 3"], "tokens_to_generate": 14},
     "has 3 tokens; with tokens_to_generate 14 that makes 17, over the model's 16 positions"),
    ({"prompts": ["1 2 3"]},  # the field left out: its default is named as such
     "has 3 tokens; with tokens_to_generate 64 (the default: the request has none) that "
     "makes 67, over the model's 16 positions"),
])
def test_bad_requests_are_400(served, body, message):
    status, text = put(served[0], body, timeout=60)
    assert status == 400 and message in text, text


HUGE = 10 ** 400


@pytest.mark.parametrize("body", [
    {"prompts": ["5"], "stop_token": HUGE},
    {"prompts": ["5"], "tokens_to_generate": HUGE},
    {"prompts": ["5"], "beam_width": 2, "tokens_to_generate": HUGE},
    {"prompts": ["5"], "beam_width": HUGE, "tokens_to_generate": 2},
    {"prompts": ["5"], "beam_width": 2, "random_seed": HUGE},
    {"prompts": ["5"], "top_k": HUGE},
    {"prompts": ["5"], "all_probs": HUGE},
    {"prompts": ["5"], "logprobs": HUGE},
])
def test_huge_integers_are_cut_short_in_messages(served, body):
    """A 401-digit JSON integer is shown as its first digits and its length, as the other
    fields' messages show it (these printed all 401 digits, some twice)."""
    status, text = put(served[0], body, timeout=60)
    assert status == 400 and "... (401 characters)" in text, text
    assert "0" * 100 not in text, text


def test_megatron_defaults_are_accepted():
    """A client that sends Megatron's defaults of every field (as its own code may, e.g.
    stop_token 50256 and beam_width null) is served; beam_width takes stop_token and
    length_penalty; all_probs, the one field not implemented, is refused unless false."""
    from tools.text_generation_api import NOT_SUPPORTED, RequestError, parse_request

    defaults = {"top_p_decay": 0.0, "top_p_bound": 0.0, "prevent_newline_after_colon": False,
                "beam_width": None, "stop_token": 50256, "length_penalty": 1,
                "all_probs": False}
    req = parse_request({"prompts": ["5"], **defaults})
    assert req.beam_width is None and req.stop_token == 50256 and req.length_penalty == 1.0
    assert NOT_SUPPORTED == {"all_probs": False}
    req = parse_request({"prompts": ["5"], "beam_width": 4, "stop_token": 7,
                         "length_penalty": 0.5, "top_k": 0, "random_seed": -1})
    assert (req.beam_width, req.stop_token, req.length_penalty) == (4, 7, 0.5)
    req = parse_request({"prompts": ["5"], "top_p": 0.5, "top_p_decay": 1,
                         "top_p_bound": 0.5, "prevent_newline_after_colon": True})
    assert (req.top_p_decay, req.top_p_bound, req.prevent_newline_after_colon) == \
        (1.0, 0.5, True)
    # all_probs (older Megatron-LM clients): false is served, true refused by name
    with pytest.raises(RequestError, match="all_probs is not supported"):
        parse_request({"prompts": ["5"], "all_probs": True})


def test_internal_request_fields_are_not_json_fields():
    """GenerationRequest's bookkeeping (default_tokens: tokens_to_generate left out) is no
    field of the API: a body that sends it is refused by name, and the list of fields in
    that message is Megatron's plus beam search's, without it."""
    from tools.text_generation_api import RequestError, parse_request

    with pytest.raises(RequestError) as err:
        parse_request({"prompts": ["5"], "default_tokens": False})
    assert str(err.value).startswith("unknown field(s) default_tokens; the fields are ")
    assert str(err.value).endswith("beam_width, stop_token, length_penalty")
    assert parse_request({"prompts": ["5"]}).default_tokens


def test_beam_search_answer(ckpt, served):
    """PUT /api with beam_width: {"text", "segments", "scores"}, beam_width hypotheses
    best first, each the prompt and its beam (a beam that met the stop token, 34, which
    this checkpoint draws after 5 6 7 68 ..., ends before it); --no-kv-cache answers the
    same."""
    from tools.text_generation_api import parse_request, run_request

    body = {"prompts": ["5 6 7"], "tokens_to_generate": 8, "beam_width": 3,
            "stop_token": 34, "length_penalty": 1.5}
    out = _ok(served[0], body)
    assert set(out) == {"text", "segments", "scores"} and len(out["scores"]) == 3
    assert out["scores"] == sorted(out["scores"], reverse=True)
    for text, segments in zip(out["text"], out["segments"]):
        assert text.startswith("5 6 7") and segments == text.split(" ")
        assert "34" not in segments[3:] and 3 < len(segments) <= 11
    assert min(len(s) for s in out["segments"]) < 11  # one ended at the stop token
    ref = run_request(_engine(ckpt, "--no-kv-cache"), parse_request(body))
    assert out["text"] == ref["text"]
    assert out["scores"] == pytest.approx(ref["scores"], abs=1e-5)


def test_sentencepiece_segments_are_the_pieces(tmp_path):
    """As Megatron-LM's server: a SentencePiece tokenizer's segments are its pieces, the
    word boundary ('\u2581') kept (before: each piece decoded alone, 'the', 'fox', so the
    segments of "the fox" could not be put back together); others decode each token."""
    from megatron.tokenizer import build_tokenizer
    from tests.test_tokenizer import _train_sentencepiece
    from tools.text_generation_api import token_segments

    model = _train_sentencepiece(tmp_path)
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        tok = build_tokenizer(kind, tokenizer_model=model)
        ids = tok.tokenize("the fox")
        segments = token_segments(tok, ids)
        assert segments == [tok._sp.id_to_piece(i) for i in ids] and segments[0][0] == "\u2581"
        assert "".join(segments).replace("\u2581", " ").strip() == "the fox"
    assert token_segments(tok, [tok.eod])[0] == tok._sp.id_to_piece(tok.eod)
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert token_segments(sp, [sp.eod]) == ["<EOD>"]
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert token_segments(null, [5, 100]) == ["5", "100"]  # Megatron-LM: str(token)


def test_cli_prints_the_text(served, monkeypatch, capsys):
    url = served[0]
    address = url.removeprefix("http://").removesuffix("/api")
    monkeypatch.setattr("sys.stdin", io.StringIO("5 6 7\n10\nhello\nx\n²\n2\n"))
    assert text_generation_cli.main([address]) == 0
    out = capsys.readouterr().out
    # unseeded sampling (it may stop at EOD): the prompt and 1 to 10 more ids; the input()
    # prompts share the line when stdin is not a terminal
    assert re.search(r"(^|: )5 6 7( \d+){1,10}$", out, re.M), out
    assert "'x' is not a whole number" in out
    assert "'²' is not a whole number" in out  # a digit to str.isdigit(), not to int()
    assert "server error 400: prompts[0] ('hello'): NullTokenizer expects" in out


def test_cli_asks_again_for_a_number_past_the_int_string_limit(monkeypatch, capsys):
    """(int() of more than 4300 digits raised a ValueError traceback.)"""
    monkeypatch.setattr("sys.stdin", io.StringIO("9" * 5000 + "\n" + "y" * 500 + "\n3\n"))
    assert text_generation_cli._ask_tokens() == 3
    lines = capsys.readouterr().out.split("\n")
    too_large = [line for line in lines if "too large a number of tokens" in line]
    assert len(too_large) == 1 and "(5000 characters)" in too_large[0], lines
    assert len(too_large[0]) < 200
    assert any("(500 characters) is not a whole number" in line for line in lines)


def test_cli_asks_again_for_zero_tokens(monkeypatch, capsys):
    """0 tokens was taken and sent, and the server refused it with advice this client
    cannot follow ("set logprobs true"): it is asked again, as a non-number is."""
    monkeypatch.setattr("sys.stdin", io.StringIO("0\n00\n3\n"))
    assert text_generation_cli._ask_tokens() == 3
    out = capsys.readouterr().out
    assert "'0' is not a whole number >= 1" in out and "'00' is not a whole number >= 1" in out


def test_cli_keeps_an_https_url():
    """(It made http://https://host/api.)"""
    assert text_generation_cli.api_url("https://gen.example:443/api/") == (
        "https://gen.example:443/api")
    assert text_generation_cli.api_url("https://gen.example") == "https://gen.example/api"


def test_cli_takes_the_servers_url(served, monkeypatch, capsys):
    """The address may be the URL curl is given (http://HOST:PORT/api), not only HOST:PORT:
    the client PUTs to /api, not /api/api (a 404)."""
    url = served[0]
    for address in (url, url + "/", url.removesuffix("/api"), url.removeprefix("http://")):
        assert text_generation_cli.api_url(address) == url, address
        monkeypatch.setattr("sys.stdin", io.StringIO("5 6 7\n2\n"))
        assert text_generation_cli.main([address]) == 0
        out = capsys.readouterr().out
        assert "server error" not in out and re.search(r"5 6 7( \d+){1,2}$", out, re.M), out


def test_cli_prints_a_plain_text_200_as_an_error(monkeypatch, capsys):
    """Megatron-LM's server refuses most requests with HTTP 200 and a plain-text body (here
    its answer to tokens_to_generate 0, given to every request): the client prints it (it
    raised JSONDecodeError)."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Megatron(BaseHTTPRequestHandler):
        def do_PUT(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"tokens_to_generate=0 implies logprobs should be True"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with HTTPServer(("127.0.0.1", 0), Megatron) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setattr("sys.stdin", io.StringIO("hi\n5\nhi\n5\n"))
        assert text_generation_cli.main([f"127.0.0.1:{server.server_address[1]}"]) == 0
        server.shutdown()
    out = capsys.readouterr().out
    assert out.count("server error 200: tokens_to_generate=0 implies logprobs") == 2, out


def test_cli_unreachable_server(monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr("sys.stdin", io.StringIO("5 6\n3\n"))
    assert text_generation_cli.main([f"127.0.0.1:{port}"]) == 1
    assert "cannot reach the text generation server at http://127.0.0.1:" in \
        capsys.readouterr().err


def test_command_line(ckpt, capsys):
    a, ns, explicit = server_mod.parse_args(
        ["--load", ckpt, "--num-layers", "2", "--hidden-size", "32", "--micro-batch-size",
         "4", "--tensor-model-parallel-size", "1", "--top_p", "0.9"])
    assert (a.port, a.host) == (5000, "127.0.0.1")
    server_mod.build_engine(a, ns, explicit)  # same shape as the checkpoint: accepted
    note = capsys.readouterr().out  # the tensor-parallel size is used (tests/test_generate_tp.py)
    assert "no effect on the server: --micro-batch-size, --top_p" in note
    a, ns, explicit = server_mod.parse_args(["--load", ckpt, "--hidden-size", "64",
                                             "--num-attention-heads", "8"])
    with pytest.raises(SystemExit, match=r"--hidden-size: checkpoint 32, command line 64\n"
                                         r"  --num-attention-heads: checkpoint 4, command "
                                         r"line 8\n"):
        server_mod.build_engine(a, ns, explicit)
    with pytest.raises(SystemExit, match="--load DIR is required"):
        server_mod.parse_args(["--num-layers", "2"])
    with pytest.raises(SystemExit, match=r"--hiden-size \(did you mean --hidden-size\?\)"):
        server_mod.parse_args(["--load", ckpt, "--hiden-size", "3"])


def test_a_port_that_cannot_be_bound_is_one_line(ckpt, monkeypatch):
    """A port in use ended in an AttributeError traceback from server_close (called by
    the failed bind before the server's state was set), not the 'pick another --port'
    line; a port out of range was bind's OverflowError, after loading the model."""
    import socket

    monkeypatch.delenv("RANK", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"error: cannot listen on 127.0.0.1:{port}: "
                                             r".*; pick another --port"):
            server_mod.main(["--load", ckpt, "--port", str(port)])
    for bad in ("70000", "-1"):
        with pytest.raises(SystemExit, match=rf"--port {bad} is not a TCP port: pass one "
                                             r"from 1 to 65535 \(0: any free port\)"):
            server_mod.parse_args(["--load", ckpt, "--port", bad])


class _Lines:
    """A tokenizer whose ids are indices into a list of strings."""

    def __init__(self, words):
        self.words = words

    def detokenize(self, ids):
        return "".join(self.words[i] for i in ids)


def test_eol_stops():
    tok = _Lines(["a", "\n", "\n\n", "b\n"])
    eol, double = eol_stop(tok, double=False), eol_stop(tok, double=True)
    assert not eol([0, 0]) and eol([0, 1]) and eol([0, 2]) and eol([0, 3])
    assert not double([0, 1]) and double([0, 2]) and double([1, 1]) and double([3, 1])
    assert not double([0, 3])


def test_max_tokens_to_oom_is_the_servers(ckpt, caplog):
    """--max-tokens-to-oom limits each request here (Megatron's server reads it too): no
    "has no effect" warning; pretrain_gpt.py accepts it with that warning (it was refused
    as "text generation is not part of pretraining yet")."""
    from megatron.arguments import parse_and_validate

    _, ns, _ = server_mod.parse_args(["--load", ckpt, "--max-tokens-to-oom", "500"])
    assert ns.max_tokens_to_oom == 500
    assert "no effect" not in caplog.text
    with pytest.raises(SystemExit, match="--max-tokens-to-oom 0 must be >= 1"):
        server_mod.parse_args(["--load", ckpt, "--max-tokens-to-oom", "0"])
    parse_and_validate(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                        "4", "--seq-length", "16", "--max-position-embeddings", "16",
                        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
                        "--train-iters", "1", "--mock-data", "--tokenizer-type",
                        "NullTokenizer", "--vocab-size", "100", "--max-tokens-to-oom", "500",
                        "--inference-batch-times-seqlen-threshold", "64"],
                       world_size=1, env={}, cuda_available=False)
    assert "--max-tokens-to-oom has no effect here: read by " \
           "tools/run_text_generation_server.py only" in caplog.text
    assert "--inference-batch-times-seqlen-threshold has no effect here" in caplog.text


@pytest.mark.parametrize("host_flags,noted", [([], True), (["--host", "127.0.0.1"], False)])
def test_main_notes_the_local_only_default(ckpt, capsys, monkeypatch, host_flags, noted):
    class Server:  # serves until Ctrl-C, at once
        server_address = ("127.0.0.1", 5999)

        def serve_forever(self):
            raise KeyboardInterrupt

        def server_close(self):
            pass

    monkeypatch.setattr(server_mod, "build_server", lambda *a, **k: Server())
    monkeypatch.delenv("RANK", raising=False)
    assert server_mod.main(["--load", ckpt, *host_flags]) == 0
    out = capsys.readouterr().out
    assert "at http://127.0.0.1:5999/api (PUT)" in out
    assert ("note: listening on 127.0.0.1 only (Megatron-LM listens on 0.0.0.0); pass "
            "--host 0.0.0.0" in out) == noted


def test_sigterm_stops_the_one_process_server_as_ctrl_c(ckpt, monkeypatch):
    """SIGTERM (kill, an orchestrator draining the server) stops the one-process server as
    Ctrl-C does: serving ends and server_close answers the running requests. Before, its
    default action ended the process at once: a request in flight got a connection reset."""
    closed = []

    class Server:
        server_address = ("127.0.0.1", 5999)

        def serve_forever(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the signal ends this
            raise AssertionError("SIGTERM did not stop serving")

        def server_close(self):
            closed.append(True)

    def not_the_servers(signum, frame):  # pytest's process must survive without the fix
        pass

    monkeypatch.setattr(server_mod, "build_server", lambda *a, **k: Server())
    monkeypatch.delenv("RANK", raising=False)
    previous = signal.signal(signal.SIGTERM, not_the_servers)
    try:
        assert server_mod.main(["--load", ckpt, "--host", "127.0.0.1"]) == 0
        assert closed == [True]
        assert signal.getsignal(signal.SIGTERM) is not_the_servers  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("penalty, tokens, ok", [
    (2000, 5, False), (-2000, 5, False), (2000, 1, True), (40, 1024, True),
    (44, 1024, False), (1.0, 64, True), (0.0, 64, True)])
def test_length_penalty_keeps_beam_scores_finite(penalty, tokens, ok):
    """A length_penalty whose divisor length ** penalty overflows (or underflows to 0) was
    accepted and failed in the search (500 on rank 0; under torchrun the other ranks left
    and the server stopped): it is a 400 naming the range, and an accepted one scores."""
    from tools.beam_search import Hypotheses
    from tools.text_generation_api import RequestError, parse_request

    body = {"prompts": ["5"], "beam_width": 2, "tokens_to_generate": tokens,
            "length_penalty": penalty}
    if not ok:
        with pytest.raises(RequestError, match=r"length_penalty must be in \[-\d"):
            parse_request(body)
        return
    req = parse_request(body)
    hyps = Hypotheses(2, req.length_penalty)
    for length in {1, min(2, tokens), tokens}:  # lengths reach tokens_to_generate
        assert math.isfinite(hyps.score(-50.0 * length, length))
