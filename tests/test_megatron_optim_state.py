"""Resuming from a Megatron-LM 23.05 checkpoint continues its optimizer exactly.

The checkpoints here are written by tests/megatron_optim_reference.py from Megatron-LM
23.05's own rules (apex FusedAdam's state: the step count in each parameter group; the
weight-decay / no-weight-decay split; fp32_from_fp16_params; the distributed optimizer's
grad-buffer layout with its padding), not by this framework's writer, and every tensor of
their optimizer state is distinguishable per parameter. One training step after `--load`
is then checked, parameter by parameter, against apex's AdamW update computed in fp64 from
that state: the moments and main weights reached the right parameters, the step count
(bias correction), the learning rate (the scheduler's position) and the weight decay are
Megatron's; the loss scale and its trackers and the consumed samples continue.
"""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

from megatron.checkpoint_files import megatron_payload
from megatron.checkpointing import checkpoint_name
from megatron.core.optimizer.adamw import AdamW
from tests import forked_script
from tests import megatron_optim_reference as ref
from tests.dist_utils import run_distributed
from tests.test_exact_resume import K, run_pretrain

HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
STEP = 5  # Adam steps taken: not the K iterations (skipped fp16 steps make them differ)
NUM_STEPS = 20  # the scheduler's position in samples (not K x global batch)
SCALER = {"scale": torch.tensor(4096.0), "growth_tracker": 7, "hysteresis_tracker": 1}


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The checks compare against apex's update in fp64 from CPU reference tensors, and the
    step recorder sees torch's AdamW: on a machine with a GPU the one-process runs would
    pick CUDA and its Triton AdamW (tests/test_distrib_optimizer_triton.py checks that one
    against torch's), so they stay on the CPU as the multi-process runs do."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _sched() -> dict:
    return ref.scheduler_state(1e-2, 1e-3, 16, 48, NUM_STEPS, HYPER["weight_decay"])


def _source(root: str, extra: list) -> dict:
    """This framework's checkpoint at K (tp 1): its payload, for weights, args and RNG."""
    run_pretrain(extra + ["--save", root, "--save-interval", str(K), "--exit-interval", str(K)])
    return torch.load(checkpoint_name(root, K, 0, 0, 1), weights_only=True)


EMBEDDING = "language_model.embedding.word_embeddings.weight"
TIED = "word_embeddings_for_head.weight"
LAYERS = 2  # tests.test_exact_resume's --num-layers


def _nest(flat: dict) -> dict:
    """Megatron-LM's nested model state of one stage's flat names."""
    out, lm = {}, {}
    for name, value in flat.items():
        parts = name.split(".")
        if name == TIED:
            out["word_embeddings_for_head"] = {"weight": value}
        elif parts[1] == "encoder":
            lm.setdefault("encoder", {})[".".join(parts[2:])] = value
        else:
            lm.setdefault(parts[1], {}).setdefault(parts[2], {})[parts[3]] = value
    return {"language_model": lm, **out}


def stage_names(names: list, pp: int, rank: int) -> dict:
    """Global name -> this pipeline stage's local name, in the stage's parameter order."""
    per = LAYERS // pp
    out = {}
    for name in names:
        parts = name.split(".")
        if parts[1] == "embedding":
            if rank == 0:
                out[name] = name
        elif parts[2] == "layers":
            layer = int(parts[3])
            if per * rank <= layer < per * (rank + 1):
                out[name] = ".".join(parts[:3] + [str(layer - per * rank)] + parts[4:])
        elif rank == pp - 1:
            out[name] = name
    if pp > 1 and rank == pp - 1:
        out[TIED] = TIED
    return out


def write_megatron(src: dict, out: str, tp: int = 1, pp: int = 1, kind: str = "indexed",
                   dp: int = 1, grad_dtype: torch.dtype = torch.float32, scaler=None) -> dict:
    """Write a Megatron-LM 23.05 checkpoint at iteration K with the weights of `src` and
    distinguishable optimizer state; returns {global name: full state} (tp 1 shapes, the
    vocabulary padded as the source's; the last stage's tied copy under TIED)."""
    full = dict(src["model"])
    names = list(full)
    values = ref.state_values(names, full)
    if all(w.dtype == torch.float32 for w in full.values()):
        for name in names:
            values[name]["param"] = full[name].clone()
    full[TIED], values[TIED] = full[EMBEDDING], values[EMBEDDING]  # identical copies
    vocab = full[EMBEDDING].shape[0]
    padded = -(-vocab // (128 * tp)) * 128 * tp

    def fit(name, t):  # the vocabulary padded for this tp (Megatron's rows past it: any)
        if "word_embeddings" in name and t.shape[0] < padded:
            return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
        return t

    for p, t in ((p, t) for p in range(pp) for t in range(tp)):
        stage = stage_names(names, pp, p)
        weights = {loc: ref.shard(fit(g, full[g]), g, tp, t) for g, loc in stage.items()}
        local = {loc: {k: ref.shard(fit(g, v), g, tp, t) for k, v in values[g].items()}
                 for g, loc in stage.items()}
        payload = megatron_payload({k: v for k, v in src.items() if k != "model"})
        payload["model"] = _nest(weights)
        args = vars(payload["args"])
        args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    padded_vocab_size=padded, use_distributed_optimizer=kind == "distributed",
                    data_parallel_size=dp, world_size=tp * pp * dp)
        payload["args"] = argparse.Namespace(**args)
        payload["opt_param_scheduler"] = _sched()
        path = checkpoint_name(out, K, t, p, pp)
        os.makedirs(os.path.dirname(path))
        hyper = dict(HYPER, lr=ref.megatron_lr(_sched()))
        order = list(weights)
        if kind == "distributed":
            payload["optimizer"], distrib = ref.distributed_optimizer(
                order, local, weights, hyper, STEP, scaler, grad_dtype, dp)
            torch.save(distrib, os.path.join(os.path.dirname(path), "distrib_optim.pt"))
        else:
            payload["optimizer"] = ref.indexed_optimizer(order, local, weights, hyper, STEP,
                                                         scaler)
        torch.save(payload, path)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(K))
    return values


