"""The request/response contract of tools/run_text_generation_server.py, apart from HTTP.

A request is Megatron-LM's `PUT /api` JSON object:

    prompts              list of 1..128 strings (required)
    tokens_to_generate   int >= 0, default 64
    temperature          number > 0, default 1.0
    top_k                int in [0, 1000], default 0 (off; 1 is greedy decoding)
    top_p                number in [0, 1], default 0.0 (off); top_k and top_p are exclusive
    top_p_decay          number in [0, 1], default 0.0 (off); needs top_p > 0
    top_p_bound          number in [0, top_p], default 0.0 (off); needs top_p > 0
    random_seed          int in [0, 2**64), or -1 (default): a base seed drawn from the
                         server's own generator (seeded by --seed at start, running on
                         across requests); prompts[i] samples with seed random_seed + i
    logprobs             bool, default false
    add_BOS              bool, default false: start each prompt with the end-of-document token
    stop_on_eol          bool, default false: stop after a token holding a newline
    stop_on_double_eol   bool, default false: stop after a blank line (either is refused
                         with a tokenizer that has no newline token, e.g. NullTokenizer:
                         it would never stop)
    prevent_newline_after_colon
                         bool, default false: never draw "\\n" right after ":"
    no_log               bool, default false: no request line on the server's stdout
    beam_width           int >= 1, or null (default): beam search (one prompt only)
    stop_token           int >= 0, default 50256 (GPT-2's end of document): ends a beam
    length_penalty       finite number, default 1: beam scores are divided by
                         (generated length) ** length_penalty; |length_penalty| at most
                         300 / ln(tokens_to_generate), so that stays a finite number

The answer is {"text": [prompt + generated text], "segments": [[token text, ...]]} (with a
SentencePiece tokenizer the pieces as Megatron-LM gives them: '\u2581the') and
"logprobs": [[log p(token | tokens before it) for every token after the first]] when
asked (tokens_to_generate 0 with logprobs scores the prompts), else null, as Megatron-LM's
answer has it (a client reading answer["logprobs"] gets None, not a KeyError).

The prompts of a request are generated together, as one batch, through tools/generate.py's
`generate_batch` and its key/value cache: every prompt is prefilled up to the shortest one,
then each model call advances every prompt by one position (a longer prompt feeds its own
tokens until they run out); a prompt ends on its own (end of document, stop_on_eol,
tokens_to_generate) and the batch when all have. Greedy answers (top_k 1) equal those of
one prompt at a time. Sampling is deterministic per prompt: prompts[i] draws from its own
generator seeded with random_seed + i, so a request with one prompt and random_seed S draws
exactly what `generate.py --seed S` draws, and prompts[i] of a batch what a one-prompt
request with seed S + i draws (up to float rounding of the probabilities). The
log-probabilities come from one full forward of all answers (padded on the right). With
--no-kv-cache the prompts run one after another instead, each recomputing its context for
every token (the reference: same seeds, same answers up to float rounding).

Measured on CPU (torch 2.13, 1 thread, fp32; random 6 layers, hidden 256, 8 heads, vocab
1024, 128 positions): 16 prompts of 23-39 tokens, 64 greedy tokens each, took 3.9-6.4 s one
prompt after another (`generate`, each with its cache) and 0.7-1.2 s as one batch
(`generate_batch`), the same tokens (six runs on a shared 2-core machine, hence the spread).

Like generate.py, tokens come from the tokenizer's vocabulary only (not the layout's
padding), log-probabilities are normalised over that vocabulary from the plain logits (no
temperature or filter), and generation stops at the end-of-document token. A prompt plus
tokens_to_generate must fit in --max-position-embeddings.

top_p decay (Megatron-LM 23.05's rule, tools/sampling_rules.py TopPSchedule): after each
position of the batch, counted from the shortest prompt's end, top_p becomes
top_p * top_p_decay and then at least top_p_bound (when > 0); every prompt of the request
follows that one schedule, --no-kv-cache too. prevent_newline_after_colon: in a sequence
whose last token is the tokenizer's first token of ":", the logit of its first token of
"\\n" is set to -1e10 before drawing (beam search too); the log-probabilities stay those of
the model.

Beam search (beam_width set; tools/beam_search.py, Megatron's algorithm): the one prompt
grows into beam_width beams scored by the sum of their log-probabilities (plain logits over
the tokenizer's vocabulary); a beam ends at stop_token (the stop token is not part of its
text), the search when no live beam can beat the finished ones or after tokens_to_generate.
The answer is {"text": [prompt + generated text], "segments": [[token text, ...]],
"scores": [sum of log-probabilities / length ** length_penalty]}, one entry per
hypothesis, best first, always beam_width of them. Megatron's beam search ignores the
sampling fields; here a request with beam_width and a non-default temperature, top_k,
top_p, top_p_decay, top_p_bound, random_seed, stop_on_eol or stop_on_double_eol is refused
(it would not do what it says), and so is logprobs true (Megatron's beam answer has no
log-probabilities) and tokens_to_generate 0. Without beam_width a non-default stop_token or
length_penalty is refused (Megatron ignores them there). The end-of-document token does not
end a beam unless it is the stop_token (Megatron's default 50256 is GPT-2's; give the
tokenizer's own for another; an id outside the vocabulary never ends a beam). A beam
request counts beam_width rows against --max-tokens-to-oom and needs a vocabulary of at
least 2 x beam_width tokens. Megatron returns each beam's whole padded row; here the text
ends where the beam ended. --no-kv-cache recomputes every beam per token (same beams);
with --decode-cuda-graph the beams are one batch of beam_width rows for the static decoder.

all_probs (older Megatron-LM servers) is refused unless false; any other field is refused
by name.
"""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/text_generation_api.py is a library module (the request handling of "
                     "the text generation server); run python "
                     "tools/run_text_generation_server.py --help")

