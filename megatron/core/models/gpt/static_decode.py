"""One-token decoding at static shapes, replayed from a CUDA graph.

Shape legend: b = batch, h = hidden, n = attention heads, g = query groups (key/value
heads), r = n / g query heads per group, d = head dim, L = the cache's max_len, V = padded
vocabulary.

Why: `forward_incremental` (kv_cache.py) decodes one token with ~100 small kernels, and
the cache it reads grows by one position per token, so shapes (and the host values that
slice the cache) change every token. On an H200 at a 1.3B shape (24 layers, hidden 2048,
bf16) a token took 1.6 ms of GPU kernels but ~88 ms of wall time: launch-bound.

`forward_static(model, input_ids_b1, cache)` is the same one-token forward with nothing
that changes between tokens:

- the cache's tensors are [b, g, L, d] per layer, allocated once (zeros);
- the current position is `cache.position`, a device tensor [1], not a Python int; the
  step writes the new keys and values at that slot in place (`index_copy_`) and adds one
  to it on the device;
- the new query attends over all L slots with a boolean mask (slot <= position), its r
  query heads per group as r query rows of that group's keys (no repeated keys);
- the rotary cos/sin rows and the learned position embedding are gathered by the position
  tensor.

So its logits equal `forward_incremental`'s (fp32: within 1e-6 of the largest logit,
tests/test_static_decode.py) and it can be recorded once as a CUDA graph and replayed per
token: one launch instead of ~100, no host work in between but copying the next tokens
into the graph's input buffer. Prefill stays on the dynamic path (`forward_incremental`
on the same cache: it writes the same tensors and keeps `position` equal to `length`).

`StaticDecoder` drives this for batches whose rows share their positions (what
tools/generate.py's `generate` and `generate_batch` decode): `new_cache(b, max_len)` hands
out its cache (position 0), `step(tokens_b1)` runs one token. Graphed (CUDA), the first
`new_cache` for a batch size captures the step (warm-up steps first, the last on the side
stream the capture uses, as torch's CUDA-graph notes ask); a later one for the same b and
at most the captured L reuses the graph, the cache tensors and the position tensor
(reset to 0); another b or a longer L captures again. L is rounded up to a power of two
(at most --max-position-embeddings) so that requests of similar lengths share a graph.

Under tensor parallelism the step's collectives (the row-parallel all-reduces, the vocab
all-gather) are captured too, which needs NCCL: with another backend (gloo, the CPU) there
is no graph (`graph_reason`). Mixture-of-experts layers are captured when they dispatch
through the grouped GEMM that stays on the device (`experts_sync_free`); the loop
dispatch counts each expert's tokens on the host, so with it there is no graph.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .grouped_experts import experts_sync_free
from .kv_cache import (
    KVCache,
    check_incremental,
    gather_vocab,
    layer_step,
    qkv_heads,
    rotary_table_of,
)

MODES = ("auto", "on", "off")
WARMUP_STEPS = 2  # eager steps before a capture (the last on the capture's stream)
MIN_CAPACITY = 64  # the smallest cache a decoder allocates (positions)


def _static_attention(attn, x_sbh, rotary_rows, cache: KVCache, layer: int,
                      visible_1111L: torch.Tensor):
    """ParallelAttention.forward for one new token at `cache.position`: its keys and
    values written into the cache at that slot, its query over all L slots (masked)."""
    q, k, v = qkv_heads(attn, x_sbh, rotary_rows)  # q [b, n, 1, d], k, v [b, g, 1, d]
    k_all, v_all = cache.tensors(layer, k, v)  # [b, g, L, d]
    k_all.index_copy_(2, cache.position, k)
    v_all.index_copy_(2, cache.position, v)
    b, g, d = k.shape[0], attn.g, attn.d
    # query head i belongs to group i // r (Megatron's fused QKV layout), so a group's r
    # heads are r query rows over that group's keys
    q_bgrd = q.reshape(b, g, attn.n // g, d)
    ctx_bgrd = F.scaled_dot_product_attention(q_bgrd, k_all, v_all, attn_mask=visible_1111L,
                                              scale=1.0 / math.sqrt(d))
    return attn.dense(ctx_bgrd.reshape(1, b, attn.n * d))


def check_static_step(model, cache: KVCache, input_ids_b1: torch.Tensor) -> None:
    """ValueError naming the reason when `forward_static` cannot run this step."""
    if cache.position is None:
        raise ValueError("the static step needs a cache with a position tensor "
                         "(StaticDecoder.new_cache, or set cache.position)")
    if input_ids_b1.dim() != 2 or input_ids_b1.shape[1] != 1:
        raise ValueError(f"the static step takes one token per row, [b, 1] (got "
                         f"{tuple(input_ids_b1.shape)}); prefill with forward_incremental")
    limit = min(cache.max_len, model.config.max_position_embeddings)
    if cache.length + 1 > limit:
        raise ValueError(f"1 new token after {cache.length} cached positions makes "
                         f"{cache.length + 1}, over the cache's {cache.max_len} / the "
                         f"model's {model.config.max_position_embeddings} positions")


@torch.no_grad()
def forward_static(model, input_ids_b1: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, 1, V] (the whole padded vocabulary on every tensor-parallel rank) of the
    tokens `input_ids_b1` at position `cache.length` (== `cache.position` on the device),
    given the earlier positions in `cache`; the cache is extended by one position (on the
    host and the device). The same model scope as `forward_incremental`."""
    check_incremental(model)
    check_static_step(model, cache, input_ids_b1)
    lm = model.language_model
    pos_1 = cache.position
    position_ids = pos_1.view(1, 1) if lm.embedding.position_embeddings is not None else None
    hidden_sbh = lm.embedding(input_ids_b1, position_ids)  # [1, b, h]
    table = rotary_table_of(model, cache, hidden_sbh.device)
    rotary = None if table is None else table.index_select(1, pos_1)
    slots = torch.arange(cache.max_len, device=pos_1.device)
    visible = (slots <= pos_1).view(1, 1, 1, cache.max_len)
    for i, layer in enumerate(lm.encoder.layers):
        hidden_sbh = layer_step(layer, hidden_sbh, lambda attn, x, i=i: _static_attention(
            attn, x, rotary, cache, i, visible))
    cache.position.add_(1)
    cache.length += 1
    hidden_sbh = lm.encoder.final_layernorm(hidden_sbh)
    return gather_vocab(model, model._head(hidden_sbh, None))


