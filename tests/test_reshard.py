"""Resharding checkpoints between parallel layouts (megatron/checkpoint_reshard.py).

1. On load: a checkpoint saved with one (tp, pp, dp, optimizer) layout loads into
   another -- TP2 -> TP1, PP2 x DP2 with the distributed optimizer -> one process with the
   plain one, DP2 distributed -> TP2 x PP2 plain -- model AND optimizer state, and the next
   training losses equal those of the saving run continuing in its own layout. Tolerance:
   fp32 on CPU, a different reduction order -> rtol 1e-5.
2. Offline: `tools/checkpoint_convert.py reshard` (TP2 -> PP2 x 2 virtual stages with the
   distributed optimizer) writes a checkpoint that loads WITHOUT resharding and gives the
   same losses; every file of every checkpoint loads with torch.load(weights_only=True).
3. Units: the payload of every rank of a TP2 x PP2 x 2-virtual-stage layout carries the
   exact slices of the full tensors (model, fp32 main weights, Adam moments, step), the
   vocabulary is re-padded, mismatched models are refused, and `--use-checkpoint-args`
   fills the model flags left unset.
"""
from __future__ import annotations

import errno
import os
import shutil
from functools import lru_cache

import pytest
import torch

from megatron import checkpoint_reshard as reshard
from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.checkpointing import MODEL_FILENAME, rank_dir_name
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.initialize import initialize_distributed, set_random_seed
from megatron.trainer_checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed
from tests.write_faults import torch_save_over_quota
from tools import checkpoint_convert
from tools.interruptible import INTERRUPTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# vocab 127 + EOD = 128 rows: padded to 128 at tp 1 and tp 2 alike (multiples of 64 x tp)
BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 "
        "--train-iters 8 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
        "--make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0 "
        "--use-cpu-initialization --weight-decay 0.1 --lr-warmup-iters 1 --num-workers 0")
SAVE_AT, STEPS_AFTER = 2, 2
RTOL = 1e-5


def _trainer(rank, world, extra, save=None, load=None):
    cfg = parse_and_validate(f"{BASE} {extra}".split(), world_size=world,
                             env={"RANK": str(rank)}, cuda_available=False)
    cfg.checkpoint.save, cfg.checkpoint.load = save, load
    rt = initialize_distributed(cfg.parallel, rank, world, 0)
    set_random_seed(cfg.training.seed, rt)
    return cfg, rt, build_trainer(cfg, rt)


def _steps(tr, data, n):
    losses = []
    for _ in range(n):
        loss, ok, _, _ = train_step(tr, data)
        assert ok
        tr.state.iteration += 1
        tr.state.consumed_train_samples += tr.config.data.global_batch_size
        losses.append(float(loss))
    return losses


def _save_and_continue(rank, world, extra, root):
    """Train SAVE_AT steps, save, train STEPS_AFTER more: the losses after the save."""
    cfg, rt, tr = _trainer(rank, world, extra, save=root)
    data = data_iterator(cfg, rt, "train", 0)
    _steps(tr, data, SAVE_AT)
    save_trainer_checkpoint(tr)
    return _steps(tr, data, STEPS_AFTER)


def _load_and_continue(rank, world, extra, root):
    """(losses of STEPS_AFTER steps after loading `root`, the conversion note or None)."""
    cfg, rt, tr = _trainer(rank, world, extra, load=root)
    converted = load_trainer_checkpoint(tr)
    assert tr.state.iteration == SAVE_AT
    assert tr.state.consumed_train_samples == SAVE_AT * cfg.data.global_batch_size
    data = data_iterator(cfg, rt, "train", tr.state.consumed_train_samples)
    return _steps(tr, data, STEPS_AFTER), converted


def _run(fn, world, *args):
    """`fn` on `world` gloo processes (in this process when world == 1); the last rank's
    result (it holds the last pipeline stage, whose losses are the model's)."""
    if world == 1:
        return fn(0, 1, *args)
    return run_distributed(fn, world, *args)[-1]


@lru_cache(maxsize=None)
def _saved(extra: str, world: int, root: str):
    return _run(_save_and_continue, world, extra, root)


def _check_weights_only(root):
    count = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".pt"):
                torch.load(os.path.join(dirpath, name), weights_only=True)
                count += 1
    assert count > 0


# ------------------------------------------------------------------- 1. resharding on load
LLAMA = ("--swiglu --group-query-attention --num-query-groups 2 --normalization RMSNorm "
         "--untie-embeddings-and-output-weights --position-embedding-type rope")


@pytest.mark.parametrize("src,src_world,dst,dst_world,rtol", [
    ("--tensor-model-parallel-size 2", 2, "", 1, RTOL),
    ("--pipeline-model-parallel-size 2 --use-distributed-optimizer", 4, "", 1, RTOL),
    ("--use-distributed-optimizer", 2,
     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 4, RTOL),
    (f"--tensor-model-parallel-size 2 --sequence-parallel {LLAMA}", 2,
     f"--pipeline-model-parallel-size 2 --use-distributed-optimizer {LLAMA}", 2, RTOL),
    # bf16 weights, fp32 main weights: the mixed-precision payload to the distributed one;
    # bf16 forward/backward in another reduction order -> bf16 tolerance
    ("--tensor-model-parallel-size 2 --bf16", 2, "--use-distributed-optimizer --bf16", 1,
     1e-4),
], ids=["tp2-to-tp1", "pp2xdp2-distributed-to-1", "dp2-distributed-to-tp2xpp2",
        "tp2-sp-llama-to-pp2-distributed", "tp2-bf16-mixed-to-1-distributed"])
