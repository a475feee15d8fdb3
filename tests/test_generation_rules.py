"""The request fields of Megatron-LM 23.05's text generation server that shape sampling
(tools/sampling_rules.py through tools/text_generation_api.py): top_p_decay / top_p_bound
give every draw of a request the top_p of Megatron's schedule (one schedule for the batch,
counted from the shortest prompt; the same with --no-kv-cache); prevent_newline_after_colon
stops the tokenizer's "\\n" from following its ":" where the model would have drawn it
(batch, --no-kv-cache and beam search); beam requests run the beam search of
tools/beam_search.py, the same with and without the cache. A tiny random model and a
tokenizer of space-separated ids whose ":" and "\\n" are ids chosen by the test."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_kv_cache import MAX_POS, _model
from tools import generate as generate_mod
from tools.beam_search import beam_search
from tools.sampling_rules import TopPSchedule
from tools.text_generation_api import (
    Engine,
    RequestError,
    fixed_seed,
    parse_request,
    run_request,
)


@dataclasses.dataclass
class _Tokenizer:
    """Space-separated ids; ":" and "\\n" are the ids `colon` and `newline`; no EOD."""

    colon: int = 126
    newline: int = 127
    vocab_size: int = 128

    def tokenize(self, text: str):
        special = {":": [self.colon], "\n": [self.newline]}
        return special.get(text) or [int(x) for x in text.split()]

    def detokenize(self, ids):
        return " ".join(map(str, ids))


def _engine(tokenizer=None, use_kv_cache=True, vocab_size=128):
    return Engine(_model("gpt2"), tokenizer or _Tokenizer(), vocab_size, MAX_POS,
                  torch.Generator().manual_seed(0), use_kv_cache=use_kv_cache)


def _ids(text: str):
    return [int(x) for x in text.split()]


def test_top_p_schedule_is_megatrons_recurrence():
    top_p, want = 0.9, []
    for _ in range(40):  # Megatron's loop: sample, then decay and bound
        want.append(top_p)
        top_p = max(top_p * 0.93, 0.3)
    schedule = TopPSchedule(0.9, 0.93, 0.3, start=5)
    assert [schedule(p) for p in range(5, 45)] == want and schedule(2) == 0.9
    assert [TopPSchedule(0.8, 0.5, 0.0, 0)(p) for p in range(3)] == [0.8, 0.4, 0.2]


def _record_top_p(monkeypatch) -> dict:
    """top_p of every draw, by the seed of the drawing row's generator."""
    seen: dict = {}
    real = generate_mod.sample_next

    def record(logits, greedy, temperature, top_k, top_p, generator):
        seen.setdefault(generator.initial_seed(), []).append(top_p)
        return real(logits, greedy, temperature, top_k, top_p, generator)

    monkeypatch.setattr(generate_mod, "sample_next", record)
    return seen


def test_top_p_decays_per_position_of_the_batch(monkeypatch):
    """Prompts of 3 tokens (seed 10) and 1 token (seed 11): the short one draws from
    position 1 with top_p 0.9, 0.45, ... and the long one from position 3 with top_p
    already decayed twice; top_p_bound 0.1 stops the decay. --no-kv-cache (one prompt at
    a time) follows the same schedule; without top_p_decay top_p stays."""
    seen = _record_top_p(monkeypatch)
    body = {"prompts": ["4 9 1", "7"], "tokens_to_generate": 5, "top_p": 0.9,
            "top_p_decay": 0.5, "top_p_bound": 0.1, "random_seed": 10}
    want = {11: [0.9, 0.45, 0.225, 0.1125, 0.1], 10: [0.225, 0.1125, 0.1, 0.1, 0.1]}
    answers = []
    for use_kv_cache in (True, False):
        seen.clear()
        answers.append(run_request(_engine(use_kv_cache=use_kv_cache), parse_request(body)))
        assert seen == want, use_kv_cache
    assert answers[0] == answers[1]
    seen.clear()
    run_request(_engine(), parse_request(dict(body, top_p_decay=0.0)))
    assert seen == {11: [0.9] * 5, 10: [0.9] * 5}


def test_top_p_decayed_to_zero_draws_the_most_likely_token(monkeypatch):
    """top_p_decay 1e-300 takes top_p 0.5 to 5e-301 and then to 0.0 (float underflow, as
    Megatron's recurrence does; decay 0.5 gets there after 1075 tokens): the draws at top_p
    0 keep the most likely token (the limit of the decay), where the filter dropped every
    token and the request failed (NaN probabilities: HTTP 500)."""
    seen = _record_top_p(monkeypatch)
    body = {"prompts": ["4 9 1"], "tokens_to_generate": 6, "top_p": 0.5,
            "top_p_decay": 1e-300, "random_seed": 4}
    out = run_request(_engine(), parse_request(body))["text"][0]
    assert seen[4] == [0.5, 5e-301, 0.0, 0.0, 0.0, 0.0]
    head = " ".join(out.split()[:5])  # the prompt and the first two new tokens
    greedy = run_request(_engine(), parse_request({"prompts": [head], "top_k": 1,
                                                   "tokens_to_generate": 4}))["text"][0]
    assert greedy == out  # from the third new token on: the argmax


