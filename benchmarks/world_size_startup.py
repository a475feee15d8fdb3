"""Start-up time of pretrain_gpt.py against the number of processes, on CPU (gloo).

    python benchmarks/world_size_startup.py [--sizes 2 4 8 16 32] [--timeout 900]
        [--tp 1 --pp 1 --num-layers 2]

Launches `torchrun --standalone --nproc-per-node N pretrain_gpt.py` with a tiny GPT (hidden
64, 4 heads, sequence 64, mock data, NullTokenizer, 3 iterations, no evaluation) for each
N and prints, per N, the seconds from the launch to the first output line of each
start-up phase and to the first iteration line. On a machine with fewer cores than ranks
every rank's start-up work (importing torch, building its model) is serialised, so the
seconds grow at least linearly with N; a cost that grows faster than that (a loop over
all ranks on each rank, an all-gather of Python objects) shows as a growing
seconds-per-added-rank column (to the first iteration, against the row above). Each
process takes about 300-400 MB of memory.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (column, the start of the first line that marks it)
PHASES = (
    ("init", "time to initialize megatron"),
    ("model", "[after model, optimizer, and learning rate scheduler are built]"),
    ("data", "[after dataloaders are built]"),
    ("iter1", " iteration        1/"),
)


def command(n: int, tp: int, pp: int, layers: int) -> list:
    dp = n // (tp * pp)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(n), os.path.join(ROOT, "pretrain_gpt.py"),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "1", "--global-batch-size", str(2 * dp),
            "--lr", "1e-3", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]


def time_phases(n: int, tp: int, pp: int, layers: int, timeout: float) -> dict:
    """{column: seconds from the launch}, plus "exit" and "status"."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    seen: dict = {}
    proc = subprocess.Popen(command(n, tp, pp, layers), cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for line in proc.stdout:
            for column, mark in PHASES:
                if column not in seen and line.startswith(mark):
                    seen[column] = time.monotonic() - started
            if time.monotonic() - started > timeout:
                proc.kill()
                break
        seen["status"] = proc.wait()
    finally:
        proc.kill()
    seen["exit"] = time.monotonic() - started
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args()
    columns = [c for c, _ in PHASES] + ["exit"]
    print(f"tp {args.tp} pp {args.pp}, {os.cpu_count()} CPU cores; seconds from the launch")
    print(f"{'N':>4} " + " ".join(f"{c:>7}" for c in columns) + "  s/added rank  status")
    previous = None  # (N, seconds to the first iteration) of the row above
    for n in args.sizes:
        if n % (args.tp * args.pp):
            raise SystemExit(f"error: --sizes {n} is not a multiple of tp x pp = "
                             f"{args.tp * args.pp}; give sizes that are")
        seen = time_phases(n, args.tp, args.pp, args.num_layers, args.timeout)
        cells = " ".join(f"{seen[c]:7.1f}" if c in seen else f"{'-':>7}" for c in columns)
        per_rank = f"{'-':>12}"
        if "iter1" in seen and previous is not None and n != previous[0]:
            per_rank = f"{(seen['iter1'] - previous[1]) / (n - previous[0]):12.2f}"
        previous = (n, seen["iter1"]) if "iter1" in seen else None
        print(f"{n:>4} {cells}  {per_rank}  {seen['status']}", flush=True)


if __name__ == "__main__":
    main()