def test_reshard_on_load_continues_with_same_losses(tmp_path_factory, src, src_world, dst,
                                                    dst_world, rtol):
    root = str(tmp_path_factory.getbasetemp() / f"src-{src_world}-{src.replace(' ', '')}")
    expected = _saved(src, src_world, root)
    _check_weights_only(root)
    losses, converted = _run(_load_and_continue, dst_world, dst, root)
    assert converted is not None and "resharded" in converted
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=rtol, atol=0)
    if dst_world == 1 and rtol == RTOL:  # the comparison sees the optimizer state: without
        # it the first loss (the loaded weights) is the same, the second one differs
        fresh, _ = _run(_load_and_continue, 1, f"{dst} --no-load-optim", root)
        assert fresh[0] == pytest.approx(expected[0], rel=RTOL)
        assert abs(fresh[1] - expected[1]) > 100 * RTOL * abs(expected[1])


def test_same_layout_loads_without_resharding(tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    expected = _saved("--tensor-model-parallel-size 2", 2, root)
    losses, converted = _run(_load_and_continue, 2, "--tensor-model-parallel-size 2", root)
    assert converted is None
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)


def test_a_checkpoint_missing_rank_directories_is_named_incomplete(tmp_path_factory,
                                                                    tmp_path):
    """A tp-2 checkpoint copied without mp_rank_01 read as a tp-1 one: the load resharded
    it and stopped on the first shape, telling the user the model flags differ; the tools
    did the same. Its stored arguments say tp 2: the missing directory is named."""
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    part = tmp_path / "part"
    shutil.copytree(root, part)
    iter_dir = part / "iter_0000002"
    shutil.rmtree(iter_dir / "mp_rank_01")
    expected = (f"error: checkpoint {iter_dir} is incomplete: mp_rank_01 is missing (found "
                "mp_rank_00; its arguments say tensor-model-parallel size 2 and "
                "pipeline-model-parallel size 1). It was copied in part")
    with pytest.raises(SystemExit) as err:
        reshard.inspect_checkpoint(str(iter_dir))
    assert str(err.value.code).startswith(expected)
    with pytest.raises(SystemExit) as err:
        _run(_load_and_continue, 1, "", str(part))
    assert str(err.value.code).startswith(expected)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(["to-hf", "--load", str(part), "--output", str(tmp_path / "hf")])
    assert str(err.value.code).startswith(expected)
    (iter_dir / "mp_rank_01").mkdir()  # the directory is there, its file is not
    with pytest.raises(SystemExit) as err:
        _run(_load_and_continue, 1, "", str(part))
    assert str(err.value.code).startswith(
        f"error: checkpoint {iter_dir} is incomplete: mp_rank_01/model_optim_rng.pt is missing "
        "(the directories say tp 2 x pp 1). It was copied in part")
    # a gap in the grid the directories span: pipeline stage 1 of 2 (none stored arguments)
    gap = tmp_path / "gap" / "iter_0000005"
    for name in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_01_001"):
        (gap / name).mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"incomplete: mp_rank_00_001 is missing \(found "
                                         r"mp_rank_00_000, mp_rank_01_000, mp_rank_01_001\)\."):
        reshard.scan_layout(str(gap))
    shutil.rmtree(gap / "mp_rank_01_001")  # the suffix means pp >= 2
    with pytest.raises(SystemExit, match="incomplete: mp_rank_00_001, mp_rank_01_001 are "
                                         "missing"):
        reshard.scan_layout(str(gap))


# ----------------------------------------------------------------------- 2. offline tool
def test_offline_reshard_loads_without_conversion(tmp_path_factory, tmp_path, capsys):
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    expected = _saved("--tensor-model-parallel-size 2", 2, root)
    out = str(tmp_path / "pp2-vpp2")
    assert checkpoint_convert.main([
        "reshard", "--load", root, "--save", out, "--target-tensor-model-parallel-size", "1",
        "--target-pipeline-model-parallel-size", "2",
        "--target-num-layers-per-virtual-pipeline-stage", "1",
        "--target-use-distributed-optimizer"]) == 0
    assert "-> " in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(os.path.join(out, "iter_0000002"))) == \
        ["mp_rank_00_000", "mp_rank_00_001"]
    _check_weights_only(out)
    layout = reshard.read_layout(os.path.join(out, "iter_0000002"))
    assert layout == reshard.Layout(1, 2, 2, "distributed")
    dst = ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
           "--use-distributed-optimizer")
    losses, converted = _run(_load_and_continue, 2, dst, out)
    assert converted is None  # the layouts match: the plain load path
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
    with pytest.raises(SystemExit, match="--save must differ"):
        checkpoint_convert.main(["reshard", "--load", out, "--save", out,
                                 "--target-tensor-model-parallel-size", "1",
                                 "--target-pipeline-model-parallel-size", "1"])
    with pytest.raises(SystemExit, match="does not divide"):
        checkpoint_convert.main(["reshard", "--load", out, "--save", str(tmp_path / "x"),
                                 "--target-tensor-model-parallel-size", "1",
                                 "--target-pipeline-model-parallel-size", "2",
                                 "--target-num-layers-per-virtual-pipeline-stage", "3"])
    # no virtual stages at pp 1 (pretrain_gpt.py refuses them; this wrote "pp 1, 2 virtual
    # stages") nor of 0 layers (it said "0 does not divide the 4 layers"): leave it out
    for pp, size, words in [("1", "2", r"2 needs a target pipeline-parallel size >= 2 \(it is 1;"),
                            ("2", "0", "0 must be >= 1 .*leave the flag out")]:
        with pytest.raises(SystemExit, match=words):
            checkpoint_convert.main(["reshard", "--load", out, "--save", str(tmp_path / "v"),
                                     "--target-pipeline-model-parallel-size", pp,
                                     "--target-num-layers-per-virtual-pipeline-stage", size])
        assert not os.path.exists(tmp_path / "v")
    # sizes that do not split the model: refused before any file is written
    for tp, pp, words in [(3, 1, "--target-tensor-model-parallel-size 3 does not divide the "
                                 "saved model's --num-attention-heads 4 and --ffn-hidden-size 128"),
                          (2, 3, "--target-pipeline-model-parallel-size 3 does not divide the "
                                 "saved model's 4 layers")]:
        with pytest.raises(SystemExit, match=words):
            checkpoint_convert.main(["reshard", "--load", out, "--save", str(tmp_path / "y"),
                                     "--target-tensor-model-parallel-size", str(tp),
                                     "--target-pipeline-model-parallel-size", str(pp)])
        assert not os.path.exists(tmp_path / "y")


