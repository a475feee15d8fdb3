"""Resharding checkpoints between parallel layouts (megatron/checkpoint_reshard.py).

1. On load: a checkpoint saved with one (tp, pp, dp, optimizer) layout loads into
   another -- TP2 -> TP1, PP2 x DP2 with the distributed optimizer -> one process with the
   plain one, DP2 distributed -> TP2 x PP2 plain -- model AND optimizer state, and the next
   training losses equal those of the saving run continuing in its own layout. Tolerance:
   fp32 on CPU, a different reduction order -> rtol 1e-5.
2. Offline: `tools/checkpoint_convert.py reshard` (TP2 -> PP2 x 2 virtual stages with the
   distributed optimizer) writes a checkpoint that loads WITHOUT resharding and gives the
   same losses; every file of every checkpoint loads with torch.load(weights_only=True).
   How the tool writes its output (refusals, Ctrl-C, full disks): tests/test_reshard_output.py.
3. Units: the payload of every rank of a TP2 x PP2 x 2-virtual-stage layout carries the
   exact slices of the full tensors (model, fp32 main weights, Adam moments, step), the
   vocabulary is re-padded, mismatched models are refused, and `--use-checkpoint-args`
   fills the model flags left unset.
"""
from __future__ import annotations

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
from tools import checkpoint_convert

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
                                                                    tmp_path, capsys):
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
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:  # checked before the output is announced
        checkpoint_convert.main(["reshard", "--load", str(part), "--save", str(tmp_path / "o"),
                                 "--target-tensor-model-parallel-size", "1"])
    assert "mp_rank_01/model_optim_rng.pt is missing" in str(err.value.code)
    assert "writing" not in capsys.readouterr().out
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
