"""The request/response contract of tools/run_text_generation_server.py, apart from HTTP.

A request is Megatron-LM's `PUT /api` JSON object:

    prompts              list of 1..128 strings (required)
    tokens_to_generate   int >= 0, default 64
    temperature          number > 0, default 1.0
    top_k                int >= 0, default 0 (off; 1 is greedy decoding)
    top_p                number in [0, 1], default 0.0 (off); top_k and top_p are exclusive
    random_seed          int >= 0, or -1 (default): the server's own generator, seeded by
                         --seed at start and running on across requests
    logprobs             bool, default false
    add_BOS              bool, default false: start each prompt with the end-of-document token
    stop_on_eol          bool, default false: stop after a token holding a newline
    stop_on_double_eol   bool, default false: stop after a blank line
    no_log               bool, default false: no request line on the server's stdout

The answer is {"text": [prompt + generated text], "segments": [[token text, ...]]} and,
when asked, "logprobs": [[log p(token | tokens before it) for every token after the
first]] (tokens_to_generate 0 with logprobs scores the prompts). Prompts run one after
another through tools/generate.py's `generate` (with its key/value cache unless the server
was started with --no-kv-cache; the log-probabilities come from one full forward of each
answer), all drawing from ONE generator: a request
with one prompt and random_seed S draws exactly what `generate.py --seed S` draws. Like
generate.py, tokens come from the tokenizer's vocabulary only (not the layout's padding),
log-probabilities are normalised over that vocabulary from the plain logits (no temperature
or filter), and generation stops at the end-of-document token. A prompt plus
tokens_to_generate must fit in --max-position-embeddings.

Megatron's other request fields (beam search, top_p decay, stop_token, ...) are refused
unless they hold their default; any other field is refused by name.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from tools.generate import generate

MAX_PROMPTS = 128
# Megatron-LM fields not implemented here, with the values that ask for nothing: Megatron's
# defaults (stop_token 50256, GPT-2's end of document, is read by beam search only)
NOT_SUPPORTED = {"top_p_decay": 0.0, "top_p_bound": 0.0, "prevent_newline_after_colon": False,
                 "beam_width": None, "stop_token": 50256, "length_penalty": 1}


class RequestError(ValueError):
    """A bad request (HTTP 400); the message names the field and the values it accepts."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One validated PUT /api request (field names as in the JSON)."""

    prompts: List[str]
    tokens_to_generate: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    random_seed: int = -1
    logprobs: bool = False
    add_BOS: bool = False  # noqa: N815 -- Megatron's field name
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    no_log: bool = False


_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))
_BOOLS = ("logprobs", "add_BOS", "stop_on_eol", "stop_on_double_eol", "no_log")


@dataclasses.dataclass
class Engine:
    """What a request runs on: the model (eval mode), its tokenizer, the tokenizer's
    vocabulary size, the longest sequence, the generator of unseeded requests, the
    request size limit, whether generation keeps a key/value cache, and the lock that
    lets one request at a time use the model."""

    model: torch.nn.Module
    tokenizer: Any
    vocab_size: int
    max_len: int
    generator: torch.Generator
    max_tokens: int = 12000  # --max-tokens-to-oom: prompts x longest sequence per request
    use_kv_cache: bool = True  # False (--no-kv-cache): recompute the context per token
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


# ------------------------------------------------------------------------ validation
def _int(body: dict, name: str, default: int, low: int, allowed: str) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{name} must be {allowed} (got {value!r})")
    return value


def _number(body: dict, name: str, default: float, ok: Callable[[float], bool],
            allowed: str) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise RequestError(f"{name} must be {allowed} (got {value!r})")
    return float(value)


def _check_fields(body: Any) -> None:
    if not isinstance(body, dict):
        raise RequestError('the body must be a JSON object such as {"prompts": ["Hello"], '
                           '"tokens_to_generate": 32}')
    unknown = sorted(set(body) - set(_FIELDS) - set(NOT_SUPPORTED))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; the fields are "
                           f"{', '.join(_FIELDS)}")
    for name, default in NOT_SUPPORTED.items():
        if body.get(name) not in (None, default):
            raise RequestError(f"{name} is not supported by this server; leave it out "
                               f"(or {default!r}) (got {body[name]!r})")
    for name in _BOOLS:
        if not isinstance(body.get(name, False), bool):
            raise RequestError(f"{name} must be true or false (got {body[name]!r})")


def parse_request(body: Any) -> GenerationRequest:
    """The decoded JSON body as a GenerationRequest; RequestError names what is wrong."""
    _check_fields(body)
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS or \
            not all(isinstance(p, str) for p in prompts):
        shown = repr(prompts) if len(repr(prompts)) <= 60 else repr(prompts)[:57] + "..."
        raise RequestError(f"prompts must be a list of 1 to {MAX_PROMPTS} strings "
                           f"(got {shown})")
    top_k = _int(body, "top_k", 0, 0, "an integer from 0 to 1000 (0: off, 1: greedy)")
    if top_k > 1000:
        raise RequestError(f"top_k must be an integer from 0 to 1000 (0: off, 1: greedy) "
                           f"(got {top_k})")
    top_p = _number(body, "top_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)")
    if top_k > 0 and top_p > 0:
        raise RequestError(f"top_k ({top_k}) and top_p ({top_p}) cannot both be set: set "
                           "one of them to 0")
    tokens = _int(body, "tokens_to_generate", 64, 0, "an integer >= 0")
    if tokens == 0 and body.get("logprobs") is not True:
        raise RequestError("tokens_to_generate 0 only scores the prompts: set logprobs true "
                           "(or ask for tokens)")
    return GenerationRequest(
        prompts=prompts,
        tokens_to_generate=tokens,
        temperature=_number(body, "temperature", 1.0, lambda v: 0 < v <= 100,
                            "a number > 0 and <= 100"),
        top_k=top_k, top_p=top_p,
        random_seed=_int(body, "random_seed", -1, -1, "an integer >= 0, or -1 (unseeded)"),
        **{name: body.get(name, False) for name in _BOOLS})