import dataclasses
import math
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron.core.models.gpt.kv_cache import gather_vocab
from megatron.tokenizer import eod_or_none
from tools.beam_search import beam_search
from tools.generate import generate, generate_batch
from tools.sampling_rules import TopPSchedule

MAX_PROMPTS = 128
# |length_penalty| x ln(generated length) at most this: length ** length_penalty stays
# within [e**-300, e**300], so a beam's score is finite (float64 reaches e**709)
_MAX_LOG_DIVISOR = 300.0
STOP_TOKEN = 50256  # Megatron's default stop_token: GPT-2's end of document
# fields not implemented here, with the value that asks for nothing: all_probs, which
# clients written for older Megatron-LM servers still send (false)
NOT_SUPPORTED = {"all_probs": False}
# fields of older Megatron-LM servers, with the ones that replaced them
_RENAMED = {"sentences": "prompts", "max_len": "tokens_to_generate"}
# the sampling fields beam search does not read, with their defaults (refused otherwise)
_NOT_FOR_BEAMS = {"temperature": 1.0, "top_k": 0, "top_p": 0.0, "top_p_decay": 0.0,
                  "top_p_bound": 0.0, "random_seed": -1, "stop_on_eol": False,
                  "stop_on_double_eol": False}


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
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    random_seed: int = -1
    logprobs: bool = False
    add_BOS: bool = False  # noqa: N815 -- Megatron's field name
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    no_log: bool = False
    beam_width: Optional[int] = None  # None: sampling; else beam search over one prompt
    stop_token: int = STOP_TOKEN
    length_penalty: float = 1.0
    # not a JSON field (a client cannot send it): tokens_to_generate was left out, 64 taken
    default_tokens: bool = dataclasses.field(default=False, metadata={"internal": True})


_PIECE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest)
                if not f.metadata.get("internal"))
_BOOLS = ("logprobs", "add_BOS", "stop_on_eol", "stop_on_double_eol",
          "prevent_newline_after_colon", "no_log")