def _numel(values: dict) -> int:
    return sum(v["param"].numel() for k, v in values.items() if k != TIED)


# ----------------------------------------------------------------- capturing one step
class StepRecorder:
    """Records every AdamW step (the build's class, megatron.core.optimizer.adamw): per stepped tensor, its value, gradient, state and
    group hyper-parameters before, and its value after."""

    def __init__(self, monkeypatch) -> None:
        self.steps = []
        original = AdamW.step

        def step(opt, *args, **kwargs):
            before = []
            for group in opt.param_groups:
                for p in group["params"]:
                    state = {k: v.detach().clone() if torch.is_tensor(v) else v
                             for k, v in opt.state.get(p, {}).items()}
                    before.append((p, p.detach().clone(), p.grad.detach().clone(), state,
                                   group["lr"], group["weight_decay"]))
            out = original(opt, *args, **kwargs)
            self.steps.append([(*b, b[0].detach().clone()) for b in before])
            return out

        monkeypatch.setattr(AdamW, "step", step)


def stepped_names(tr) -> dict:
    """id(stepped tensor) -> (parameter name, offset of its first element in the
    flattened parameter), from the optimizer's own pairing of model and main tensors."""
    name_of = {}
    for chunk in tr.model:
        for n, p in chunk.named_parameters():
            name_of[p] = n[len("module."):] if n.startswith("module.") else n
    opt, out = tr.optimizer, {}
    if hasattr(opt, "shards"):
        for s in opt.shards:
            lo = s.bucket.shard_range[0]
            for e in s.entries:
                out[id(e.main)] = (name_of[e.param], lo + e.start - s.bucket.param_ranges[e.param][0])
    elif hasattr(opt, "_model_main_pairs"):
        out.update({id(main): (name_of[model], 0) for model, main in opt._model_main_pairs()})
        out.update({id(p): (name_of[p], 0) for g in opt.fp32_from_fp32_groups for p in g})
    else:
        out.update({id(p): (name_of[p], 0) for p in opt.get_parameters()})
    return out


