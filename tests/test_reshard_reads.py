"""Which shard files a rank of another layout reads when it reshards a checkpoint on load.

Each rank opens the files holding parts of its own parameters: the saved pipeline stages
of its layers, the saved tp ranks whose slices overlap its own (a fused swiglu weight
too: its split is the same within each of its blocks), one saved tp rank for a
replicated parameter. It opened all tp x pp of them: a 512-rank job resuming a tp 8 x
pp 16 checkpoint made 65k opens of 128 files on the shared file system. The payloads are
bit-identical to those merged from every file.
"""
from __future__ import annotations

import os

import pytest

from megatron import checkpoint_reshard as reshard
from megatron import checkpoint_source
from tests.dist_utils import run_distributed
from tests.test_checkpoint_util import _assert_same
from tests.test_reshard import _load_and_continue, _save_and_continue
from tools.checkpoint_convert import _stage_modules

SOURCE = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --swiglu"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tp 2 x pp 2 checkpoint (swiglu, distributed optimizer) after two steps."""
    root = str(tmp_path_factory.mktemp("reads") / "ckpt")
    run_distributed(_save_and_continue, 4, f"{SOURCE} --use-distributed-optimizer", root)
    return root


def _recording(monkeypatch) -> list:
    """The rank directories of the files SourceCheckpoint opens, in order."""
    opened, real = [], checkpoint_source.load_shard

    def load(path):
        opened.append(os.path.basename(os.path.dirname(path)))
        return real(path)

    monkeypatch.setattr(checkpoint_source, "load_shard", load)
    return opened


def _payloads(iter_dir, tp, pp, padded_vocab):
    """Every target rank of tp x pp: ((tp rank, pp rank), payloads, rank dirs opened),
    each rank from a SourceCheckpoint of its own (as a training run's rank builds it)."""
    layout, _, first = reshard.inspect_checkpoint(iter_dir)
    config = reshard.config_from_args(first["args"], padded_vocab_size=padded_vocab)
    out = []
    for p in range(pp):
        modules, offsets = _stage_modules(config, pp, p, 1, False)
        for t in range(tp):
            plan = reshard.plan_rank(modules, offsets, tp, t, (pp, p), module_tp_size=1)
            with pytest.MonkeyPatch.context() as mp:
                opened = _recording(mp)
                src = reshard.SourceCheckpoint(iter_dir, layout, first["args"])
                payloads = reshard.build_rank_payload(src, plan, "distributed", set())
            out.append(((t, p), payloads, set(opened)))
    return out


def _dirs(*ranks):
    return {f"mp_rank_{t:02d}_{p:03d}" for t, p in ranks}


@pytest.mark.parametrize("tp,pp,vocab,expected", [
    (1, 2, 128, {(0, 0): _dirs((0, 0), (1, 0)), (0, 1): _dirs((0, 1), (1, 1))}),
    (2, 1, 128, {(0, 0): _dirs((0, 0), (0, 1)), (1, 0): _dirs((1, 0), (1, 1))}),
    # 128 vocabulary rows padded to 256 at tp 4: rank 1's rows 64-127 are saved rank 1's;
    # ranks 2 and 3 hold padding rows, copies of the last saved row (saved rank 1's)
    (4, 1, 256, {(0, 0): _dirs((0, 0), (0, 1)), (1, 0): _dirs((0, 0), (0, 1), (1, 0)),
                 (2, 0): _dirs((1, 0), (1, 1)), (3, 0): _dirs((1, 0), (1, 1))}),
], ids=["tp1xpp2", "tp2xpp1", "tp4xpp1"])
def test_each_rank_reads_only_the_files_of_its_parameters(saved, tp, pp, vocab, expected):
    iter_dir = reshard.locate_iteration(saved, note=lambda _: None)[0]
    built = _payloads(iter_dir, tp, pp, vocab)
    assert {rank: opened for rank, _, opened in built} == expected
    with pytest.MonkeyPatch.context() as mp:  # the reference: every file merged, as before
        whole = reshard.SourceCheckpoint._sources
        mp.setattr(reshard.SourceCheckpoint, "_sources",
                   lambda self, name, part, target, local: whole(self, name, part, None, None))
        reference = _payloads(iter_dir, tp, pp, vocab)
    for (rank, payloads, opened), (_, expect, every) in zip(built, reference):
        assert every >= opened  # the reference read every tp rank of the stages
        _assert_same(payloads, expect, f"rank {rank}")


def _load_recording(rank, world, extra, root):
    """_load_and_continue's conversion note and the rank directories this rank opened."""
    mp = pytest.MonkeyPatch()
    opened = _recording(mp)
    try:
        _, converted = _load_and_continue(rank, world, extra, root)
    finally:
        mp.undo()
    return converted, sorted(set(opened))


def test_a_training_run_reads_its_own_stages_files(saved):
    """tp 2 x pp 2 resumed at tp 2 x pp 1: each rank reads its tp rank's file of both
    stages (the first rank's file is read by rank 0 alone, for the checks)."""
    results = run_distributed(_load_recording, 2, "--tensor-model-parallel-size 2 "
                              "--swiglu --use-distributed-optimizer", saved)
    assert [opened for _, opened in results] == [sorted(_dirs((0, 0), (0, 1))),
                                                 sorted(_dirs((1, 0), (1, 1)))]
    assert "converted from 2 of 4 shard file(s)" in results[0][0], results[0][0]