@dataclasses.dataclass
class Engine:
    """What a request runs on: the model (eval mode), its tokenizer, the tokenizer's
    vocabulary size, the longest sequence, the generator of unseeded requests, the
    request size limit, whether generation keeps a key/value cache, the tensor x
    pipeline-parallel runtime (None: one process), the static decoder whose CUDA graph the requests share
    (None: the eager cached step), and the lock that lets one request at a time use the
    model."""

    model: torch.nn.Module
    tokenizer: Any
    vocab_size: int
    max_len: int
    generator: torch.Generator
    max_tokens: int = 12000  # --max-tokens-to-oom: prompts x longest sequence per request
    use_kv_cache: bool = True  # False (--no-kv-cache): recompute the context per token
    runtime: Any = None  # under torchrun: the tp x pp Runtime (tools/generate_tp.py)
    decoder: Any = None  # a StaticDecoder (--decode-cuda-graph), reused across requests
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


# ------------------------------------------------------------------------ validation
def _shown(value: Any) -> str:
    """`value` as a message shows it: a JSON integer may have 4300 digits."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _int(body: dict, name: str, default: int, low: int, allowed: str) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{name} must be {allowed} (got {_shown(value)})")
    return value


def _number(body: dict, name: str, default: float, ok: Callable[[float], bool],
            allowed: str) -> float:
    value = body.get(name, default)
    try:  # a JSON integer past float's range (1e308) is no number a sampler can use
        number = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):
        number = None
    if not isinstance(value, (int, float)) or number is None or not ok(number):
        raise RequestError(f"{name} must be {allowed} (got {_shown(value)})")
    return number


def _seed(body: dict) -> int:
    seed = _int(body, "random_seed", -1, -1, "an integer >= 0, or -1 (unseeded)")
    if seed >= 2 ** 64:  # torch.Generator.manual_seed's range
        raise RequestError(f"random_seed must be below 2**64 = {2 ** 64} (got {_shown(seed)})")
    return seed


def _check_fields(body: Any) -> None:
    if not isinstance(body, dict):
        raise RequestError('the body must be a JSON object such as {"prompts": ["Hello"], '
                           '"tokens_to_generate": 32}')
    for name, use in _RENAMED.items():
        if name in body:
            raise RequestError(f"{name} is no longer a field (renamed by Megatron-LM): "
                               f"send {use} instead")
    unknown = sorted(set(body) - set(_FIELDS) - set(NOT_SUPPORTED))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; the fields are "
                           f"{', '.join(_FIELDS)}")
    for name, default in NOT_SUPPORTED.items():
        if body.get(name) not in (None, default):
            raise RequestError(f"{name} is not supported by this server; leave it out "
                               f"(or {default!r}) (got {_shown(body[name])})")
    for name in _BOOLS:
        if not isinstance(body.get(name, False), bool):
            raise RequestError(f"{name} must be true or false (got {_shown(body[name])})")


def _prompts(body: dict) -> List[str]:
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS or \
            not all(isinstance(p, str) for p in prompts):
        shown = repr(prompts) if len(repr(prompts)) <= 60 else repr(prompts)[:57] + "..."
        raise RequestError(f"prompts must be a list of 1 to {MAX_PROMPTS} strings "
                           f"(got {shown})")
    for i, prompt in enumerate(prompts):
        try:  # a JSON "\ud800" without its pair is no text: no tokenizer takes it
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(
                f"prompts[{i}] has a lone UTF-16 surrogate {prompt[exc.start]!r} at "
                f"character {exc.start} (a JSON \\u escape without its pair), which is not "
                "text: send the prompt as UTF-8, or a character beyond U+FFFF as both "
                "halves of its surrogate pair") from None
    return prompts


def _top_k_p(body: dict) -> Tuple[int, float]:
    top_k = _int(body, "top_k", 0, 0, "an integer from 0 to 1000 (0: off, 1: greedy)")
    if top_k > 1000:
        raise RequestError(f"top_k must be an integer from 0 to 1000 (0: off, 1: greedy) "
                           f"(got {_shown(top_k)})")
    top_p = _number(body, "top_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)")
    if top_k > 0 and top_p > 0:
        raise RequestError(f"top_k ({top_k}) and top_p ({top_p}) cannot both be set: set "
                           "one of them to 0")
    return top_k, top_p


def _top_p_decay(body: dict, top_p: float) -> Dict[str, float]:
    """top_p_decay and top_p_bound: both shape the top_p schedule, so need top_p > 0."""
    decay = _number(body, "top_p_decay", 0.0, lambda v: 0 <= v <= 1,
                    "a number in [0, 1] (0: off)")
    bound = _number(body, "top_p_bound", 0.0, lambda v: 0 <= v <= 1,
                    "a number in [0, top_p] (0: off)")
    for name, value in (("top_p_decay", decay), ("top_p_bound", bound)):
        if value and not top_p:
            raise RequestError(f"{name} needs top_p: it changes top_p after each token, and "
                               f"top_p is 0 (off); set top_p > 0 or leave {name} out (got "
                               f"{value})")
    if bound > top_p:
        raise RequestError(f"top_p_bound must be a number in [0, top_p] = [0, {top_p}] "
                           f"(got {bound})")
    return {"top_p_decay": decay, "top_p_bound": bound}


def _check_penalty_range(penalty: float, tokens: int) -> None:
    """Refuse a length_penalty for which (generated length) ** length_penalty, for a length
    up to `tokens`, leaves the range where a beam's score is a finite float (Megatron's
    server fails there with an OverflowError or ZeroDivisionError)."""
    limit = _MAX_LOG_DIVISOR / math.log(tokens) if tokens > 1 else math.inf
    if abs(penalty) > limit:
        raise RequestError(
            f"length_penalty must be in [-{limit:.4g}, {limit:.4g}] with tokens_to_generate "
            f"{_shown(tokens)}: a beam's score is divided by (generated length) ** length_penalty, "
            f"which must stay a finite number (got {penalty!r}); the default is 1")


def _beam_fields(body: dict, num_prompts: int, tokens: int) -> Dict[str, Any]:
    """beam_width, stop_token and length_penalty, checked with what beam search reads:
    one prompt, tokens to generate, no sampling field (see the module docstring)."""
    stop = _int(body, "stop_token", STOP_TOKEN, 0, f"an integer token id >= 0 (default "
                f"{STOP_TOKEN}, GPT-2's end of document)")
    penalty = _number(body, "length_penalty", 1.0, math.isfinite, "a finite number")
    out = {"stop_token": stop, "length_penalty": penalty}
    if body.get("beam_width") is None:
        for name, value, default in (("stop_token", stop, STOP_TOKEN),
                                     ("length_penalty", penalty, 1.0)):
            if value != default:
                raise RequestError(f"{name} is read by beam search only: set beam_width "
                                   f"too, or leave {name} out (got {_shown(body[name])})")
        return out
    width = _int(body, "beam_width", None, 1, "an integer >= 1, or null (no beam search)")
    if num_prompts != 1:
        raise RequestError(f"beam_width: beam search takes exactly one prompt (got "
                           f"{num_prompts}); send one request per prompt")
    if body.get("logprobs") is True:
        raise RequestError("logprobs is not returned by beam search (its answer has text, "
                           "segments and scores, as Megatron's): leave logprobs out or "
                           "drop beam_width")
    if tokens < 1:
        raise RequestError("beam search needs tokens_to_generate >= 1 (got 0)")
    _check_penalty_range(penalty, tokens)
    for name, default in _NOT_FOR_BEAMS.items():
        if body.get(name, default) != default:
            raise RequestError(f"{name} is not used by beam search (it follows the most "
                               f"likely tokens; Megatron ignores {name} there): leave it out "
                               f"or {default!r} with beam_width (got {_shown(body[name])})")
    return {**out, "beam_width": width}


def parse_request(body: Any) -> GenerationRequest:
    """The decoded JSON body as a GenerationRequest; RequestError names what is wrong."""
    _check_fields(body)
    prompts = _prompts(body)
    top_k, top_p = _top_k_p(body)
    tokens = _int(body, "tokens_to_generate", 64, 0, "an integer >= 0")
    beam = _beam_fields(body, len(prompts), tokens)
    if tokens == 0 and body.get("logprobs") is not True:
        raise RequestError("tokens_to_generate 0 only scores the prompts: set logprobs true "
                           "(or ask for tokens)")
    return GenerationRequest(
        prompts=prompts,
        tokens_to_generate=tokens,
        temperature=_number(body, "temperature", 1.0, lambda v: 0 < v <= 100,
                            "a number > 0 and <= 100"),
        top_k=top_k, top_p=top_p, **_top_p_decay(body, top_p),
        random_seed=_seed(body), **beam,
        default_tokens="tokens_to_generate" not in body,
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
        eod = eod_or_none(engine.tokenizer)
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
        default = " (the default: the request has none)" if req.default_tokens else ""
        raise RequestError(f"{where} has {len(ids)} tokens; with tokens_to_generate "
                           f"{_shown(req.tokens_to_generate)}{default} that makes {_shown(total)}, over the "
                           f"model's {engine.max_len} positions: shorten the prompt or lower "
                           "tokens_to_generate")
    return ids


def has_newline_token(tokenizer) -> bool:
    """Whether the tokenizer spells a newline: a token of "\\n" decodes (alone) to text
    holding one. NullTokenizer's ids are numbers and never do."""
    try:
        ids = tokenizer.tokenize("\n")
    except ValueError:
        return False
    return any("\n" in tokenizer.detokenize([i]) for i in ids)


