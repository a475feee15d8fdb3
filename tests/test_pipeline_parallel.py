"""Pipeline parallelism on gloo processes against the single-process model.

1. The executor alone, on a toy stack of linear stages: losses and gradients equal the
   sequential model's, and 1F1B holds at most pp micro-batches of activations (counted
   as live output tensors, not read off the plan).
   Its watch hook is called around every action, in plan order (a single process, its
   neighbours stood in for).
2. The whole GPT training step with PP=2, PP=4, interleaved PP=2 x 2 virtual stages,
   TP=2 x PP=2 x DP=2 (8 processes, sequence parallel) and a standalone embedding stage:
   every stage starts from the single-process model's weights (sharded by TP, layers
   picked by index, the tied output copy from the embedding); losses of every iteration
   (broadcast from the last stage), the evaluation loss and the full gradients of the last
   iteration must match. Tolerance: fp32, different reduction order -> rtol 1e-5 on losses,
   max abs diff <= 1e-5 * (1 + max|g|) on gradients.
3. Tied embeddings: the last stage's copy is broadcast from the first stage when built and
   stays equal to it through training.
4. Checkpoint payload keys with virtual stages (model0, model1).
5. Through torchrun: save and resume with pp 2 and tp 2 x pp 2 x virtual stages, against
   an uninterrupted pretrain() on forked ranks.
6. pretrain_gpt.py's evaluation (--skip-train --load) of one checkpoint with dp 2, pp 2 and
   tp 2 prints the single process's validation and test losses.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron import trainer_checkpoint
from megatron.arguments import parse_and_validate
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.stages import build_stage_models, stage_layout
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel import (
    ModelChunks,
    P2PCommunicator,
    ScheduleExecutor,
    build_schedule,
)
from megatron.core.pipeline_parallel.schedules import BACKWARD, COMM, FORWARD, WAIT
from megatron.core.tensor_parallel.layers import shard_of_full_weight
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, initialize_distributed, set_random_seed
from megatron.training import (
    build_trainer,
    data_iterator,
    forward_backward,
    pretrain,
    train_step,
)
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads, tiny_config

SHAPE = (4, 2, 8)  # [s, b, h] of the toy pipeline


# --------------------------------------------------------------------------- 1. executor
def _toy_stage(stage: int) -> torch.nn.Linear:
    torch.manual_seed(100 + stage)
    return torch.nn.Linear(SHAPE[-1], SHAPE[-1])


def _toy_input(mb: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(mb))


def _toy_reference(num_stages: int, m: int):
    stages = [_toy_stage(s) for s in range(num_stages)]
    total = 0.0
    for mb in range(m):
        x = _toy_input(mb)
        for layer in stages:
            x = torch.tanh(layer(x))
        loss = x.pow(2).mean()
        (loss / m).backward()
        total += loss.item()
    return total / m, [layer.weight.grad for layer in stages]


def _toy_worker(rank, world_size, vpp, m, overlap):
    pp = world_size
    chunks = [_toy_stage(c * pp + rank) for c in range(vpp)]
    last = pp * vpp - 1
    live = weakref.WeakSet()
    peak = [0]

    def forward_step(c, mb, x):
        stage = c * pp + rank
        out = torch.tanh(chunks[c](_toy_input(mb) if stage == 0 else x))
        out = out.pow(2).mean() if stage == last else out
        live.add(out)
        peak[0] = max(peak[0], len(live))
        return out

    comm = P2PCommunicator(list(range(pp)), SHAPE, torch.float32, "cpu", None)
    executor = ScheduleExecutor(chunks, forward_step, comm, rank, pp, m)
    result = executor.run(build_schedule(pp, m, vpp, False, overlap)[rank])
    loss = torch.zeros(()) if result.loss_sum is None else result.loss_sum / m
    dist.broadcast(loss, src=pp - 1)
    return {"loss": loss.item(), "peak": peak[0], "in_flight": result.max_in_flight,
            "grads": {c * pp + rank: chunks[c].weight.grad for c in range(vpp)}}


@pytest.mark.parametrize("pp,vpp,m,overlap", [(4, 1, 6, False), (2, 2, 4, True)])
def test_executor_matches_sequential_model(pp, vpp, m, overlap):
    ref_loss, ref_grads = _toy_reference(pp * vpp, m)
    results = run_distributed(_toy_worker, pp, vpp, m, overlap)
    for rank, res in enumerate(results):
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-6)
        for stage, g in res["grads"].items():
            torch.testing.assert_close(g, ref_grads[stage], rtol=1e-5, atol=1e-7)
        if vpp == 1:  # 1F1B: rank r holds min(pp - r, m) <= pp micro-batches
            assert res["peak"] == res["in_flight"] == min(pp - rank, m) <= pp, (rank, res)


class _StandInNeighbours:
    """A P2PCommunicator's stand-in for one rank run alone: each receive gets ones, each
    send is dropped; posts and waits are recorded in `events`."""

    def __init__(self, events: list) -> None:
        self.events = events

    def post(self, ops, sends):
        self.events.append(("post", tuple(ops)))
        got = {(op.kind, op.microbatch, op.chunk): torch.ones(SHAPE) for op in ops
               if op.kind.startswith("recv")}
        return SimpleNamespace(wait=lambda: self.events.append(("wait", tuple(ops))) or got)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_watch_hook_is_called_around_every_action(rank):
    """Interleaved 1F1B with deferred waits (pp 2 x 2 chunks): each action runs inside the
    context the hook returns for it, in plan order; a wait is given with its batch's
    transfers. Without a hook nothing is called and the result is the same."""
    pp, vpp, m = 2, 2, 4
    plan = build_schedule(pp, m, vpp, False, True)[rank]
    events = []

    @contextlib.contextmanager
    def watch(action):
        events.append(("enter", action))
        yield
        events.append(("exit", action))

    def forward_step(c, mb, x):
        events.append(("forward", mb, c))
        stage = c * pp + rank
        out = torch.tanh(chunks[c](_toy_input(mb) if stage == 0 else x))
        out.register_hook(lambda g: events.append(("backward", mb, c)))
        return out.pow(2).mean() if stage == pp * vpp - 1 else out

    results = []
    for hook in (watch, None):
        chunks = [_toy_stage(c * pp + rank) for c in range(vpp)]
        executor = ScheduleExecutor(chunks, forward_step, _StandInNeighbours(events), rank,
                                    pp, m, watch=hook)
        results.append((executor.run(plan), [ch.weight.grad for ch in chunks]))
        if hook is watch:
            watched, events[:] = list(events), []
    expected, batches = [], {}
    for a in plan:
        if a.kind == COMM:
            batches[a.batch] = a.ops
        shown = dataclasses.replace(a, ops=batches[a.batch]) if a.kind == WAIT else a
        inner = {FORWARD: ("forward", a.microbatch, a.chunk),
                 BACKWARD: ("backward", a.microbatch, a.chunk),
                 COMM: ("post", a.ops), WAIT: ("wait", batches.get(a.batch))}[a.kind]
        expected += [("enter", shown), inner, ("exit", shown)]
    assert watched == expected
    assert not any(e[0] in ("enter", "exit") for e in events)  # no hook: nothing called
    (with_hook, grads), (without, plain_grads) = results
    assert with_hook.max_in_flight == without.max_in_flight
    for g, h in zip(grads, plain_grads):
        torch.testing.assert_close(g, h, rtol=0, atol=0)


# --------------------------------------------------------------------------- 2. GPT parity
LAYERS = 4


def _cfg(world, tp, pp, sp, vpp=None, model_kw=None, gbs=8, **parallel):
    cfg = tiny_config(world_size=world, tp=tp, pp=pp, sp=sp, gbs=gbs, num_layers=LAYERS,
                      **(model_kw or {}))
    cfg.parallel.virtual_pp_size = vpp
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    cfg.training.eval_iters = 1
    cfg.training.eval_interval = 2  # it evaluates: an interval of 0 builds no validation set
    return cfg


def _reference_weights(model_kw) -> dict:
    """The single-process model's initial weights (same seed, same construction order)."""
    cfg = _cfg(1, 1, 1, False, model_kw=model_kw)
    rt = Runtime(ParallelState.build(1, 0), torch.device("cpu"), RNGStatesTracker(), "gloo")
    set_random_seed(cfg.training.seed, rt)
    return GPTModel(cfg.model, rng_tracker=rt.rng_tracker).state_dict()


