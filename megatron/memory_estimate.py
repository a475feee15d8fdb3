"""Analytic peak-memory estimate per GPU for a resolved configuration (`--dry-run` prints it).

    est = estimate_memory(config)          # dict of bytes, the worst pipeline stage
    est["allocated"]   # compare with torch.cuda.max_memory_allocated() of a training step
    est["total"]       # + a fixed allowance for what torch's allocator does not see

Symbols: s = sequence length, b = micro batch, h = hidden size, a = attention heads,
t = tensor-parallel size, V = padded vocabulary, L = layers on the stage, P = parameters on
this rank, e = bytes of an activation element (2 with --bf16/--fp16, else 4), d = dp size.

Model state (bytes per parameter of this rank):
  weights     2 (bf16/fp16) or 4 (fp32)
  gradients   the contiguous grad buffer: 4 when gradients accumulate in fp32 (always with
              --bf16), else the parameter's own width
  optimizer   Adam: two fp32 moments (8) + fp32 main params (4) under mixed precision
              = 12; SGD: momentum 4 (+4). With --use-distributed-optimizer divided by d.
              With fp16 grads (no fp32 accumulation) the optimizer also makes an fp32 copy
              of the grads (4) during its step: counted in `step_transient` (or / d inside
              the distributed optimizer's shard).

Activations saved for backward, per layer and micro-batch. The reference is Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): s*b*h*(34 +
5*a*s/h) bytes for 16-bit activations without parallelism; s*b*h*(10 + 24/t + 5*a*s/(h*t))
with tensor parallelism; s*b*h*(34/t + 5*a*s/(h*t)) with sequence parallelism too. Terms
used here, each checked against the tensors this model's layers actually save
(tests/test_memory_estimate.py):
  boundary (replicated over TP; divided by t with sequence parallelism):
    norm_inputs    2 norm inputs, 2*e*sbh (fp32 with --fp32-residual-connection); eager
                   RMSNorm also keeps x*rstd (+2*e*sbh)
    norm_outputs   the 2 norm outputs that the QKV and fc1 GEMMs save, 2*e*sbh
    norm_stats     mean/rstd in fp32 (small)
    dropout_masks  2 bool masks, 2*sbh, only when --hidden-dropout > 0
  tensor-parallel (divided by t):
    qkv            Q, K, V as the attention kernel sees them: with grouped-query attention
                   K and V have the groups' width (the kernel takes them as groups), or are
                   repeated to all heads first where it cannot (--attention-backend
                   efficient); with rotary embeddings all three are separate tensors (the
                   split-and-rotate operator's outputs); otherwise a view of the fused QKV
                   output keeps all of it alive (see `qkv_saved_width`)
    attention_output  the kernel's output, which is also the projection's input, e*sbh
    attention_logsumexp  flash kernel (default: torch SDPA picks flash/memory-efficient
                   kernels, which never store the s x s scores): 4*a*s*b
    attention_scores  without flash instead: softmax output e*a*s*s*b, plus dropout mask
                   and output (a*s*s*b + e*a*s*s*b) when --attention-dropout > 0 -- the
                   5*a*s/h term of the paper
    mlp            gelu / squared-relu: activation input and fc2 input, 2*e*s*b*f;
                   SwiGLU: fc1 output (2f, saved by the SwiGLU operator) and fc2 input,
                   3*e*s*b*f
  So with e = 2, f = 4h, dropout on and no flash the sum is exactly the paper's
  s*b*h*(34 + 5*a*s/h) (plus the small norm_stats); with flash the 5*a*s/h term is gone.
    switch_mlp     with --num-experts: the router's probabilities, the tokens grouped by
                   expert, the experts' outputs before the scaling (see
                   `switch_mlp_bytes`); the experts' own tensors are the mlp term (every
                   token passes one expert), the E experts' weights are all in P
  selective recompute: the attention core keeps only Q and the unrepeated K, V (compiled
                 layers with --attention-dropout > 0 recompute nothing: as without).
  full recompute: each layer keeps only its input (e*sbh, / t with sequence parallelism),
  plus one layer's full set while it is rebuilt in backward (once per stage, not per
  micro-batch in flight: one micro-batch's backward runs at a time); method block N: N
  layers of each (virtual) pipeline stage.
Outside the layers: the embedding dropout mask (sbh), the final norm's input and output
(2*e*sbh), with rotary embeddings the cos/sin table all layers share (fp32 [2, s, rotary
dim], small), and `logits`: the fp32 logits and their shifted copy inside the vocab-parallel
cross entropy at the forward peak, 2 * 4*s*b*V/t (the saved softmax later becomes the
logits' grad in place). With --reset-attention-mask, per micro-batch in flight: the bool
[b, 1, s, s] mask and the additive bias the layers share and keep for backward,
(1 + e)*b*s*s (not split by TP: every rank holds the whole mask).
Pipeline parallelism (1F1B): stage i keeps min(pp - i, num_micro_batches) micro-batches in
flight, so stage 0 holds about all layers' worth of activations; the interleaved schedule
(v virtual stages) multiplies that by 1 + (pp - 1) / (pp * v) (Korthikanti et al.).

workspace: a fixed 1.5 GiB for the CUDA context, cuBLAS workspaces and NCCL buffers, which
torch.cuda.max_memory_allocated() does not see; `total` includes it, `allocated` does not.

Not counted: the caching allocator's fragmentation, temporaries of one layer's backward
GEMMs, the largest parameter's transient grad before it is added into the grad buffer,
pipeline p2p buffers.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from megatron.config import Config, ModelConfig
from megatron.core.models.gpt.rotary import rotary_dim

GiB = 2**30
# CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers: on the GPU, but not in
# torch.cuda.max_memory_allocated().
WORKSPACE_BYTES = int(1.5 * GiB)


def _act_bytes(config: Config) -> int:
    o = config.optimizer
    return 2 if (o.bf16 or o.fp16) else 4


def qkv_saved_width(n: int, g: int, d: int, rope: bool, repeated: bool = True) -> int:
    """Elements per token that the attention kernel's saved Q, K, V hold on one rank.

    This model splits the fused QKV output [s, b, g, (n/g + 2) * d] into views. A view
    keeps the whole fused output alive ((n + 2g) * d); rotary embeddings (the
    split-and-rotate operator returns three tensors), grouped-query repetition
    (`repeated`: K and V repeated to n heads before the kernel) and a query reshape that
    cannot be a view (1 < g < n) make separate tensors instead.
    """
    q_view = not rope and (g == n or g == 1)
    k_view = not rope and (g == n or not repeated)
    v_view = not rope and (g == n or not repeated)
    width = 0 if q_view else n * d
    if not k_view:
        width += (n if repeated else g) * d
    if not v_view:
        width += (n if repeated else g) * d
    if q_view or k_view or v_view:
        width += (n + 2 * g) * d
    return width


def layer_activation_terms(m: ModelConfig, s: int, b: int, tp: int, sp: bool, e: int,
                           flash_attention: bool = True,
                           compiled: Optional[bool] = None) -> Dict[str, float]:
    """Bytes one transformer layer saves for backward for one micro-batch on one TP rank,
    by term (no recompute). `compiled` None follows `m.compile_layers`. See the module
    docstring for the terms."""
    compiled = m.compile_layers if compiled is None else compiled
    h, a, f = m.hidden_size, m.num_attention_heads, m.ffn_hidden_size
    qd = a * m.kv_channels  # query (and repeated key/value) width
    sbh = s * b * h
    er = 4 if m.fp32_residual_connection else e
    rms = m.normalization == "RMSNorm"
    rope = m.use_rotary_position_embeddings
    bdiv = tp if sp else 1  # boundary terms are split only with sequence parallelism
    terms = {
        "norm_inputs": 2 * er * sbh / bdiv,
        "norm_stats": 2 * (1 if rms else 2) * 4 * s * b / bdiv,
        "norm_outputs": 2 * e * sbh / bdiv,
        "dropout_masks": (2 * sbh if m.hidden_dropout > 0 else 0) / bdiv,
        "qkv": e * s * b * qkv_saved_width(a // tp, m.num_query_groups // tp, m.kv_channels,
                                           rope, repeated=m.attention_backend == "efficient"),
        "attention_output": e * s * b * qd / tp,
    }
    if rms and not compiled:
        terms["norm_inputs"] += 2 * e * sbh / bdiv  # eager composite keeps x * rstd too
    if flash_attention:
        terms["attention_logsumexp"] = 4 * a * s * b / tp
    else:
        scores = a * s * s * b
        dropout = (scores + e * scores) if m.attention_dropout > 0 else 0
        terms["attention_scores"] = (e * scores + dropout) / tp
    mlp_factor = 3 if m.swiglu else 2
    terms["mlp"] = mlp_factor * e * s * b * f / tp
    if m.num_experts:
        terms["switch_mlp"] = switch_mlp_bytes(m, s, b, e)
    return terms


def switch_mlp_bytes(m: ModelConfig, s: int, b: int, e: int) -> float:
    """What the switch MLP (--num-experts E) saves beyond the dense MLP's terms, which
    its experts save together (each token passes one expert): the router's softmax output
    (e*s*b*E), the tokens grouped by expert (e*sbh), the experts' outputs and, with
    biases, their fc2 biases before the scaling by the routing probability (e*sbh each),
    that probability (e*s*b), and three int64 token indices (24*s*b; the grouped expert
    dispatch with biases keeps a fourth, 8*s*b more, not counted). Not split by TP."""
    sbh = s * b * m.hidden_size
    bias = 1 if m.add_bias_linear else 0
    return e * s * b * (m.num_experts + 1) + e * sbh * (2 + bias) + 24 * s * b


def _selective_layer_bytes(m: ModelConfig, s: int, b: int, tp: int, sp: bool, e: int) -> float:
    """A layer with the attention core recomputed: its inputs Q, K, V (unrepeated) are kept
    instead of the kernel's; the projection still saves the recomputed function's output."""
    terms = layer_activation_terms(m, s, b, tp, sp, e, flash_attention=True)
    terms.pop("attention_logsumexp")
    rope = m.use_rotary_position_embeddings
    terms["qkv"] = e * s * b * qkv_saved_width(m.num_attention_heads // tp, m.num_query_groups // tp,
                                               m.kv_channels, rope, repeated=False)
    return sum(terms.values())


def activation_bytes(config: Config, num_layers: int, flash_attention: bool = True) -> float:
    """Activations `num_layers` layers save for ONE micro-batch, with the recompute setting
    (with full recompute: plus the one layer rebuilt in backward)."""
    return sum(_saved_and_rebuilt(config, num_layers, flash_attention))


def _saved_and_rebuilt(config: Config, num_layers: int, flash_attention: bool, chunks: int = 1):
    """(bytes saved for one micro-batch, bytes of the one layer a full recompute rebuilds in
    backward): the rebuild happens for one micro-batch at a time, however many are in flight.
    `chunks`: the virtual pipeline stages the layers form; --recompute-method block counts
    its layers in each of them (every chunk is a transformer block of its own)."""
    m, p, d = config.model, config.parallel, config.data
    s, b, tp, sp = d.seq_length, d.micro_batch_size, p.tp_size, p.sequence_parallel
    e = _act_bytes(config)
    full = sum(layer_activation_terms(m, s, b, tp, sp, e, flash_attention).values())
    # compiled layers keep a dropout attention core out of the selective checkpoint
    if m.recompute_granularity == "selective" and not (m.compile_layers and m.attention_dropout > 0):
        return num_layers * _selective_layer_bytes(m, s, b, tp, sp, e), 0.0
    if m.recompute_granularity == "full":
        n_recomputed = num_layers
        if m.recompute_method == "block":
            n_recomputed = chunks * recomputed_per_chunk(m, num_layers // chunks)
        # the layer input is kept per recomputed layer: split over TP with sequence
        # parallelism or --distribute-saved-activations, whole otherwise
        split = sp or m.distribute_saved_activations
        layer_input = e * s * b * m.hidden_size / (tp if split else 1)
        rebuilt = full if n_recomputed else 0
        return n_recomputed * layer_input + (num_layers - n_recomputed) * full, rebuilt
    return num_layers * full, 0.0


def recomputed_per_chunk(m: ModelConfig, chunk_layers: int) -> int:
    """Layers full recompute rebuilds in a chunk (a pipeline stage, or a virtual one) of
    `chunk_layers`: all with uniform; with block the first --recompute-num-layers, none
    for a count <= 0, all for a count above the chunk's layers."""
    if m.recompute_method == "block":
        return max(0, min(m.recompute_num_layers, chunk_layers))
    return chunk_layers


