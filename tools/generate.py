#!/usr/bin/env python
"""Generate text from a checkpoint written by pretrain_gpt.py (any tensor/pipeline layout).

    python tools/generate.py --load CKPT_DIR --prompt "The meaning of life" --max-new-tokens 40
    python tools/generate.py --load CKPT_DIR --prompt-ids 464,3616,286 --greedy
    python tools/generate.py --load CKPT_DIR --prompt "..." --temperature 0.8 --top-p 0.9 --seed 7
    python tools/generate.py --load CKPT_DIR --prompt-file prompts.txt --json

--prompt-file: one prompt per non-empty line, generated together as one batch through the
key/value cache (`generate_batch`); prompt i (counting from 0) draws from --seed + i, so its
answer equals `--prompt` with that seed, whatever the other lines are. The file is read
before the model loads; a prompt the tokenizer refuses stops every rank, and under
torchrun either is printed once (tools/generate_prompts.py).

The model is rebuilt from the `args` stored in the checkpoint (through megatron.arguments'
config builder) as ONE process: tensor-parallel shards are concatenated along each
parameter's partition dimension (blocks of a strided parameter, the SwiGLU [gate; up] fc1,
interleaved back; the fused QKV weight is laid out per query group, so a plain
concatenation restores it) and pipeline stages (and virtual stages) are put back in layer
order. Text prompts need the checkpoint's tokenizer (its files can be given again with
--vocab-file/--merge-file/--tokenizer-model; other files than the saved ones, where those
still exist, or another --tokenizer-type are warned); NullTokenizer text is space-separated
ids.
Tokens are drawn from the tokenizer's vocabulary only, so a --seed gives the same text
whatever layout padded the vocabulary (without a tokenizer: the padded vocabulary).

Decoding keeps a key/value cache (megatron/core/models/gpt/kv_cache.py): the prompt runs
through the model once, then each new token alone. On CUDA that one-token step runs at
static shapes (a preallocated cache, the position in a device tensor) and is captured once
as a CUDA graph, then replayed per token (megatron/core/models/gpt/static_decode.py):
one launch instead of ~100 small kernels. --decode-cuda-graph auto (default: on where it
can be captured -- CUDA, NCCL under tensor parallelism, MoE layers only with the
grouped GEMM that stays on the device: bf16 on sm90/sm100), on (an error names
why it cannot) or off (the eager step). --no-kv-cache recomputes the whole sequence for
every new token instead (the reference; same tokens, logits equal up to float rounding).
Past --max-position-embeddings the context is cut to the last max_len tokens (a note on
stderr says from which token on);
the cached keys cannot slide with it (their positions would change), so from there on
every token recomputes that window, with or without the cache. It stops after
--max-new-tokens or at the end-of-document token (unless --no-stop-at-eod). Prints the
prompt and generated ids and text (--json: one JSON line instead); the generated text is
what the new tokens add to the prompt's text, so prompt text + generated text is the text
of the whole sequence (a SentencePiece continuation keeps the space that starts its first
word, NullTokenizer's the space before its first id).

`generate_batch` (the text generation server's path) decodes several prompts together
through one cache, one model call per position for all of them; per prompt it gives what
`generate` gives (greedy: the same tokens; sampling: the same draws from that prompt's
generator, up to float rounding of the probabilities).

Models too big for one device: `torchrun --nproc-per-node T*P tools/generate.py
--tensor-model-parallel-size T --pipeline-model-parallel-size P --load CKPT ...` builds
each rank's 1/T tensor-parallel shard of its pipeline stage's layers and loads the
checkpoint through the training loader, resharded from any saved layout
(tools/generate_tp.py); the ranks decode in lockstep (the tokens pass the stages in
order, the last stage's logits reach every rank) with identical full-vocabulary logits
and rank 0 prints. A world size of D x T x P runs D data-parallel replicas of that
layout (as Megatron-LM accepts any world size): the lines of --prompt-file are split
over the replicas in contiguous blocks (5 lines over 2: lines 0-2 and 3-4; a replica
without a line waits), each replica decodes its block as one batch, and rank 0 gathers
the answers and prints them in the file's order. They are the answers of one replica:
greedy ids the same, and sampled ids too, since line i draws from --seed + i whichever
replica runs it (up to the float rounding that batching allows, as for `generate_batch`:
a batch of other rows may round a logit differently). A single --prompt runs on replica
0. A world size that is not a multiple of T x P is refused, and so is
--decode-cuda-graph on at P > 1 (auto runs the eager cached step there).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megatron.agreed_exit import exit_on_every_rank, silent_ranks_wait
from megatron.checkpoint_reshard import (
    config_from_args,
    full_model_state,
    locate_iteration,
)
from megatron.checkpoint_source import SourceCheckpoint
from megatron.core.models.gpt.kv_cache import (
    KVCache,
    check_incremental,
    forward_incremental,
    gather_vocab,
)
from megatron.core.models.gpt.static_decode import MODES, StaticDecoder
from megatron.tokenizer import eod_or_none
from tools.generate_prompts import (
    all_prompt_ids,
    continuation_text,
    early_prompt_ids,
    file_prompts,
    window_note,
)
from tools.generate_tp import Replicas
from tools.sampling_rules import TopP, forbid_after, top_p_at

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# sample_next: below this temperature the logits are shifted to a maximum of 0 before the
# division (logits / 1e-4 stays finite in fp32 up to |logit| 3e34; the shift changes the
# probabilities' rounding, so ordinary temperatures keep the plain division)
_SHIFT_BELOW = 1e-4
__all__ = ["build_decoder", "config_from_args", "load_model", "sample_next", "generate",
           "generate_batch", "main"]


# ------------------------------------------------------------------------------ model
def load_model(load: str, iteration: Optional[int] = None, device="cpu",
               dtype: Optional[torch.dtype] = None):
    """(model in eval mode, Config, iteration) from the checkpoint under `load`, merged
    into one process by megatron.checkpoint_reshard. `dtype` None keeps the checkpoint's
    parameter dtype; another dtype is written into the model config too, since the forward
    casts activations to `params_dtype` (a bf16 run's config with fp32 weights would mix
    dtypes in the first matmul)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    iter_dir, iteration, _ = locate_iteration(load, iteration)
    src = SourceCheckpoint(iter_dir)
    if not src.args:
        raise SystemExit(f"error: {iter_dir} has no 'args' dict: it was not written by "
                         "pretrain_gpt.py, so the model shape is unknown")
    config = config_from_args(src.args)
    if dtype is not None:
        config.model = dataclasses.replace(config.model, params_dtype=dtype,
                                           embedding_weights_in_fp32=False)
    model = GPTModel(config.model, device="meta")
    model.load_state_dict(full_model_state(src, model), strict=True, assign=True)
    model.to(device=device, dtype=dtype)
    model.eval()
    return model, config, iteration