def _full_name(name: str, layer_offset: int) -> str:
    """Name of a stage parameter in the single-process model."""
    if name == "word_embeddings_for_head.weight":
        return "language_model.embedding.word_embeddings.weight"
    return re.sub(r"encoder\.layers\.(\d+)\.",
                  lambda m: f"encoder.layers.{int(m.group(1)) + layer_offset}.", name)


def _load_reference(tr, ps, full: dict, offsets) -> None:
    with torch.no_grad():
        for module, offset in zip(tr.model.unwrapped(), offsets):
            for name, p in module.named_parameters():
                w = full[_full_name(name, offset)]
                if getattr(p, "tensor_model_parallel", False) and ps.tp_size > 1:
                    w = shard_of_full_weight(w, p.partition_dim, p.partition_stride,
                                             ps.tp_rank, ps.tp_size)
                p.copy_(w)
    tr.optimizer.reload_model_params()


def _embedding_pair(tr, ps):
    """(first-stage embedding, last-stage output copy) on the ranks that hold them."""
    mods = tr.model.unwrapped()
    first = mods[0].language_model.embedding.word_embeddings.weight if ps.is_first_stage else None
    last = mods[-1].word_embeddings_for_head.weight if (
        ps.is_last_stage and hasattr(mods[-1], "word_embeddings_for_head")) else None
    return [None if t is None else t.detach().clone() for t in (first, last)]