def test_offline_reshard_keeps_a_target_size_left_out(tmp_path_factory, tmp_path):
    """Only --target-pipeline-model-parallel-size given: the saved tp (2) is kept; neither
    given: an error naming both flags, nothing written."""
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    out = str(tmp_path / "tp2pp2")
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", out,
                                    "--target-pipeline-model-parallel-size", "2"]) == 0
    assert reshard.read_layout(os.path.join(out, "iter_0000002")).tp == 2
    assert reshard.read_layout(os.path.join(out, "iter_0000002")).pp == 2
    with pytest.raises(SystemExit, match="--target-tensor-model-parallel-size and/or "
                                         "--target-pipeline-model-parallel-size"):
        checkpoint_convert.main(["reshard", "--load", root, "--save", str(tmp_path / "z")])
    assert not os.path.exists(tmp_path / "z")
    # only the optimizer's form (or only the virtual stages) was refused as 'no target'
    out = str(tmp_path / "distopt")
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", out,
                                    "--target-use-distributed-optimizer"]) == 0
    assert reshard.read_layout(os.path.join(out, "iter_0000002")) == \
        reshard.Layout(2, 1, 1, "distributed")
    # Megatron-LM's checkpoint_util.py spelling, without -model-, is taken too
    out = str(tmp_path / "tp1")
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", out,
                                    "--target-tensor-parallel-size", "1"]) == 0
    assert reshard.read_layout(os.path.join(out, "iter_0000002")).tp == 1


def test_offline_reshard_holds_one_target_rank_in_memory_at_a_time(tmp_path_factory, tmp_path,
                                                                    monkeypatch):
    """A big model is resharded on a node with little more RAM than the checkpoint: the
    payload of a target rank written must be freed before the next rank's is built."""
    import gc
    import weakref

    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    build, alive, built = reshard.build_rank_payload, [], []

    def tracked(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in built))
        payload, distrib = build(*args, **kwargs)
        built.append(weakref.ref(next(iter(payload["model"].values()))))
        return payload, distrib

    monkeypatch.setattr(reshard, "build_rank_payload", tracked)
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", str(tmp_path / "o"),
                                    "--target-tensor-model-parallel-size", "2",
                                    "--target-pipeline-model-parallel-size", "2"]) == 0
    assert alive == [0, 0, 0, 0]


def test_fp32_reshard_makes_no_unused_copy_of_the_weights(tmp_path_factory, tmp_path,
                                                         monkeypatch):
    """An fp32 optimizer's main weights are the model weights: a target rank's payload cuts
    each weight once (for the model), not a second time as a main weight nobody saves."""
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    cut, weight_cuts, state_cuts = reshard._cut, [], []

    def counting(plan, name, full, notes, weights=True):
        (weight_cuts if weights else state_cuts).append(name)
        return cut(plan, name, full, notes, weights)

    monkeypatch.setattr(reshard, "_cut", counting)
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", str(tmp_path / "o"),
                                    "--target-tensor-model-parallel-size", "1"]) == 0
    assert reshard.read_layout(str(tmp_path / "o" / "iter_0000002")).optimizer == "fp32"
    assert len(state_cuts) == 2 * len(weight_cuts) > 0  # exp_avg, exp_avg_sq; weights once
    _check_weights_only(str(tmp_path / "o"))


