#!/usr/bin/env python
"""Where the host's time goes between two replays of the whole-step CUDA graph (CUDA).

    python benchmarks/host_gap_probe.py [--preset gpt2-124m] [--steps 30] [-- pretrain flags]

With fp16 the host waits for each replay's overflow flag, so whatever it does after that
until the next replay starts is GPU idle time. This wraps the pieces of a graphed step
with host timers -- the data iterator, the copy into the graph's inputs, the upload of the
step's lr / bias corrections, the replay launch, the wait for the flag, the scheduler --
runs the preset's benchmark step and prints the mean milliseconds of each per step, with
the step's wall time and the rest (the loop and train_step's own bookkeeping).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

TOTALS = collections.defaultdict(float)


def timed(owner, name: str, label: str) -> None:
    """Replace owner.name with a wrapper adding its host seconds to TOTALS[label]."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    import benchmark as bm
    import torch

    from megatron import step_graph, train_step
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_entry_point, set_random_seed
    from megatron.training import build_trainer, data_iterator

    cuda = torch.cuda.is_available()  # the CPU runs it too (tests of the probe itself)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = parse_and_validate(bm.build_argv(a.preset, a.steps, 5, bm.PRESETS[a.preset][1],
                                           a.extra), env={"RANK": "0"}, cuda_available=cuda)
    rt = initialize_entry_point(cfg.parallel, cfg.args["cublas_workspace"], 0, 1, 0, os.environ)
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    data = data_iterator(cfg, rt, "train", 0)
    for _ in range(5):  # warm-up and capture
        train_step.train_step(tr, data)
    sync()

    class Timed:  # the iterator's __next__, timed
        def __iter__(self):
            return self

        def __next__(self):
            t0 = time.perf_counter()
            try:
                return next(data)
            finally:
                TOTALS["next(data)"] += time.perf_counter() - t0

    timed(step_graph, "_copy_into", "copy into graph inputs")
    timed(tr.optimizer, "prepare_replay", "prepare_replay (lr, bias corrections)")
    timed(step_graph._Unread, "skipped", "read the previous fp16 flag (waits for it)")
    timed(tr.optimizer, "step", "optimizer.step (eager steps)")
    timed(tr.scheduler, "step", "scheduler.step")
    if tr.step_graph:
        timed(tr.step_graph.graph, "replay", "graph.replay launch")
    source = Timed()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        train_step.train_step(tr, source)
    sync()
    wall = (time.perf_counter() - t0) / a.steps * 1000
    print(f"{a.preset} {' '.join(a.extra)}: {wall:.2f} ms per step (host wall), graph "
          f"{'on' if tr.step_graph else 'off'}")
    accounted = 0.0
    for label, seconds in TOTALS.items():
        ms = seconds / a.steps * 1000
        accounted += ms
        print(f"  {label:40s} {ms:8.3f} ms")
    print(f"  {'rest':40s} {wall - accounted:8.3f} ms")


if __name__ == "__main__":
    main()