def _stop(engine: Engine, req: GenerationRequest) -> Optional[Callable[[List[int]], bool]]:
    """generate()'s `stop` for stop_on_eol / stop_on_double_eol, or None; RequestError
    when the tokenizer has no newline token (the request would never stop at one)."""
    field = ("stop_on_double_eol" if req.stop_on_double_eol else
             "stop_on_eol" if req.stop_on_eol else None)
    if field is None:
        return None
    if not has_newline_token(engine.tokenizer):
        name = getattr(engine.tokenizer, "name", type(engine.tokenizer).__name__)
        raise RequestError(f"{field}: this tokenizer ({name}) has no token holding a newline, "
                           "so generation would never stop at one; leave it false")
    return eol_stop(engine.tokenizer, double=req.stop_on_double_eol)


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
    return batch_token_logprobs(model, [ids], vocab_size)[0]


@torch.no_grad()
def batch_token_logprobs(model, seqs: List[List[int]], vocab_size: int) -> List[List[float]]:
    """`token_logprobs` of each sequence, from ONE forward of them all: shorter sequences
    are padded on the right (id 0), which no real position sees (causal attention: a
    position attends to itself and the positions before it) and whose scores are dropped.
    Equal to one forward per sequence up to float rounding (fp32: within 1e-5). A
    tensor-parallel model's logits are all-gathered over the vocabulary first, a pipeline's
    come from its last stage (every rank of the model calls this with the same sequences)."""
    longest = max(len(ids) for ids in seqs)
    if longest < 2:
        return [[] for _ in seqs]
    device = next(model.parameters()).device
    tokens = torch.tensor([ids + [0] * (longest - len(ids)) for ids in seqs],
                          dtype=torch.long, device=device)
    logits = gather_vocab(model, model(tokens))  # the whole vocabulary under TP too
    logp = torch.log_softmax(logits[:, :-1, :vocab_size].float(), dim=-1)
    scores = logp.gather(2, tokens[:, 1:, None])[..., 0]  # [b, longest - 1]
    return [scores[i, :len(ids) - 1].tolist() for i, ids in enumerate(seqs)]


