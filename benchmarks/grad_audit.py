"""Gradient audit of the training step on whatever device is present: for every
configuration of the matrix (recompute none / selective / full uniform / full block, eager
and compiled, dropout on; a llama-style model; a switch MLP; post-LN residuals; two
micro-batches; the distributed optimizer with a loss scale; bf16; fp16 with a dynamic
loss scale), the gradient the optimizer would apply against the derivative of the loss
the step reports (tests/grad_audit.py says how). One row per configuration; exit status
1 when any row fails.

    python benchmarks/grad_audit.py                  # CUDA if present
    python benchmarks/grad_audit.py --device cpu --quick
    python benchmarks/grad_audit.py --cases compiled  # names containing it

Rows without --compile/--no-compile in their name run with the device's default (compiled
on CUDA). Everything runs in one process, on one device, in fp32 with TF32 off (the
16-bit rows: against fp32).

--layouts: the parallel layouts instead (tests/grad_audit_parallel.py: tp2 with and
without sequence parallelism, recompute and dropout; a switch MLP at tp2; pp2 with tied
and untied embeddings, virtual stages; dp2 plain and with the distributed optimizer; tp2
x pp2 and x dp2 on 4 ranks). This script starts the ranks itself, one launch per world
size running its layouts one after the other (a launch that fails is started again for
the layouts after the failed one): with CUDA every rank on GPU 0, NCCL between them (each
rank its own NCCL_HOSTID, as tools/layout_parity.py --one-gpu), else gloo on the CPU
(2 cores: the 17 layouts in 45 s).

    python benchmarks/grad_audit.py --layouts           # the GPU if present
    python benchmarks/grad_audit.py --layouts --quick --device cpu
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist_utils import ROOT, free_port  # noqa: E402
from tests.grad_audit import CASES, QUICK, AuditRow, audit_case  # noqa: E402
from tests.grad_audit_parallel import LAYOUT_QUICK, LAYOUTS, audit_layout, layout  # noqa: E402
from tools.child_processes import sigterm_as_exit, stop, stopping  # noqa: E402
from tools.layout_parity import rank_env


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layouts", action="store_true",
                   help="the parallel layouts, on ranks this script starts (see above)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {len(QUICK)} rows: {', '.join(QUICK)}; with --layouts "
                        f"{len(LAYOUT_QUICK)}: {', '.join(LAYOUT_QUICK)}")
    p.add_argument("--cases", default="", help="only the rows whose name contains this")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds for one launch of ranks (--layouts)")
    p.add_argument("--verbose", action="store_true",
                   help="show what building the models prints")
    p.add_argument("--worker-rows", help=argparse.SUPPRESS)  # a rank of --layouts
    p.add_argument("--worker-layouts", help=argparse.SUPPRESS)
    return p.parse_args(argv)


@contextlib.contextmanager
def _quiet():
    """What building a model prints (the parallel layout, warnings for the audit's own
    flags) kept out of the table; shown on stderr when an exception ends the block (a
    flag error's message)."""
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    except BaseException:
        sys.stderr.write(sink.getvalue())
        raise


HEADER = f"{'configuration':32s} {'check':12s} {'error':>9s}  {'result':6s} {'s':>5s}  detail"


def _row_line(row: AuditRow, seconds: float) -> str:
    return (f"{row.name:32s} {row.check:12s} {row.error:9.2e}  "
            f"{'pass' if row.ok else 'FAIL':6s} {seconds:5.1f}  {row.detail}")


def _error_line(name: str, seconds: float, why: str) -> str:
    return f"{name:32s} {'-':12s} {'-':>9s}  {'ERROR':6s} {seconds:5.1f}  {why:.300}"


def _one_process(args, device: torch.device) -> Tuple[int, int]:
    """The one-process matrix: (rows, failures)."""
    cases = [c for c in CASES if (not args.quick or c.name in QUICK) and args.cases in c.name]
    print(f"{len(cases)} configurations, one process\n{HEADER}", flush=True)
    failed = 0
    for case in cases:
        start = time.time()
        quiet = contextlib.nullcontext() if args.verbose else _quiet()
        try:
            with quiet:
                row = audit_case(case, device)
            line = _row_line(row, time.time() - start)
            failed += not row.ok
        except Exception as e:  # one broken configuration must not hide the others
            failed += 1
            line = _error_line(case.name, time.time() - start, repr(e))
            traceback.print_exc(file=sys.stderr)
        print(line, flush=True)
    return len(cases), failed


# --------------------------------------------------------------------------- --layouts
def _rank_main(args) -> int:
    """One rank of a --layouts launch: the process group (NCCL on GPU 0, or gloo), then
    the layouts named, one after the other; rank 0 appends each row to --worker-rows as a
    JSON line. An exception ends the launch (the other ranks would wait in a collective)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300),
                            **({"device_id": torch.device("cuda", 0)} if cuda else {}))
    try:
        for name in args.worker_layouts.split(","):
            start = time.time()
            quiet = contextlib.nullcontext() if args.verbose else _quiet()
            with quiet:
                row = audit_layout(layout(name), device)
            if rank == 0:
                with open(args.worker_rows, "a") as f:
                    f.write(json.dumps(dict(vars(row), seconds=time.time() - start)) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


def _new_rows(path: str, seen: int) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return [json.loads(line) for line in lines[seen:]]


def _failed_output(logs: List[str], bad: List[int]) -> str:
    """The end of the output of the first failed rank that wrote any (a rank whose flag
    error rank 0 reports prints nothing), else of any rank."""
    texts = [open(path).read() for path in logs]
    for r in bad + list(range(len(logs))):
        if texts[r].strip():
            return f"rank {r}: ...\n{texts[r][-3000:]}"
    return "(no rank wrote anything)"


def _launch(names: List[str], world: int, args, log_dir: str,
            on_row: Callable[[dict], None]) -> Tuple[int, Optional[str]]:
    """Start `world` ranks running the layouts `names`; `on_row` for each row as rank 0
    writes it. (rows written, None or the failed rank's output when the launch failed or
    ran past --timeout)."""
    rows_path, port, procs, logs = os.path.join(log_dir, "rows.jsonl"), free_port(), [], []
    if os.path.exists(rows_path):
        os.remove(rows_path)
    for rank in range(world):
        env = rank_env(rank, world, port, True, f"grad-audit-{port}")
        env.update(NCCL_NVLS_ENABLE="0", PYTHONPATH=str(ROOT),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        logs.append(os.path.join(log_dir, f"rank{rank}.log"))
        cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device,
               "--worker-rows", rows_path, "--worker-layouts", ",".join(names)]
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd + (["--verbose"] if args.verbose else []),
                                          stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=ROOT))
    deadline, seen, failed = time.time() + args.timeout, 0, None
    with stopping(procs):
        while failed is None:
            for row in _new_rows(rows_path, seen):
                seen += 1
                on_row(row)
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad or time.time() > deadline:
                stop(procs, grace_s=0)
                failed = (_failed_output(logs, bad) if bad
                          else f"timed out after {args.timeout:g} s (--timeout)")
            time.sleep(0.2)
    for row in _new_rows(rows_path, seen):
        seen += 1
        on_row(row)
    return seen, failed


def _layouts(args) -> Tuple[int, int]:
    """The layouts, one launch per world size: (rows, failures)."""
    cases = [c for c in LAYOUTS
             if (not args.quick or c.name in LAYOUT_QUICK) and args.cases in c.name]
    where = "GPU 0 (NCCL)" if args.device == "cuda" else "the CPU (gloo)"
    print(f"{len(cases)} layouts, ranks on {where}\n{HEADER}", flush=True)
    failed = 0

    def on_row(row: dict) -> None:
        nonlocal failed
        seconds = row.pop("seconds")
        failed += not row["ok"]
        print(_row_line(AuditRow(**row), seconds), flush=True)

    with tempfile.TemporaryDirectory(prefix="grad_audit_") as log_dir:
        for world in sorted({c.world_size for c in cases}):
            pending = [c.name for c in cases if c.world_size == world]
            while pending:
                start = time.time()
                done, why = _launch(pending, world, args, log_dir, on_row)
                pending = pending[done:]
                if why is not None and pending:  # the layout that was running failed
                    failed += 1
                    print(_error_line(pending[0], time.time() - start, "the launch failed; "
                                      "its output is below"), flush=True)
                    print(why, file=sys.stderr, flush=True)
                    pending = pending[1:]
    return len(cases), failed


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker_rows:
        return _rank_main(args)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gradient audit on {name}, torch {torch.__version__}", flush=True)
    start = time.time()
    total, failed = _layouts(args) if args.layouts else _one_process(args, device)
    print(f"{total - failed} of {total} pass ({time.time() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sigterm_as_exit()  # SIGTERM (`timeout`, a job's end): the ranks are stopped first
    sys.exit(main())