def _train(rank, world_size, tp, pp, sp, vpp, model_kw, parallel, iters=3, gbs=8):
    """`gbs` / (micro batch 2 x dp) micro-batches per step."""
    torch.manual_seed(0)
    full = _reference_weights(model_kw)
    cfg = _cfg(world_size, tp, pp, sp, vpp, model_kw, gbs, **parallel)
    ps = ParallelState.build(world_size, rank, tp_size=tp, pp_size=pp, virtual_pp_size=vpp,
                             sequence_parallel=sp)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    built = _embedding_pair(tr, ps)
    specs = stage_layout(LAYERS, pp, ps.pp_rank, vpp, cfg.parallel.standalone_embedding_stage)
    _load_reference(tr, ps, full, [s.layer_offset for s in specs])
    data = data_iterator(cfg, rt, "train", 0)
    losses = []
    for _ in range(iters):
        loss, ok, _, _ = train_step(tr, data)
        assert ok
        losses.append(float(loss))
    grads = {}
    for module, s in zip(tr.model.unwrapped(), specs):
        for name, g in full_named_grads(module, ps.tp_group).items():
            grads[_full_name(name, s.layer_offset)] = g
    tr.model.eval()
    with torch.no_grad():
        valid = forward_backward(tr, data_iterator(cfg, rt, "valid", 0),
                                 cfg.data.num_micro_batches, forward_only=True)
    if ps.dp_group is not None:  # this replica's share of the validation batch -> mean
        dist.all_reduce(valid, group=ps.dp_group)
        valid /= ps.dp_size
    return {"losses": losses, "grads": grads, "valid": float(valid), "built": built,
            "trained": _embedding_pair(tr, ps), "pp_rank": ps.pp_rank}


def _compare(ref, got, what):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0, msg=f"{what}: losses differ")
    assert got["valid"] == pytest.approx(ref["valid"], rel=1e-5), what
    for name, g in got["grads"].items():
        r = ref["grads"][name]
        diff = (g - r).abs().max().item()
        assert diff <= 1e-5 * (1 + r.abs().max().item()), f"{what}: grad of {name} off by {diff}"


def _check_pipeline(ref, results, pp, what, tied=True):
    by_stage = {}
    for rank, got in enumerate(results):
        _compare(ref, got, f"{what} rank={rank}")
        by_stage.setdefault(got["pp_rank"], set()).update(got["grads"])
    covered = set().union(*by_stage.values())
    assert covered == set(ref["grads"]), f"{what}: parameters missing {set(ref['grads']) - covered}"
    if not tied:
        return
    firsts = [r for r in results if r["pp_rank"] == 0]
    lasts = [r for r in results if r["pp_rank"] == pp - 1]
    for f, la in zip(firsts, lasts):  # same (tp, dp) coordinates, in rank order
        assert torch.equal(f["built"][0], la["built"][1]), f"{what}: copy not broadcast"
        assert torch.equal(f["trained"][0], la["trained"][1]), f"{what}: copies drifted"


