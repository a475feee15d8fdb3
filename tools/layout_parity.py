#!/usr/bin/env python
"""Do parallel layouts train like one process? Loss and grad-norm curves, layout by layout.

    python tools/layout_parity.py --layouts tp1,tp2,pp2,pp2vp2,dp2+distopt --iters 50
    python tools/layout_parity.py --one-gpu --layouts tp1,tp2,tp4,tp8,pp4vp2 --iters 50
    python tools/layout_parity.py --layouts tp1,tp2 -- --num-layers 4 ...   (own model/data)

A seed run (one process) trains --start-iters iterations and saves a checkpoint. Every
layout then loads it -- resharded to its own layout, as any load is -- and trains --iters
more iterations through pretrain_gpt.py, logging every iteration. Each layout's lm loss
and grad norm are compared iteration by iteration with those of the first layout (the
reference, normally tp1): the largest relative differences must stay within --tolerance
(the loss, iteration by iteration) and --gnorm-tolerance (the grad norm, in means over 10
iterations: 16-bit rounding alone swings single iterations both ways).
Starting every layout from one checkpoint makes the comparison independent of how each
layout draws its initial weights. Prints a table; the exit status is 1 when a layout
failed to run or left the tolerance.

Layouts: tpN, ppN, vpN (virtual stages per pipeline rank, the interleaved schedule) and
dpN in any order, ranks = tp*pp*dp; then options, each after a '+': nosp (sequence
parallelism is on whenever tp > 1, as Megatron users run it, except with --num-experts,
which refuses it), overlap
(--overlap-grad-reduce), distopt (--use-distributed-optimizer), eager (--no-compile: the
same layout without torch.compile, a control for how far rounding alone moves a run).

--one-gpu puts every rank on GPU 0 (or on the CPU without CUDA). The tool starts the ranks
itself and gives each its own NCCL_HOSTID, so NCCL takes them for ranks on different hosts
and connects them through loopback sockets (it refuses two ranks of one host on one GPU).
That checks the NCCL code paths of any layout on a machine with one GPU; speed means
nothing there: the ranks time-slice the GPU, so a collective costs milliseconds (tens
with 8 ranks) -- keep the model, its micro-batch count and the TP size small. Without
it, rank r runs on GPU r, as under torchrun on one host.

With --fp16 and the dynamic loss scale, layouts with another number of micro-batches per
rank overflow at other iterations: each micro-batch's loss is divided by the rank's own
micro-batch count (as in Megatron), so dp scales the activation grads. A skip in one run
only is reported as a failure; compare fp16 layouts under a constant --loss-scale.

Every run pads the vocabulary to the same size: the tool sets
--make-vocab-size-divisible-by per layout to (the given value, 128 by default) x lcm(tp
sizes) / tp, since Megatron pads to that flag times tp and the padded rows enter the
softmax. A layout whose log reports another padded size fails.

Flags after `--` replace the default model and data (a small GPT with biases on mock
data, bf16 on CUDA; without CUDA fp32 and narrower, CPU_SIZES); the tool adds the layout, --train-iters, --log-interval 1 and the
checkpoint flags. Give them --hidden-dropout 0 --attention-dropout 0 (a warning says so
otherwise): with dropout on, each layout draws other masks and no layout matches. Each rank's output goes to --out-dir/<run>/rank<r>.log (by default a
temporary directory, removed when every layout passed).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, ROOT)

from tools.child_processes import sigterm_as_exit, stop, stopping  # noqa: E402

# 8 layers and 8 heads: up to tp8, and pp4 with two virtual stages per rank. A global batch
# of 16 micro-batches of 2 fits every dp up to 8, and interleaving with pp up to 4.
DEFAULT_MODEL = [
    "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "2", "--global-batch-size", "32",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4095",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234", "--eval-iters", "0",
]
# Without CUDA the same layers and heads at hidden 64 and sequence 64 (a twentieth of the
# FLOPs): the GPU model trains at about a minute per iteration on 2 CPU cores, past the
# --timeout of a 50-iteration run. fp32 on the CPU keeps layouts within 1e-4 of each other
# at either size, so the check is as tight.
CPU_SIZES = {"--hidden-size": "64", "--seq-length": "64", "--max-position-embeddings": "64"}


def default_model(cuda: bool) -> List[str]:
    """The model and data flags when none follow `--`: DEFAULT_MODEL in bf16 on CUDA, in
    fp32 at CPU_SIZES without it."""
    if cuda:
        return DEFAULT_MODEL + ["--bf16"]
    return [CPU_SIZES.get(prev, flag) if prev in CPU_SIZES else flag
            for prev, flag in zip([None] + DEFAULT_MODEL[:-1], DEFAULT_MODEL)]


OPTIONS = {"nosp": [], "overlap": ["--overlap-grad-reduce"],
           "distopt": ["--use-distributed-optimizer"], "eager": ["--no-compile"]}
LINE = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|(.*)$", re.M)
LOSS = re.compile(r" lm loss: ([0-9.E+-]+) \|")
GNORM = re.compile(r" grad norm: ([0-9.E+-]+) \|")
PADDED_VOCAB = re.compile(r"padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)")
GRAD_NORM_UNIT = 1e-3  # the log line prints the grad norm with three decimals
WINDOW = 10  # iterations per grad-norm mean compared


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    options: Tuple[str, ...] = ()

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp


def parse_layout(text: str) -> Layout:
    """'tp2pp2vp2dp2+distopt' -> Layout(tp=2, pp=2, vp=2, dp=2, options=('distopt',))."""
    base, *options = text.strip().split("+")
    if not re.fullmatch(r"((tp|pp|vp|dp)\d+)+", base):
        raise ValueError(f"bad layout {text!r}: write sizes as tpN, ppN, vpN, dpN (e.g. "
                         f"tp2pp2dp2), then options after '+' from {sorted(OPTIONS)}")
    sizes = {}
    for key, value in re.findall(r"(tp|pp|vp|dp)(\d+)", base):
        if key in sizes:
            raise ValueError(f"bad layout {text!r}: {key} given twice")
        if int(value) < 1:
            raise ValueError(f"bad layout {text!r}: {key}{value} must be at least 1")
        sizes[key] = int(value)
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise ValueError(f"bad layout {text!r}: unknown option(s) {unknown}; "
                         f"known: {sorted(OPTIONS)}")
    if sizes.get("vp", 1) > 1 and sizes.get("pp", 1) < 2:
        raise ValueError(f"bad layout {text!r}: vp (virtual stages) needs pp >= 2")
    return Layout(name=text.strip(), options=tuple(options), **sizes)


def flag_value(flags: List[str], name: str) -> Optional[str]:
    """The last value given to `name` in an argv list (either `--x v` or `--x=v`)."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def vocab_multiple(layouts: List[Layout], model: List[str]) -> int:
    """What every layout's padded vocabulary must be a multiple of to have the same size:
    --make-vocab-size-divisible-by (Megatron's 128 by default) times the least common
    multiple of the layouts' tp sizes. Megatron pads to that flag times tp, and the padded
    rows take part in the softmax, so runs padded differently train different models."""
    base = int(flag_value(model, "--make-vocab-size-divisible-by") or 128)
    return base * math.lcm(*(lay.tp for lay in layouts))