def test_save_holding_a_checkpoint_is_refused_unless_overwrite(tmp_path, capsys):
    """reshard / to-megatron into a --save that holds newer iterations would point its
    tracker back at the converted one: refused, nothing written; --overwrite replaces the
    same-named directory and the tracker, saying so, and keeps the other iterations."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    dst.mkdir()  # an empty directory is fine
    reshard_argv = ["reshard", "--load", str(src), "--save", str(dst),
                    "--target-tensor-model-parallel-size", "2",
                    "--target-pipeline-model-parallel-size", "1"]
    assert checkpoint_convert.main(reshard_argv) == 0
    shutil.copytree(dst / "iter_0000001", dst / "iter_0000020")  # a later run's checkpoint
    (dst / "latest_checkpointed_iteration.txt").write_text("20")
    for argv in (reshard_argv, ["to-megatron", "--load", str(src), "--save", str(dst)]):
        with pytest.raises(SystemExit, match=f"--save {dst} already holds a checkpoint: "
                           r"latest_checkpointed_iteration.txt \('20'\), iter_0000001, "
                           "iter_0000020; .* add --overwrite"):
            checkpoint_convert.main(argv)
        assert (dst / "latest_checkpointed_iteration.txt").read_text() == "20"
        assert sorted(os.listdir(dst)) == ["iter_0000001", "iter_0000020",
                                           "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    assert checkpoint_convert.main(["to-megatron", "--load", str(src), "--save", str(dst),
                                    "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"overwrite: replacing {dst / 'iter_0000001'}" in out and "said '20', now '1'" in out
    assert "writing 1 rank file to " in out  # to-megatron of the tp 1 source
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(os.listdir(dst)) == ["iter_0000001", "iter_0000020",
                                       "latest_checkpointed_iteration.txt"]
    assert reshard.read_layout(str(dst / "iter_0000001")).tp == 1  # to-megatron's copy
    with pytest.raises(SystemExit, match="is a file; pass a directory"):
        checkpoint_convert.check_save(str(dst / "latest_checkpointed_iteration.txt"))


def _interrupt_on(module, name: str, call: int, monkeypatch):
    """Make module.name raise KeyboardInterrupt (Ctrl-C) on its `call`-th call."""
    real, calls = getattr(module, name), []

    def fake(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fake)


def test_interrupted_conversion_leaves_no_partial_output(tmp_path, capsys, monkeypatch):
    """Ctrl-C during reshard / to-megatron (the 2nd rank file): the partial iter_N.tmp
    is removed, and a --save the tool created with it; one line, status 130 (it was a
    KeyboardInterrupt traceback and a partial directory of the model's size). Each finished
    rank file is reported as it is written (a large model's conversion printed nothing
    until the end)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    argv = ["reshard", "--load", str(src), "--save", str(dst),
            "--target-tensor-model-parallel-size", "2"]
    with monkeypatch.context() as m:
        _interrupt_on(checkpoint_convert.torch, "save", 2, m)
        assert checkpoint_convert.main(argv) == INTERRUPTED
    out = capsys.readouterr()
    assert "[1/2] mp_rank_00 (" in out.out and "[2/2]" not in out.out
    assert "reshard: interrupted (Ctrl-C); the partial output was removed" in out.err
    assert not dst.exists()
    assert checkpoint_convert.main(argv) == 0
    assert "[2/2] mp_rank_01 (" in capsys.readouterr().out
    with monkeypatch.context() as m:
        _interrupt_on(checkpoint_convert.torch, "save", 2, m)
        assert checkpoint_convert.main(argv + ["--overwrite",
                                               "--target-pipeline-model-parallel-size", "2",
                                               "--target-tensor-model-parallel-size", "1"]) == 130
        _interrupt_on(checkpoint_convert, "load_checkpoint_file", 1, m)
        assert checkpoint_convert.main(["to-megatron", "--load", str(src), "--save",
                                        str(tmp_path / "mlm")]) == 130
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert reshard.read_layout(str(dst / "iter_0000001")).tp == 2, "the earlier one is kept"
    assert not (tmp_path / "mlm").exists()


def test_a_full_disk_during_a_conversion_is_one_message(tmp_path, monkeypatch):
    """reshard writing into a full disk ended in an OSError traceback (its partial output
    removed): one error line now, naming the directory and the free space, status 1."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    real, calls = checkpoint_convert.torch.save, []

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_convert.torch, "save", full)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                 "--target-tensor-model-parallel-size", "2"])
    assert str(err.value.code).startswith(
        f"error: writing {dst / 'iter_0000001.tmp'} failed (OSError: [Errno 28] No space left "
        f"on device); its partial output was removed; ")
    assert f"free on the file system of {tmp_path} (a disk quota or file-size limit may " \
           "allow less). Free space or pass another --save" in \
        str(err.value.code)
    assert not dst.exists()


def test_a_quota_during_a_conversion_is_named_not_torchs_zip_error(tmp_path, monkeypatch):
    """torch.save over quota raises RuntimeError 'unexpected pos ... vs ...' (the OSError
    in its context): the line showed that text and 'Free space' only; it names the quota
    and its fix now."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)

    monkeypatch.setattr(checkpoint_convert.torch, "save", torch_save_over_quota)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                 "--target-tensor-model-parallel-size", "2"])
    msg = str(err.value.code)
    assert msg.startswith(f"error: writing {dst / 'iter_0000001.tmp'} failed (OSError: "
                          f"[Errno 122] Disk quota exceeded: '{dst / 'iter_0000001.tmp'}"), msg
    assert "unexpected pos" not in msg
    assert msg.endswith("Free space within your disk quota (or have it raised), or pass "
                        "another --save on a file system with room in your quota")
    assert not dst.exists()


@pytest.mark.parametrize("command", ["reshard", "to-megatron"])
def test_torch_saves_own_full_disk_error_is_one_message(tmp_path, monkeypatch, command):
    """On a real full disk torch.save raises a RuntimeError ("unexpected pos ..."), not an
    OSError: reshard (checkpoint_util.py's too) and to-megatron ended in that traceback.
    Now the one error line, naming the file, with the partial output removed."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)

    def full(obj, f, *args, **kwargs):
        f.write(b"PK partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 10")

    monkeypatch.setattr(checkpoint_convert.torch, "save", full)
    extra = ["--target-tensor-model-parallel-size", "2"] if command == "reshard" else []
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main([command, "--load", str(src), "--save", str(dst), *extra])
    tmp_dir = dst / "iter_0000001.tmp"
    assert str(err.value.code).startswith(
        f"error: writing {tmp_dir} failed (OSError: could not write {tmp_dir / 'mp_rank_00'}"
        f"/{MODEL_FILENAME}: [enforce fail at inline_container.cc:672] . unexpected pos 64 "
        "vs 10); its partial output was removed; ")
    assert not dst.exists()


_FILE_SIZE_LIMIT = """
import os, resource, signal, sys, torch
from tools.checkpoint_convert import save_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
try:
    save_file({"w": torch.zeros(100_000)}, sys.argv[1])