# ------------------------------------------------------------------------ generation
def _prompt_ids(engine: Engine, index: int, prompt: str, req: GenerationRequest) -> List[int]:
    """The token ids of prompts[index] (after the BOS token with add_BOS), checked."""
    where = f"prompts[{index}] ({prompt[:40]!r})"
    try:
        ids = engine.tokenizer.tokenize(prompt) if prompt else []
    except ValueError as exc:
        raise RequestError(f"{where}: {exc}") from None
    if req.add_BOS:
        eod = getattr(engine.tokenizer, "eod", None)
        if eod is None:
            raise RequestError("add_BOS needs an end-of-document token, and this tokenizer "
                               "has none: leave add_BOS false")
        ids = [eod] + ids
    if not ids:
        raise RequestError(f"prompts[{index}] is empty: give text, or set add_BOS true to "
                           "start from the end-of-document token")
    bad = [i for i in ids if not 0 <= i < engine.vocab_size]
    if bad:
        raise RequestError(f"{where}: token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {engine.vocab_size})")
    total = len(ids) + req.tokens_to_generate
    if total > engine.max_len:
        raise RequestError(f"{where} has {len(ids)} tokens; with tokens_to_generate "
                           f"{req.tokens_to_generate} that makes {total}, over the model's "
                           f"{engine.max_len} positions: shorten the prompt or lower "
                           "tokens_to_generate")
    return ids


def eol_stop(tokenizer, double: bool) -> Callable[[List[int]], bool]:
    """generate()'s `stop`: True after a token whose text holds a newline or, with
    `double`, after a blank line (a token holding two newlines, or a newline token that
    follows a token ending with one)."""
    def stop(ids: List[int]) -> bool:
        last = tokenizer.detokenize(ids[-1:])
        if "\n\n" in last or (not double and "\n" in last):
            return True
        return double and last.startswith("\n") and len(ids) > 1 and \
            tokenizer.detokenize(ids[-2:-1]).endswith("\n")
    return stop


@torch.no_grad()
def token_logprobs(model, ids: List[int], vocab_size: int) -> List[float]:
    """log p(ids[i] | ids[:i]) for i = 1 .. len(ids) - 1, in one forward pass, normalised
    over the first `vocab_size` logits (the tokenizer's vocabulary)."""
    if len(ids) < 2:
        return []
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    logp = torch.log_softmax(model(tokens)[0, :-1, :vocab_size].float(), dim=-1)
    return logp.gather(1, tokens[0, 1:, None])[:, 0].tolist()


def run_request(engine: Engine, req: GenerationRequest) -> Dict[str, list]:
    """The response object of a validated request (call it holding engine.lock).
    RequestError when a prompt does not tokenize or does not fit."""
    all_ids = [_prompt_ids(engine, i, p, req) for i, p in enumerate(req.prompts)]
    total = len(all_ids) * (max(len(ids) for ids in all_ids) + req.tokens_to_generate)
    if total > engine.max_tokens:
        raise RequestError(f"too many tokens: {len(all_ids)} prompts x (longest prompt + "
                           f"tokens_to_generate) = {total}, over the server's "
                           f"--max-tokens-to-oom {engine.max_tokens}: send fewer prompts, "
                           "lower tokens_to_generate, or restart the server with a larger "
                           "--max-tokens-to-oom")
    gen = (torch.Generator().manual_seed(req.random_seed) if req.random_seed >= 0
           else engine.generator)
    stop: Optional[Callable[[List[int]], bool]] = None
    if req.stop_on_eol or req.stop_on_double_eol:
        stop = eol_stop(engine.tokenizer, double=req.stop_on_double_eol)
    tok = engine.tokenizer
    out: Dict[str, list] = {"text": [], "segments": []}
    if req.logprobs:
        out["logprobs"] = []
    for ids in all_ids:
        new = generate(engine.model, ids, req.tokens_to_generate, greedy=req.top_k == 1,
                       temperature=req.temperature, top_k=req.top_k,
                       top_p=req.top_p if req.top_p > 0 else 1.0, generator=gen,
                       eod=getattr(tok, "eod", None), vocab_limit=engine.vocab_size,
                       stop=stop, use_cache=engine.use_kv_cache)
        full = ids + new
        out["text"].append(tok.detokenize(full))
        out["segments"].append([tok.detokenize([t]) for t in full])
        if req.logprobs:
            out["logprobs"].append(token_logprobs(engine.model, full, engine.vocab_size))
    return out


__all__ = ["MAX_PROMPTS", "NOT_SUPPORTED", "Engine", "GenerationRequest", "RequestError",
           "eol_stop", "parse_request", "run_request", "token_logprobs"]
