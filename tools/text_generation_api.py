"""The request/response contract of tools/run_text_generation_server.py, apart from HTTP.

A request is Megatron-LM's `PUT /api` JSON object:

    prompts              list of 1..128 strings (required)
    tokens_to_generate   int >= 0, default 64
    temperature          number > 0, default 1.0
    top_k                int >= 0, default 0 (off; 1 is greedy decoding)
    top_p                number in [0, 1], default 0.0 (off); top_k and top_p are exclusive
    random_seed          int in [0, 2**64), or -1 (default): a base seed drawn from the
                         server's own generator (seeded by --seed at start, running on
                         across requests); prompts[i] samples with seed random_seed + i
    logprobs             bool, default false
    add_BOS              bool, default false: start each prompt with the end-of-document token
    stop_on_eol          bool, default false: stop after a token holding a newline
    stop_on_double_eol   bool, default false: stop after a blank line
    no_log               bool, default false: no request line on the server's stdout

The answer is {"text": [prompt + generated text], "segments": [[token text, ...]]} (with a
SentencePiece tokenizer the pieces as Megatron-LM gives them: '\u2581the') and,
when asked, "logprobs": [[log p(token | tokens before it) for every token after the
first]] (tokens_to_generate 0 with logprobs scores the prompts).

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

Megatron's other request fields (beam search, top_p decay, stop_token, ...) are refused
unless they hold their default; any other field is refused by name.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.core.models.gpt.kv_cache import gather_vocab
from tools.generate import generate, generate_batch

MAX_PROMPTS = 128
# Megatron-LM fields not implemented here, with the values that ask for nothing: Megatron's
# defaults (stop_token 50256, GPT-2's end of document, is read by beam search only), and
# all_probs, which clients written for older Megatron-LM servers still send (false)
NOT_SUPPORTED = {"top_p_decay": 0.0, "top_p_bound": 0.0, "prevent_newline_after_colon": False,
                 "beam_width": None, "stop_token": 50256, "length_penalty": 1,
                 "all_probs": False}


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


_PIECE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))
_BOOLS = ("logprobs", "add_BOS", "stop_on_eol", "stop_on_double_eol", "no_log")


@dataclasses.dataclass
class Engine:
    """What a request runs on: the model (eval mode), its tokenizer, the tokenizer's
    vocabulary size, the longest sequence, the generator of unseeded requests, the
    request size limit, whether generation keeps a key/value cache, the tensor-parallel
    runtime (None: one process), the static decoder whose CUDA graph the requests share
    (None: the eager cached step), and the lock that lets one request at a time use the
    model."""

    model: torch.nn.Module
    tokenizer: Any
    vocab_size: int
    max_len: int
    generator: torch.Generator
    max_tokens: int = 12000  # --max-tokens-to-oom: prompts x longest sequence per request
    use_kv_cache: bool = True  # False (--no-kv-cache): recompute the context per token
    runtime: Any = None  # under torchrun: the tensor-parallel Runtime (tools/generate_tp.py)
    decoder: Any = None  # a StaticDecoder (--decode-cuda-graph), reused across requests
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


def _seed(body: dict) -> int:
    seed = _int(body, "random_seed", -1, -1, "an integer >= 0, or -1 (unseeded)")
    if seed >= 2 ** 64:  # torch.Generator.manual_seed's range
        raise RequestError(f"random_seed must be below 2**64 = {2 ** 64} (got {seed})")
    return seed


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
        random_seed=_seed(body),
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
    return batch_token_logprobs(model, [ids], vocab_size)[0]


@torch.no_grad()
def batch_token_logprobs(model, seqs: List[List[int]], vocab_size: int) -> List[List[float]]:
    """`token_logprobs` of each sequence, from ONE forward of them all: shorter sequences
    are padded on the right (id 0), which no real position sees (causal attention: a
    position attends to itself and the positions before it) and whose scores are dropped.
    Equal to one forward per sequence up to float rounding (fp32: within 1e-5). A
    tensor-parallel model's logits are all-gathered over the vocabulary first (every rank
    of its group calls this with the same sequences)."""
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
    stop: Optional[Callable[[List[int]], bool]] = None
    if req.stop_on_eol or req.stop_on_double_eol:
        stop = eol_stop(engine.tokenizer, double=req.stop_on_double_eol)
    kw = dict(greedy=req.top_k == 1, temperature=req.temperature, top_k=req.top_k,
              top_p=req.top_p if req.top_p > 0 else 1.0,
              eod=getattr(engine.tokenizer, "eod", None), vocab_limit=engine.vocab_size,
              stop=stop)
    gens = row_generators(engine, req, len(all_ids))
    if engine.use_kv_cache:
        return generate_batch(engine.model, all_ids, req.tokens_to_generate,
                              generators=gens, decoder=engine.decoder, **kw)
    return [generate(engine.model, ids, req.tokens_to_generate, generator=gen,
                     use_cache=False, **kw) for ids, gen in zip(all_ids, gens)]


def token_segments(tokenizer, ids: List[int]) -> List[str]:
    """The "segments" of a sequence, one string per token, as Megatron-LM gives them: a
    SentencePiece tokenizer's pieces as the model spells them ('\u2581the': the word
    boundary kept, which a piece decoded alone loses), else each token decoded alone."""
    if getattr(tokenizer, "name", None) in _PIECE_TOKENIZERS:
        return [tokenizer.decoder[t] for t in ids]
    return [tokenizer.detokenize([t]) for t in ids]


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
    tok = engine.tokenizer
    full = [ids + new for ids, new in zip(all_ids, _generate_all(engine, req, all_ids))]
    out: Dict[str, list] = {"text": [tok.detokenize(ids) for ids in full],
                            "segments": [token_segments(tok, ids) for ids in full]}
    if req.logprobs and engine.use_kv_cache:
        out["logprobs"] = batch_token_logprobs(engine.model, full, engine.vocab_size)
    elif req.logprobs:  # --no-kv-cache, the reference: one forward per answer
        out["logprobs"] = [token_logprobs(engine.model, ids, engine.vocab_size)
                           for ids in full]
    return out


__all__ = ["MAX_PROMPTS", "NOT_SUPPORTED", "Engine", "GenerationRequest", "RequestError",
           "batch_token_logprobs", "eol_stop", "parse_request", "row_generators",
           "run_request", "token_logprobs", "token_segments"]