except OSError as exc:  # the files still open while the error is handled, as the tool does
    print("failed:", exc)
    os.remove(sys.argv[1])
    for fd in os.listdir("/proc/self/fd"):
        try:
            print("open:", os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_a_failed_write_leaves_no_file_open(tmp_path):
    """A write that fails midway (a full disk; here a file-size limit) left the file open
    in torch's writer, held by the error's traceback: the partial output was removed, but
    its space stayed in use while the error line measured the free space ('0 bytes free'
    on a disk that had room again). The file is closed once the error is raised."""
    import subprocess
    import sys

    path = tmp_path / "model_optim_rng.pt"
    proc = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = f"failed: [Errno 27] File too large: '{path}'"  # the reason, not torch's text
    assert shown in proc.stdout, proc.stdout
    assert str(path) not in proc.stdout.replace(shown, ""), proc.stdout


def test_a_read_only_save_is_one_message(tmp_path, monkeypatch):
    """--save on a read-only file system (a mount of the shared checkpoint store): a new
    directory that cannot be made, or an existing one where the lock file cannot be
    written, ended reshard / checkpoint_util.py / from-hf / to-megatron in an OSError
    traceback. Now one line naming --save and the error (as a training run's check)."""
    from megatron import save_lock

    src, dst = tmp_path / "src", tmp_path / "ro" / "out"
    _one_step_checkpoint(src)
    real = os.makedirs

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    argv = ["reshard", "--load", str(src), "--save", str(dst),
            "--target-tensor-model-parallel-size", "2"]
    with monkeypatch.context() as m:
        m.setattr(os, "makedirs", read_only)
        with pytest.raises(SystemExit) as err:
            checkpoint_convert.main(argv)
    assert str(err.value.code) == (
        f"error: --save {dst} cannot be used: could not create it (OSError: [Errno 30] "
        f"Read-only file system: '{dst}'); pass a directory that can be created and written to")
    dst.mkdir(parents=True)

    def no_lock_file(self):
        raise OSError(errno.EROFS, "Read-only file system", self.path)

    monkeypatch.setattr(save_lock.SaveDirLock, "acquire", no_lock_file)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(argv)
    assert str(err.value.code).startswith(
        f"error: --save {dst} cannot be used: could not write its lock file (OSError: "
        "[Errno 30] Read-only file system: ")
    assert os.listdir(dst) == []


def test_ctrl_c_inside_torch_save_is_the_interrupt_not_a_full_disk(tmp_path, monkeypatch,
                                                                   capsys):
    """torch.save stopped by Ctrl-C midway raises a RuntimeError over the
    KeyboardInterrupt: a conversion reports the interrupt (status 130), not a write
    failure with free-space advice."""
    from tests.test_checkpointing_ranks import _ctrl_c_inside_torch_save

    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)
    monkeypatch.setattr(checkpoint_convert.torch, "save", _ctrl_c_inside_torch_save)
    assert checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                    "--target-tensor-model-parallel-size", "2"]) == 130
    assert "reshard: interrupted (Ctrl-C); the partial output was removed" in capsys.readouterr().err
    assert not dst.exists()


def _one_step_checkpoint(src):
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)