def row_generators(engine: Engine, req: GenerationRequest, rows: int) -> List[torch.Generator]:
    """One generator per prompt: prompts[i] draws from a generator seeded with
    random_seed + i (mod 2**64), whatever the other prompts are or when they end. Without
    random_seed the base seed is drawn from the server's generator (one draw per request)."""
    seed = req.random_seed
    if seed < 0:
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=engine.generator))
    return [torch.Generator().manual_seed((seed + i) % 2 ** 64) for i in range(rows)]


def _generate_all(engine: Engine, req: GenerationRequest,
                  all_ids: List[List[int]]) -> List[List[int]]:
    """The new ids of every prompt: together as one batch through the key/value cache
    (tools/generate.py generate_batch), or, with --no-kv-cache, one prompt after another
    recomputing the context for every token (the reference; same seeding per prompt)."""
    stop = _stop(engine, req)
    top_p: Any = req.top_p if req.top_p > 0 else 1.0
    if req.top_p > 0 and req.top_p_decay > 0:  # one schedule, from the shortest prompt's end
        top_p = TopPSchedule(req.top_p, req.top_p_decay, req.top_p_bound,
                             min(len(ids) for ids in all_ids))
    kw = dict(greedy=req.top_k == 1, temperature=req.temperature, top_k=req.top_k,
              top_p=top_p, eod=eod_or_none(engine.tokenizer),
              vocab_limit=engine.vocab_size, stop=stop, forbid=_forbid(engine, req))
    gens = row_generators(engine, req, len(all_ids))
    if engine.use_kv_cache:
        return generate_batch(engine.model, all_ids, req.tokens_to_generate,
                              generators=gens, decoder=engine.decoder, **kw)
    return [generate(engine.model, ids, req.tokens_to_generate, generator=gen,
                     use_cache=False, **kw) for ids, gen in zip(all_ids, gens)]


