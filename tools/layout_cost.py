"""The layout planner's cost model: a relative step time for one resolved configuration.

This is an estimate from a deliberately simple model, not a measurement. It is meant to
order layouts of ONE model on ONE cluster (tools/plan_layout.py divides by the fastest
layout), so only the ratios of the constants below matter, and only roughly.

Symbols: l layers, h hidden size, s sequence length, V padded vocabulary, B global batch,
b micro batch, m micro-batches per step per data-parallel rank, t / p / d tensor /
pipeline / data-parallel size, v virtual stages per pipeline rank, N = t * p * d GPUs,
e bytes per activation element (2 with --bf16/--fp16, else 4), L = l / p layers on a
pipeline rank (l / (p - 1) with --standalone-embedding-stage).

    step = (compute + tp_comm + p2p + overhead) * (1 + bubble) + dp_exposed

compute     the busiest pipeline stage's FLOPs: the last stage, with its L layers AND the
            logits layer (a pipeline splits the layers, never the logits), over the B s / d
            tokens of its data-parallel rank, / t (tensor parallelism splits both) /
            GPU_FLOPS. With p = 1 that is the whole model's FLOPs per token
            (megatron.logging_utils.model_flops_per_token: 72 l h^2 (1 + s/6h + V/12lh) for
            a GPT with a 4h MLP, more or less with SwiGLU, query groups or another
            --ffn-hidden-size) x B s tokens / N / GPU_FLOPS. Full recompute adds one more
            forward of the layers (24 L h^2 (1 + s/6h) per token for that GPT); selective
            recompute adds the attention core's forward, 4 L s h per token.
tp_comm     per layer and micro-batch 4 collectives of the activation (b s h e bytes): two
            all-reduces in forward, two in backward (6 with full recompute, whose second
            forward repeats them), each moving 2 (t-1)/t of it at NVLINK_BW and costing
            COMM_LATENCY_S whatever its size. With sequence parallelism they become
            all-gathers and reduce-scatters of the same total volume (Korthikanti et al.
            2022), so its cost is the same; its gain is memory. Tensor parallelism stays
            inside a node.
p2p         per micro-batch and virtual stage: one activation forward and one gradient
            backward between pipeline neighbours (/ t with sequence parallelism), at
            NETWORK_BW when the job spans nodes, else NVLINK_BW, each exchange also costing
            COMM_LATENCY_S.
overhead    MICRO_BATCH_OVERHEAD_S per layer and micro-batch (kernel launches and GEMMs too
            small to run at full rate): the simple reason a larger micro batch is faster.
bubble      (p - 1) / (m v), the idle time of 1F1B (interleaved with v > 1) over the busy
            time: (p - 1) / (m v + p - 1) of the step.
dp_exposed  gradient reduction across data-parallel ranks of the largest pipeline stage's
            parameters: an all-reduce of the gradient buffer, 2 (d-1)/d x params x grad
            bytes, or with the distributed optimizer a reduce-scatter of the gradients and
            an all-gather of the parameters, (d-1)/d x params x (grad + param bytes). At
            NETWORK_BW when the data-parallel group spans nodes (t d > GPUs per node), else
            NVLINK_BW. With --overlap-grad-reduce a fraction DP_OVERLAP of it hides behind
            backward; without (the default) none does.

Not modelled: the optimizer step, the first stage's embedding work, stragglers, compute speed-ups of sequence parallelism, GEMM shapes, topology beyond one
intra-node and one inter-node bandwidth.
"""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/layout_cost.py is a library module (the cost model of the layout "
                     "planner); run python tools/plan_layout.py --help")

from typing import NamedTuple, Optional

from megatron.arguments_report import count_parameters
from megatron.config import Config
from megatron.logging_utils import layer_forward_flops

# An H100-class cluster. Sustained matmul rate of one GPU, FLOP/s (bf16; about 40% of an
# H100's dense peak).
GPU_FLOPS = 400e12
# Collective bus bandwidth per GPU inside a node (NVLink), bytes/s.
NVLINK_BW = 300e9
# Collective bus bandwidth per GPU between nodes (one 400 Gb/s NIC per GPU), bytes/s.
NETWORK_BW = 40e9
# Share of the data-parallel gradient reduction hidden behind backward with --overlap-grad-reduce.
DP_OVERLAP = 0.5
# Fixed cost per transformer layer and micro-batch (forward + backward), seconds.
MICRO_BATCH_OVERHEAD_S = 40e-6
# Fixed cost of one NCCL operation on the critical path (a tensor-parallel collective, a
# pipeline send/recv), whatever its size: launch and synchronisation, seconds. What makes
# tensor and pipeline parallelism a loss for a model that needs neither.
COMM_LATENCY_S = 20e-6

