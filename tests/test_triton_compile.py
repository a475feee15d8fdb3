"""Every Triton kernel of the project compiles for an H100/H200 (sm_90) without a GPU.

The CPU tests run the kernels through Triton's interpreter, which accepts some programs
the GPU compiler rejects (and the reverse). Here each kernel, in each constexpr mode and
dtype the code launches, goes through Triton's real compiler down to a cubin for sm_90.
That runs in a child process: this test session set TRITON_INTERPRET before Triton was
imported (tests/conftest.py), which turns Triton's own library functions (tl.max,
tl.sum) into interpreter code the compiler cannot use. Skipped where Triton or its
NVIDIA backend (ptxas) is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron.core import fused_activation as fa, fused_cross_entropy as fce
from megatron.core import fused_rotary as fr
from megatron.core.optimizer import multi_tensor_adam as mta

def cases():
    for dt in ("bf16", "fp16", "fp32"):
        for backward in (False, True):
            yield (f"gelu {dt} backward={backward}", fa._gelu_source,
                   {"g_ptr": f"*{dt}", "h_ptr": f"*{dt}", "out_ptr": f"*{dt}", "n": "i64"},
                   {"BACKWARD": backward, "BLOCK": fa.BLOCK})
    for dt in ("bf16", "fp16"):
        for backward in (False, True):
            yield (f"swiglu {dt} backward={backward}", fa._swiglu_source,
                   {"h_ptr": f"*{dt}", "g_ptr": f"*{dt}", "out_ptr": f"*{dt}", "cols": "i32"},
                   {"BACKWARD": backward, "BLOCK": fa.SWIGLU_BLOCK})
    rope = {"src_ptr": None, "q_ptr": None, "k_ptr": None, "v_ptr": None, "table_ptr": "*fp32",
            "tokens": "i64", "batch": "i32", "groups": "i32", "q_tok": "i64", "q_head": "i64",
            "k_tok": "i64", "k_head": "i64", "v_tok": "i64", "v_head": "i64",
            "table_stride": "i64", "table_half": "i64"}
    for dt in ("bf16", "fp16"):  # llama-1b's heads (4 per group, 64 channels) and MHA's 128
        for p, d in ((4, 64), (1, 128)):
            for backward in (False, True):
                sig = {k: v or f"*{dt}" for k, v in rope.items()}
                yield (f"rope {dt} p={p} d={d} backward={backward}", fr._rope_source, sig,
                       {"P": p, "D": d, "ROT": d, "HP": triton.next_power_of_2(p + 2),
                        "DP": d, "BACKWARD": backward, "BLOCK_T": fr.BLOCK_T})
    for dt in ("bf16", "fp16", "fp32"):
        for mode in (0, 1, 2):
            yield (f"cross entropy {dt} mode={mode}", fce._rows_source,
                   {"logits": f"*{dt}", "labels": "*i64", "lse_in": "*fp32", "out0": "*fp32",
                    "out1": "*fp32", "out2": "*fp32", "vocab": "i32", "stride": "i64",
                    "vocab_start": "i32"}, {"MODE": mode, "BLOCK": fce.BLOCK})
    adamw = {"block_tensor": "*i32", "block_chunk": "*i32", "addrs": "*i64", "numels": "*i64",
             "ntensors": "i32", "scale_ptr": "*fp32", "skip_ptr": "*fp32", "hyper": "*fp32",
             "beta1": "fp32", "beta2": "fp32", "eps": "fp32"}
    for out in ("bfloat16", "float16", "float32"):  # fp32 grad buffers (bf16 and fp32 runs)
        for has_scale in (False, True):
            yield (f"adamw {out} scale={has_scale}", mta._adamw_kernel_source, adamw,
                   {"OUT_DTYPE": getattr(tl, out), "GRAD_DTYPE": tl.float32,
                    "HAS_SCALE": has_scale, "HAS_SKIP": False, "ALIGNED": True,
                    "BLOCK": mta.BLOCK})
    for grad in ("bfloat16", "float16"):  # 16-bit grad buffers (fp16 runs), eager or captured
        for has_skip in (False, True):
            yield (f"adamw {grad} grads skip={has_skip}", mta._adamw_kernel_source, adamw,
                   {"OUT_DTYPE": getattr(tl, grad), "GRAD_DTYPE": getattr(tl, grad),
                    "HAS_SCALE": True, "HAS_SKIP": has_skip, "ALIGNED": True,
                    "BLOCK": mta.BLOCK})

results = {}
for name, source, sig, consts in cases():
    sig = dict(sig, **{k: "constexpr" for k in consts})
    try:
        src = ASTSource(fn=triton.jit(source), signature=sig, constexprs=consts)
        results[name] = len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"])
    except Exception as exc:  # report every failing kernel, not only the first
        results[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(results))
'''


def test_every_kernel_compiles_for_sm90():
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    if proc.returncode and "triton.compiler" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton has no ahead-of-time compile API")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 37
    failed = {name: r for name, r in results.items() if not isinstance(r, int)}
    assert not failed, "\n".join(f"{n}: {r[:400]}" for n, r in failed.items())
    assert all(size > 0 for size in results.values())
