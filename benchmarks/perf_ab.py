#!/usr/bin/env python
"""Run tools/benchmark.py over several variants in one go and print a table (one device call).

    python benchmarks/perf_ab.py VARIANTS_FILE [--out DIR]

Each non-empty line of VARIANTS_FILE that does not start with '#':
    label | preset | ENV=1 ENV2=x (or -) | benchmark flags (or -) | flags after -- (or -) [| tree]
`tree` (optional) is another checkout to run the benchmark from (an A/B against older code).
Every run's command, JSON line and stderr are appended to DIR/runs.log.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import child_processes  # noqa: E402


def parse(path: str) -> list:
    rows = []
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("|")]
        parts += ["-"] * (6 - len(parts))
        rows.append([None if p == "-" else p for p in parts[:6]])
    return rows


def run_one(label, preset, env, flags, extra, tree, out_dir) -> dict:
    tool = os.path.join(os.path.abspath(tree or ROOT), "tools", "benchmark.py")
    cmd = [sys.executable, tool, "--preset", preset] + shlex.split(flags or "")
    if extra:
        cmd += ["--"] + shlex.split(extra)
    run_env = dict(os.environ, PYTHONUNBUFFERED="1")
    for item in shlex.split(env or ""):
        key, _, value = item.partition("=")
        run_env[key] = value
    t0 = time.time()
    proc = child_processes.run(cmd, capture_output=True, text=True, env=run_env)
    with open(os.path.join(out_dir, "runs.log"), "a") as f:
        f.write(f"\n===== {label}\n" + " ".join(cmd) + f"\nenv: {env}\nexit {proc.returncode} in {time.time() - t0:.0f} s\n")
        f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        tail = proc.stderr.strip().splitlines()[-3:]
        print(f"{label}: failed (exit {proc.returncode}): {' / '.join(tail)}", flush=True)
        return {"label": label, "failed": True}
    result = json.loads(lines[-1])
    result["label"] = label
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", help="the variants file (format above)")
    ap.add_argument("--out", default="/tmp/perf_ab", help="directory of runs.log")
    a = ap.parse_args(argv)
    if not os.path.isfile(a.variants):
        ap.error(f"variants file {a.variants} not found")
    os.makedirs(a.out, exist_ok=True)
    results = [run_one(*row, a.out) for row in parse(a.variants)]
    print(f"\n{'variant':<28}{'tokens/s':>10}{'MFU':>7}{'step ms':>9}{'peak GB':>9}"
          f"{'1st step s':>11}{'syncs':>6}{'MHz':>6}{'W':>5}{'gap ms':>8}")
    for r in results:
        if r.get("failed"):
            print(f"{r['label']:<28}{'failed':>10}")
            continue
        print(f"{r['label']:<28}{r['tokens_per_s']:>10,}{r['mfu']:>7.1%}{r['step_ms']:>9.2f}"
              f"{r['peak_mem_gb']!s:>9}{r['time_to_first_step_s']:>11}"
              f"{r.get('host_syncs', '-')!s:>6}{r.get('sm_clock_mhz', '-')!s:>6}"
              f"{r.get('power_w', '-')!s:>5}{r.get('step_gap_ms', '-')!s:>8}")
    return 0


if __name__ == "__main__":
    child_processes.sigterm_as_exit()  # SIGTERM ends the running benchmark too
    sys.exit(main())