# The constants as the planner's --help and report name them.
CONSTANTS = {
    "GPU_FLOPS": f"{GPU_FLOPS / 1e12:.0f} TFLOP/s sustained per GPU",
    "NVLINK_BW": f"{NVLINK_BW / 1e9:.0f} GB/s per GPU inside a node",
    "NETWORK_BW": f"{NETWORK_BW / 1e9:.0f} GB/s per GPU between nodes",
    "DP_OVERLAP": f"{DP_OVERLAP:.0%} of the gradient reduction hidden with --overlap-grad-reduce",
    "MICRO_BATCH_OVERHEAD_S": f"{MICRO_BATCH_OVERHEAD_S * 1e6:.0f} us per layer and micro-batch",
    "COMM_LATENCY_S": f"{COMM_LATENCY_S * 1e6:.0f} us per tensor-parallel collective or "
                      "pipeline send/recv",
}


class StepCost(NamedTuple):
    """Seconds per step by term (see the module docstring); `total` combines them."""

    compute: float
    tp_comm: float
    p2p: float
    overhead: float
    bubble: float  # a fraction, not seconds
    dp_exposed: float
    total: float


def bubble_fraction(pp_size: int, num_micro_batches: int, virtual_pp_size: int = 1) -> float:
    """Pipeline idle fraction (p - 1) / (m v) of the 1F1B schedule."""
    return (pp_size - 1) / (num_micro_batches * virtual_pp_size)


def training_flops_per_token(config: Config, num_layers: Optional[float] = None) -> float:
    """FLOPs per token of one step with the configuration's activation recompute, for
    `num_layers` layers (default: the model's) and the logits layer."""
    m, s = config.model, config.data.seq_length
    layers = m.num_layers if num_layers is None else num_layers
    flops = 3.0 * (layers * layer_forward_flops(m, s) + 2.0 * m.hidden_size * m.padded_vocab_size)
    if m.recompute_granularity == "full":  # the layers' forward once more
        flops += layers * layer_forward_flops(m, s)
    elif m.recompute_granularity == "selective":  # the attention scores and values
        flops += 4.0 * layers * s * m.num_attention_heads * m.kv_channels
    return flops


def _act_bytes(config: Config) -> int:
    o = config.optimizer
    return 2 if (o.bf16 or o.fp16) else 4


def _dp_seconds(config: Config, gpus_per_node: int) -> float:
    """Seconds of the data-parallel gradient reduction (before any overlap)."""
    p, o = config.parallel, config.optimizer
    d = p.dp_size
    if d == 1:
        return 0.0
    params = max(count_parameters(config.model, p.tp_size, p.pp_size,
                                  p.standalone_embedding_stage).per_stage)
    mixed = o.bf16 or o.fp16
    param_b = 2 if mixed else 4
    grad_b = 4 if (p.accumulate_allreduce_grads_in_fp32 or not mixed) else param_b
    if p.use_distributed_optimizer:
        volume = (d - 1) / d * params * (grad_b + param_b)
    else:
        volume = 2 * (d - 1) / d * params * grad_b
    bw = NETWORK_BW if p.tp_size * d > gpus_per_node else NVLINK_BW
    return volume / bw


def step_cost(config: Config, gpus_per_node: int) -> StepCost:
    """Estimated seconds per training step of a validated configuration (see module doc)."""
    m, p, d = config.model, config.parallel, config.data
    tp, pp, dp, vp = p.tp_size, p.pp_size, p.dp_size, p.virtual_pp_size or 1
    gpus = tp * pp * dp
    n_mb = d.num_micro_batches
    act = d.micro_batch_size * d.seq_length * m.hidden_size * _act_bytes(config)
    layers = m.num_layers / (pp - 1 if p.standalone_embedding_stage else pp)
    # The last stage paces the pipeline: its layers and the whole logits layer.
    tokens = d.global_batch_size * d.seq_length / dp
    compute = training_flops_per_token(config, layers) * tokens / tp / GPU_FLOPS
    tp_comm = 0.0
    if tp > 1:
        collectives = n_mb * layers * (6 if m.recompute_granularity == "full" else 4)
        tp_comm = collectives * (2 * (tp - 1) / tp * act / NVLINK_BW + COMM_LATENCY_S)
    p2p = 0.0
    if pp > 1:
        bw = NETWORK_BW if gpus > gpus_per_node else NVLINK_BW
        p2p = n_mb * vp * 2 * (act / (tp if p.sequence_parallel else 1) / bw + COMM_LATENCY_S)
    overhead = n_mb * layers * MICRO_BATCH_OVERHEAD_S
    bubble = bubble_fraction(pp, n_mb, vp)
    hidden = DP_OVERLAP if p.overlap_grad_reduce else 0.0
    dp_exposed = (1 - hidden) * _dp_seconds(config, gpus_per_node)
    total = (compute + tp_comm + p2p + overhead) * (1 + bubble) + dp_exposed
    return StepCost(compute, tp_comm, p2p, overhead, bubble, dp_exposed, total)