def recompute_summary(config: Config) -> str:
    """What the run recomputes in backward, in words (every stage with layers has as many:
    the last one is asked, which --standalone-embedding-stage does not leave empty)."""
    from megatron.core.models.gpt.stages import stage_layout

    m, p = config.model, config.parallel
    if m.recompute_granularity == "selective":
        return ("selective recompute (the attention core; none in compiled layers with "
                "attention dropout)" if m.compile_layers and m.attention_dropout > 0 else
                "selective recompute (the attention core)")
    if m.recompute_granularity != "full":
        return "no recompute"
    chunks = stage_layout(m.num_layers, p.pp_size, p.pp_size - 1, p.virtual_pp_size,
                          standalone_embedding_stage=p.standalone_embedding_stage)
    per = chunks[0].num_layers
    n = recomputed_per_chunk(m, per)
    where = (" of each virtual stage" if len(chunks) > 1 else " of each stage"
             if p.pp_size > 1 else "")
    if n == 0:
        return (f"no recompute (--recompute-method block --recompute-num-layers "
                f"{m.recompute_num_layers})")
    if n == per:
        return f"full recompute of every layer ({per}{where})"
    return (f"full recompute of the first {n} of the {per} layers{where} "
            f"(--recompute-method block --recompute-num-layers {m.recompute_num_layers})")