def graph_reason(model) -> Optional[str]:
    """Why the one-token step of `model` cannot be captured as a CUDA graph (None: it
    can)."""
    stages = getattr(model, "pp_size", 1)  # a PipelineGPT (pipeline_decode.py)
    if stages > 1:
        return (f"the model is split over {stages} pipeline stages, and the captured step "
                "is one stage's whole forward (each token here crosses the stages)")
    device = next(model.parameters()).device
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"it needs CUDA (the model is on {device})"
    if model._tp_size() > 1:
        backend = torch.distributed.get_backend(model.tp_group)
        if backend != "nccl":
            return (f"the tensor-parallel group's collectives run on {backend}; capturing "
                    "them needs nccl")
    return experts_reason(model)


def experts_reason(model) -> Optional[str]:
    """Why the model's mixture-of-experts layers keep its step out of a CUDA graph (None:
    there are none, or every one dispatches through the host-free grouped GEMM)."""
    if not model.config.num_experts or experts_sync_free(model):
        return None
    return (f"the model's {model.config.num_experts} experts per layer dispatch tokens "
            "through a loop that counts them on the host (the grouped GEMM that stays on "
            "the device needs bf16 on a compute capability 9.0 or 10.0 GPU)")


def capacity_for(max_len: int, limit: int) -> int:
    """The cache length a decoder allocates for `max_len` positions: the next power of two
    (at least MIN_CAPACITY), at most `limit` (the model's positions)."""
    return min(limit, max(MIN_CAPACITY, 1 << (max_len - 1).bit_length()))