def test_a_conversion_into_a_directory_a_run_saves_into_is_refused(tmp_path):
    """A training run holds its --save's lock (megatron/save_lock.py) and is writing
    iter_0000001.tmp there. reshard / to-megatron / from-hf into that directory took no
    lock: the conversion emptied that iter_0000001.tmp for its own output, then moved its
    own iter_0000001 into place and pointed the tracker at it. Now each stops with one
    line naming the run that holds the directory, and leaves it as it was."""
    from megatron.save_lock import LOCK_NAME, SaveDirLock

    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)
    (dst / "iter_0000001.tmp" / "mp_rank_00").mkdir(parents=True)
    (dst / "iter_0000001.tmp" / "mp_rank_00" / "model_optim_rng.pt").write_text("the run's")
    with SaveDirLock(str(dst)) as run:
        assert run.acquire() is None
        for argv in (["reshard", "--target-tensor-model-parallel-size", "2"],
                     ["to-megatron"]):
            with pytest.raises(SystemExit) as err:
                checkpoint_convert.main(argv + ["--load", str(src), "--save", str(dst)])
            assert str(err.value.code).startswith(
                f"error: --save {dst} is in use by another training run (host "
                f"{os.uname().nodename}, process {os.getpid()}, since "), err.value.code
            assert sorted(os.listdir(dst)) == [LOCK_NAME, "iter_0000001.tmp"]
            assert (dst / "iter_0000001.tmp" / "mp_rank_00" /
                    "model_optim_rng.pt").read_text() == "the run's"
    assert checkpoint_convert.main(["to-megatron", "--load", str(src), "--save",
                                    str(dst)]) == 0, "once the run has ended"
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_two_conversions_into_one_directory(tmp_path, monkeypatch):
    """While a reshard writes into OUT, a second conversion into OUT (another process)
    and a training run saving there stop with one line naming the reshard; the reshard
    completes, and its lock is gone afterwards."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from megatron.save_lock import LOCK_NAME, lock_save_dir

    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)
    seen = []
    done = checkpoint_convert.Progress.done

    def meanwhile(progress, name):
        if not seen:
            second = subprocess.run(
                [sys.executable, os.path.join(REPO, "tools", "checkpoint_convert.py"),
                 "to-megatron", "--load", str(src), "--save", str(dst)],
                cwd=REPO, capture_output=True, text=True, timeout=120)
            seen.append((second.returncode, second.stderr.strip().splitlines()))
            with pytest.raises(SystemExit) as err:
                lock_save_dir(str(dst), SimpleNamespace(rank=0))
            seen.append(str(err.value.code))
        done(progress, name)

    monkeypatch.setattr(checkpoint_convert.Progress, "done", meanwhile)
    assert checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                    "--target-tensor-model-parallel-size", "2"]) == 0
    (status, lines), run = seen
    holder = (f"error: --save {dst} is in use by another run of tools/checkpoint_convert.py "
              f"reshard (host {os.uname().nodename}, process {os.getpid()}, since ")
    assert status == 1 and lines[-1].startswith(holder), lines  # after to-megatron's warnings
    assert run.startswith(holder), run
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert not os.path.exists(dst / LOCK_NAME)
    assert reshard.read_layout(str(dst / "iter_0000001")).tp == 2


def _remove_first_file_then_interrupt(monkeypatch):
    """shutil.rmtree of an `.old` directory stops (Ctrl-C) after removing one file."""
    real = shutil.rmtree

    def fake(path, *args, **kwargs):
        if str(path).endswith(".old"):
            os.remove(next(os.path.join(top, f) for top, _, files in os.walk(path)
                           for f in files))
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", fake)


def test_an_overwrite_interrupted_mid_replace_leaves_a_readable_checkpoint(tmp_path, capsys,
                                                                           monkeypatch):
    """reshard --overwrite stopped between moving iter_N aside and the new one into place
    leaves iter_N.old, the only copy, under the tracker's iteration: the tools (and
    --use-checkpoint-args) said the iteration directory did not exist while a training
    --load restored it; they read it now, saying so. A later --overwrite stopped while
    removing that .old removed it first, before the new copy was in place: nothing was
    left."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    argv = ["reshard", "--load", str(src), "--save", str(dst),
            "--target-tensor-model-parallel-size", "2"]
    assert checkpoint_convert.main(argv) == 0
    with monkeypatch.context() as m:
        _interrupt_on(os, "rename", 2, m)  # the 1st moves iter_1 aside, the 2nd the new one
        assert checkpoint_convert.main(argv + ["--overwrite"]) == INTERRUPTED
    assert sorted(os.listdir(dst)) == ["iter_0000001.old", "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    again = str(tmp_path / "again")
    assert checkpoint_convert.main(["reshard", "--load", str(dst), "--save", again,
                                    "--target-tensor-model-parallel-size", "1"]) == 0
    out = capsys.readouterr().out
    assert (f"note: {dst / 'iter_0000001'} is missing but {dst / 'iter_0000001'}.old is there "
            "(an interrupted save that was replacing it): reading that copy; `mv ") in out
    assert reshard.read_layout(os.path.join(again, "iter_0000001")).tp == 1
    from megatron.arguments_checkpoint import read_checkpoint_args

    assert read_checkpoint_args(str(dst))["tensor_model_parallel_size"] == 2
    assert sorted(os.listdir(dst)) == ["iter_0000001.old", "latest_checkpointed_iteration.txt"]
    with monkeypatch.context() as m:
        _remove_first_file_then_interrupt(m)
        assert checkpoint_convert.main(argv + ["--overwrite", "--target-pipeline-model-parallel"
                                               "-size", "2", "--target-tensor-model-parallel-"
                                               "size", "1"]) == INTERRUPTED
    layout = reshard.read_layout(reshard.locate_iteration(str(dst))[0])
    assert (layout.tp, layout.pp) == (1, 2), "the new copy is in place"


def test_the_old_copy_note_is_printed_once_per_command(tmp_path, capsys):
    """README: the tools read an `iter_N.old` left by a killed re-save where it is, with a
    note line. reshard (a target size left out), checkpoint_util.py and to-megatron looked
    the iteration up twice and printed the note twice."""
    from tools import checkpoint_util

    src = tmp_path / "src"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    os.rename(src / "iter_0000001", src / "iter_0000001.old")
    note = f"note: {src / 'iter_0000001'} is missing but"
    commands = [
        lambda out: checkpoint_convert.main(["reshard", "--load", str(src), "--save", out,
                                             "--target-tensor-model-parallel-size", "1"]),
        lambda out: checkpoint_convert.main(["reshard", "--load", str(src), "--save", out,
                                             "--target-pipeline-model-parallel-size", "1"]),
        lambda out: checkpoint_convert.main(["to-megatron", "--load", str(src), "--save", out]),
        lambda out: checkpoint_util.main(["--model-type", "GPT", "--load-dir", str(src),
                                          "--save-dir", out]),
    ]
    capsys.readouterr()
    for i, command in enumerate(commands):
        assert command(str(tmp_path / f"out{i}")) == 0
        captured = capsys.readouterr()
        assert (captured.out + captured.err).count(note) == 1, (i, captured.out)


def test_target_layout_check_names_the_sizes_that_fit():
    args = {"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 2,
            "ffn_hidden_size": 96, "num_layers": 6, "standalone_embedding_stage": True}
    with pytest.raises(SystemExit, match="--num-query-groups 2; .* divides them: 1, 2$"):
        checkpoint_convert.check_target_layout(args, 4, 1)
    checkpoint_convert.check_target_layout(args, 2, 4)  # 6 layers over 3 stages + embedding
    with pytest.raises(SystemExit, match="6 layers over 4 stage.* fits: 1, 2, 3, 6$"):
        checkpoint_convert.check_target_layout(args, 2, 4, virtual=True)
    # the embedding stage adds one to each layer split: 6 layers over 1, 2, 3 or 6 stages
    with pytest.raises(SystemExit, match="6 layers over 4 stage.* fits: 1, 2, 3, 4, 7$"):
        checkpoint_convert.check_target_layout(args, 2, 5)


# ------------------------------------------------------------------------------- 3. units
def _full_partitions(src):
    config = reshard.config_from_args(src.args)
    return reshard.plan_rank([GPTModel(config.model, device="meta")], [0], 1, 0).partition


def _write_layout(src, out, tp, pp, vpp, kind, dtype):
    """Every rank's payload of a tp x pp x vpp layout, written as a checkpoint and opened."""
    config = reshard.config_from_args(src.args, params_dtype=str(dtype))
    iter_dir = out / "iter_0000002"
    for p in range(pp):
        modules, offsets = checkpoint_convert._stage_modules(config, pp, p, vpp, False)
        for t in range(tp):
            plan = reshard.plan_rank(modules, offsets, tp, t, (pp, p), module_tp_size=1)
            payload, distrib = reshard.build_rank_payload(src, plan, kind)
            payload["args"] = dict(payload["args"], tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp)  # as `reshard` writes them
            rank_dir = iter_dir / rank_dir_name(t, p, pp)
            rank_dir.mkdir(parents=True)
            torch.save(payload, rank_dir / MODEL_FILENAME)
            if distrib is not None:
                torch.save(distrib, rank_dir / reshard.DISTRIB_FILENAME)
    return reshard.SourceCheckpoint(str(iter_dir))


@pytest.mark.parametrize("tp,pp,vpp,kind,dtype", [
    (2, 2, 2, "fp32", torch.float32), (4, 1, 1, "distributed", torch.float32),
    (1, 4, 1, "mixed", torch.bfloat16), (2, 2, 1, "distributed", torch.bfloat16),
])
def test_payloads_round_trip_exactly(tmp_path_factory, tmp_path, tp, pp, vpp, kind, dtype):
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    src = reshard.SourceCheckpoint(os.path.join(root, "iter_0000002"))
    assert src.layout == reshard.Layout(2, 1, 1, "fp32") and src.step == SAVE_AT
    back = _write_layout(src, tmp_path, tp, pp, vpp, kind, dtype)
    _check_weights_only(str(tmp_path))
    assert back.layout == reshard.Layout(tp, pp, vpp, kind)
    assert back.names == src.names and back.step == src.step and back.num_layers == 4
    for name, split in _full_partitions(src).items():
        assert torch.equal(back.model(name, split), src.model(name, split).to(dtype)), name
        want, got = src.optimizer_state(name, split), back.optimizer_state(name, split)
        assert sorted(got) == ["exp_avg", "exp_avg_sq", "param"], name
        for key in want:  # fp32 main weights and Adam moments are carried exactly
            assert torch.equal(got[key], want[key]), (name, key)


def test_vocabulary_repadding_and_shape_errors(tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    src = reshard.SourceCheckpoint(os.path.join(root, "iter_0000002"))
    config = reshard.config_from_args(src.args, padded_vocab_size=192)
    model = GPTModel(config.model, device="meta")
    plan = reshard.plan_rank([model], [0], 2, 1, module_tp_size=1)
    notes = set()
    payload, _ = reshard.build_rank_payload(src, plan, "fp32", notes)
    emb = payload["model"][reshard.EMBEDDING]
    full = src.model(reshard.EMBEDDING, (0, 1))
    assert emb.shape == (96, 32)  # rank 1 of 2: rows 96..191 of the re-padded table
    # the added padding rows repeat the saved last row (a trained padding row), as
    # Megatron-LM's checkpoint_util pads: zero rows would score every token 0 in the softmax
    assert torch.equal(emb[:32], full[96:])
    assert torch.equal(emb[32:], full[-1:].expand(64, -1)) and full[-1].any()
    assert notes == {"padded vocabulary 128 -> 192 rows"}
    state = payload["optimizer"]["state"]
    moments = [v for v in state.values() if v["exp_avg"].shape == (96, 32)]
    assert len(moments) == 1 and moments[0]["exp_avg"][:32].any()
    assert not moments[0]["exp_avg"][32:].any() and not moments[0]["exp_avg_sq"][32:].any()
    # the distributed optimizer's fp32 main copy is padded as the weights are
    _, distrib = reshard.build_rank_payload(src, plan, "distributed", set())
    flat = torch.cat([b["param"] for b in distrib[0].values()])
    main = flat.unfold(0, emb.numel(), 1)  # every window of the embedding's size
    assert any(torch.equal(w.view_as(emb), emb) for w in main[::32])
    wrong = reshard.config_from_args(src.args, hidden_size=64, ffn_hidden_size=256,
                                     kv_channels=16)
    plan = reshard.plan_rank([GPTModel(wrong.model, device="meta")], [0], 1, 0)
    with pytest.raises(ValueError, match="the checkpoint holds shape"):
        reshard.build_rank_payload(src, plan, "fp32")


def test_reshard_on_load_of_another_model_exits_cleanly(tmp_path_factory, tmp_path):
    """Another model behind a checkpoint without `args` (nothing to check up front): the
    resharding's shape error is a clean exit."""
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    bare = str(tmp_path / "bare")
    shutil.copytree(root, bare)
    for t in range(2):
        path = os.path.join(bare, "iter_0000002", rank_dir_name(t, 0, 1), MODEL_FILENAME)
        state = torch.load(path, weights_only=True)
        del state["args"]
        torch.save(state, path)
    _, _, tr = _trainer(0, 1, "--hidden-size 64", load=bare)
    with pytest.raises(SystemExit, match="cannot reshard .* the checkpoint holds shape"):
        load_trainer_checkpoint(tr)


NO_MODEL_FLAGS = ("--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 4 "
                  "--mock-data --use-checkpoint-args")


def test_use_checkpoint_args_fills_model_flags(tmp_path_factory, tmp_path, caplog):
    root = str(tmp_path_factory.getbasetemp() / "src-2---tensor-model-parallel-size2")
    _saved("--tensor-model-parallel-size 2", 2, root)
    cfg = parse_and_validate(f"{NO_MODEL_FLAGS} --load {root}".split(), world_size=2, env={},
                             cuda_available=False)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length,
            m.max_position_embeddings, m.padded_vocab_size) == (4, 32, 4, 16, 16, 128)
    assert cfg.parallel.tp_size == 2 and cfg.data.tokenizer_type == "NullTokenizer"
    # an explicit value wins (the checkpoint reshards on load)
    cfg = parse_and_validate(f"{NO_MODEL_FLAGS} --load {root} --tensor-model-parallel-size 1 "
                             "--num-layers 4".split(), world_size=1, env={},
                             cuda_available=False)
    assert cfg.parallel.tp_size == 1 and cfg.model.hidden_size == 32
    with pytest.raises(ArgumentsError, match="needs --load"):
        parse_and_validate(NO_MODEL_FLAGS.split(), world_size=1, env={}, cuda_available=False)
    # no checkpoint yet (a job's first launch with --load = --save): the command line's
    # flags, as in Megatron-LM, with a warning; without them, validation names them
    with pytest.raises(ArgumentsError, match="missing required flags: --num-layers"):
        parse_and_validate(f"{NO_MODEL_FLAGS} --load {tmp_path}".split(), world_size=1, env={},
                           cuda_available=False)
    assert "no checkpoint under --load" in caplog.text and "the command line's" in caplog.text
    cfg = parse_and_validate(f"{NO_MODEL_FLAGS} --load {tmp_path / 'new'} --num-layers 2 "
                             "--hidden-size 16 --num-attention-heads 2 --seq-length 8 "
                             "--max-position-embeddings 8 --tokenizer-type NullTokenizer "
                             "--vocab-size 100".split(), world_size=1, env={},
                             cuda_available=False)
    assert cfg.model.num_layers == 2 and cfg.model.hidden_size == 16
    # checkpoints without a tracker, or an iteration directory: training's fix, not the
    # tools' --iteration (pretrain_gpt.py has no such flag)
    shutil.copytree(os.path.join(root, "iter_0000002"), tmp_path / "untracked" / "iter_0000002")
    for load, fix in ((tmp_path / "untracked", "printf 2 >"),
                      (tmp_path / "untracked" / "iter_0000002", f"--load {tmp_path / 'untracked'} ")):
        with pytest.raises(ArgumentsError) as err:
            parse_and_validate(f"{NO_MODEL_FLAGS} --load {load}".split(), world_size=1, env={},
                               cuda_available=False)
        assert fix in str(err.value) and "--iteration" not in str(err.value)


# ------------------------------------------------------------------ 4. the CLI (torchrun)
@pytest.mark.slow
def test_torchrun_tp2_checkpoint_resumes_at_dp2_with_checkpoint_args(tmp_path):
    """Saved at tp2, resumed at dp2 under torchrun with --use-checkpoint-args: rank 0 reads
    the arguments for both ranks through torchrun's store (megatron/startup_store.py)."""
    from tests.test_end_to_end import losses_by_iteration, torchrun

    ckpt = tmp_path / "ckpt"
    run = (f"{NO_MODEL_FLAGS.replace(' --use-checkpoint-args', '')} --train-iters 6 "
           "--log-interval 1 --eval-iters 0 --lr-warmup-iters 1 --hidden-dropout 0 "
           "--attention-dropout 0").split()  # dropout is not a model-shape flag: not copied
    model = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --tokenizer-type NullTokenizer --vocab-size 200 "
             "--use-cpu-initialization").split()
    full = torchrun(2, ["--tensor-model-parallel-size", "2", *model, *run, "--save", str(ckpt),
                        "--save-interval", "3"])
    ref = losses_by_iteration(full)
    assert sorted(ref) == list(range(1, 7)), full[-3000:]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")  # resume from iteration 3
    resumed = torchrun(2, [*run, "--use-checkpoint-args", "--tensor-model-parallel-size", "1",
                           "--load", str(ckpt)])
    assert "resharded" in resumed and "saved with tp 2, pp 1" in resumed, resumed[-3000:]
    got = losses_by_iteration(resumed)
    assert sorted(got) == [4, 5, 6], resumed[-3000:]
    for i in (4, 5, 6):
        assert float(got[i]) == pytest.approx(float(ref[i]), rel=RTOL), (i, got, ref)