def check_step(records, names, values: dict) -> int:
    """Assert the recorded step is apex's AdamW update from `values` (fp64); returns how
    many parameter elements were checked."""
    lr = ref.megatron_lr(_sched())
    checked = 0
    for p, before, grad, state, group_lr, group_wd, after in records:
        if p.numel() == 0:
            continue
        name, offset = names[id(getattr(p, "key", p))]
        n = p.numel()
        want = {k: v.reshape(-1)[offset:offset + n].reshape(p.shape)
                for k, v in values[name].items()}
        assert torch.equal(before, want["param"]), f"{name}: main weight"
        assert torch.equal(state["exp_avg"], want["exp_avg"]), f"{name}: exp_avg"
        assert torch.equal(state["exp_avg_sq"], want["exp_avg_sq"]), f"{name}: exp_avg_sq"
        assert int(state["step"]) == STEP, f"{name}: step {state['step']}"
        wd = 0.0 if ref.no_weight_decay(name, values[name]["param"]) else HYPER["weight_decay"]
        assert group_lr == pytest.approx(lr, rel=1e-12) and group_wd == wd, name
        expect = ref.adamw_step(want["param"], grad, want["exp_avg"], want["exp_avg_sq"],
                                STEP + 1, lr, wd, HYPER["beta1"], HYPER["beta2"], HYPER["eps"])
        torch.testing.assert_close(after.double(), expect, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")
        checked += n
    return checked


def one_step(root: str, extra: list, monkeypatch, world_size: int = 1, rank: int = 0):
    rec = StepRecorder(monkeypatch)
    _, tr = run_pretrain(extra + ["--load", root, "--exit-interval", str(K + 1)], world_size,
                         rank)
    assert tr.state.iteration == K + 1 and len(rec.steps) == 1
    return tr, rec.steps[0]


# -------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("precision,ddp", [("fp32", "local"), ("bf16", "local"),
                                           ("fp16", "local"), ("fp32", "torch"),
                                           ("fp16", "torch")])
def test_one_step_from_a_megatron_optimizer_state(tmp_path, monkeypatch, precision, ddp):
    """Megatron-LM writes the same checkpoint under --DDP-impl local and torch (it unwraps
    either); a run of either loads it (bf16 needs local, as in Megatron-LM)."""
    extra = [] if precision == "fp32" else [f"--{precision}"]
    src = _source(str(tmp_path / "src"), extra)
    extra += ["--DDP-impl", ddp]
    out = str(tmp_path / "mlm")
    scaler = {k: v.clone() if torch.is_tensor(v) else v for k, v in SCALER.items()} \
        if precision == "fp16" else None
    values = write_megatron(src, out, scaler=scaler)
    tr, records = one_step(out, extra, monkeypatch)
    numel = _numel(values)
    assert check_step(records, stepped_names(tr), values) == numel
    assert tr.state.consumed_train_samples == (K + 1) * 8
    assert tr.scheduler.num_steps == NUM_STEPS + 8
    if precision == "fp16":
        scaler = tr.optimizer.grad_scaler
        assert float(scaler.scale) == 4096.0
        assert (scaler.growth_tracker, scaler.hysteresis_tracker) == (8, 1)


def _dp_worker(rank, world_size, root, extra):
    with pytest.MonkeyPatch.context() as mp:
        tr, records = one_step(root, extra, mp, world_size, rank)
        assert tr.rt.ps.dp_size == world_size
        names = stepped_names(tr)
        return {"records": [(names[id(r[0])], *r[1:]) for r in records],
                "scale": float(tr.optimizer.get_loss_scale())}


def _check_named(named_records, values) -> int:
    """`check_step` on records whose tensors were replaced by their (name, offset)."""
    keyed = {}
    records = []
    for (name, offset), *rest in named_records:
        key = object()
        keyed[id(key)] = (name, offset)
        records.append((_Stand(key, rest[0]), *rest))
    return check_step(records, keyed, values)


class _Stand:
    """A stepped tensor's stand-in: its id and shape (the tensor stayed in its process)."""

    def __init__(self, key, value):
        self.key, self.shape = key, value.shape
        self._numel = value.numel()

    def numel(self):
        return self._numel


@pytest.mark.parametrize("precision,grad_dtype", [("bf16", torch.float32),
                                                  ("fp16", torch.float16)])
