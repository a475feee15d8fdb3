"""An independent plain-torch GPT forward with Megatron-LM 23.05's model semantics.

It reads a full (tensor-parallel size 1) state dict under Megatron's checkpoint names and
a `ModelConfig`, and computes per-token losses [b, s] (or logits [b, s, V]) the way
Megatron-LM 23.05's `GPTModel` does, spelled out step by step with explicit matmuls and
no code shared with `megatron/`:

* embedding: word (+ learned absolute positions at `position_ids`), [b, s, h] -> [s, b, h];
* each layer: norm -> fused QKV per query group [q x (n/g), k, v] -> rotary on the first
  channels of q and k ("rotate half", positions 0..s-1 whatever the position ids; the
  whole head, or int(d * rotary_percent) channels below 1, one more when that is odd) -> scores / sqrt(d), or / (sqrt(d) * layer) then * layer with query-key
  layer scaling -> masked fill -10000 -> softmax -> context -> dense (+ bias) -> residual
  (the norm's output with --apply-residual-connection-post-layernorm, else the input);
  then the same around the MLP: fc1 (+ bias) -> activation -> fc2 (+ bias), or with
  `num_experts` E Megatron-LM 23.05's SwitchMLP: router = nn.Linear(h, E) with bias,
  probs = softmax over E, each token sent to its argmax expert (the same in training and
  evaluation: no Sinkhorn, no capacity, no auxiliary loss) and that expert's MLP output,
  its fc2 bias included, scaled by the chosen probability;
* final norm, then logits against the word embeddings (or the untied output layer) and
  cross entropy.

Activations: "gelu" erf, "openai_gelu" the tanh form written out, "squared_relu",
"swiglu" = silu(first half) * second half of fc1's output.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

PREFIX = "language_model."


def _norm(x, sd, name, cfg):
    w = sd[name + ".weight"]
    if cfg.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w
    if cfg.apply_layernorm_1p:
        w = w + 1
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + cfg.layernorm_epsilon) * w + sd[name + ".bias"]


def _linear(x, sd, name):
    y = x @ sd[name + ".weight"].t()
    bias = sd.get(name + ".bias")
    return y if bias is None else y + bias


def _activation(h, kind):
    if kind == "gelu":
        return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    if kind == "openai_gelu":
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))
    if kind == "squared_relu":
        return torch.relu(h) ** 2
    if kind == "swiglu":
        gate, up = torch.chunk(h, 2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    raise ValueError(kind)


def _rotate(t, s, dim, base):
    """Rotary of t [s, b, heads, d] at positions 0..s-1 with Megatron's RotaryEmbedding(dim):
    frequencies base^(-i/dim) for even i < dim, each angle twice ([f, f]), so an odd dim
    rotates dim + 1 channels."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim))
    angles = torch.arange(s).double()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    width = angles.shape[-1]
    head, rest = t[..., :width], t[..., width:]
    x1, x2 = head[..., : width // 2], head[..., width // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([head * angles.cos() + rotated * angles.sin(), rest], dim=-1)


def _attention(x, sd, name, cfg, layer_number, mask_bss):
    s, b, _ = x.shape
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    qkv = _linear(x, sd, name + ".query_key_value").view(s, b, g, (n // g + 2) * d)
    q = qkv[..., : (n // g) * d].reshape(s, b, n, d)
    k = qkv[..., (n // g) * d: (n // g + 1) * d]
    v = qkv[..., (n // g + 1) * d:]
    if cfg.use_rotary_position_embeddings:
        # the whole head, or int(d * percent) channels when --rotary-percent is below 1
        rot_dim = d if cfg.rotary_percent >= 1.0 else int(d * cfg.rotary_percent)
        q, k = _rotate(q, s, rot_dim, cfg.rotary_base), _rotate(k, s, rot_dim, cfg.rotary_base)
    # query head i reads key/value group i // (n / g)
    k = k.repeat_interleave(n // g, dim=2)
    v = v.repeat_interleave(n // g, dim=2)
    coeff = layer_number if cfg.apply_query_key_layer_scaling else 1
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / (math.sqrt(d) * coeff) * coeff
    scores = scores.masked_fill(mask_bss[:, None], -10000.0)
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, n * d)
    return _linear(ctx, sd, name + ".dense")


def _mlp(x, sd, name, cfg):
    h = _activation(_linear(x, sd, name + ".dense_h_to_4h"), cfg.activation)
    return _linear(h, sd, name + ".dense_4h_to_h")


def _switch_mlp(x, sd, name, cfg):
    """Every expert on every token, then per token the argmax expert's output (fc2 bias
    included) times its softmax probability, selected by a one-hot mask (an unchosen
    expert's output is multiplied by 0: it gets no gradient from that token)."""
    probs = torch.softmax(_linear(x, sd, name + ".router"), dim=-1)  # [s, b, E]
    prob, chosen = probs.max(dim=-1)
    out = torch.zeros_like(x)
    for e in range(cfg.num_experts):
        out = out + (chosen == e)[..., None] * _mlp(x, sd, f"{name}.experts.{e}", cfg)
    return out * prob[..., None]


def _layer(x, sd, i, cfg, mask_bss, drop):
    name = f"{PREFIX}encoder.layers.{i}"
    ln = _norm(x, sd, name + ".input_layernorm", cfg)
    out = _attention(ln, sd, name + ".self_attention", cfg, i + 1, mask_bss)
    x = (ln if cfg.apply_residual_connection_post_layernorm else x) + drop(out)
    ln = _norm(x, sd, name + ".post_attention_layernorm", cfg)
    out = (_switch_mlp if cfg.num_experts else _mlp)(ln, sd, name + ".mlp", cfg)
    return (ln if cfg.apply_residual_connection_post_layernorm else x) + drop(out)


def reference_forward(sd: Dict[str, torch.Tensor], cfg, tokens: torch.Tensor,
                      labels: Optional[torch.Tensor] = None,
                      position_ids: Optional[torch.Tensor] = None,
                      attention_mask: Optional[torch.Tensor] = None,
                      hidden_dropout: Optional[Callable] = None) -> torch.Tensor:
    """Per-token losses [b, s] with `labels`, else logits [b, s, V]. attention_mask: bool
    [b, 1, s, s], True = masked (None: causal); position_ids [b, s] (None: 0..s-1).
    `hidden_dropout` (default: none, eval mode) is applied where Megatron's hidden dropout
    sits: on the embeddings' sum, and on each attention and MLP output (its bias added)
    before the residual add. The weights are taken in fp64 as given: fp64 leaves that
    require grad give the reference's gradients."""
    drop = hidden_dropout or (lambda t: t)
    sd = {k: v.double() for k, v in sd.items()}
    b, s = tokens.shape
    word = sd[PREFIX + "embedding.word_embeddings.weight"]
    x = word[tokens]
    if cfg.add_position_embedding:
        pos = torch.arange(s)[None].expand(b, s) if position_ids is None else position_ids
        x = x + sd[PREFIX + "embedding.position_embeddings.weight"][pos]
    x = drop(x.transpose(0, 1))
    if attention_mask is None:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None].expand(b, s, s)
    else:
        mask = attention_mask[:, 0]
    for i in range(cfg.num_layers):
        x = _layer(x, sd, i, cfg, mask, drop)
    x = _norm(x, sd, PREFIX + "encoder.final_layernorm", cfg)
    out_w = sd.get(PREFIX + "output_layer.weight", word)
    logits = (x @ out_w.t()).transpose(0, 1)  # [b, s, V]
    if labels is None:
        return logits
    logp = torch.log_softmax(logits, dim=-1)
    return -logp.gather(-1, labels[..., None]).squeeze(-1)


# ------------------------------------------------------------------ cases the tests share
# A tiny model (vocabulary 64, 4 heads of 8, 2 layers) and the model-shaping settings
# compared against the reference, each as the ModelConfig fields its flags give.
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
            seq_length=16, max_position_embeddings=20, hidden_dropout=0.0,
            attention_dropout=0.0, use_cpu_initialization=True)
CASES = {
    "erf_gelu": dict(activation="gelu"),  # --no-bias-gelu-fusion / --disable-bias-linear
    "tanh_gelu": dict(activation="openai_gelu"),  # --openai-gelu, and the fused default
    "squared_relu": dict(activation="squared_relu"),
    "swiglu": dict(activation="swiglu", ffn_hidden_size=48, add_bias_linear=False),
    "post_layernorm_residual": dict(apply_residual_connection_post_layernorm=True),
    "layernorm_1p_eps": dict(apply_layernorm_1p=True, layernorm_epsilon=0.3),
    "rmsnorm": dict(normalization="RMSNorm", layernorm_epsilon=0.3, add_bias_linear=False),
    "untied": dict(untie_embeddings_and_output_weights=True),
    "rope_half": dict(position_embedding_type="rope", rotary_percent=0.5),
    "rope_learned": dict(position_embedding_type="rope+learned"),
    "rope_odd_dim": dict(position_embedding_type="rope", kv_channels=12, rotary_percent=0.25),
    "rope_over_one": dict(position_embedding_type="rope", rotary_percent=1.5),
    "no_positions": dict(position_embedding_type="none"),
    "kv_channels": dict(kv_channels=12),
    "query_groups": dict(num_query_groups=2, position_embedding_type="rope"),
    "qk_layer_scaling": dict(apply_query_key_layer_scaling=True, num_layers=3),
    "documents": dict(reset=True),  # --reset-position-ids --reset-attention-mask
    "documents_rope": dict(reset=True, position_embedding_type="rope"),
    "experts": dict(num_experts=4),  # --num-experts 4
    "experts_swiglu": dict(num_experts=3, activation="swiglu", ffn_hidden_size=48,
                           add_bias_linear=False),
}
EOD = 63


def case_config(name: str, **extra):
    """(ModelConfig fields, whether the batch has document masks) of a case."""
    kw = dict(CASES[name])
    reset = kw.pop("reset", False)
    return {**BASE, **kw, **extra}, reset


def perturb_(model: torch.nn.Module, seed: int = 1) -> None:
    """Every parameter of a tensor-parallel size 1 model moved by N(0, 0.3^2) noise, so
    that biases, norm weights and the 1p offsets all take part."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def case_batch(reset: bool, b: int = 2, s: int = 16):
    """(tokens, labels, position_ids, attention_mask) with EODs in the tokens; the masks
    and restarted positions only with `reset` (else None: causal, 0..s-1), built by
    Megatron's loop: after each EOD at i, rows > i see nothing up to i and positions
    restart at 0."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, EOD, (b, s), generator=g)
    tokens[0, 4], tokens[0, 9], tokens[1, 11] = EOD, EOD, EOD
    labels = torch.randint(0, 64, (b, s), generator=g)
    if not reset:
        return tokens, labels, None, None
    keep = torch.tril(torch.ones(b, s, s))
    pos = torch.arange(s).repeat(b, 1)
    for row in range(b):
        prev = 0
        for i in (tokens[row] == EOD).nonzero().flatten().tolist():
            keep[row, i + 1:, : i + 1] = 0
            pos[row, i + 1:] -= i + 1 - prev
            prev = i + 1
    return tokens, labels, pos, (keep < 0.5)[:, None]