REFERENCE = {}


def _reference(model_kw=None, gbs=8):
    key = (repr(model_kw), gbs)
    if key not in REFERENCE:
        REFERENCE[key] = _train(0, 1, 1, 1, False, None, model_kw, {}, gbs=gbs)
    return REFERENCE[key]


@pytest.mark.parametrize("world,tp,pp,sp,vpp,parallel", [
    (2, 1, 2, False, None, {}),
    (4, 1, 4, False, None, {"overlap_p2p_comm": True}),
    (2, 1, 2, False, 2, {}),
    (8, 2, 2, True, None, {"overlap_grad_reduce": True}),
    (3, 1, 3, False, None, {"standalone_embedding_stage": True}),
], ids=["pp2", "pp4-overlap-p2p", "pp2-vpp2", "tp2-pp2-dp2-sp", "pp3-standalone-embedding"])
def test_gpt_pipeline_matches_single_process(world, tp, pp, sp, vpp, parallel):
    ref = _reference()
    results = run_distributed(_train, world, tp, pp, sp, vpp, None, parallel)
    _check_pipeline(ref, results, pp, f"world={world} tp={tp} pp={pp} vpp={vpp}")


def test_untied_llama_style_interleaved_matches_single_process():
    llama = dict(normalization="RMSNorm", activation="swiglu", ffn_hidden_size=48,
                 position_embedding_type="rope", add_bias_linear=False,
                 untie_embeddings_and_output_weights=True)
    ref = _reference(llama)
    results = run_distributed(_train, 4, 2, 2, True, 2, llama, {})
    _check_pipeline(ref, results, 2, "llama tp=2 pp=2 vpp=2", tied=False)


UNTIED = {"untie_embeddings_and_output_weights": True}


@pytest.mark.parametrize("world,pp,vpp,gbs,model_kw", [
    (2, 2, 2, 4, None),
    (2, 2, 2, 12, UNTIED),
    (4, 4, None, 6, None),
    (4, 4, None, 6, UNTIED),
], ids=["pp2-vpp2-m2", "pp2-vpp2-m6-untied", "pp4-m3", "pp4-m3-untied"])
def test_micro_batch_counts_off_the_common_case_match_single_process(world, pp, vpp, gbs,
                                                                     model_kw):
    """The schedules' edge cases: interleaved with as many micro-batches as stages (all
    forwards in the warm-up) and with three times as many; 1F1B with fewer micro-batches
    than stages, not a multiple of them (the warm-up is cut short). Tied and untied
    output weights: losses, validation loss and grads equal the single-process run with
    the same micro-batches, and the tied copies stay equal."""
    ref = _reference(model_kw, gbs)
    results = run_distributed(_train, world, 1, pp, False, vpp, model_kw, {}, 3, gbs)
    _check_pipeline(ref, results, pp, f"pp={pp} vpp={vpp} micro-batches={gbs // 2}",
                    tied=model_kw is None)


EOD = 5  # planted end-of-document id of the document-flag runs below


def _with_documents(data):
    """The mock micro-batches with EOD planted at fixed positions: several documents per
    sample, so --reset-attention-mask changes what every layer attends to."""
    for micro in data:
        text = micro["text"].clone()
        text[:, 4] = text[:, 9] = text[:, 10] = EOD
        yield {**micro, "text": text}


def _train_documents(rank, world_size, pp, vpp):
    """Losses of 2 steps and a validation loss with --reset-attention-mask
    --reset-position-ids --eod-mask-loss from the single-process model's weights."""
    full = _reference_weights(None)
    cfg = _cfg(world_size, 1, pp, False, vpp)
    cfg.data.reset_attention_mask = cfg.data.reset_position_ids = True
    cfg.data.eod_mask_loss = True
    ps = ParallelState.build(world_size, rank, pp_size=pp, virtual_pp_size=vpp)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    tr.eod = EOD
    specs = stage_layout(LAYERS, pp, ps.pp_rank, vpp, False)
    _load_reference(tr, ps, full, [s.layer_offset for s in specs])
    data = _with_documents(data_iterator(cfg, rt, "train", 0))
    losses = [float(train_step(tr, data)[0]) for _ in range(2)]
    with torch.no_grad():  # the forward-only schedule of evaluation
        valid = forward_backward(tr, _with_documents(data_iterator(cfg, rt, "valid", 0)),
                                 cfg.data.num_micro_batches, forward_only=True)
    return losses + [float(valid)]


