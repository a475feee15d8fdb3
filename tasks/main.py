#!/usr/bin/env python
r"""Zero-shot evaluation of a GPT checkpoint, with Megatron-LM's command line:

    torchrun --nproc-per-node 1 tasks/main.py --task WIKITEXT103|LAMBADA \
        --valid-data FILE [--strict-lambada] [--overlapping-eval 32] \
        --load CKPT --no-load-optim --no-load-rng <pretrain_gpt.py's model/tokenizer flags>

The logic is in tasks/zeroshot_gpt/evaluate.py.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    """The command line. Errors the ranks agree on: rank 0 prints them. A rank whose
    collective failed because another rank stopped prints one line naming that rank
    (megatron/rank_failure.py) instead of the backend's traceback; the process group is
    destroyed unless a rank may be gone (all in tasks/zeroshot_gpt/evaluate.py's main)."""
    from pretrain_gpt import _launcher_env
    from tasks.zeroshot_gpt.evaluate import main as evaluate_main

    rank, world, local_rank = _launcher_env()
    evaluate_main(sys.argv[1:] if argv is None else argv, rank, world, local_rank, os.environ)
    return 0


if __name__ == "__main__":
    from megatron.process_exit import run

    run(main)  # sys.exit(main()) without the interpreter's teardown (about a second)