def test_distributed_optimizer_state_at_dp2(tmp_path, precision, grad_dtype):
    """distrib_optim.pt as Megatron-LM 23.05 writes it (grad-buffer order, the last
    parameter first, NaN padding to a multiple of dp 2): each data-parallel rank's shard
    gets its own parameters' main weights and moments."""
    extra = [f"--{precision}", "--use-distributed-optimizer"]
    src = _source(str(tmp_path / "src"), [f"--{precision}"])
    out = str(tmp_path / "mlm")
    scaler = dict(SCALER) if precision == "fp16" else None
    values = write_megatron(src, out, kind="distributed", dp=2, grad_dtype=grad_dtype,
                            scaler=scaler)
    results = run_distributed(_dp_worker, 2, out, extra)
    numel = _numel(values)
    assert sum(_check_named(r["records"], values) for r in results) == numel
    if precision == "fp16":
        assert all(r["scale"] == 4096.0 for r in results)


@pytest.mark.parametrize("kind,run_flags", [("indexed", []),
                                            ("distributed", ["--use-distributed-optimizer"])])
def test_tp2_checkpoint_resumes_at_tp1_with_its_optimizer_state(tmp_path, monkeypatch, kind,
                                                                run_flags):
    """A tp 2 checkpoint (vocabulary padded to 256 rows for tp 2) resharded on load for a
    tp 1 run: the merged shards of every moment and main weight reach their parameter."""
    src = _source(str(tmp_path / "src"), ["--bf16"])
    out = str(tmp_path / "mlm")
    values = write_megatron(src, out, tp=2, kind=kind, dp=2)
    tr, records = one_step(out, ["--bf16"] + run_flags, monkeypatch)
    numel = _numel(values)
    assert check_step(records, stepped_names(tr), values) == numel


def _pp_worker(rank, world_size, root, extra):
    with pytest.MonkeyPatch.context() as mp:
        tr, records = one_step(root, extra, mp, world_size, rank)
        names = stepped_names(tr)
        return {"pp_rank": tr.rt.ps.pp_rank,
                "records": [(names[id(r[0])], *r[1:]) for r in records]}


@pytest.mark.parametrize("kind,run_flags", [("indexed", []),
                                            ("distributed", ["--use-distributed-optimizer"])])
def test_pp2_checkpoint_with_the_tied_embedding_copy(tmp_path, kind, run_flags):
    """pp 2: the last stage's `word_embeddings_for_head` (the tied output copy, last in
    its parameter order, first in its grad buffer) gets the embedding's state."""
    src = _source(str(tmp_path / "src"), ["--bf16"])
    out = str(tmp_path / "mlm")
    values = write_megatron(src, out, pp=2, kind=kind)
    flags = ["--bf16", "--pipeline-model-parallel-size", "2"] + run_flags
    results = run_distributed(_pp_worker, 2, out, flags)
    checked = 0
    for r in results:
        to_global = {loc: g for g, loc in stage_names(list(src["model"]), 2, r["pp_rank"]).items()}
        named = [((to_global[name], offset), *rest) for (name, offset), *rest in r["records"]]
        checked += _check_named(named, values)
    assert checked == _numel(values) + values[TIED]["param"].numel()


# ------------------------------------------------- optimizer states that do not fit
_MEGATRON_RULE = ref.no_weight_decay


def _biases_only(name, tensor):  # norms' weights decayed too: other group sizes
    return name.endswith(".bias")


def _swapped(name, tensor):  # the same group sizes, two parameters trading groups
    if name.endswith("position_embeddings.weight"):
        return True
    return _MEGATRON_RULE(name, tensor) and not name.endswith("final_layernorm.bias")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("rule,message", [
    (_biases_only, r"groups of (sizes )?\[15, 13\].*\[10, 18\]"),
    (_swapped, r"optimizer state .*(shape|matched by position)")])