def newline_after_colon(tokenizer) -> Tuple[int, int]:
    """(the first token id of ":", that of "\\n") as the tokenizer spells each alone: the
    pair prevent_newline_after_colon forbids (Megatron's rule, first ids included)."""
    try:
        colon, newline = tokenizer.tokenize(":"), tokenizer.tokenize("\n")
    except ValueError as exc:
        raise RequestError(f"prevent_newline_after_colon: this tokenizer cannot spell ':' "
                           f"and '\\n' ({exc}); leave it false") from None
    if not colon or not newline:
        raise RequestError("prevent_newline_after_colon: this tokenizer spells ':' or '\\n' "
                           "as no token; leave it false")
    return colon[0], newline[0]


def _forbid(engine: Engine, req: GenerationRequest) -> Optional[Tuple[int, int]]:
    return newline_after_colon(engine.tokenizer) if req.prevent_newline_after_colon else None


def _run_beams(engine: Engine, req: GenerationRequest, ids: List[int]) -> Dict[str, list]:
    """The beam search answer of a one-prompt request: text, segments, scores."""
    if engine.vocab_size < 2 * req.beam_width:
        raise RequestError(f"beam_width {req.beam_width} needs at least 2 x beam_width "
                           f"candidate tokens; the vocabulary has {engine.vocab_size}: "
                           f"pass a beam_width of at most {engine.vocab_size // 2}")
    hyps = beam_search(engine.model, ids, req.beam_width, req.tokens_to_generate,
                       stop_token=req.stop_token, length_penalty=req.length_penalty,
                       vocab_limit=engine.vocab_size, use_cache=engine.use_kv_cache,
                       decoder=engine.decoder, forbid=_forbid(engine, req))
    tok, full = engine.tokenizer, [ids + new for new, _ in hyps]
    return {"text": [tok.detokenize(seq) for seq in full],
            "segments": [token_segments(tok, seq) for seq in full],
            "scores": [score for _, score in hyps]}