def layout_flags(lay: Layout, model: List[str], multiple: Optional[int] = None) -> List[str]:
    """pretrain_gpt.py flags that set up `lay` for the model flags `model`; with
    `multiple` (see vocab_multiple), the vocabulary padding that gives every layout the
    same padded size."""
    flags = ["--tensor-model-parallel-size", str(lay.tp),
             "--pipeline-model-parallel-size", str(lay.pp)]
    if multiple is not None:
        flags += ["--make-vocab-size-divisible-by", str(multiple // lay.tp)]
    if lay.tp > 1 and "nosp" not in lay.options and flag_value(model, "--num-experts") is None:
        flags.append("--sequence-parallel")
    if lay.vp > 1:
        layers = flag_value(model, "--num-layers")
        if layers is None or int(layers) % (lay.pp * lay.vp):
            raise ValueError(f"layout {lay.name}: --num-layers {layers} must be a multiple of "
                             f"pp*vp = {lay.pp * lay.vp}")
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  str(int(layers) // (lay.pp * lay.vp))]
    for option in lay.options:
        flags += OPTIONS[option]
    return flags


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, one_gpu: bool, tag: str) -> Dict[str, str]:
    """The environment of one rank (the tool starts the ranks itself, as torchrun would
    on one host: rank r on GPU r; with `one_gpu` every rank on GPU 0)."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_RANK="0" if one_gpu else str(rank),
               LOCAL_WORLD_SIZE="1" if one_gpu else str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if one_gpu:
        # A host id per rank: NCCL then connects the ranks as separate hosts (sockets on
        # the loopback interface) instead of refusing two ranks on one GPU.
        env.update(NCCL_HOSTID=f"{tag}-rank{rank}", NCCL_SOCKET_IFNAME="lo",
                   NCCL_IB_DISABLE="1")
    return env


# After another rank fails, how long rank 0 gets to end by itself: a rank whose argument
# or load error is rank 0's to print exits without a word, maybe before rank 0 prints.
RANK0_GRACE_S = 15.0


def _wait_all(procs: List[subprocess.Popen], deadline: float) -> Tuple[int, Optional[int]]:
    """Wait for every rank; when one fails or time runs out, stop the others (they would
    wait in a collective until the backend's timeout), rank 0 after `RANK0_GRACE_S`. An
    exception meanwhile (Ctrl-C, SIGTERM: `sigterm_as_exit`) stops every rank before it propagates.
    (status, first failed rank)."""
    with stopping(procs, grace_s=0):
        return _wait_ranks(procs, deadline)


def _wait_ranks(procs: List[subprocess.Popen], deadline: float) -> Tuple[int, Optional[int]]:
    """`_wait_all` without the clean-up on an exception."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and codes[0] is None:
            try:
                procs[0].wait(timeout=min(RANK0_GRACE_S, max(0.0, deadline - time.time())))
            except subprocess.TimeoutExpired:
                pass
        if failed or time.time() > deadline:
            stop(procs, grace_s=0)
            return (codes[failed[0]], failed[0]) if failed else (124, None)  # 124: timeout
        if all(c == 0 for c in codes):
            return 0, None
        time.sleep(0.2)


def launch(argv: List[str], world: int, one_gpu: bool, log_dir: str, timeout_s: float,
           base_env: Dict[str, str]) -> Tuple[int, str, str]:
    """Run pretrain_gpt.py with `argv` on `world` ranks, each rank's output in
    log_dir/rank<r>.log. (exit status, all ranks' output, the failed rank's output)."""
    os.makedirs(log_dir, exist_ok=True)
    deadline = time.time() + timeout_s
    port, tag = free_port(), os.path.basename(log_dir)
    procs, paths = [], []
    for rank in range(world):
        paths.append(os.path.join(log_dir, f"rank{rank}.log"))
        env = {**rank_env(rank, world, port, one_gpu, tag), **base_env}
        with open(paths[-1], "w") as f:
            procs.append(subprocess.Popen([sys.executable, PRETRAIN] + argv, stdout=f,
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    rc, bad = _wait_all(procs, deadline)
    logs = [open(p).read() for p in paths]
    failed = logs[bad] if bad is not None else logs[-1]
    if not failed.strip():  # a rank that leaves an error to rank 0's message prints nothing
        failed = next((log for log in logs if log.strip()), failed)
    return rc, "".join(logs), failed


def describe_exit(rc: int, timeout_s: float) -> str:
    return f"timed out after {timeout_s:g} s (--timeout)" if rc == 124 else f"exit {rc}"


def curves(log: str) -> Dict[int, Tuple[Optional[float], Optional[float]]]:
    """{iteration: (lm loss, grad norm)} from pretrain_gpt.py's iteration lines; both are
    None for an iteration whose step was skipped (fp16 overflow), as its line has neither."""
    out = {}
    for it, rest in LINE.findall(log):
        loss, gnorm = LOSS.search(rest), GNORM.search(rest)
        out[int(it)] = (float(loss.group(1)) if loss else None,
                        float(gnorm.group(1)) if gnorm else None)
    return out


def window_gap(ref: List[float], got: List[float], window: int) -> float:
    """Largest relative difference between the means of `window` consecutive values (the
    last window may be shorter), less one printed grad-norm unit."""
    worst = 0.0
    for k in range(0, len(ref), window):
        a = sum(ref[k:k + window]) / len(ref[k:k + window])
        b = sum(got[k:k + window]) / len(got[k:k + window])
        worst = max(worst, max(0.0, abs(b - a) - GRAD_NORM_UNIT) / max(abs(a), 1e-12))
    return worst


def compare(ref: Dict[int, tuple], got: Dict[int, tuple], iterations: List[int],
            window: int = 10) -> dict:
    """Largest relative differences over `iterations`: of the loss, iteration by iteration;
    of the grad norm, between means over `window` iterations (the checked one) and
    iteration by iteration (shown). A wrong gradient scale moves every window; 16-bit
    rounding can make single iterations swing by 20% in a spiky stretch of training
    (benchmarks/RESULTS.md), and those swings go both ways. An iteration skipped (no loss)
    in one run but not in the other is listed under "skip_mismatch"."""
    missing = [i for i in iterations if i not in got or i not in ref]
    its = [i for i in iterations if i not in missing]
    mismatch = [i for i in its if (ref[i][0] is None) != (got[i][0] is None)]
    stepped = [i for i in its if ref[i][0] is not None and got[i][0] is not None]
    loss_rel = [abs(got[i][0] - ref[i][0]) / max(abs(ref[i][0]), 1e-12) for i in stepped]
    both = [i for i in stepped if ref[i][1] is not None and got[i][1] is not None]
    g0, g1 = [ref[i][1] for i in both], [got[i][1] for i in both]
    return {"missing": missing, "skip_mismatch": mismatch, "stepped": len(stepped),
            "loss_max_rel": max(loss_rel, default=float("nan")),
            "loss_mean_rel": sum(loss_rel) / len(loss_rel) if loss_rel else float("nan"),
            "gnorm_max_rel": max((window_gap([a], [b], 1) for a, b in zip(g0, g1)),
                                 default=float("nan")),
            "gnorm_window_rel": window_gap(g0, g1, window) if both else float("nan")}


def verdict(cmp: dict, tolerance: Tuple[float, float]) -> str:
    """'ok' or why not; `tolerance` is (loss, grad norm), both relative."""
    if cmp["missing"]:
        return f"FAIL: no log line for iterations {cmp['missing'][:5]}"
    if cmp["skip_mismatch"]:
        return (f"FAIL: skipped in one run only: iterations {cmp['skip_mismatch'][:5]} "
                "(with fp16, compare layouts under a constant --loss-scale)")
    if not cmp["stepped"]:
        return "FAIL: no iteration updated the weights in both runs (all skipped); raise --iters"
    if not cmp["loss_max_rel"] <= tolerance[0]:
        return f"FAIL: loss beyond {tolerance[0]:g}"
    if cmp["gnorm_window_rel"] > tolerance[1]:  # nan (no grad norms logged) passes
        return f"FAIL: grad norm beyond {tolerance[1]:g}"
    return "ok"


def default_tolerance(model: List[str]) -> Tuple[float, float]:
    """Relative (loss, grad norm) tolerances. 16-bit runs drift apart when sums run in
    another order: on the H200 (bf16, 50 iterations, benchmarks/RESULTS.md) layouts
    differed from tp1 by at most 2.9e-3 in loss and 3.0% in 10-iteration grad-norm means,
    and tp1 without torch.compile (rounding alone) by 3.4e-3 and 3.2%; fp32 runs on the
    CPU by 2e-7. A wrong gradient scale or a lost shard moves the grad norm by tens of
    percent."""
    return (0.01, 0.05) if ("--bf16" in model or "--fp16" in model) else (1e-4, 0.01)


def dropout_warning(model: List[str]) -> Optional[str]:
    """A warning when the model flags leave dropout on (Megatron's default is 0.1 for both):
    each layout then draws other dropout masks (the tensor-parallel RNG streams differ), so
    the curves part by far more than any tolerance whether or not the layout is right."""
    on = []
    for flag in ("--hidden-dropout", "--attention-dropout"):
        value = flag_value(model, flag)
        try:
            if value is None or float(value) != 0.0:
                on.append(f"{flag} {value if value is not None else '0.1 (the default)'}")
        except ValueError:
            continue  # pretrain_gpt.py names the bad value
    if not on:
        return None
    return (f"warning: dropout is on ({', '.join(on)}): every layout draws other dropout "
            "masks, so the losses differ beyond the tolerance even where the layout is "
            "right; add --hidden-dropout 0 --attention-dropout 0 to the flags after --")


def seed_checkpoint(model: List[str], start: int, total: int, out_dir: str, timeout_s: float,
                    base_env: Dict[str, str], multiple: int) -> str:
    """Train `start` of `total` iterations on one process and save; the checkpoint dir."""
    ckpt = os.path.join(out_dir, "seed-checkpoint")
    shutil.rmtree(ckpt, ignore_errors=True)
    # The layouts' --train-iters (the learning-rate schedule depends on it), stopped early.
    argv = model + ["--make-vocab-size-divisible-by", str(multiple),
                    "--train-iters", str(total), "--exit-interval", str(start),
                    "--log-interval", "1", "--save", ckpt, "--save-interval", str(start)]
    rc, _, log = launch(argv, 1, True, os.path.join(out_dir, "seed"), timeout_s, base_env)
    if rc != 0 or not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        raise SystemExit(f"layout_parity: the seed run failed ({describe_exit(rc, timeout_s)}); "
                         f"its output ends:\n{log[-3000:]}")
    return ckpt


HEADER = (f"{'layout':<28}{'ranks':>6}{'loss max':>10}{'loss mean':>11}{'gnorm max':>11}"
          f"{'gnorm 10-it':>13}{'last loss':>11}{'seconds':>9}  result")


def run_layout(lay: Layout, n: int, model: List[str], a, ckpt: str,
               base_env: Dict[str, str]) -> dict:
    """One layout from the seed checkpoint for a.iters iterations."""
    row = {"layout": lay, "curve": {}, "error": None, "seconds": 0.0, "padded_vocab": None}
    try:
        flags = layout_flags(lay, model, a.vocab_multiple)
    except ValueError as e:
        row["error"] = str(e)
        return row
    argv = model + flags + ["--train-iters", str(a.start_iters + a.iters),
                            "--log-interval", "1", "--load", ckpt]
    log_dir = os.path.join(a.out_dir, f"{n:02d}-" + re.sub(r"[^A-Za-z0-9]+", "_", lay.name))
    t0 = time.time()
    rc, log, failed_log = launch(argv, lay.ranks, a.one_gpu, log_dir, a.timeout, base_env)
    row["seconds"] = time.time() - t0
    row["curve"] = curves(log)
    padded = PADDED_VOCAB.search(log)
    row["padded_vocab"] = int(padded.group(1)) if padded else None
    if rc != 0:
        row["error"] = f"{describe_exit(rc, a.timeout)}, output in {log_dir}"
        print(f"layout_parity: {lay.name} failed ({describe_exit(rc, a.timeout)}); the failed "
              f"rank's output ends:\n{failed_log[-2000:]}", file=sys.stderr, flush=True)
    return row


def row_line(row: dict, ref: dict, iterations: List[int],
             tolerance: Tuple[float, float]) -> Tuple[str, bool]:
    """(the table line of one layout, whether it passed)."""
    lay, curve = row["layout"], row["curve"]
    last = curve.get(iterations[-1], (None, None))[0]
    last = float("nan") if last is None else last  # no line, or a skipped step
    cmp = None
    if row["error"]:
        result = f"FAIL: {row['error']}"
    elif row is ref:
        missing = [i for i in iterations if i not in curve]
        result = f"FAIL: no log line for iterations {missing[:5]}" if missing else "reference"
    elif ref["error"] or len(ref["curve"]) < len(iterations):
        result = "not compared: the reference failed"
    elif row["padded_vocab"] != ref["padded_vocab"]:
        result = (f"FAIL: padded vocabulary {row['padded_vocab']} against "
                  f"{ref['padded_vocab']} in the reference")
    else:
        cmp = compare(ref["curve"], curve, iterations, WINDOW)
        result = verdict(cmp, tolerance)
    cells = (f"{cmp['loss_max_rel']:>10.2e}{cmp['loss_mean_rel']:>11.2e}"
             f"{cmp['gnorm_max_rel']:>11.2e}{cmp['gnorm_window_rel']:>13.2e}" if cmp
             else f"{'':>45}")
    line = (f"{lay.name:<28}{lay.ranks:>6}{cells}{last:>11.4f}{row['seconds']:>9.0f}  "
            f"{result}")
    return line, result in ("ok", "reference")


def run_all(layouts: List[Layout], model: List[str], a, ckpt: str, base_env: Dict[str, str],
            tolerance: Tuple[float, float]) -> int:
    """Run the layouts in order, printing each one's line as it finishes; 0 when all
    ran and stayed within the tolerance of the first."""
    iterations = list(range(a.start_iters + 1, a.start_iters + a.iters + 1))
    print(HEADER, flush=True)
    ref, status = None, 0
    for n, lay in enumerate(layouts):
        row = run_layout(lay, n, model, a, ckpt, base_env)
        ref = ref or row
        line, ok = row_line(row, ref, iterations, tolerance)
        status |= not ok
        print(line, flush=True)
    print(f"(iterations {iterations[0]}-{iterations[-1]} against the first layout, relative "
          f"differences; tolerance {tolerance[0]:g} on the loss, {tolerance[1]:g} on the grad "
          f"norm's {WINDOW}-iteration means)", flush=True)
    return int(status)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="tp1,tp2,pp2,dp2",
                    help="comma-separated layouts; the first is the reference")
    ap.add_argument("--iters", type=int, default=50, help="iterations compared per layout")
    ap.add_argument("--start-iters", type=int, default=1,
                    help="iterations of the seed run whose checkpoint every layout loads")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest relative difference of the loss (default 0.01 with "
                         "--bf16/--fp16, else 1e-4)")
    ap.add_argument("--gnorm-tolerance", type=float, default=None,
                    help="largest relative difference of the grad norm's 10-iteration means, "
                         "beyond one printed unit (default 0.05 with --bf16/--fp16, else 0.01)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="every rank on GPU 0, NCCL through loopback sockets")
    ap.add_argument("--out-dir", default=None, help="logs and the seed checkpoint (default: "
                                                    "a temporary directory, removed on success)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    a = ap.parse_args(argv)
    try:
        layouts = [parse_layout(t) for t in a.layouts.split(",") if t.strip()]
    except ValueError as e:
        ap.error(str(e))
    if a.iters < 1 or a.start_iters < 1:
        ap.error(f"--iters {a.iters} and --start-iters {a.start_iters} must be at least 1")
    import torch

    model = extra or default_model(torch.cuda.is_available())
    loss_tol, gnorm_tol = default_tolerance(model)
    warning = dropout_warning(model)
    if warning:
        print(f"layout_parity: {warning}", file=sys.stderr, flush=True)
    tolerance = (loss_tol if a.tolerance is None else a.tolerance,
                 gnorm_tol if a.gnorm_tolerance is None else a.gnorm_tolerance)
    keep = a.out_dir is not None
    a.out_dir = a.out_dir or tempfile.mkdtemp(prefix="layout_parity_")
    base_env = {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    a.vocab_multiple = vocab_multiple(layouts, model)
    ckpt = seed_checkpoint(model, a.start_iters, a.start_iters + a.iters, a.out_dir, a.timeout,
                           base_env, a.vocab_multiple)
    status = run_all(layouts, model, a, ckpt, base_env, tolerance)
    if status == 0 and not keep:
        shutil.rmtree(a.out_dir, ignore_errors=True)
    elif status:
        print(f"layout_parity: logs in {a.out_dir}", file=sys.stderr)
        if warning:
            print(f"layout_parity: {warning}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sigterm_as_exit()  # SIGTERM (`timeout`, a job's end): `_wait_all` stops the ranks first
    sys.exit(main())
