"""Gradient audit of the training step on whatever device is present: for every
configuration of the matrix (recompute none / selective / full uniform / full block, eager
and compiled, dropout on; a llama-style model; a switch MLP; post-LN residuals; two
micro-batches; the distributed optimizer with a loss scale; bf16; fp16 with a dynamic
loss scale), the gradient the optimizer would apply against the derivative of the loss
the step reports (tests/grad_audit.py says how). One row per configuration; exit status
1 when any row fails.

    PYTHONPATH=. python benchmarks/grad_audit.py                  # CUDA if present
    PYTHONPATH=. python benchmarks/grad_audit.py --device cpu --quick
    PYTHONPATH=. python benchmarks/grad_audit.py --cases compiled  # names containing it

Rows without --compile/--no-compile in their name run with the device's default (compiled
on CUDA). Everything runs in one process, on one device, in fp32 with TF32 off (the
16-bit rows: against fp32).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
import traceback

import torch

from tests.grad_audit import CASES, QUICK, audit_case


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true",
                   help=f"only {len(QUICK)} rows: {', '.join(QUICK)}")
    p.add_argument("--cases", default="", help="only the rows whose name contains this")
    p.add_argument("--verbose", action="store_true",
                   help="show what building the models prints")
    return p.parse_args(argv)


@contextlib.contextmanager
def _quiet():
    """What building a model prints (the parallel layout, warnings for the audit's own
    flags) kept out of the table."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def main(argv=None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    cases = [c for c in CASES if (not args.quick or c.name in QUICK) and args.cases in c.name]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gradient audit on {name}, torch {torch.__version__}, {len(cases)} configurations")
    print(f"{'configuration':32s} {'check':12s} {'error':>9s}  {'result':6s} {'s':>5s}  detail")
    failed = 0
    for case in cases:
        start = time.time()
        quiet = contextlib.nullcontext() if args.verbose else _quiet()
        try:
            with quiet:
                row = audit_case(case, device)
            line = (f"{row.check:12s} {row.error:9.2e}  {'pass' if row.ok else 'FAIL':6s} "
                    f"{time.time() - start:5.1f}  {row.detail}")
            failed += not row.ok
        except Exception as e:  # one broken configuration must not hide the others
            failed += 1
            line = f"{'-':12s} {'-':>9s}  {'ERROR':6s} {time.time() - start:5.1f}  {e!r:.200}"
            traceback.print_exc(file=sys.stderr)
        print(f"{case.name:32s} {line}", flush=True)
    print(f"{len(cases) - failed} of {len(cases)} pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
