"""Values a command-line fuzzer found accepted by validation and failing later: nan / inf
floats (each comparison with NaN is False), a zero or negative --rotary-base, --gpu-memory-gb
or --layernorm-epsilon, a --seed beyond numpy's 2**32 - 1. Each is now an error naming the flag
and the value."""
from __future__ import annotations

import pytest

from tests.args_helpers import error_of, run


@pytest.mark.parametrize("extra, expected", [
    # a traceback at model build before: int(kv_channels * nan)
    ("--use-rotary-position-embeddings --rotary-percent nan",
     "--rotary-percent nan is not a finite number"),
    # NaN loss at the second iteration before
    ("--lr inf", "--lr inf is not a finite number"),
    ("--lr nan", "--lr nan is not a finite number"),
    ("--init-method-std inf", "--init-method-std inf is not a finite number"),
    ("--hidden-dropout nan", "--hidden-dropout nan is not a finite number"),
    # OverflowError in --dry-run's memory report / the whole-number check before
    ("--gpu-memory-gb inf", "--gpu-memory-gb inf is not a finite number"),
    ("--fp16 --loss-scale-window inf", "--loss-scale-window inf is not a finite number"),
    # ValueError / OverflowError mapping the deprecated flag before
    ("--warmup nan", "--warmup nan is not a finite number"),
    ("--warmup inf", "--warmup inf is not a finite number"),
])
def test_non_finite_float_is_an_error(extra, expected):
    assert expected in error_of(extra)


@pytest.mark.parametrize("extra, expected", [
    # NaN loss at the first iteration before (inverse frequencies 1 / 0 ** x)
    ("--use-rotary-position-embeddings --rotary-base 0", "--rotary-base 0.0 must be > 0"),
    ("--use-rotary-position-embeddings --rotary-base -1", "--rotary-base -1.0 must be > 0"),
    # "estimated peak memory ... exceeds -1.0 GiB" before
    ("--gpu-memory-gb -1", "--gpu-memory-gb -1.0 must be > 0"),
    ("--gpu-memory-gb 0", "--gpu-memory-gb 0.0 must be > 0"),
    ("--layernorm-epsilon -1", "--layernorm-epsilon -1.0 must be >= 0"),
])
def test_out_of_range_value_is_an_error(extra, expected):
    assert expected in error_of(extra)


@pytest.mark.parametrize("extra", ["--clip-grad inf",
                                   "--use-rotary-position-embeddings --rotary-percent inf",
                                   "--layernorm-epsilon 0", "--gpu-memory-gb 0.5"])
def test_meaningful_values_still_pass(extra):
    run(extra)


@pytest.mark.parametrize("extra, world_size, largest", [
    ("--seed 4294967296", 1, 4294967296),
    ("--seed 4294967295 --pipeline-model-parallel-size 2", 2, 4294967395),
    ("--seed 4294967200 --pipeline-model-parallel-size 2 --data-parallel-random-init", 4,
     4294967310),
])
def test_seed_beyond_numpy_range_is_an_error(extra, world_size, largest):
    # a ValueError traceback from np.random.seed on every rank before
    message = error_of(extra, world_size=world_size)
    assert f"the last rank seeds numpy with {largest}" in message
    assert "pass a --seed of at most" in message


def test_largest_seed_numpy_takes_passes():
    run("--seed 4294967195 --pipeline-model-parallel-size 2", world_size=2)


def test_mock_data_needs_two_token_ids():
    # MockGPTDataset's ValueError traceback when the datasets were built, before
    message = error_of("--vocab-size 1")
    assert "--vocab-size 1 must be >= 2 (--mock-data's token ids are drawn below it)" in message
    run("--vocab-size 2")
