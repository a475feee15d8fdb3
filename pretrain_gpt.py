#!/usr/bin/env python
"""Pretrain a GPT model: parse -> validate -> initialise -> build -> train.

Takes Megatron-LM 23.05's command line, e.g.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 16 \
        --lr 3e-4 --train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024

`--dry-run` validates the configuration for $WORLD_SIZE processes and exits.
"""
from __future__ import annotations

import os
import sys
import time


def _launcher_env() -> tuple:
    """(rank, world_size, local_rank) as torchrun / srun set them."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return rank, world, local_rank


def tokenizer_vocab_size(args) -> int:
    """Unpadded vocabulary size of the run's tokenizer (built from its local files). A
    tokenizer that cannot be built is a configuration error (exit status 2)."""
    from megatron.arguments_common import ArgumentsError
    from megatron.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                              merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                              vocab_size=args.vocab_size, vocab_extra_ids=args.vocab_extra_ids)
    except (OSError, ValueError, RuntimeError) as e:
        raise ArgumentsError(f"cannot build the {args.tokenizer_type}: {e}") from None
    return tok.vocab_size


def main(argv=None) -> int:
    start = time.time()
    from megatron.arguments import format_args_dump, parse_and_validate, run_dry_run

    rank, world, local_rank = _launcher_env()
    config = parse_and_validate(sys.argv[1:] if argv is None else argv, world_size=world,
                                vocab_size_fn=tokenizer_vocab_size)
    if config.args.get("dry_run"):
        return run_dry_run(config, world)

    import torch.distributed as dist

    from megatron.agreed_exit import silent_ranks_wait
    from megatron.initialize import initialize_entry_point, set_random_seed
    from megatron.interrupt import INTERRUPTED_STATUS, InterruptWatch, interrupt_message
    from megatron.logging_utils import print_rank_0
    from megatron.oom_report import OutOfMemoryExit
    from megatron.training import pretrain, print_datetime

    rt = initialize_entry_point(config.parallel, config.args["cublas_workspace"], rank, world,
                                local_rank, os.environ)
    if rank == 0:
        print(format_args_dump(config.args), flush=True)
    set_random_seed(config.training.seed, rt, config.training.data_parallel_random_init)
    print_rank_0(f"time to initialize megatron (seconds): {time.time() - start:.3f}")
    print_datetime("after megatron is initialized")
    oom = interrupted = None
    with silent_ranks_wait(os.environ), InterruptWatch() as watch:  # rank 0 prints errors
        try:
            pretrain(config, rt, process_start_time=start)  # exits return here too: status 0
        except OutOfMemoryExit as e:  # reported already
            oom = e
        except BaseException as e:  # Ctrl-C: one line below instead of every rank's traceback
            if not watch.explains(e):
                raise
            interrupted = e
        finally:  # not after an OOM or Ctrl-C: the teardown may wait for ranks still in a
            if dist.is_initialized() and oom is None and interrupted is None:  # collective
                dist.destroy_process_group()  # (the launcher ends those)
    if interrupted is not None:
        if rank == 0 or local_rank == 0:
            print(interrupt_message(getattr(interrupted, "iteration", None),
                                    config.checkpoint.save), flush=True)
        return INTERRUPTED_STATUS
    return 0 if oom is None else oom.code


if __name__ == "__main__":
    sys.exit(main())
