#!/usr/bin/env python
"""Which GEMM calls work under each cuBLAS workspace setting (one child process per setting).

    python benchmarks/cublas_env_probe.py

The workspace variables are read when torch makes its first cuBLAS handle, so every
setting runs in a fresh interpreter. Each child runs, in bf16 on CUDA: a plain product
(`mm`), one with a bias (`addmm`, which torch sends to cuBLASLt with a bias epilogue),
`F.linear` with a bias, the fp32-accumulating weight-grad product of the model
(`addmm(..., out_dtype=float32)`), and a backward through a biased linear; once with
torch's default BLAS choice and once with cuBLASLt preferred. Prints ok or the error.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import child_processes  # noqa: E402

SETTINGS = {
    "torch default": {},
    "CUBLAS_WORKSPACE_CONFIG=:0:0": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"},
    "both zero": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
}

CHILD = r'''
import json, torch
import torch.nn.functional as F
res = {}
for lib in ("default", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    a = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    acc = torch.zeros(2048, 1024, device="cuda", dtype=torch.float32)
    g = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    cases = {
        "mm": lambda: a @ w.detach().t(),
        "addmm bias": lambda: torch.addmm(b.detach(), a, w.detach().t()),
        "linear bias": lambda: F.linear(a, w.detach(), b.detach()),
        "addmm fp32 out": lambda: torch.addmm(acc, g.t(), a, out_dtype=torch.float32, out=acc),
        "linear backward": lambda: F.linear(a, w, b).float().square().mean().backward(),
    }
    for name, fn in cases.items():
        try:
            fn(); torch.cuda.synchronize(); res[f"{lib}: {name}"] = "ok"
        except Exception as e:  # report, go on
            res[f"{lib}: {name}"] = f"{type(e).__name__}: {str(e)[:80]}"
print(json.dumps(res))
'''


def main() -> int:
    rows = {}
    for label, extra in SETTINGS.items():
        env = {k: v for k, v in os.environ.items()
               if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
        env.update(extra)
        proc = child_processes.run([sys.executable, "-c", CHILD], capture_output=True,
                                   text=True, env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        rows[label] = json.loads(lines[-1]) if lines else {"child": proc.stderr[-300:]}
    for label, res in rows.items():
        print(f"== {label}")
        for case, outcome in res.items():
            print(f"   {case:28s} {outcome}")
    return 0


if __name__ == "__main__":
    child_processes.sigterm_as_exit()  # SIGTERM ends the probe's child too
    sys.exit(main())