def _pair_it_would_draw(engine, body):
    """(a, b): two tokens the greedy answer of prompts[0] has in a row after its prompt."""
    prompt = _ids(body["prompts"][0])
    full = _ids(run_request(engine, parse_request(body))["text"][0])
    k = len(prompt) - 1
    return full[k], full[k + 1]


def _follows(seq, pair, start):
    return any(seq[i:i + 2] == list(pair) for i in range(start, len(seq) - 1))


def test_no_newline_after_colon(monkeypatch):
    """Name the model's own greedy pair (a, b) ':' and '\\n': with
    prevent_newline_after_colon no answer (batch, --no-kv-cache, beam search) has b right
    after a where it generated, and the first answer changes; without it b follows a."""
    body = {"prompts": ["4 9 1", "7 3"], "tokens_to_generate": 10, "top_k": 1}
    a, b = _pair_it_would_draw(_engine(), body)
    tok = _Tokenizer(colon=a, newline=b)
    plain = run_request(_engine(tok), parse_request(body))
    assert _follows(_ids(plain["text"][0]), (a, b), 2)
    rule = dict(body, prevent_newline_after_colon=True)
    for use_kv_cache in (True, False):
        out = run_request(_engine(tok, use_kv_cache), parse_request(rule))
        for prompt, text in zip(body["prompts"], out["text"]):
            assert not _follows(_ids(text), (a, b), len(_ids(prompt)) - 1), (text, a, b)
        assert out["text"][0] != plain["text"][0]
    beams = {"prompts": ["4 9 1"], "tokens_to_generate": 6, "beam_width": 3}
    assert any(_follows(_ids(t), (a, b), 2)
               for t in run_request(_engine(tok), parse_request(beams))["text"])
    out = run_request(_engine(tok), parse_request(dict(beams, prevent_newline_after_colon=True)))
    assert not any(_follows(_ids(t), (a, b), 2) for t in out["text"])


@dataclasses.dataclass
class _LineTokenizer(_Tokenizer):
    """_Tokenizer whose `newline` id decodes to "\\n"."""

    def detokenize(self, ids):
        return " ".join("\n" if i == self.newline else str(i) for i in ids)


@pytest.mark.parametrize("field", ["stop_on_eol", "stop_on_double_eol"])
def test_stop_on_eol_needs_a_newline_token(field):
    """With a tokenizer that spells a newline, stop_on_eol ends the answer at it; with one
    that has none (NullTokenizer's numbers) the request never stopped and said nothing:
    now it is refused by name."""
    body = {"prompts": ["4 9 1"], "tokens_to_generate": 6, "top_k": 1}
    first = _ids(run_request(_engine(), parse_request(body))["text"][0])[3]
    out = run_request(_engine(_LineTokenizer(newline=first)),
                      parse_request(dict(body, stop_on_eol=True)))
    assert out["text"] == ["4 9 1 \n"]
    with pytest.raises(RequestError, match=f"^{field}: this tokenizer \\(_Tokenizer\\) has "
                                           "no token holding a newline, so generation would "
                                           "never stop at one; leave it false$"):
        run_request(_engine(), parse_request(dict(body, **{field: True})))


def test_a_refused_request_draws_no_seed_on_rank_0():
    """fixed_seed (rank 0 at dp > 1, before the request goes to a replica) refuses what
    run_request refuses before its draw: stop_on_eol without a newline token drew the
    base seed and was then refused by the replica, so every later unseeded answer
    differed from the one a one-replica server gives."""
    engine = _engine()
    before = engine.generator.get_state()
    body = {"prompts": ["4 9 1"], "tokens_to_generate": 6, "stop_on_eol": True}
    with pytest.raises(RequestError, match="^stop_on_eol: this tokenizer"):
        fixed_seed(engine, parse_request(body))
    assert torch.equal(engine.generator.get_state(), before)
    assert fixed_seed(engine, parse_request(dict(body, stop_on_eol=False))).random_seed >= 0


def test_beam_request_with_and_without_the_cache():
    """A beam request's answer: beam_width hypotheses, best first, text = prompt +
    generated, scores as tools/beam_search.py gives them; --no-kv-cache the same beams."""
    body = {"prompts": ["4 9 1"], "tokens_to_generate": 6, "beam_width": 3,
            "stop_token": 5, "length_penalty": 0.5}
    engine = _engine()
    out = run_request(engine, parse_request(body))
    ref = run_request(_engine(use_kv_cache=False), parse_request(body))
    assert set(out) == {"text", "segments", "scores"} and len(out["text"]) == 3
    assert out["text"] == ref["text"] and out["segments"] == ref["segments"]
    assert out["scores"] == pytest.approx(ref["scores"], abs=1e-5)
    assert out["scores"] == sorted(out["scores"], reverse=True)
    hyps = beam_search(engine.model, [4, 9, 1], 3, 6, stop_token=5, length_penalty=0.5,
                       vocab_limit=128)
    assert out["text"] == [" ".join(map(str, [4, 9, 1] + ids)) for ids, _ in hyps]
    assert out["segments"] == [t.split(" ") for t in out["text"]]
    with pytest.raises(RequestError, match="beam_width 3 needs at least 2 x beam_width "
                                           "candidate tokens; the vocabulary has 5: "
                                           "pass a beam_width of at most 2"):
        run_request(_engine(vocab_size=5), parse_request(dict(body, prompts=["4 1"])))