class StaticDecoder:
    """Static one-token steps for batches of rows at shared positions: eager
    (`graphed=False`), or replayed from a CUDA graph captured per (batch size, cache
    length). Holds one cache at a time; every rank of a tensor-parallel group must make
    the same calls. See the module docstring for the protocol."""

    def __init__(self, model, graphed: bool) -> None:
        check_incremental(model)
        self.model = model
        self.graphed = graphed
        self.device = next(model.parameters()).device
        self.cache: Optional[KVCache] = None
        self.graph = None  # torch.cuda.CUDAGraph while one is captured
        self.tokens_b1: Optional[torch.Tensor] = None  # the graph's input buffer
        self.logits_b1v: Optional[torch.Tensor] = None  # the graph's output
        self.num_captures = 0

    @classmethod
    def for_mode(cls, model, mode: str) -> Optional["StaticDecoder"]:
        """The decoder for `--decode-cuda-graph MODE`: None for "off" and for "auto" where
        the step cannot be captured (decoding stays on the dynamic path); ValueError for
        "on" where it cannot, naming the reason."""
        if mode not in MODES:
            raise ValueError(f"decode CUDA graph mode {mode!r}: use one of {', '.join(MODES)}")
        if mode == "off":
            return None
        reason = graph_reason(model)
        if reason is None:
            return cls(model, graphed=True)
        if mode == "on":
            raise ValueError(f"--decode-cuda-graph on: the decode step cannot be captured: "
                             f"{reason}; use --decode-cuda-graph auto or off")
        return None

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache of at least `max_len` positions for a new batch of `batch` rows at
        position 0: the last one, reset, when its batch size matches and it is long
        enough (its graph is reused); else a new one (captured again when graphed)."""
        limit = self.model.config.max_position_embeddings
        if not 1 <= max_len <= limit:
            raise ValueError(f"a cache of {max_len} positions: the model has {limit}")
        cache = self.cache
        if cache is None or self.tokens_b1.shape[0] != batch or cache.max_len < max_len:
            self._build(batch, capacity_for(max_len, limit))
        else:
            cache.reset()
        return self.cache

    def step(self, tokens_b1: torch.Tensor) -> torch.Tensor:
        """Logits [b, 1, V] of `tokens_b1` [b, 1] at the cache's position, which advances
        by one (a new tensor: the graph's output buffer is copied)."""
        if self.graph is None:
            return forward_static(self.model, tokens_b1, self.cache)
        check_static_step(self.model, self.cache, tokens_b1)
        self.tokens_b1.copy_(tokens_b1)
        self.graph.replay()
        self.cache.length += 1
        return self.logits_b1v.clone()

    def _build(self, batch: int, capacity: int) -> None:
        """A new cache (its tensors and rotary table allocated by one eager step on the
        current stream) and, graphed, the step captured over it; position 0 after."""
        self.cache = self.graph = self.logits_b1v = None  # free the old ones first
        cache = KVCache(len(self.model.language_model.encoder.layers), capacity)
        cache.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.tokens_b1 = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.cache = cache
        forward_static(self.model, self.tokens_b1, cache)
        if self.graphed:
            try:
                self._capture()
            except RuntimeError as exc:  # e.g. an op that syncs with the host
                self.graph, self.graphed = None, False
                warnings.warn(f"the decode step could not be captured as a CUDA graph "
                              f"({exc}); decoding runs the static step eagerly")
        cache.reset()

    def _capture(self) -> None:
        """Warm-up steps on a side stream (lazily made cuBLAS handles and workspaces then
        exist for it), then the capture on that stream. Warm-ups restart at position 0,
        so they never write past the cache; the capture only records. The model's device
        is made current (a server's HTTP thread may have another), and other threads may
        use CUDA meanwhile (thread-local capture mode)."""
        cache = self.cache
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_STEPS):
                    cache.reset()
                    forward_static(self.model, self.tokens_b1, cache)
            torch.cuda.current_stream().wait_stream(stream)
            cache.reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self.logits_b1v = forward_static(self.model, self.tokens_b1, cache)
        self.graph = graph
        self.num_captures += 1


__all__ = ["MODES", "StaticDecoder", "capacity_for", "check_static_step", "forward_static",
           "graph_reason"]
