"""Text generation at several tensor x pipeline layouts against one process, on one machine.

    python benchmarks/generate_layouts.py [--layouts tp2,pp2,tp2pp2] [--device cuda|cpu]

Trains a small GPT for a few iterations (one process, fp32), then generates from its
checkpoint with tools/generate.py: once in one process (the reference), then at each
layout with every rank started here. With --one-gpu (the default on CUDA) every rank runs
on GPU 0 and NCCL connects them through loopback sockets, as tools/layout_parity.py
--one-gpu does, so a single GPU exercises the NCCL paths of tensor- and pipeline-parallel
decoding (the CUDA-graph step under tensor parallelism included). Prints one line per
layout and case: the same generated ids as one process or not; exit status 1 if any differ.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import child_processes  # noqa: E402
from tools.layout_parity import free_port, rank_env  # noqa: E402

MODEL = ("--num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 64 "
         "--max-position-embeddings 64 --tokenizer-type NullTokenizer --vocab-size 1000").split()
CASES = {  # name -> generate.py flags (besides --load, the layout and --json)
    "greedy": ["--prompt-ids", "5,17,300,42", "--greedy", "--max-new-tokens", "24"],
    "sampled": ["--prompt-ids", "9,8,7", "--top-k", "20", "--seed", "3",
                "--max-new-tokens", "24"],
    "no-cache": ["--prompt-ids", "5,17,300,42", "--greedy", "--max-new-tokens", "16",
                 "--no-kv-cache"],
    # CUDA only, pipeline size 1: the captured one-token step insisted on (auto falls back)
    "graph": ["--prompt-ids", "5,17,300,42", "--greedy", "--max-new-tokens", "24",
              "--decode-cuda-graph", "on"],
}


def train(ckpt: str, device: str) -> None:
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, "--mock-data",
            "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", "20", "--eval-iters", "0", "--log-interval", "10",
            "--save", ckpt, "--save-interval", "20"]
    if device == "cpu":
        argv.append("--no-compile")
    child_processes.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def generate(ckpt: str, case: List[str], layout: Dict[str, int], device: str,
             one_gpu: bool, timeout_s: float) -> str:
    """Rank 0's --json line for `case` at `layout` ({'tp': ., 'pp': .}), else what went
    wrong. A run past `timeout_s` is stopped, every rank of it."""
    flags = [os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt, "--json",
             "--dtype", "fp32", *case]
    world = layout["tp"] * layout["pp"]
    if world == 1:  # ranks started below use cuda:LOCAL_RANK, or the CPU without CUDA
        try:
            out = child_processes.run([sys.executable, *flags, "--device", device], cwd=ROOT,
                                      capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:g} s (--timeout)"
        return out.stdout.strip() if out.returncode == 0 else f"exit {out.returncode}: {out.stderr[-400:]}"
    flags += ["--tensor-model-parallel-size", str(layout["tp"]),
              "--pipeline-model-parallel-size", str(layout["pp"])]
    port, tag = free_port(), f"gen{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, *flags], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=rank_env(r, world, port, one_gpu, tag))
             for r in range(world)]
    try:
        with child_processes.stopping(procs):  # the other ranks too, not only the late one
            outs = [p.communicate(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s (--timeout)"
    if any(p.returncode for p in procs):
        return "; ".join(f"rank {r} exit {p.returncode}: {outs[r][1][-300:]}"
                         for r, p in enumerate(procs) if p.returncode)
    return outs[0][0].strip()


def parse_layout(text: str) -> Dict[str, int]:
    tp = int(text.split("tp")[1].split("pp")[0]) if "tp" in text else 1
    pp = int(text.split("pp")[1]) if "pp" in text else 1
    return {"tp": tp, "pp": pp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="tp2,pp2,tp2pp2")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda when available")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per generation")
    a = ap.parse_args()
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        train(ckpt, device)
        for name, case in CASES.items():
            if name == "graph" and device != "cuda":
                continue
            ref = generate(ckpt, case, {"tp": 1, "pp": 1}, device, True, a.timeout)
            ref_ids = json.loads(ref)["generated_ids"] if ref.startswith("{") else None
            for text in a.layouts.split(","):
                if name == "graph" and (device != "cuda" or parse_layout(text)["pp"] > 1):
                    continue
                got = generate(ckpt, case, parse_layout(text), device, True, a.timeout)
                ids = json.loads(got)["generated_ids"] if got.startswith("{") else None
                same = ids is not None and ids == ref_ids
                failed += not same
                print(f"{text:8s} {name:9s} {'same ids as one process' if same else 'DIFFERENT'}"
                      f" ({len(ids) if ids else 0} tokens){'' if same else ': ' + got[:300]}",
                      flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    child_processes.sigterm_as_exit()  # SIGTERM ends the ranks too
    sys.exit(main())
