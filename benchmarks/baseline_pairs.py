#!/usr/bin/env python
"""Time the plain baseline trainer and this framework's step alternately on one machine,
and print their ratio per pair (one device call).

    python benchmarks/baseline_pairs.py --preset gpt-1.3b [--rounds 2] [--steps 24]
        [--warmup 3] [--gelu erf,tanh] [--no-compile] [--out DIR]

Each round runs, for every GeLU form in --gelu, `benchmarks/baseline_gpt.py` and then
`tools/benchmark.py` with the same preset, steps and warm-up: erf is both trainers'
default, tanh is `--gelu tanh` against `-- --openai-gelu` (GPT-2's form; this framework
then computes it in cuBLASLt's epilogues). `--no-compile` runs both eager
(`baseline_gpt.py --no-compile`, `tools/benchmark.py -- --no-compile`): on the CPU, where
this framework does not compile its layers by default, the baseline's torch.compile then
no longer dominates a smoke run. Alternating the two trainers spreads the
machine's clock drift over both. A row is printed as each pair finishes, then the mean
ratio per GeLU form; every command's JSON line and stderr go to DIR/pairs.log.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import child_processes  # noqa: E402

PRESETS = ("gpt2-124m", "gpt-1.3b", "tiny")  # tiny: --device cpu, a smoke run


def commands(preset: str, steps: int, warmup: int, gelu: str, device: str = "cuda",
             compile_model: bool = True) -> tuple:
    common = ["--preset", preset, "--steps", str(steps), "--warmup", str(warmup),
              "--device", device]
    base = [sys.executable, os.path.join(ROOT, "benchmarks", "baseline_gpt.py"), *common,
            "--gelu", gelu] + ([] if compile_model else ["--no-compile"])
    ours = [sys.executable, os.path.join(ROOT, "tools", "benchmark.py"), *common]
    extra = (["--openai-gelu"] if gelu == "tanh" else []) + ([] if compile_model
                                                             else ["--no-compile"])
    if extra:
        ours += ["--", *extra]
    return base, ours


def run_json(cmd: list, log_path: str, timeout: float) -> dict:
    """Run one trainer; its last stdout line that parses as JSON, or {} on failure."""
    try:
        proc = child_processes.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = exc.stdout or "", f"timed out after {timeout:.0f} s", "timeout"
        out = out.decode() if isinstance(out, bytes) else out
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\nrc {rc}\n{out}\n{err[-4000:] if err else ''}\n")
    for line in reversed(out.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    print(f"failed (rc {rc}): {' '.join(cmd)}; see {log_path}", file=sys.stderr)
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-1.3b", choices=PRESETS,
                    help="tiny's shapes differ between the two trainers: a smoke run only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gelu", default="erf,tanh", help="comma-separated: erf, tanh")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-compile", action="store_true",
                    help="both trainers eager (neither torch.compiles its model)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per trainer run")
    ap.add_argument("--out", default="runs/baseline_pairs")
    a = ap.parse_args()
    forms = [g for g in a.gelu.split(",") if g]
    bad = [g for g in forms if g not in ("erf", "tanh")]
    if bad or not forms:
        ap.error(f"--gelu {a.gelu!r}: a comma-separated list of erf and tanh")
    if a.rounds < 1 or a.steps < 1 or a.warmup < 1:
        ap.error("--rounds, --steps and --warmup: at least 1 each")
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "pairs.log")
    ratios = {g: [] for g in forms}
    print("| round | gelu | baseline tokens/s | this framework | ratio | step ms (baseline / ours) | MHz (ours) |")
    print("|---|---|---|---|---|---|---|")
    for r in range(1, a.rounds + 1):
        for g in forms:
            base_cmd, ours_cmd = commands(a.preset, a.steps, a.warmup, g, a.device,
                                          not a.no_compile)
            base, ours = run_json(base_cmd, log, a.timeout), run_json(ours_cmd, log, a.timeout)
            if not base or not ours:
                print(f"| {r} | {g} | {base.get('tokens_per_s', 'failed')} | "
                      f"{ours.get('tokens_per_s', 'failed')} | | | |", flush=True)
                continue
            ratio = ours["tokens_per_s"] / base["tokens_per_s"]
            ratios[g].append(ratio)
            print(f"| {r} | {g} | {base['tokens_per_s']:,} | {ours['tokens_per_s']:,} | "
                  f"{ratio:.3f} | {base['step_ms']} / {ours['step_ms']} | "
                  f"{ours.get('sm_clock_mhz', '')} |", flush=True)
    for g, rs in ratios.items():
        if rs:
            print(f"{a.preset} {g}: mean ratio {statistics.mean(rs):.3f} over {len(rs)} pairs")
    return 0 if all(ratios.values()) else 1


if __name__ == "__main__":
    child_processes.sigterm_as_exit()  # SIGTERM ends the running trainer too
    sys.exit(main())