# ------------------------------------------------------------------------- generation
def sample_next(logits: torch.Tensor, greedy: bool = False, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> int:
    """One token id from a [V] logits vector: argmax when greedy (or temperature 0), else a
    draw from softmax(logits / temperature) restricted to the top_k ids and to the ids
    whose more likely ids hold at most top_p of the mass (Megatron's rule: the smallest
    set whose probability exceeds top_p; the most likely id always stays, so a top_p that
    a TopPSchedule decayed to 0 draws it). A temperature so small that logits / temperature
    would overflow (a request's 1e-320) divides the logits less their maximum: the same
    distribution (the argmax and its ties), never inf - inf = nan."""
    if greedy or temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float()
    if temperature < _SHIFT_BELOW:  # in fp64: 5e-324 is 0 as an fp32 scalar
        logits = (logits - logits.max()).double()
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = torch.cat([cum.new_zeros(1), cum[:-1]]) > top_p  # the mass before this id
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class _NextLogits:
    """Logits [V] of the token after `ids`, for a sequence that grows by one token per
    call. With `use_cache` the first call runs the prompt through the model once (the
    key/value cache's prefill) and later calls run the new token only; once the sequence
    is longer than the model's positions (no cache slot, and learned or rotary positions
    cannot slide) every call recomputes the last --max-position-embeddings tokens, as the
    path without a cache does for every token. With a `decoder` (StaticDecoder) the cache
    is the decoder's and the one-token calls are its static steps (CUDA-graph replays)."""

    def __init__(self, model, use_cache: bool, capacity: int,
                 decoder: Optional[StaticDecoder] = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.max_len = model.config.max_position_embeddings
        self.cache = None
        self.decoder = decoder if use_cache else None
        if use_cache:
            check_incremental(model)
            capacity = min(self.max_len, capacity)
            self.cache = (decoder.new_cache(1, capacity) if decoder is not None else
                          KVCache(len(model.language_model.encoder.layers), capacity))

    def __call__(self, ids: List[int]) -> torch.Tensor:
        cache = self.cache
        if cache is None or len(ids) > cache.max_len:
            context = torch.tensor([ids[-self.max_len:]], dtype=torch.long, device=self.device)
            return gather_vocab(self.model, self.model(context))[0, -1]
        new = torch.tensor([ids[cache.length:]], dtype=torch.long, device=self.device)
        if self.decoder is not None and cache.length > 0 and new.shape[1] == 1:
            return self.decoder.step(new)[0, -1]
        return forward_incremental(self.model, new, cache, last_only=True)[0, -1]


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, *, greedy: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: TopP = 1.0,
             generator: Optional[torch.Generator] = None, eod: Optional[int] = None,
             vocab_limit: Optional[int] = None,
             stop: Optional[Callable[[List[int]], bool]] = None,
             use_cache: bool = True, decoder: Optional[StaticDecoder] = None,
             forbid: Optional[Tuple[int, int]] = None) -> List[int]:
    """New token ids after `prompt_ids`. With `use_cache` (default) a key/value cache
    (megatron/core/models/gpt/kv_cache.py) runs each new token alone through the model;
    `use_cache=False` recomputes the whole context for every token (the reference: the
    same tokens, logits equal up to float rounding). Past --max-position-embeddings both
    run the last max_len tokens in full. The model is a whole GPTModel (pp 1) in eval mode,
    as load_model returns it, or a rank's tensor-parallel shard or pipeline stage
    (load_model_tp in tools/generate_tp.py) that every rank of the model calls with the
    same arguments (ValueError otherwise).

    Only the first `vocab_limit` logits (the tokenizer's vocabulary) are sampled: the
    padding rows of the embedding are never produced, and a seeded draw does not depend on
    how far the layout padded the vocabulary (tp x --make-vocab-size-divisible-by).
    `stop(ids)`, called with the whole sequence after each new token, ends generation
    early when it returns True. `decoder` (a StaticDecoder, `StaticDecoder.for_mode`; None:
    the dynamic path) runs the cached one-token steps at static shapes -- on CUDA replayed
    from a captured graph -- with the same tokens (the logits agree up to float rounding).
    `top_p` may be a function of the position of the token drawn (a TopPSchedule:
    Megatron's top_p_decay); with `forbid` = (a, b) token b is never drawn right after
    token a (Megatron's prevent_newline_after_colon; tools/sampling_rules.py)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give --prompt or --prompt-ids")
    ids = list(prompt_ids)
    next_logits = _NextLogits(model, use_cache and max_new_tokens > 0,
                              len(ids) + max_new_tokens - 1, decoder)
    out: List[int] = []
    for _ in range(max_new_tokens):
        logits = forbid_after(next_logits(ids)[None, :vocab_limit].float(), ids[-1:], forbid)
        token = sample_next(logits[0], greedy, temperature, top_k, top_p_at(top_p, len(ids)),
                            generator)
        out.append(token)
        ids.append(token)
        if (eod is not None and token == eod) or (stop is not None and stop(ids)):
            break
    return out


def _batch_step_logits(model, cache: KVCache, tokens_bs: torch.Tensor,
                       vocab_limit: Optional[int],
                       decoder: Optional[StaticDecoder] = None) -> torch.Tensor:
    """Logits [b, vocab_limit] (fp32) of the token after `tokens_bs`, which extend `cache`
    (one token after the prefill: `decoder`'s static step, when given)."""
    if decoder is not None and cache.length > 0 and tokens_bs.shape[1] == 1:
        logits = decoder.step(tokens_bs)
    else:
        logits = forward_incremental(model, tokens_bs, cache, last_only=True)
    return logits[:, -1, :vocab_limit].float()


def _decode_together(model, prompts: List[List[int]], max_new_tokens: int,
                     pick: Callable[[torch.Tensor, int, List[int]], int],
                     done: Callable[[int, List[int], int], bool],
                     vocab_limit: Optional[int],
                     decoder: Optional[StaticDecoder] = None) -> List[List[int]]:
    """New ids of each prompt, all rows through one key/value cache at shared positions.
    Every row is prefilled up to the shortest prompt; then each call feeds one position
    of every row: a row still inside its prompt feeds its next prompt token (what the
    model predicted there is not used), a row past it feeds the token it drew last, a
    finished row feeds padding (id 0) that no other row sees (attention stays within a
    row). `pick(logits [V], row, sequence)` draws the token after the row's sequence so
    far, `done(row, sequence, token)` says whether
    the row ends after it. Every row must fit: len(prompt) + max_new_tokens - 1 <= the
    model's positions. With a `decoder` the cache is its own (reused across calls) and
    the one-token calls are its static steps."""
    device = next(model.parameters()).device
    seqs = [list(p) for p in prompts]
    out: List[List[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    pos = min(len(p) for p in prompts)
    need = max(len(p) for p in prompts) + max_new_tokens - 1
    cache = (decoder.new_cache(len(prompts), need) if decoder is not None else
             KVCache(len(model.language_model.encoder.layers), need))
    tokens = torch.tensor([p[:pos] for p in prompts], dtype=torch.long, device=device)
    while True:
        logits = _batch_step_logits(model, cache, tokens, vocab_limit, decoder)  # index pos
        for row, seq in enumerate(seqs):
            if not finished[row] and len(seq) == pos:  # the row's prompt is all in the cache
                token = pick(logits[row], row, seq)
                out[row].append(token)
                seq.append(token)
                finished[row] = len(out[row]) == max_new_tokens or done(row, seq, token)
        if all(finished):
            return out
        feed = [seq[pos] if pos < len(seq) else 0 for seq in seqs]
        tokens = torch.tensor(feed, dtype=torch.long, device=device)[:, None]
        pos += 1


@torch.no_grad()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
                   top_p: TopP = 1.0,
                   generators: Optional[Sequence[Optional[torch.Generator]]] = None,
                   eod: Optional[int] = None, vocab_limit: Optional[int] = None,
                   stop: Optional[Callable[[List[int]], bool]] = None,
                   decoder: Optional[StaticDecoder] = None,
                   forbid: Optional[Tuple[int, int]] = None) -> List[List[int]]:
    """New token ids after each of `prompts`, decoded together as one batch through a
    key/value cache: `generate` for every prompt (same arguments, `use_cache` on), one
    model call per position instead of one per prompt and position.

    Row i draws from `generators[i]` only (None: torch's global generator), one draw per
    token it generates, so it draws what `generate(prompts[i], generator=generators[i])`
    draws; greedy tokens equal `generate`'s per prompt (the logits agree up to float
    rounding: the batch feeds a longer prompt's tail one token at a time). Rows end
    independently (`eod`, `stop(ids)`, max_new_tokens); the batch runs until every row has
    ended. A prompt whose tokens plus max_new_tokens - 1 exceed --max-position-embeddings
    is generated alone by `generate` (its window recompute does not fit a shared cache).
    The model is as for `generate`: one process, or every rank of a tensor x pipeline
    layout in lockstep (ValueError otherwise). `decoder` (a StaticDecoder; None: the dynamic
    path) runs the one-token steps of the batch at static shapes, its cache and CUDA graph
    reused by the next call with as many rows and no more positions."""
    prompts = [list(p) for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("generate_batch needs at least one prompt and no empty prompt "
                         f"(got prompt lengths {[len(p) for p in prompts]})")
    gens = list(generators) if generators is not None else [None] * len(prompts)
    if len(gens) != len(prompts):
        raise ValueError(f"{len(gens)} generators for {len(prompts)} prompts: give one per "
                         "prompt (or None)")
    out: List[List[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0:
        return out
    max_len = model.config.max_position_embeddings
    rows = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens - 1 <= max_len]
    for i in sorted(set(range(len(prompts))) - set(rows)):
        out[i] = generate(model, prompts[i], max_new_tokens, greedy=greedy,
                          temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=gens[i], eod=eod, vocab_limit=vocab_limit, stop=stop,
                          forbid=forbid)
    if not rows:
        return out

    def pick(logits: torch.Tensor, row: int, seq: List[int]) -> int:
        logits = forbid_after(logits[None], seq[-1:], forbid)[0]
        return sample_next(logits, greedy, temperature, top_k, top_p_at(top_p, len(seq)),
                           gens[rows[row]])

    def done(row: int, seq: List[int], token: int) -> bool:
        return (eod is not None and token == eod) or (stop is not None and stop(seq))

    batch = _decode_together(model, [prompts[i] for i in rows], max_new_tokens, pick, done,
                             vocab_limit, decoder)
    for i, new in zip(rows, batch):
        out[i] = new
    return out


# -------------------------------------------------------------------------------- CLI
def build_tokenizer_from(args: dict, a, show: bool = True
                         ) -> Tuple[Optional[object], Optional[str]]:
    """(tokenizer, None) or (None, why not), from the checkpoint's args and CLI overrides.
    A tokenizer with more ids than the model has vocabulary rows (other files than the
    model's) is refused; one that pads to another size than the model's, another
    --tokenizer-type or files whose contents differ from the saved paths' is used with a
    warning on stderr (`show`: this rank prints it)."""
    kind = a.tokenizer_type or args.get("tokenizer_type")
    try:
        from megatron.tokenizer import build_tokenizer
        from megatron.tokenizer.tokenizer import (
            checkpoint_tokenizer_overrides,
            checkpoint_vocab_mismatch,
        )
    except ImportError as exc:
        return None, f"megatron.tokenizer is not available ({exc})"
    try:
        tok = build_tokenizer(kind, vocab_file=a.vocab_file or args.get("vocab_file"),
                              merge_file=a.merge_file or args.get("merge_file"),
                              tokenizer_model=a.tokenizer_model or args.get("tokenizer_model"),
                              vocab_size=args.get("vocab_size"),
                              vocab_extra_ids=args.get("vocab_extra_ids") or 0)
    except (ValueError, OSError) as exc:
        return None, f"tokenizer {kind}: {exc}"
    mismatch = checkpoint_vocab_mismatch(tok.vocab_size, args)
    if mismatch is not None and mismatch[0]:
        return None, f"tokenizer {kind}: {mismatch[1]}"
    if mismatch is not None and show:
        print(f"WARNING: tokenizer {kind}: {mismatch[1]}", file=sys.stderr, flush=True)
    given = {d: getattr(a, d, None) for d in ("tokenizer_type", "vocab_file", "merge_file",
                                              "tokenizer_model")}
    for note in checkpoint_tokenizer_overrides(args, given) if show else ():
        print(f"WARNING: {note}", file=sys.stderr, flush=True)
    return tok, None


_MAX_SEED = 2**32 - 1


def sampling_flag_problems(a: argparse.Namespace) -> List[str]:
    """Each sampling flag out of its range, with the value given: a nan --temperature
    ended in torch.multinomial's traceback, an inf one sampled every token uniformly."""
    rules = [("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 0, "an integer >= 0"),
             ("--temperature", a.temperature, 0 <= a.temperature < float("inf"),
              "a finite number >= 0 (0: greedy, as --greedy)"),
             ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1] (1.0: no nucleus filter)"),
             ("--top-k", a.top_k, a.top_k >= 0, "an integer >= 0 (0: no top-k filter)"),
             # pretrain_gpt.py's rule (> 0, within numpy's seeds); torch refused >= 2**64
             # only after the checkpoint had loaded
             ("--seed", a.seed, 0 < a.seed <= _MAX_SEED,
              f"in 1..{_MAX_SEED} (as pretrain_gpt.py's --seed)")]
    return [f"{flag} {value} must be {allowed}" for flag, value, ok, allowed in rules if not ok]


def parse_args(argv=None) -> argparse.Namespace:
    from megatron.cli_suggest import SuggestingParser

    ap = SuggestingParser(description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", required=True, help="checkpoint directory (as --save wrote it)")
    ap.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (NullTokenizer: space-separated ids)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt-file", help="one prompt per non-empty line (batched)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--greedy", action="store_true", help="argmax decoding")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    ap.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus filter")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-stop-at-eod", action="store_true", help="keep going after EOD")
    ap.add_argument("--no-kv-cache", action="store_true",
                    help="recompute the whole context for every token (the reference the "
                         "key/value cache is checked against; slower)")
    ap.add_argument("--decode-cuda-graph", choices=MODES, default="auto",
                    help="run each cached one-token step as one replay of a CUDA graph "
                         "(static shapes; captured per batch size and cache length). "
                         "auto (default): on CUDA where the step can be captured; on: "
                         "insist (an error names why it cannot); off (and auto elsewhere): "
                         "the eager cached step")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                    help="default: the checkpoint's on CUDA, fp32 on CPU")
    ap.add_argument("--tokenizer-type", default=None, help="default: the checkpoint's")
    ap.add_argument("--vocab-file", default=None)
    ap.add_argument("--merge-file", default=None)
    ap.add_argument("--tokenizer-model", default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1,
                    help="under torchrun: the number of processes (ranks) the model is "
                         "split over; world size (--nproc-per-node x nodes) = tensor x "
                         "pipeline size x data-parallel replicas")
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                    help="under torchrun: the number of pipeline stages the layers are "
                         "split over (each further tensor x pipeline size processes are "
                         "one more data-parallel replica, given its share of the prompts)")
    a = ap.parse_args(argv)
    bad = sampling_flag_problems(a)
    if bad:
        ap.error("; ".join(bad))
    if a.no_kv_cache and a.decode_cuda_graph == "on":
        ap.error("--decode-cuda-graph on replays the cached one-token step: it needs the "
                 "key/value cache; drop --no-kv-cache or use --decode-cuda-graph auto/off")
    return a


def build_decoder(model, mode: str, use_cache: bool = True,
                  prog: str = "generate.py") -> Optional[StaticDecoder]:
    """The StaticDecoder of --decode-cuda-graph MODE (None: the dynamic cached path, or no
    cache at all); SystemExit naming the reason when `on` cannot be honoured."""
    if not use_cache:
        if mode == "on":
            raise SystemExit(f"{prog}: error: --decode-cuda-graph on replays the cached "
                             "one-token step: it needs the key/value cache; drop "
                             "--no-kv-cache or use --decode-cuda-graph auto/off")
        return None
    try:
        return StaticDecoder.for_mode(model, mode)
    except ValueError as exc:
        raise SystemExit(f"{prog}: error: {exc}") from None


def _device(name: Optional[str]) -> torch.device:
    """--device as a torch.device (default: cuda when available); SystemExit when it names
    no device this machine has."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        raise SystemExit(f"error: --device {name!r}: {exc}; use cpu or cuda") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"error: --device {name}: this machine has "
                         f"{torch.cuda.device_count()} usable CUDA device(s) (torch "
                         f"{torch.__version__}); use --device cpu or leave --device out")
    if device.type not in ("cpu", "cuda"):  # mps, xpu...: torch raises at the first tensor
        try:
            torch.empty(1, device=device)
        except Exception as exc:  # RuntimeError, NotImplementedError, AssertionError
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
            raise SystemExit(f"error: --device {name}: this machine has no usable "
                             f"{device.type} device ({why}); use --device cpu or leave "
                             "--device out") from None
    return device


def _load(a, environ) -> Tuple[torch.nn.Module, object, int, object]:
    """(model, Config, iteration, Runtime or None): the whole model in this process, or
    under torchrun with --tensor-model-parallel-size T and --pipeline-model-parallel-size
    P (world size = T x P x D, D data-parallel replicas) this rank's share of its
    replica's model (tools/generate_tp.py). SystemExit for a layout generation does not
    run."""
    from tools.generate_tp import checked_launch, load_model_tp

    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    rank, world_size, local_rank = checked_launch("generate.py", environ, tp, pp,
                                                  device=a.device)
    dtype = _DTYPES[a.dtype] if a.dtype else None
    if rank == 0:  # reading a large checkpoint takes minutes: say so (stderr: --json's stdout)
        print(f"loading the checkpoint under {a.load} ...", file=sys.stderr, flush=True)
    if world_size == 1:
        device = _device(a.device)
        dtype = dtype or (None if device.type == "cuda" else torch.float32)
        return (*load_model(a.load, a.iteration, device, dtype), None)
    if dtype is None and not torch.cuda.is_available():
        dtype = torch.float32
    return load_model_tp(a.load, tp, rank, local_rank, environ, a.iteration, dtype,
                         pp_size=pp, dp_size=world_size // (tp * pp))


def _early_prompts(a, environ) -> Optional[List[str]]:
    """--prompt-file's lines, read before the model loads (None without it), and
    --prompt-ids checked then too: a missing or empty file, or ids that are no integers,
    stop the run at once, printed once per node under torchrun."""
    if a.prompt_file is None and a.prompt_ids is None:
        return None
    from tools.generate_tp import launch_ranks

    try:
        if a.prompt_file is None:
            early_prompt_ids(a.prompt_ids)
            return None
        return file_prompts(a.prompt_file)
    except SystemExit as exc:
        from megatron.arguments import exit_before_group

        rank, world_size, _ = launch_ranks(environ)
        if world_size == 1:
            raise
        raise exit_before_group(exc, rank, world_size, environ, machine=True) from None


def main(argv=None, environ=None) -> int:
    """The command line; under torchrun (RANK / WORLD_SIZE in `environ`, default
    os.environ) the ranks of each replica generate in lockstep, the replicas their share
    of the prompts, and rank 0 prints. Callable more than once in one process: the
    variables the start-up sets in `environ` and the warnings hooks come back as they were
    (megatron.entry_state.entry_point_changes_undone), and the process group the run made
    is ended (one the caller made is kept)."""
    from megatron.entry_state import entry_point_changes_undone, one_line_project_warnings
    from megatron.initialize import announce_broken_triton
    from megatron.rank_failure import process_group_closed
    from megatron.srun_tasks import launcher_ranks

    a = parse_args(argv)
    environ = os.environ if environ is None else environ
    announce_broken_triton(launcher_ranks(environ)[0])
    texts = _early_prompts(a, environ)
    with entry_point_changes_undone(environ), process_group_closed(env=environ):
        one_line_project_warnings()  # a merges file's unread line: one line (undone after)
        return _run(a, environ, texts)


def _run(a, environ, texts: Optional[List[str]]) -> int:
    """main after the command line: load, check the prompts, generate, print."""
    with silent_ranks_wait(environ):  # a load error the ranks agree on: rank 0 prints it
        model, config, iteration, rt = _load(a, environ)
        rank = 0 if rt is None else rt.ps.rank
        tokenizer, why_not = build_tokenizer_from(config.args, a, show=rank == 0)
        # the tokenizer's vocabulary, not the padded one (which depends on the layout);
        # without a tokenizer the checkpoint's padded vocabulary (tp > 1 may pad it further)
        vocab = (tokenizer.vocab_size if tokenizer is not None else
                 int(config.args.get("padded_vocab_size") or config.model.padded_vocab_size))
        try:  # every rank meets the same prompt error: rank 0 prints it
            prompts = all_prompt_ids(a, texts, tokenizer, why_not, vocab)
        except SystemExit as exc:
            raise exit_on_every_rank(str(exc.code)) from None
    replicas = Replicas(rt)
    eod = None if a.no_stop_at_eod else eod_or_none(tokenizer)
    sampling = dict(greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                    eod=eod, vocab_limit=vocab,
                    decoder=build_decoder(model, a.decode_cuda_graph, not a.no_kv_cache))
    if texts is not None:
        return _main_file(a, model, iteration, replicas, tokenizer, texts, prompts, sampling)
    ids = prompts[0]
    note = window_note(len(ids), a.max_new_tokens, config.model.max_position_embeddings)
    if note and rank == 0:
        print(f"note: {note}", file=sys.stderr)
    mine = {}
    if replicas.block(1):  # replica 0; the others wait for it
        gen = torch.Generator().manual_seed(a.seed)
        mine[0] = generate(model, ids, a.max_new_tokens, generator=gen,
                           use_cache=not a.no_kv_cache, **sampling)
    answers = replicas.gather(mine)
    if rank != 0:
        return 0
    new = answers[0]
    text = continuation_text(tokenizer, ids, new) if tokenizer is not None else None
    if a.json:
        print(json.dumps({"iteration": iteration, "prompt_ids": ids, "generated_ids": new,
                          "generated_text": text}))
        return 0
    print(f"checkpoint: {a.load} iteration {iteration}")
    if tokenizer is not None:
        print(f"prompt: {tokenizer.detokenize(ids)}")
    print(f"prompt ids: {ids}")
    print(f"generated ids: {new}")
    print(f"generated text: {text if text is not None else '(no tokenizer: ' + str(why_not) + ')'}")
    return 0


def _main_file(a, model, iteration: int, replicas: Replicas, tokenizer, texts: List[str],
               prompts: List[List[int]], sampling: dict) -> int:
    """--prompt-file: every line's prompt, as one batch (one by one with --no-kv-cache);
    line i draws from --seed + i. With data-parallel replicas each generates its block of
    the lines (tools/generate_tp.py Replicas) and rank 0 gathers the answers. Prints one
    block (--json: one line) per prompt, in the file's order."""
    rank = replicas.rank
    for i, ids in enumerate(prompts):
        note = window_note(len(ids), a.max_new_tokens, model.config.max_position_embeddings)
        if note and rank == 0:
            print(f"note: [{i}] {note}", file=sys.stderr)
    block = replicas.block(len(prompts))
    gens = [torch.Generator().manual_seed((a.seed + i) % 2**64) for i in block]
    mine = [prompts[i] for i in block]
    if not mine:  # more replicas than prompts
        news = []
    elif a.no_kv_cache:
        news = [generate(model, ids, a.max_new_tokens, generator=g, use_cache=False, **sampling)
                for ids, g in zip(mine, gens)]
    else:
        news = generate_batch(model, mine, a.max_new_tokens, generators=gens, **sampling)
    answers = replicas.gather(dict(zip(block, news)))
    if rank != 0:
        return 0
    for i, ids in enumerate(prompts):
        new = answers[i]
        text = continuation_text(tokenizer, ids, new) if tokenizer is not None else None
        if a.json:
            print(json.dumps({"index": i, "iteration": iteration, "prompt_ids": ids,
                              "generated_ids": new, "generated_text": text}))
        else:
            print(f"[{i}] prompt: {texts[i]}\n[{i}] generated text: "
                  f"{text if text is not None else new}")
    return 0


if __name__ == "__main__":
    from megatron.process_exit import run

    run(main)  # sys.exit(main()) without the interpreter's teardown (about a second)