def test_a_bf16_checkpoint_loaded_without_bf16_takes_the_fp32_main_weights(tmp_path_factory):
    """Dropping --bf16 on resume (e.g. to rule precision out while debugging) reshards the
    mixed optimizer to the fp32 one: the model goes on from the saved fp32 main weights, the
    ones its Adam moments belong to -- it used to load their bf16-rounded copy silently."""
    root = str(tmp_path_factory.getbasetemp() / "src-bf16-to-fp32")
    _saved("--bf16", 1, root)
    cfg, rt, tr = _trainer(0, 1, "", load=root)
    assert "resharded" in load_trainer_checkpoint(tr)
    src = reshard.SourceCheckpoint(os.path.join(root, "iter_0000002"))
    for name, param in tr.model.unwrapped()[0].named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param.detach(), src.optimizer_state(name, None)["param"]), name


@pytest.mark.parametrize("flag", ["--no-load-optim", "--finetune"])
def test_a_bf16_checkpoint_loaded_at_fp32_without_its_optimizer_says_the_weights_are_rounded(
        tmp_path_factory, capsys, flag):
    """Without the optimizer state (--no-load-optim, --finetune) an fp32 run loads the
    checkpoint's bf16 weights, as Megatron-LM does: their fp32 main weights are optimizer
    state. That rounding was silent (the next loss moved by ~1e-6 relative); a note says
    so and how to go on from the fp32 weights."""
    root = str(tmp_path_factory.getbasetemp() / "src-bf16-to-fp32")
    _saved("--bf16", 1, root)
    capsys.readouterr()
    cfg, rt, tr = _trainer(0, 1, flag, load=root)
    load_trainer_checkpoint(tr)
    out = capsys.readouterr().out
    assert (" > the model takes the checkpoint's bf16 weights (this run is fp32): its fp32 "
            f"main weights are optimizer state, which {flag} leaves out") in out, out
    cfg, rt, tr = _trainer(0, 1, "--bf16 " + flag, load=root)  # no rounding: no note
    load_trainer_checkpoint(tr)
    assert "main weights are optimizer state" not in capsys.readouterr().out


