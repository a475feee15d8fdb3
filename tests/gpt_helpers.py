"""Shared helpers for GPT parity tests: a tiny config and full-tensor reconstruction."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)


def tiny_config(world_size=1, tp=1, pp=1, sp=False, mbs=2, gbs=8, iters=3, lr=1e-3,
                **model_kw) -> Config:
    dp = world_size // (tp * pp)
    seq = model_kw.pop("seq_length", 16)
    model = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                 seq_length=seq, max_position_embeddings=seq, hidden_dropout=0.0,
                 attention_dropout=0.0, use_cpu_initialization=True, sequence_parallel=sp)
    model.update(model_kw)
    decay = iters * gbs
    return Config(
        model=ModelConfig(**model),
        parallel=ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp, world_size=world_size,
                                sequence_parallel=sp),
        optimizer=OptimizerConfig(lr=lr, min_lr=lr / 10, lr_warmup_steps=gbs,
                                  lr_decay_steps=decay, wd_incr_steps=decay,
                                  lr_decay_style="cosine", weight_decay=0.1),
        data=DataConfig(mock_data=True, seq_length=seq, micro_batch_size=mbs,
                        global_batch_size=gbs, num_micro_batches=gbs // (mbs * dp),
                        vocab_size=model["padded_vocab_size"], seed=1234),
        training=TrainingConfig(train_iters=iters, eval_interval=0, eval_iters=0, seed=1234),
        checkpoint=CheckpointConfig(),
        logging=LoggingConfig(log_interval=1000),
        args={},
    )


def full_tensor(param: torch.Tensor, tensor: torch.Tensor, tp_group) -> torch.Tensor:
    """Reassemble the full (TP=1) tensor of a possibly TP-sharded parameter (or its grad),
    honouring `partition_dim` and `partition_stride`."""
    if tp_group is None or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    tp = dist.get_world_size(tp_group)
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=tp_group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [s.chunk(stride, dim=dim) for s in shards]  # pieces[rank][block]
    return torch.cat([pieces[r][b] for b in range(stride) for r in range(tp)], dim=dim)


def full_named_grads(model: torch.nn.Module, tp_group) -> dict:
    """name -> full grad (from `main_grad` when present), as the TP=1 model would have."""
    out = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            continue
        out[name] = full_tensor(p, g.float(), tp_group)
    return out


def cli_trainer(argv, world_size: int = 1, rank: int = 0, cuda_available: bool = False,
                vocab_size_fn=None):
    """(config, runtime, trainer) built from pretrain_gpt.py flags, validated as for the CPU
    unless `cuda_available` (a test that means the GPU where there is one: its CUDA-only
    choices are then checked against CUDA), seeded as pretrain_gpt.py seeds; inside
    run_distributed the process group already exists. `vocab_size_fn`: as
    parse_and_validate's (pretrain_gpt.tokenizer_vocab_size for SentencePiece models)."""
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed, set_random_seed
    from megatron.training import build_trainer

    cfg = parse_and_validate(list(argv), world_size=world_size, env={"RANK": str(rank)},
                             cuda_available=cuda_available, vocab_size_fn=vocab_size_fn)
    rt = initialize_distributed(cfg.parallel, rank, world_size, 0)
    set_random_seed(cfg.training.seed, rt)
    return cfg, rt, build_trainer(cfg, rt)


def train_steps(tr, data, steps: int) -> list:
    """Run `steps` training steps counting iterations; the losses as floats."""
    from megatron.training import train_step

    losses = []
    for _ in range(steps):
        losses.append(float(train_step(tr, data)[0]))
        tr.state.iteration += 1
    return losses


def gloo_trainer_losses(cfg, ps, steps: int = 2):
    """(trainer, losses of `steps` train steps) on the CPU over gloo for the layout `ps`
    (a ParallelState of this rank), seeded as training seeds, reading the train data."""
    from megatron.core.tensor_parallel.random import RNGStatesTracker
    from megatron.initialize import Runtime, set_random_seed
    from megatron.training import build_trainer, data_iterator, train_step

    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(),
                 backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    data = data_iterator(cfg, rt, "train", 0)
    return tr, [float(train_step(tr, data)[0]) for _ in range(steps)]