@pytest.mark.parametrize("world,pp,vpp", [(4, 4, None), (2, 2, 2)], ids=["pp4", "pp2-vpp2"])
def test_reset_attention_mask_reaches_the_middle_stages(world, pp, vpp):
    """Megatron-LM gives every pipeline stage the batch's per-document attention mask;
    a middle stage (no embedding, no loss) attending across documents trains on other
    losses than the single process."""
    if "documents" not in REFERENCE:  # one single-process run for both layouts
        REFERENCE["documents"] = run_distributed(_train_documents, 1, 1, None)[0]
    ref = REFERENCE["documents"]
    for rank, got in enumerate(run_distributed(_train_documents, world, pp, vpp)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0,
                                   msg=f"pp={pp} vpp={vpp} rank={rank}: losses differ")


# --------------------------------------------------------------------------- 4. checkpoints
def test_virtual_chunks_save_as_model0_model1():
    cfg = _cfg(2, 1, 2, False, vpp=2)
    ps = ParallelState.build(2, 1, pp_size=2, virtual_pp_size=2, create_groups=False)
    torch.manual_seed(0)
    chunks = ModelChunks(build_stage_models(cfg.model, ps, vpp_size=2))
    state = trainer_checkpoint.model_state_dicts(chunks)
    assert sorted(state) == ["model0", "model1"]
    assert "language_model.encoder.layers.0.self_attention.query_key_value.weight" in state["model0"]
    assert "word_embeddings_for_head.weight" in state["model1"]  # last stage, tied
    assert "language_model.encoder.final_layernorm.weight" in state["model1"]
    torch.manual_seed(1)
    other = ModelChunks(build_stage_models(cfg.model, ps, vpp_size=2))
    trainer_checkpoint.load_model_state_dicts(other, state)
    for a, b in zip(chunks.parameters(), other.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(SystemExit, match=r"has model entries \['model'\].*2 model chunk"):
        trainer_checkpoint.load_model_state_dicts(other, {"model": state["model0"]})
    single = ModelChunks(build_stage_models(cfg.model, ParallelState.build(1, 0)))
    assert list(trainer_checkpoint.model_state_dicts(single)) == ["model"]
    with pytest.raises(RuntimeError, match="2 virtual-pipeline chunks"):
        chunks.module


# --------------------------------------------------------------------------- 5. end to end
def _e2e_args(layout):
    from tests.test_end_to_end import MODEL
    args = list(MODEL)
    args[args.index("--num-layers") + 1] = str(LAYERS)
    return layout + args


def _pretrain_e2e(rank, world_size, argv) -> str:
    """pretrain() with tests/test_end_to_end.py's model and `argv` on this rank (a forked
    rank: no interpreter start, no imports); its stdout."""
    return _pretrain_gpt(rank, world_size, argv, base=[])


def _tensorboard_steps(tb_dir) -> list:
    from megatron.logging_utils import read_scalars

    return [step for step, _ in read_scalars(str(tb_dir))["lm loss"]]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layout,ranks,stop", [
    (2, ["--pipeline-model-parallel-size", "2"], ["mp_rank_00_000", "mp_rank_00_001"], "exit"),
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"], "rewind"),
], ids=["pp2", "tp2-pp2-vpp2"])
def test_torchrun_pipeline_save_resume(tmp_path, nproc, layout, ranks, stop):
    """Through torchrun: the last stage prints the iteration lines and writes tensorboard;
    a run stopped at a checkpoint (by --exit-interval, or rewound to it) and resumed gives
    the same losses (printed values, bit-identical on CPU fp32) as an uninterrupted run.
    The uninterrupted run is pretrain() on forked ranks (the code pretrain_gpt.py runs,
    without a launch: each torchrun launch costs every rank the interpreter's start and
    the imports); the stopped (pp2) and the resumed runs go through torchrun."""
    from tests.test_end_to_end import losses_by_iteration, rewind_to, torchrun

    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "4"]
    full = run_distributed(_pretrain_e2e, nproc, _e2e_args(layout) + [
        "--train-iters", "8", "--tensorboard-dir", str(tmp_path / "tb-full")]
        + (save if stop == "rewind" else []))[-1]  # the last stage prints
    ref = losses_by_iteration(full)
    assert sorted(ref) == list(range(1, 9)), full[-3000:]
    assert "validation loss at iteration 4" in full
    assert _tensorboard_steps(tmp_path / "tb-full") == list(range(1, 9))

    if stop == "exit":
        first = torchrun(nproc, _e2e_args(layout) + ["--train-iters", "8", "--exit-interval", "4",
                                                     "--tensorboard-dir", str(tmp_path / "tb")]
                         + save)
        assert losses_by_iteration(first) == {i: ref[i] for i in range(1, 5)}
        assert "validation loss at iteration 4" in first
        assert _tensorboard_steps(tmp_path / "tb") == list(range(1, 5))
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    else:
        rewind_to(ckpt, 4)  # one launch less than stopping a second run there
    resumed = torchrun(nproc, _e2e_args(layout) + ["--train-iters", "8", "--load", str(ckpt),
                                               "--save", str(ckpt), "--save-interval", "4",
                                               "--tensorboard-dir", str(tmp_path / "tb-resumed")])
    assert losses_by_iteration(resumed) == {i: ref[i] for i in range(5, 9)}, resumed[-3000:]
    assert "validation loss at iteration 8" in resumed
    assert _tensorboard_steps(tmp_path / "tb-resumed") == list(range(5, 9))
    keys = ["model0", "model1"] if "--num-layers-per-virtual-pipeline-stage" in layout \
        else ["model"]
    for iteration, name in ((it, name) for it in (4, 8) for name in ranks):  # 8: by torchrun
        state = torch.load(ckpt / f"iter_{iteration:07d}" / name / "model_optim_rng.pt",
                           weights_only=True)
        assert all(k in state for k in keys), (iteration, name, sorted(state))


