"""The command line the CLI tests start from (BASE: a tiny model on mock data) and the
helpers that parse and validate it as pretrain_gpt.py does, on a machine without CUDA."""
from __future__ import annotations

import pytest

from megatron.arguments import ArgumentsError, parse_and_validate

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 "
        "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data").split()


def run(extra="", world_size=1, base=BASE, **kw):
    argv = list(base) + (extra.split() if isinstance(extra, str) else list(extra))
    kw.setdefault("cuda_available", False)
    return parse_and_validate(argv, world_size=world_size, env={}, **kw)


def error_of(extra="", world_size=1, base=BASE, **kw) -> str:
    with pytest.raises(ArgumentsError) as info:
        run(extra, world_size, base, **kw)
    assert info.value.code == 2
    return info.value.message


def without(flag, base=BASE):
    """BASE minus one flag and its value."""
    out = list(base)
    i = out.index(flag)
    del out[i:i + 2]
    return out
