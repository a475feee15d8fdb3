"""Speed of building a blend's indices (`build_blending_indices`) against the plain
per-sample greedy loop, on the same weights; both outputs are compared bit for bit.

    python benchmarks/blend_bench.py [--samples 2000000] [--datasets 3,8,24,100]

Prints microseconds per sample for each number of datasets (random weights and the
`--data-path 0.3 a 0.2 b 0.2 c 0.15 d 0.1 e 0.05 f ...` pattern), the best of `--repeat`
runs, as other load on the machine only slows runs down.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets import blended  # noqa: E402


def _loop(w: np.ndarray, size: int):
    index, sample = np.zeros(size, np.uint8), np.zeros(size, np.int64)
    blended._blending_loop(w, size, np.zeros(len(w), dtype=np.int64), 0, index, sample)
    return index, sample


def _best(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def _weights(kind: str, num: int) -> np.ndarray:
    if kind == "data_path":
        base = np.array([0.3, 0.2, 0.2, 0.15, 0.1, 0.05])
        w = base[np.arange(num) % len(base)]
    else:
        w = np.random.default_rng(num).random(num)
    return w / w.sum()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2_000_000)
    p.add_argument("--datasets", default="3,8,24,100")
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args(argv)
    print("| datasets | weights | loop (us/sample) | builder (us/sample) | same |")
    print("|---|---|---|---|---|")
    for num in (int(x) for x in a.datasets.split(",")):
        for kind in ("random", "data_path"):
            w = _weights(kind, num)
            t_loop, want = _best(lambda: _loop(w, a.samples), a.repeat)
            t_new, got = _best(lambda: blended.build_blending_indices(w, a.samples), a.repeat)
            same = all(np.array_equal(x, y) for x, y in zip(got, want))
            print(f"| {num} | {kind} | {1e6 * t_loop / a.samples:.2f} | "
                  f"{1e6 * t_new / a.samples:.2f} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