def test_another_weight_decay_split_is_refused_and_loads_without_the_optimizer(
        tmp_path, monkeypatch, tp, rule, message):
    """A checkpoint whose parameter groups split the parameters otherwise than Megatron-LM
    23.05's rule (biases and 1-D parameters skip weight decay) cannot have its state
    matched by position: an error naming the group sizes, or the moment whose shape
    differs, and --no-load-optim (torch's bare "doesn't match the size of optimizer's
    group", or a traceback from inside the step, before). --no-load-optim then loads it,
    also when resharded (tp 2 -> 1: it stopped with the same error, as a traceback)."""
    src = _source(str(tmp_path / "src"), ["--bf16"])
    out = str(tmp_path / "mlm")
    with monkeypatch.context() as m:
        m.setattr(ref, "no_weight_decay", rule)
        write_megatron(src, out, tp=tp)
    with pytest.raises(SystemExit, match=message) as exc:
        run_pretrain(["--bf16", "--load", out])
    assert "pass --no-load-optim" in str(exc.value) or "or with --no-load-optim" in str(exc.value)
    losses, tr = run_pretrain(["--bf16", "--load", out, "--no-load-optim"])
    assert sorted(losses) == [K + 1, K + 2, K + 3] and tr.state.consumed_train_samples == 48


def test_the_offline_reshard_of_such_a_checkpoint_names_the_flag_that_leaves_it_out(
        tmp_path, monkeypatch):
    """tools/checkpoint_convert.py reshard of a checkpoint whose optimizer state cannot be
    matched to the parameters ended in a ValueError traceback: now one line naming the
    problem and --no-load-optim, status 1, no output left behind. With --no-load-optim
    (checkpoint_util.py takes it too) the model is written without the optimizer state and
    a run loading it with --no-load-optim trains on."""
    src = _source(str(tmp_path / "src"), ["--bf16"])
    out, resharded = str(tmp_path / "mlm"), str(tmp_path / "tp1")
    with monkeypatch.context() as m:
        m.setattr(ref, "no_weight_decay", _swapped)
        write_megatron(src, out, tp=2)
    tool = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "checkpoint_convert.py")
    proc = forked_script.run(  # forked from this process: its imports come free
        [sys.executable, tool, "reshard", "--load", out, "--save", resharded,
         "--target-tensor-model-parallel-size", "1"], dict(os.environ), timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        f"error: cannot reshard the optimizer state: {out}/iter_{K:07d} rank (tp 0, pp 0): "
        "the optimizer state {"), proc.stderr
    assert proc.stderr.endswith("pass --no-load-optim to write the model weights without the "
                                "optimizer state (a run loading the output passes "
                                "--no-load-optim too)\n"), proc.stderr
    assert not os.path.exists(resharded)
    from tools import checkpoint_util

    assert checkpoint_util.main(["--model-type", "GPT", "--load-dir", out, "--save-dir",
                                 resharded, "--target-tensor-parallel-size", "1",
                                 "--no-load-optim"]) == 0
    payload = torch.load(checkpoint_name(resharded, K, 0, 0, 1), weights_only=True)
    assert "optimizer" not in payload and "opt_param_scheduler" in payload
    with pytest.raises(SystemExit, match="holds no optimizer state"):
        run_pretrain(["--bf16", "--load", resharded])
    losses, tr = run_pretrain(["--bf16", "--load", resharded, "--no-load-optim"])
    assert sorted(losses) == [K + 1, K + 2, K + 3] and tr.state.consumed_train_samples == 48


@pytest.mark.parametrize("flag", ["--no-load-optim", "--finetune"])
def test_a_distributed_checkpoint_without_its_distrib_optim_files(tmp_path, flag):
    """model_optim_rng.pt files of a --use-distributed-optimizer checkpoint without their
    distrib_optim.pt (dropped to share the weights), loaded at another tp: --no-load-optim
    and --finetune load the model (they stopped with "distrib_optim.pt ... is missing; load
    with --no-load-optim"); a load of the optimizer says what is missing."""
    src = _source(str(tmp_path / "src"), ["--bf16"])
    out = str(tmp_path / "mlm")
    write_megatron(src, out, tp=2, kind="distributed", dp=2)
    for t in range(2):
        os.remove(os.path.join(os.path.dirname(checkpoint_name(out, K, t, 0, 1)),
                               "distrib_optim.pt"))
    with pytest.raises(SystemExit, match=r"distrib_optim.pt of rank \(tp 0, pp 0\) is missing"):
        run_pretrain(["--bf16", "--load", out])
    losses, tr = run_pretrain(["--bf16", "--load", out, flag])
    assert tr.state.iteration == 6 and len(losses) == (3 if flag == "--no-load-optim" else 6)


