"""The gradient audit across ranks (tests/grad_audit_parallel.py) on 2 gloo processes, one
launch: tp2 with and without sequence parallelism (dropout inside and outside the
tensor-parallel regions, selective recompute), pp2 with virtual stages and the tied
embedding, dp2 with the distributed optimizer. In the same launch the audit fails the
step with the sequence-parallel norm/bias all-reduce left out, and with the tied
embedding's all-reduce left out. And benchmarks/grad_audit.py --layouts starts its own
ranks and prints the table.

The whole matrix, on a GPU with NCCL: benchmarks/grad_audit.py --layouts."""
from __future__ import annotations

import sys
from unittest import mock

import torch

from tests import forked_script
from tests.dist_utils import ROOT, cpu_env, run_distributed
from tests.grad_audit import TOLERANCE
from tests.grad_audit_parallel import audit_layout, audit_layouts, layout

GOOD = ("tp2-sp/selective", "tp2", "pp2-vp2", "dp2-distopt")
# (layout, what is left out of megatron/train_step.py's gradient reductions)
BROKEN = (("tp2-sp/selective", "allreduce_sequence_parallel_grads"),
          ("pp2-vp2", "allreduce_tied_embedding_grads"))


def _good_and_broken(rank, world_size):
    rows = audit_layouts(rank, world_size, GOOD)
    for name, reduction in BROKEN:
        with mock.patch(f"megatron.train_step.{reduction}", lambda *args, **kw: None):
            rows.append(audit_layout(layout(name), torch.device("cpu")))
    return rows


def test_layouts_pass_and_the_audit_fails_a_missing_gradient_reduction():
    rows = run_distributed(_good_and_broken, 2)
    assert [r.error for r in rows[0]] == [r.error for r in rows[1]]  # one verdict
    for row in rows[0][:len(GOOD)]:
        assert row.ok, f"{row.name}: {row.check} error {row.error:.2e} ({row.detail})"
    # measured: 5e-1 (sp) and 4e-1 (tied) against 2.5e-4 and 7e-5 intact
    for row, (name, reduction) in zip(rows[0][len(GOOD):], BROKEN):
        assert row.error > 30 * TOLERANCE, f"{name} without {reduction}: {row}"


def test_benchmark_layouts_starts_its_ranks():
    proc = forked_script.run(  # forked from this process: its imports come free
        [sys.executable, str(ROOT / "benchmarks" / "grad_audit.py"), "--layouts", "--device",
         "cpu", "--cases", "dp2-distopt/overlap"], cpu_env(), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines()
               if line.startswith("dp2-distopt/overlap "))
    assert " pass " in row and "1 of 1 pass" in proc.stdout, proc.stdout