def _head_bytes(config: Config, first: bool, last: bool) -> Dict[str, float]:
    """Embedding and output-layer activations of one micro-batch on a stage."""
    m, p, d = config.model, config.parallel, config.data
    s, b, tp, e = d.seq_length, d.micro_batch_size, p.tp_size, _act_bytes(config)
    sbh_div = s * b * m.hidden_size / (tp if p.sequence_parallel else 1)
    out = {"embedding": 0.0, "final_norm": 0.0, "logits": 0.0, "rotary_table": 0.0}
    if m.use_rotary_position_embeddings:  # cos and sin, fp32 [2, s, rotary dim]
        width = 2 * -(-rotary_dim(m.kv_channels, m.rotary_percent) // 2)
        out["rotary_table"] = 2 * 4 * s * width
    if first and m.hidden_dropout > 0:
        out["embedding"] = sbh_div  # dropout mask
    if last:
        er = 4 if m.fp32_residual_connection else e
        extra = e if (m.normalization == "RMSNorm" and not m.compile_layers) else 0
        stats = (1 if m.normalization == "RMSNorm" else 2) * 4 * s * b
        out["final_norm"] = (er + e + extra) * sbh_div + stats / (tp if p.sequence_parallel else 1)
        out["logits"] = 2 * 4 * s * b * m.padded_vocab_size / tp
    return out


def _mask_bytes(config: Config) -> float:
    """--reset-attention-mask: the bool [b, 1, s, s] mask and the additive bias made of it
    in the activation dtype, which every layer's attention keeps for backward."""
    d = config.data
    if not d.reset_attention_mask:
        return 0.0
    return (1 + _act_bytes(config)) * d.micro_batch_size * d.seq_length ** 2


def _optimizer_bytes_per_param(config: Config) -> Dict[str, float]:
    o, p = config.optimizer, config.parallel
    mixed = o.bf16 or o.fp16
    param_b = 2 if mixed else 4
    grad_b = 4 if (p.accumulate_allreduce_grads_in_fp32 or not mixed) else param_b
    states = 8 if o.optimizer == "adam" else (4 if o.sgd_momentum else 0)
    main = 4 if mixed else 0
    grad_copy = 4 if grad_b != 4 else 0  # fp32 copy of fp16 grads for the step
    return {"weights": param_b, "gradients": grad_b, "optimizer": states + main,
            "grad_copy": grad_copy}


def _stage_params(config: Config) -> List[int]:
    """Parameters on one tensor-parallel rank of each pipeline stage."""
    from megatron.arguments_report import count_parameters  # avoids an import cycle

    p = config.parallel
    return count_parameters(config.model, p.tp_size, p.pp_size,
                            p.standalone_embedding_stage).per_stage


def estimate_stage_memory(config: Config, stage: int = 0, *,
                          use_distributed_optimizer: Optional[bool] = None,
                          flash_attention: bool = True,
                          workspace_bytes: int = WORKSPACE_BYTES,
                          stage_params: Optional[List[int]] = None) -> Dict[str, int]:
    """Peak bytes on one GPU of pipeline stage `stage` (see `estimate_memory`).
    `stage_params`: the parameters per stage when the caller has counted them already."""
    from megatron.core.models.gpt.stages import stage_layout

    m, p, d = config.model, config.parallel, config.data
    if use_distributed_optimizer is None:
        use_distributed_optimizer = p.use_distributed_optimizer
    n_params = (stage_params or _stage_params(config))[stage]
    per = _optimizer_bytes_per_param(config)
    shard = p.dp_size if use_distributed_optimizer else 1
    in_flight = min(p.pp_size - stage, d.num_micro_batches)
    if (p.virtual_pp_size or 1) > 1:  # interleaved 1F1B keeps more warm-up micro-batches
        in_flight *= 1 + (p.pp_size - 1) / (p.pp_size * p.virtual_pp_size)
    layers = sum(s.num_layers for s in stage_layout(
        m.num_layers, p.pp_size, stage, standalone_embedding_stage=p.standalone_embedding_stage))
    head = _head_bytes(config, stage == 0, stage == p.pp_size - 1)
    saved, rebuilt = _saved_and_rebuilt(config, layers, flash_attention,
                                        chunks=p.virtual_pp_size or 1)
    acts = (in_flight * (saved + head["embedding"] + head["final_norm"] + _mask_bytes(config))
            + rebuilt + head["rotary_table"])
    est = {
        "weights": n_params * per["weights"],
        "gradients": n_params * per["gradients"],
        "optimizer": n_params * (per["optimizer"] + (per["grad_copy"] if shard > 1 else 0)) / shard,
        "activations": acts,
        "logits": head["logits"],
        "step_transient": 0 if shard > 1 else n_params * per["grad_copy"],
    }
    static = est["weights"] + est["gradients"] + est["optimizer"]
    est["allocated"] = static + max(est["activations"] + est["logits"], est["step_transient"])
    est["workspace"] = workspace_bytes
    est["total"] = est["allocated"] + workspace_bytes
    return {k: int(round(v)) for k, v in est.items()}


def estimate_memory(config: Config, *, use_distributed_optimizer: Optional[bool] = None,
                    flash_attention: bool = True,
                    workspace_bytes: int = WORKSPACE_BYTES) -> Dict[str, int]:
    """Peak memory per GPU in bytes, for the pipeline stage that needs the most.

    Keys: weights, gradients, optimizer, activations (saved for backward, all in-flight
    micro-batches), logits (fp32 logits + cross-entropy buffer at the forward peak),
    step_transient (fp32 grad copy during the optimizer step, fp16 without fp32
    accumulation), allocated (= weights + gradients + optimizer + max(activations + logits,
    step_transient): comparable with torch.cuda.max_memory_allocated()), workspace (fixed
    allowance), total, stage (the pipeline stage the figures are for).
    `use_distributed_optimizer` None follows the config.
    """
    best: Optional[Dict[str, int]] = None
    params = _stage_params(config)  # once, not once per stage
    for stage in range(config.parallel.pp_size):
        est = estimate_stage_memory(config, stage, use_distributed_optimizer=use_distributed_optimizer,
                                    flash_attention=flash_attention, workspace_bytes=workspace_bytes,
                                    stage_params=params)
        est["stage"] = stage
        if best is None or est["total"] > best["total"]:
            best = est
    return best


def _gb(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def format_memory_report(config: Config, gpu_memory_bytes: Optional[int],
                         source: str = "--gpu-memory-gb") -> List[str]:
    """Lines for `--dry-run`: the breakdown, the figure with the other optimizer choice, and
    a WARNING line when the total exceeds `gpu_memory_bytes` (None: no check)."""
    est = estimate_memory(config)
    dist_opt = config.parallel.use_distributed_optimizer
    other = estimate_memory(config, use_distributed_optimizer=not dist_opt)
    stage = f" (pipeline stage {est['stage']})" if config.parallel.pp_size > 1 else ""
    lines = [
        f"  memory per GPU{stage}, estimate: {_gb(est['total'])} = weights {_gb(est['weights'])}"
        f" + grads {_gb(est['gradients'])} + optimizer {_gb(est['optimizer'])}"
        f" + activations {_gb(est['activations'])} + logits {_gb(est['logits'])}"
        f" + workspace {_gb(est['workspace'])}",
        f"    ({recompute_summary(config)}, sequence parallel "
        f"{'on' if config.parallel.sequence_parallel else 'off'}, "
        f"{'distributed' if dist_opt else 'replicated'} optimizer; with the "
        f"{'replicated' if dist_opt else 'distributed'} optimizer: {_gb(other['total'])})",
    ]
    if est["step_transient"] > est["activations"] + est["logits"]:
        lines.append(f"    (the optimizer step's fp32 grad copy, {_gb(est['step_transient'])}, "
                     "is the peak, not the activations)")
    if gpu_memory_bytes is not None and est["total"] > gpu_memory_bytes:
        lines.append(
            f"WARNING: estimated peak memory {_gb(est['total'])} per GPU exceeds {_gb(gpu_memory_bytes)}"
            f" ({source}); use more tensor/pipeline parallelism, a smaller --micro-batch-size, "
            "--sequence-parallel, activation recompute or the distributed optimizer")
    return lines


def estimate_evaluation_memory(config: Config) -> Dict[str, int]:
    """Peak bytes per GPU of a forward-only evaluation (tasks/main.py), for the pipeline
    stage that needs the most: the weights (no gradients, no optimizer), one layer's
    tensors of one micro-batch at a time (nothing is kept for a backward; its saved set
    bounds what one layer holds), the last stage's fp32 logits and their softmax
    (`logits`, as in training), and the fixed workspace. Keys: weights, activations,
    logits, allocated, workspace, total, stage."""
    p = config.parallel
    params = _stage_params(config)
    weight_bytes = 2 if (config.optimizer.bf16 or config.optimizer.fp16) else 4
    layer = activation_bytes(dataclasses.replace(
        config, model=dataclasses.replace(config.model, recompute_granularity=None)), 1)
    best: Optional[Dict[str, int]] = None
    for stage in range(p.pp_size):
        head = _head_bytes(config, stage == 0, stage == p.pp_size - 1)
        est = {"weights": params[stage] * weight_bytes,
               "activations": layer + head["embedding"] + head["final_norm"]
               + head["rotary_table"],
               "logits": head["logits"]}
        est["allocated"] = est["weights"] + est["activations"] + est["logits"]
        est["workspace"] = WORKSPACE_BYTES
        est["total"] = est["allocated"] + WORKSPACE_BYTES
        est = {k: int(round(v)) for k, v in est.items()}
        est["stage"] = stage
        if best is None or est["total"] > best["total"]:
            best = est
    return best


def format_evaluation_memory_report(config: Config, gpu_memory_bytes: Optional[int],
                                    source: str = "--gpu-memory-gb") -> List[str]:
    """Lines for an evaluation's `--dry-run` (`estimate_evaluation_memory`), with a
    WARNING line when the total exceeds `gpu_memory_bytes` (None: no check)."""
    est = estimate_evaluation_memory(config)
    stage = f" (pipeline stage {est['stage']})" if config.parallel.pp_size > 1 else ""
    lines = [f"  memory per GPU{stage}, estimate (forward only): {_gb(est['total'])} = weights "
             f"{_gb(est['weights'])} + one layer's activations {_gb(est['activations'])} + "
             f"logits {_gb(est['logits'])} + workspace {_gb(est['workspace'])}"]
    if gpu_memory_bytes is not None and est["total"] > gpu_memory_bytes:
        lines.append(f"WARNING: estimated peak memory {_gb(est['total'])} per GPU exceeds "
                     f"{_gb(gpu_memory_bytes)} ({source}); use more tensor/pipeline "
                     "parallelism or a smaller --micro-batch-size")
    return lines