# ------------------------------------------------------ back: what to-megatron writes
def _exported(root: str, out: str):
    """to-megatron of `root`'s iteration K; (raw rank-0 payload, its distrib_optim.pt or
    None), read as Megatron-LM does (plain torch.load, argparse and numpy allowed)."""
    from megatron.checkpoint_files import ModelType, megatron_globals
    from tools.checkpoint_convert import to_megatron

    to_megatron(root, out)
    path = checkpoint_name(out, K, 0, 0, 1)
    with torch.serialization.safe_globals([g for g in megatron_globals()
                                           if g[0] is not ModelType]):
        raw = torch.load(path, weights_only=True)
        extra = os.path.join(os.path.dirname(path), "distrib_optim.pt")
        distrib = torch.load(extra, weights_only=True) if os.path.isfile(extra) else None
    return raw, distrib


def _megatron_params(raw: dict) -> dict:
    """fp32 copies of the exported weights, by name in Megatron-LM's module order."""
    lm = raw["model"]["language_model"]
    out = {f"embedding.{k}": v["weight"] for k, v in lm["embedding"].items()}
    out.update({f"encoder.{k}": v for k, v in lm["encoder"].items()})
    return {k: v.detach().float().clone() for k, v in out.items()}


def _step_as_megatron(opt, expected_step: int) -> None:
    """One apex step with zero gradients; it must count from the saved step."""
    before = {p: (p.clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for g in opt.param_groups for p in g["params"]}
    for p in before:
        p.grad = torch.zeros_like(p)
    opt.step()
    for group in opt.param_groups:
        assert group["step"] == expected_step, "the step count restarted"
        for p in group["params"]:
            p0, state = before[p]
            want = ref.adamw_step(p0, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                  expected_step, group["lr"], group["weight_decay"],
                                  *group["betas"], group["eps"])
            torch.testing.assert_close(p.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_to_megatron_optimizer_state_loads_in_megatron_lm(tmp_path, precision):
    """Megatron-LM 23.05 loads the export's optimizer into apex FusedAdam, whose step reads
    each group's "bias_correction" and "step" (torch's per-parameter step is not read):
    without them it stopped with KeyError 'bias_correction', and its bias correction would
    have restarted at step 1."""
    extra = [] if precision == "fp32" else [f"--{precision}"]
    root = str(tmp_path / "ck")
    run_pretrain(extra + ["--save", root, "--save-interval", str(K), "--exit-interval", str(K)])
    raw, _ = _exported(root, str(tmp_path / "mlm"))
    params = _megatron_params(raw)
    opt = ref.megatron_load_indexed(raw["optimizer"], params)
    original = torch.load(checkpoint_name(root, K, 0, 0, 1), weights_only=True)["optimizer"]
    inner = original.get("optimizer", original)
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        assert torch.equal(opt.state[p]["exp_avg"], inner["state"][i]["exp_avg"])
    _step_as_megatron(opt, K + 1)


@pytest.mark.parametrize("megatron_dp", [1, 2, 3, 8])
def test_to_megatron_distributed_optimizer_loads_at_any_dp(tmp_path, megatron_dp):
    """distrib_optim.pt of a dp 1 run, exported: Megatron-LM 23.05 scatters its flat tensors
    in pieces of its own padded grad buffer's shard size, so they must be long enough for
    the data-parallel size it resumes with."""
    root = str(tmp_path / "ck")
    run_pretrain(["--bf16", "--use-distributed-optimizer", "--save", root, "--save-interval",
                  str(K), "--exit-interval", str(K)])
    raw, distrib = _exported(root, str(tmp_path / "mlm"))
    params = _megatron_params(raw)
    opt = ref.megatron_load_distributed(raw["optimizer"], distrib, params, megatron_dp)
    _step_as_megatron(opt, K + 1)