def _weights_after_load(rank, world, extra, root):
    """{name: this rank's full model weight} right after loading `root` (before any step)."""
    cfg, rt, tr = _trainer(rank, world, extra, load=root)
    load_trainer_checkpoint(tr)
    return {n: p.detach().clone() for n, p in tr.model.unwrapped()[0].named_parameters()}


@pytest.mark.parametrize("extra", ["", "--bf16", "--no-load-optim"],
                         ids=["fp32", "bf16", "fp32-no-load-optim"])
def test_a_bf16_distributed_checkpoint_resumed_at_its_layout_loads_the_same_weights_on_every_dp_rank(
        tmp_path_factory, extra):
    """Dropping --bf16 on resume with --use-distributed-optimizer at the saved layout (no
    resharding): every data-parallel rank's model holds the saved fp32 main weights before
    the first step. Each rank wrote them into its own shard only, the rest of its model kept
    the bf16-rounded weights until the first step's all-gather: the first forward ran other
    weights on each rank. With --bf16 every rank holds the saved bf16 weights, as before;
    with --no-load-optim every rank holds them in fp32 (the main weights are left out)."""
    dist_opt = "--use-distributed-optimizer"
    root = str(tmp_path_factory.getbasetemp() / "src-bf16-distributed-dp2")
    _saved(f"--bf16 {dist_opt}", 2, root)
    ranks = run_distributed(_weights_after_load, 2, f"{dist_opt} {extra}", root)
    src = reshard.SourceCheckpoint(os.path.join(root, "iter_0000002"))
    for name in ranks[0]:
        want = (src.optimizer_state(name, None)["param"] if not extra
                else src.model(name, None))
        if extra == "--no-load-optim":
            want = want.float()
        for rank, weights in enumerate(ranks):
            assert weights[name].dtype == want.dtype, (rank, name)
            assert torch.equal(weights[name], want), (rank, name)