def _check_size(engine: Engine, req: GenerationRequest, all_ids: List[List[int]]) -> None:
    """RequestError when the request's rows x longest sequence pass --max-tokens-to-oom (a
    beam request has beam_width rows)."""
    longest = max(len(ids) for ids in all_ids) + req.tokens_to_generate
    rows = (f"beam_width {_shown(req.beam_width)} x (prompt" if req.beam_width is not None else
            f"{len(all_ids)} prompts x (longest prompt")
    total = (req.beam_width or len(all_ids)) * longest
    if total > engine.max_tokens:
        raise RequestError(f"too many tokens: {rows} + tokens_to_generate) = {_shown(total)}, over "
                           f"the server's --max-tokens-to-oom {engine.max_tokens}: send "
                           "fewer prompts or beams, lower tokens_to_generate, or restart the "
                           "server with a larger --max-tokens-to-oom")


def token_segments(tokenizer, ids: List[int]) -> List[str]:
    """The "segments" of a sequence, one string per token, as Megatron-LM gives them: a
    SentencePiece tokenizer's pieces as the model spells them ('\u2581the': the word
    boundary kept, which a piece decoded alone loses), else each token decoded alone."""
    if getattr(tokenizer, "name", None) in _PIECE_TOKENIZERS:
        return [tokenizer.decoder[t] for t in ids]
    return [tokenizer.detokenize([t]) for t in ids]


def fixed_seed(engine: Engine, req: GenerationRequest) -> GenerationRequest:
    """`req` checked as run_request checks it (RequestError: its prompts do not tokenize or
    pass --max-tokens-to-oom, or the tokenizer cannot spell what stop_on_eol /
    prevent_newline_after_colon need) and, when it would draw its base seed from the
    server's generator, with that draw made now as its random_seed: run anywhere
    afterwards (another data-parallel replica), it answers as run_request would have
    answered it now (a request refused draws nothing, as in run_request)."""
    all_ids = [_prompt_ids(engine, i, p, req) for i, p in enumerate(req.prompts)]
    _check_size(engine, req, all_ids)
    _stop(engine, req)  # run_request's other checks before its draw
    _forbid(engine, req)
    if req.beam_width is not None or req.random_seed >= 0:
        return req
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=engine.generator))
    return dataclasses.replace(req, random_seed=seed)


def run_request(engine: Engine, req: GenerationRequest) -> Dict[str, Optional[list]]:
    """The response object of a validated request (call it holding engine.lock).
    RequestError when a prompt does not tokenize or does not fit."""
    all_ids = [_prompt_ids(engine, i, p, req) for i, p in enumerate(req.prompts)]
    _check_size(engine, req, all_ids)
    if req.beam_width is not None:
        return _run_beams(engine, req, all_ids[0])
    tok = engine.tokenizer
    full = [ids + new for ids, new in zip(all_ids, _generate_all(engine, req, all_ids))]
    out: Dict[str, Optional[list]] = {"text": [tok.detokenize(ids) for ids in full],
                                      "segments": [token_segments(tok, ids) for ids in full],
                                      "logprobs": None}  # null unless asked, as Megatron's
    if req.logprobs and engine.use_kv_cache:
        out["logprobs"] = batch_token_logprobs(engine.model, full, engine.vocab_size)
    elif req.logprobs:  # --no-kv-cache, the reference: one forward per answer
        out["logprobs"] = [token_logprobs(engine.model, ids, engine.vocab_size)
                           for ids in full]
    return out


__all__ = ["MAX_PROMPTS", "NOT_SUPPORTED", "STOP_TOKEN", "Engine", "GenerationRequest",
           "RequestError", "batch_token_logprobs", "eol_stop", "fixed_seed",
           "has_newline_token", "newline_after_colon", "parse_request", "row_generators", "run_request", "token_logprobs",
           "token_segments"]
