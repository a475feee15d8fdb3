"""Configuration dataclasses used by the library (`megatron.core`).

The driver (`megatron/arguments.py`) turns command-line flags into these objects once;
library components receive the one they need. Field names follow the flag names
(`--num-layers` -> `num_layers`) except where STYLE.md asks for one short name per
concept (`tp_size`, `pp_size`, `dp_size`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch is imported where a config is made, not for `--help`
    import torch


@dataclass
class ModelConfig:
    """Shape and numerics of the GPT model."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    seq_length: int
    max_position_embeddings: int
    ffn_hidden_size: Optional[int] = None  # None -> 4 * hidden (or the SwiGLU rule)
    kv_channels: Optional[int] = None  # None -> hidden // heads
    num_query_groups: Optional[int] = None  # grouped-query attention; None -> heads
    # "learned_absolute" | "rope" | "none" | "rope+learned" (both: the learned table added to
    # the word embedding and q, k rotated in every layer -- Megatron-LM 23.05's
    # --use-rotary-position-embeddings without --no-position-embedding)
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    layernorm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    apply_residual_connection_post_layernorm: bool = False
    activation: str = "gelu"  # "gelu" | "openai_gelu" | "squared_relu" | "swiglu"
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    untie_embeddings_and_output_weights: bool = False
    # --num-experts E: every layer's MLP is a top-1 switch MLP of E experts (Megatron-LM
    # 23.05's SwitchMLP; transformer.SwitchMLP). None: the dense MLP.
    num_experts: Optional[int] = None
    init_method_std: float = 0.02
    init_method_xavier_uniform: bool = False
    init_seed: int = 1234
    # False (--no-initialization): weights are allocated but not initialised (a checkpoint
    # overwrites them).
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    params_dtype: Optional[torch.dtype] = None  # None -> torch.float32
    fp32_residual_connection: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    fp16_lm_cross_entropy: bool = False
    embedding_weights_in_fp32: bool = False
    sequence_parallel: bool = False
    async_tensor_model_parallel_allreduce: bool = True
    # Weight grads of the parallel linear layers are added straight into `param.main_grad`
    # (the data-parallel grad buffer) instead of producing `.grad`.
    gradient_accumulation_fusion: bool = False
    # Activation recompute: None | "full" | "selective"; method None | "uniform" | "block".
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: int = 1
    # With full recompute and tp > 1 (no sequence parallel): each TP rank keeps only 1/tp
    # of every recomputed layer's input until backward.
    distribute_saved_activations: bool = False
    # torch.compile of each transformer layer (regional compile); off on CPU by default.
    compile_layers: bool = False
    # torch.compile mode for the layers: "default", "reduce-overhead" (CUDA graphs per
    # layer), "max-autotune-no-cudagraphs".
    compile_mode: str = "default"
    # "layer": one compiled graph shared by the layers (each from its input norm to the next
    # norm); "block": the stage's layer stack as one graph
    # (the argument layer resolves --compile-scope auto to one of them).
    compile_scope: str = "layer"
    # scaled_dot_product_attention kernel: "auto" (torch picks), "flash", "cudnn",
    # "efficient" or "math".
    attention_backend: str = "auto"
    # Output layer + cross entropy: "auto" (Triton passes over the logits that write their
    # gradient in place, per vocabulary slice under TP, when Triton can run), "torch",
    # "triton".
    cross_entropy_kernel: str = "auto"
    # GeLU (erf form): "torch", "polynomial" (megatron/core/fused_activation.py: Triton
    # kernels on CUDA, torch ops elsewhere), or "auto" (polynomial where Triton runs);
    # "epilogue": the tanh form, after fc1's bias, inside the MLP's products (gemm_algos,
    # cuBLASLt on CUDA), also auto's choice for the tanh-form activation ("openai_gelu").
    gelu_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.params_dtype is None:
            import torch

            self.params_dtype = torch.float32
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        heads, groups = self.num_attention_heads, self.num_query_groups
        if groups < 1 or heads % groups:
            # else the first forward fails in a view of the QKV product naming neither
            raise ValueError(
                f"num_query_groups={groups} must divide num_attention_heads={heads} (each "
                f"key/value head serves the same number of query heads); choose one of "
                f"{[d for d in range(1, heads + 1) if heads % d == 0]}")

    @property
    def swiglu(self) -> bool:
        return self.activation == "swiglu"

    @property
    def add_position_embedding(self) -> bool:
        """A learned absolute position table is added to the word embedding."""
        return self.position_embedding_type in ("learned_absolute", "rope+learned")

    @property
    def use_rotary_position_embeddings(self) -> bool:
        """Queries and keys are rotated in every attention layer."""
        return self.position_embedding_type in ("rope", "rope+learned")


def position_embedding_type_for(use_rotary: bool, add_position_embedding: bool) -> str:
    """The `position_embedding_type` of Megatron-LM 23.05's two switches
    (--use-rotary-position-embeddings, and --no-position-embedding turning off the other)."""
    if use_rotary:
        return "rope+learned" if add_position_embedding else "rope"
    return "learned_absolute" if add_position_embedding else "none"


@dataclass
class ParallelConfig:
    """Sizes of the parallel grid. `dp_size` is derived from the world size."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    world_size: int = 1
    ep_size: int = 1  # expert-model-parallel size, carved out of dp
    virtual_pp_size: Optional[int] = None
    sequence_parallel: bool = False
    standalone_embedding_stage: bool = False
    overlap_p2p_comm: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    # Distributed optimizer only: the parameter all-gather after the step runs while the
    # next forward pass starts (each module waits for its own parameters).
    overlap_param_gather: bool = False
    ddp_impl: str = "local"
    ddp_bucket_size: Optional[int] = None
    accumulate_allreduce_grads_in_fp32: bool = False
    distributed_timeout_minutes: int = 10


@dataclass
class OptimizerConfig:
    """Optimizer, mixed precision and learning-rate schedule.

    Schedule lengths are in samples, as Megatron counts them (see the scheduler).
    """

    optimizer: str = "adam"  # "adam" | "sgd"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    lr_decay_style: str = "linear"
    lr_warmup_steps: float = 0  # samples; fractional from --lr-warmup-fraction (as Megatron)
    lr_decay_steps: int = 1  # samples
    wd_incr_steps: int = 1  # samples
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    # Mixed precision
    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None  # static scale when set
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    log_num_zeros_in_grad: bool = False
    use_fused: Optional[bool] = None  # None: fused Adam when params are on CUDA
    # AdamW kernel: "auto" (Triton multi-tensor kernel that also writes the 16-bit model
    # params, when it can run), "torch" (torch's fused/foreach AdamW), "triton" (insist).
    adam_kernel: str = "auto"

    @property
    def params_dtype(self) -> torch.dtype:
        import torch

        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32


__all__ = ["ModelConfig", "ParallelConfig", "OptimizerConfig", "field", "position_embedding_type_for"]