# --------------------------------------------------------------------------- 6. evaluation
EVAL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "1e-2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",  # 256 ids: no padding
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization",
        "--eval-iters", "3", "--log-interval", "1"]


def _pretrain_gpt(rank, world_size, argv, base=None) -> str:
    """pretrain() as pretrain_gpt.py runs it with `base` (default EVAL) + `argv` on this
    rank; its stdout."""
    cfg = parse_and_validate((EVAL if base is None else base) + argv, world_size=world_size, env={"RANK": str(rank)},
                             cuda_available=False)
    rt = initialize_distributed(cfg.parallel, rank, world_size, 0)
    set_random_seed(cfg.training.seed, rt)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(cfg, rt)
    return out.getvalue()


def _evaluate_checkpoint(rank, world_size, load, layout):
    """The validation and test losses printed by a --skip-train evaluation of `load`."""
    out = _pretrain_gpt(rank, world_size, layout + ["--skip-train", "--load", load])
    return re.findall(r"from (\w+) set \| lm loss value: (\S+)", out)


def test_evaluation_of_a_checkpoint_matches_single_process_in_every_layout(tmp_path):
    """The validation / test loss of one checkpoint (--skip-train --load): the mean over
    --eval-iters global batches of the micro-batch means, reduced over the data-parallel
    ranks and taken from the last pipeline stage, is the single process's to 1e-5 with
    dp 2 (2 micro-batches per rank), pp 2 and tp 2."""
    ck = str(tmp_path / "ck")
    _pretrain_gpt(0, 1, ["--train-iters", "3", "--save", ck, "--save-interval", "3"])
    ref = _evaluate_checkpoint(0, 1, ck, [])
    assert [name for name, _ in ref] == ["validation", "test"]
    for layout in ([], ["--pipeline-model-parallel-size", "2"],
                   ["--tensor-model-parallel-size", "2"]):
        got = run_distributed(_evaluate_checkpoint, 2, ck, layout)[-1]  # the last rank prints
        assert [name for name, _ in got] == ["validation", "test"], layout
        for (_, want), (_, value) in zip(ref, got):
            assert float(value) == pytest.approx(float(want), rel=1e-5), layout
