"""The linear layers' products with cuBLASLt algorithms chosen by measurement
(`--gemm-algorithms`, CUDA only: by default the tables shipped for this GPU model and
cuBLASLt version, `shipped_tables`; or a FILE of your own; or none).

torch asks cuBLAS for one algorithm per product shape, and its heuristic ranks by speed on
an idle chip. Inside a training step an H200 sits at its power limit, where other
candidates of the same heuristic can do more work per joule: for gpt-1.3b's fc1 forward
product one runs at 691 TFLOP/s against 646 for the first choice, held back to back at the
limit (benchmarks/RESULTS.md; the probe that measured it was folded into
tools/tune_gemms.py). tools/tune_gemms.py records the shapes one training step multiplies
(`recording()`), times every candidate for each against torch's own product at the power
limit, and writes a table of the shapes where a candidate wins by more than 1%. With a
table active (`activate`), the linear layers' forward, input-grad (dgrad) and weight-grad
(wgrad, into the fp32 main grad) products of those shapes call cuBLASLt -- the library
torch loaded, through ctypes, on the current stream, so CUDA graphs capture them -- with
the recorded algorithm; every other product stays torch's. The forward and dgrad calls are
an operator of our own (`megatron::lt_matmul`), opaque to torch.compile like torch's own
products.

A table is tied to the GPU model and the cuBLASLt version it was measured with;
`load_table` refuses it elsewhere, `shipped_tables` passes it over. A table only names
algorithms for exact product shapes, so it serves any model that multiplies them. The
tuner keeps only candidates whose product matches torch's to 1e-3 of its largest
value (without split-K the candidates accumulate in the same order: the probe found
them bitwise equal; a split-K winner, such as gpt2-124m's 768x768 weight grads, sums
in another order).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

FORMAT = 1
KINDS = ("forward", "dgrad", "wgrad")
_CUDA_TYPES = {"bf16": 14, "fp16": 2, "fp32": 0}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_COMPUTE_32F, _DESC_TRANSA, _DESC_TRANSB, _PREF_MAX_WORKSPACE = 68, 3, 4, 1
_DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_AUX_POINTER, _DESC_AUX_LD = 7, 8, 11, 12
# cuBLASLt epilogues: BIAS adds a vector over the output features; GELU_AUX writes
# gelu(AB) and AB itself (the "aux" matrix, for the backward); GELU_AUX_BIAS the same for
# AB + bias; DGELU multiplies AB by gelu'(aux). cuBLASLt's GELU is the tanh form.
EPILOGUES = {"": 1, "bias": 4, "gelu_aux": 160, "gelu_aux_bias": 164, "dgelu": 192}
_EPILOGUE_OF = {"forward": ("", "bias", "gelu_aux", "gelu_aux_bias"), "dgrad": ("", "dgelu"),
                "wgrad": ("",)}
_WITH_AUX = ("gelu_aux", "gelu_aux_bias", "dgelu")
_WITH_BIAS = ("bias", "gelu_aux_bias")
_ALGO_ATTRS = (("id", 0), ("tile", 1), ("splitk", 2), ("stages", 6))
WORKSPACE_BYTES = 32 << 20
ALIGNMENT = 256  # bytes: cuBLASLt's default minimum alignment when it picks algorithms


@dataclass(frozen=True)
class Shape:
    """One product: row-major out[m, n]. forward: x[m, k] @ w[n, k].T; dgrad: dy[m, k] @
    w[k, n]; wgrad: dy[k, m].T @ x[k, n] into an fp32 out (k: the tokens)."""

    kind: str
    m: int
    n: int
    k: int
    dtype: str  # of the 16-bit operands: bf16 / fp16
    epilogue: str = ""  # forward: "", "bias", "gelu_aux", "gelu_aux_bias"; dgrad: "", "dgelu"

    @property
    def key(self) -> tuple:
        """The plain tuple the layers look up (Shape(*key) == self)."""
        base = (self.kind, self.m, self.n, self.k, self.dtype)
        return base + (self.epilogue,) if self.epilogue else base

    @property
    def out_dtype(self) -> str:
        return "fp32" if self.kind == "wgrad" else self.dtype

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def layouts(self):
        """(transa, transb, A, B, C) for cuBLASLt's column-major view (out^T = Q^T P^T of
        out = P Q): A is the weight (wgrad: x), B the activation grad or input."""
        m, n, k, t = self.m, self.n, self.k, _CUDA_TYPES[self.dtype]
        c = (_CUDA_TYPES[self.out_dtype], n, m, n)
        if self.kind == "forward":
            return 1, 0, (t, k, n, k), (t, k, m, k), c
        if self.kind == "dgrad":
            return 0, 0, (t, n, k, n), (t, k, m, k), c
        return 0, 1, (t, n, k, n), (t, m, k, m), c


class CublasLt:
    """ctypes calls into the libcublasLt that torch loaded (Linux)."""

    def __init__(self) -> None:
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        torch.mm(a, a)  # torch loads cuBLAS(Lt) with its first product
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcublasLt" in line})
        if not paths:
            raise RuntimeError("cuBLASLt is not loaded in this process (torch did not load "
                               "libcublasLt); run without --gemm-algorithms")
        self.lib = lib = ctypes.CDLL(paths[0])
        vp, i32, sz, u64, i64 = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                 ctypes.c_uint64, ctypes.c_int64)
        for name, types in {
            "cublasLtCreate": [vp], "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, i64],
            "cublasLtMatmulDescCreate": [vp, i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulPreferenceCreate": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp] * 7 + [i32, vp, vp],
            "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, vp],
            "cublasLtMatmul": [vp] * 14 + [sz, vp],
        }.items():
            getattr(lib, name).argtypes = types
            getattr(lib, name).restype = ctypes.c_int
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t
        self.version = int(lib.cublasLtGetVersion())
        self.handle = ctypes.c_void_p()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._problems: Dict[Shape, tuple] = {}
        self._workspaces: Dict[int, torch.Tensor] = {}

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")

    def workspace(self, device: torch.device) -> torch.Tensor:
        """This device's workspace (allocate it before any graph capture: `activate`)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._workspaces:
            self._workspaces[index] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                  device=torch.device("cuda", index))
        return self._workspaces[index]

    def problem(self, shape: Shape, epilogue: str = "") -> tuple:
        """(descriptor, A, B, C layouts) of `shape` with `epilogue`, made once."""
        key = (shape, epilogue)
        if key not in self._problems:
            lib = self.lib
            transa, transb, *lays = shape.layouts()
            desc = ctypes.c_void_p()
            self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F,
                                                  _CUDA_TYPES["fp32"]), "cublasLtMatmulDescCreate")
            attrs = [(_DESC_TRANSA, ctypes.c_int32(transa)),
                     (_DESC_TRANSB, ctypes.c_int32(transb))]
            if epilogue:
                attrs.append((_DESC_EPILOGUE, ctypes.c_int32(EPILOGUES[epilogue])))
            if epilogue in _WITH_AUX:  # the aux matrix has the output's layout: ld n
                attrs.append((_DESC_AUX_LD, ctypes.c_int64(shape.n)))
            for attr, v in attrs:
                self._ok(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v),
                                                            ctypes.sizeof(v)),
                         "cublasLtMatmulDescSetAttribute")
            handles = []
            for dtype, rows, cols, ld in lays:
                lay = ctypes.c_void_p()
                self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld),
                         "cublasLtMatrixLayoutCreate")
                handles.append(lay)
            self._problems[key] = (desc, *handles)
        return self._problems[key]

    def candidates(self, shape: Shape, count: int, epilogue: str = "") -> List[bytes]:
        """The algorithms cuBLASLt's heuristic offers for `shape`, best first, as bytes."""
        desc, a, b, c = self.problem(shape, epilogue)
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(
            pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "preference attribute")
        results = (_HeuristicResult * count)()
        got = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, c, c, pref, count, results, ctypes.byref(got)),
            "cublasLtMatmulAlgoGetHeuristic")
        return [bytes(r.algo) for r in results[:got.value] if r.state == 0]

    def describe(self, algo: bytes) -> str:
        """'tile 201, stages 35, ...' of an algorithm (cuBLASLt's enum values)."""
        buf = (ctypes.c_uint64 * 8).from_buffer_copy(algo)
        parts = []
        for name, attr in _ALGO_ATTRS:
            v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(buf), attr, ctypes.byref(v), 4, ctypes.byref(written))
            parts.append(f"{name} {v.value if status == 0 else '?'}")
        return ", ".join(parts)

    def matmul(self, shape: Shape, algo, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               beta: float, epilogue: str = "", aux: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None) -> None:
        """C = A B (+ beta C) in cuBLASLt's terms (see Shape.layouts), on the current stream;
        with `epilogue`, `aux` is the matrix it writes (gelu_aux*) or reads (dgelu) and
        `bias` the vector it adds (bias, gelu_aux_bias)."""
        desc, la, lb, lc = self.problem(shape, epilogue)
        pointers = [(_DESC_AUX_POINTER, aux)] if epilogue in _WITH_AUX else []
        if epilogue in _WITH_BIAS:
            pointers.append((_DESC_BIAS_POINTER, bias))
        for attr, tensor in pointers:
            ptr = ctypes.c_void_p(tensor.data_ptr())
            self._ok(self.lib.cublasLtMatmulDescSetAttribute(
                desc, attr, ctypes.byref(ptr), ctypes.sizeof(ptr)),
                "cublasLtMatmulDescSetAttribute")
        alpha, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)
        ws = self.workspace(c.device)
        self._ok(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(alpha), a.data_ptr(), la, b.data_ptr(), lb,
            ctypes.byref(beta_), c.data_ptr(), lc, c.data_ptr(), lc, ctypes.byref(algo),
            ws.data_ptr(), WORKSPACE_BYTES, torch.cuda.current_stream(c.device).cuda_stream),
            "cublasLtMatmul")


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


_LT: Optional[CublasLt] = None


def cublaslt() -> CublasLt:
    global _LT
    if _LT is None:
        _LT = CublasLt()
    return _LT


# --------------------------------------------------------------------------- the table
def load_table(path: str, device_name: str, cublaslt_version: int) -> Dict[Shape, bytes]:
    """{shape: algorithm} from a file tools/tune_gemms.py wrote, refused (ValueError) when
    it was measured on another GPU model or cuBLASLt version."""
    table = _read_table(path)
    for key, here in (("device", device_name), ("cublaslt_version", cublaslt_version)):
        if table.get(key) != here:
            raise ValueError(f"--gemm-algorithms {path} was measured with {key} "
                             f"{table.get(key)!r}, this process has {here!r}; tune again "
                             "here with tools/tune_gemms.py, or run without the flag")
    return {shape: algo for shape, (algo, _) in _entries(path, table).items()}


def shipped_tables(directory: str, device_name: str, cublaslt_version: int
                   ) -> Tuple[Dict[Shape, bytes], List[str]]:
    """The entries of every table (*.json) in `directory` that was measured on this GPU
    model with this cuBLASLt version, merged (a shape several tables list: the algorithm
    measured fastest), and the files they came from. Tables of other GPUs or versions
    are passed over; a broken file raises ValueError, naming it."""
    merged: Dict[Shape, Tuple[bytes, float]] = {}
    used = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if not name.endswith(".json"):
            continue
        table = _read_table(path)
        if (table.get("device"), table.get("cublaslt_version")) != (device_name,
                                                                     cublaslt_version):
            continue
        used.append(path)
        for shape, (algo, ms) in _entries(path, table).items():
            if shape not in merged or ms < merged[shape][1]:
                merged[shape] = (algo, ms)
    return {shape: algo for shape, (algo, _) in merged.items()}, used


def _read_table(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--gemm-algorithms {path}: cannot read it ({e})") from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        got = table.get("format") if isinstance(table, dict) else type(table).__name__
        raise ValueError(f"--gemm-algorithms {path}: format {got!r}, this "
                         f"version reads {FORMAT}; tune again with tools/tune_gemms.py")
    return table


def _entries(path: str, table: dict) -> Dict[Shape, Tuple[bytes, float]]:
    """{shape: (algorithm, measured ms or inf)} of one table, each entry checked."""
    out = {}
    for e in table.get("entries", []):
        try:
            shape = Shape(e["kind"], int(e["m"]), int(e["n"]), int(e["k"]), e["dtype"],
                          e.get("epilogue", ""))
            algo = bytes.fromhex(e["algo"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"--gemm-algorithms {path}: bad entry {e}") from None
        if (shape.kind not in KINDS or shape.dtype not in ("bf16", "fp16")
                or shape.epilogue not in _EPILOGUE_OF[shape.kind]):
            raise ValueError(f"--gemm-algorithms {path}: bad entry {e}")
        if len(algo) != 64:
            raise ValueError(f"--gemm-algorithms {path}: algorithm of {len(algo)} bytes in {e}")
        out[shape] = (algo, float(e.get("ms", math.inf)))
    return out


def save_table(path: str, device_name: str, cublaslt_version: int, rows: List[dict]) -> None:
    """Write a table: `rows` are dicts with a Shape under "shape", the algorithm bytes
    under "algo" and anything else worth reading (timings, the tile)."""
    entries = []
    for row in rows:
        s = row["shape"]
        extra = {k: v for k, v in row.items() if k not in ("shape", "algo")}
        entry = {"kind": s.kind, "m": s.m, "n": s.n, "k": s.k, "dtype": s.dtype}
        if s.epilogue:
            entry["epilogue"] = s.epilogue
        entries.append({**entry, "algo": row["algo"].hex(), **extra})
    # A temporary file renamed into place: a failed or interrupted write (a full disk,
    # SIGTERM while re-tuning into the same file) keeps the earlier table whole.
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "device": device_name,
                       "cublaslt_version": cublaslt_version, "entries": entries}, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# --------------------------------------------------------------- what the layers call
# (kind, m, n, k, dtype name) -> index into _ALGOS: plain tuples, which torch.compile
# looks up while tracing the layers (the choice is made then, per traced shape).
_ACTIVE: Dict[tuple, int] = {}
_ALGOS: List[tuple] = []  # (shape, ctypes algorithm)
_RECORDING: Optional[Counter] = None
_HEURISTIC: Dict[tuple, int] = {}  # epilogue products without a table entry -> _ALGOS


def activate(table: Dict[Shape, bytes], device: torch.device) -> None:
    """Use `table`'s algorithms from now on in this process (CUDA); an empty table turns
    the choice off again. Allocates the workspace and the descriptors now, before any
    CUDA graph capture."""
    _ACTIVE.clear()
    _ALGOS.clear()
    _HEURISTIC.clear()
    if not table:
        return
    if device.type != "cuda":
        raise ValueError(f"--gemm-algorithms chooses cuBLASLt algorithms, which need CUDA; "
                         f"this run is on {device.type}: run without the flag")
    lt = cublaslt()
    lt.workspace(device)
    for shape, algo in table.items():
        lt.problem(shape, shape.epilogue)
        _ACTIVE[shape.key] = len(_ALGOS)
        _ALGOS.append((shape, (ctypes.c_uint64 * 8).from_buffer_copy(algo)))


@contextlib.contextmanager
def recording():
    """Inside: every product the layers route through here is counted by Shape (run the
    step eagerly); yields the Counter."""
    global _RECORDING
    counts, _RECORDING = Counter(), Counter()
    try:
        yield counts
    finally:
        counts.update({Shape(*key): c for key, c in _RECORDING.items()})
        _RECORDING = None


def _choice(kind: str, m: int, n: int, k: int, dtype: torch.dtype, epilogue: str = "") -> int:
    key = (kind, m, n, k, _NAMES.get(dtype, str(dtype))) + ((epilogue,) if epilogue else ())
    if _RECORDING is not None:
        _RECORDING[key] += 1
    return _ACTIVE.get(key, -1)


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def _torch_forward(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    if bias is None:
        return torch.matmul(x, weight.t())
    # addmm: on CUDA the bias is added in the product's epilogue (no separate add kernel)
    n, k = weight.shape
    return torch.addmm(bias, x.reshape(-1, k), weight.t()).view(*x.shape[:-1], n)


def linear_forward(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight.T (+ bias) (x: [..., k], weight: [n, k], bias: [n])."""
    if not _ACTIVE and _RECORDING is None:
        return _torch_forward(x, weight, bias)
    n, k = weight.shape
    i = _choice("forward", x.numel() // k, n, k, x.dtype, "" if bias is None else "bias")
    if (i < 0 or x.dtype != weight.dtype or not _fits(x, weight)
            or (bias is not None and (bias.dtype != x.dtype or not _fits(bias)))):
        return _torch_forward(x, weight, bias)
    out = torch.ops.megatron.lt_matmul(x.reshape(-1, k), weight, bias, i)
    return out.view(*x.shape[:-1], n)


def linear_dgrad(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_output @ weight (grad_output: [..., k], weight: [k, n])."""
    if not _ACTIVE and _RECORDING is None:
        return grad_output.matmul(weight)
    k, n = weight.shape
    i = _choice("dgrad", grad_output.numel() // k, n, k, grad_output.dtype)
    if i < 0 or grad_output.dtype != weight.dtype or not _fits(grad_output, weight):
        return grad_output.matmul(weight)
    out = torch.ops.megatron.lt_matmul(grad_output.reshape(-1, k), weight, None, i)
    return out.view(*grad_output.shape[:-1], n)


def wgrad_into(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, x_2d: torch.Tensor,
               accumulate: bool) -> bool:
    """main_grad (+)= grad_output_2d.T @ x_2d in fp32 with the table's algorithm; False
    (nothing done) when the table has none for this shape."""
    if not _ACTIVE and _RECORDING is None:
        return False
    m, n = main_grad.shape
    i = _choice("wgrad", m, n, x_2d.shape[0], x_2d.dtype)
    if (i < 0 or main_grad.dtype != torch.float32 or grad_output_2d.dtype != x_2d.dtype
            or not _fits(main_grad, grad_output_2d, x_2d)
            or not _aligned(main_grad, grad_output_2d, x_2d)):
        return False
    shape, algo = _ALGOS[i]
    cublaslt().matmul(shape, algo, x_2d, grad_output_2d, main_grad, 1.0 if accumulate else 0.0)
    return True


def _aligned(*tensors: torch.Tensor) -> bool:
    """The heuristic's algorithms may assume 256-byte aligned matrices (its default);
    views into a grad buffer or of sliced activations need not be."""
    return all(t.data_ptr() % ALIGNMENT == 0 for t in tensors)


def _lt_matmul(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               entry: int) -> torch.Tensor:
    shape, algo = _ALGOS[entry]
    # alignment is checked here, at run time (not while torch.compile traces)
    if not _aligned(*(t for t in (a, weight, bias) if t is not None)):
        return _torch_forward(a, weight, bias) if shape.kind == "forward" else a @ weight
    out = torch.empty(shape.m, shape.n, dtype=a.dtype, device=a.device)
    cublaslt().matmul(shape, algo, weight, a, out, 0.0, shape.epilogue, bias=bias)
    return out


def _lt_matmul_fake(a, weight, bias, entry):
    n = weight.shape[0] if _ALGOS[entry][0].kind == "forward" else weight.shape[1]
    return a.new_empty(a.shape[0], n)


_LIB = torch.library.Library("megatron", "FRAGMENT")
_LIB.define("lt_matmul(Tensor a, Tensor weight, Tensor? bias, int entry) -> Tensor")
for _key in ("CUDA", "CPU"):  # CPU: only tests reach it (activate refuses the CPU)
    _LIB.impl("lt_matmul", _lt_matmul, _key)
torch.library.register_fake("megatron::lt_matmul", _lt_matmul_fake, lib=_LIB)


# ------------------------------------------- the MLP's GeLU in the products' epilogues
# The tanh-form GeLU (`--openai-gelu`, or Megatron's fused bias-GeLU) and
# `--gelu-kernel epilogue`: fc1's forward product writes gelu(h) and h in one pass
# (GELU_AUX; with fc1's bias added first, GELU_AUX_BIAS) and fc2's input-grad product
# multiplies by gelu'(h) as it writes (DGELU), so no separate activation kernel reads and
# writes the [tokens, ffn] tensors. cuBLASLt's
# GELU is the tanh form; where cuBLASLt cannot run (CPU, fp32, unaligned operands) the
# same tanh form is computed with torch ops.
def _epilogue_entry(kind: str, epilogue: str, m: int, n: int, k: int, a: torch.Tensor,
                    weight: torch.Tensor) -> int:
    """_ALGOS index of the table's algorithm for an epilogue product; -2: the heuristic's
    first choice (looked up when the product runs: torch.compile traces this function);
    -1: compute it with torch ops."""
    key = (kind, m, n, k, _NAMES.get(a.dtype, str(a.dtype)), epilogue)
    if _RECORDING is not None:
        _RECORDING[key] += 1
    if (a.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != a.dtype
            or not _fits(a, weight) or m == 0):  # m = 0: a switch-MLP expert without tokens
        return -1
    return _ACTIVE.get(key, -2)


def _resolve(entry: int, kind: str, epilogue: str, a: torch.Tensor, weight: torch.Tensor,
             n: int) -> int:
    """`entry`, with -2 replaced by the heuristic's first algorithm (asked once per shape;
    -1 when it offers none)."""
    if entry != -2:
        return entry
    k = a.shape[1]
    key = (kind, a.shape[0], n, k, _NAMES[a.dtype], epilogue)
    if key not in _HEURISTIC:
        shape = Shape(*key)
        found = cublaslt().candidates(shape, 1, epilogue)
        _HEURISTIC[key] = len(_ALGOS) if found else -1
        if found:
            _ALGOS.append((shape, (ctypes.c_uint64 * 8).from_buffer_copy(found[0])))
    return _HEURISTIC[key]


def gelu_tanh_grad(grad: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """grad * d/dh gelu_tanh(h) at h = pre, in fp32, returned in grad's dtype."""
    x, g = pre.float(), grad.float()
    c = 0.7978845608028654  # sqrt(2 / pi)
    t = torch.tanh(c * (x + 0.044715 * x * x * x))
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return (g * d).to(grad.dtype)


def linear_gelu_forward(x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None):
    """(gelu_tanh(h), h) for h = x @ weight.T (+ bias) (x: [..., k], weight: [n, k],
    bias: [n])."""
    n, k = weight.shape
    epilogue = "gelu_aux" if bias is None else "gelu_aux_bias"
    entry = _epilogue_entry("forward", epilogue, x.numel() // k, n, k, x, weight)
    if bias is not None and (bias.dtype != x.dtype or not _fits(bias)):
        entry = -1
    act, pre = torch.ops.megatron.lt_gelu_forward(x.reshape(-1, k), weight, bias, entry)
    return act.view(*x.shape[:-1], n), pre.view(*x.shape[:-1], n)


def linear_dgrad_dgelu(grad_output: torch.Tensor, weight: torch.Tensor,
                       pre: torch.Tensor) -> torch.Tensor:
    """(grad_output @ weight) * gelu_tanh'(pre): the gradient of the pre-activation
    (grad_output: [..., k], weight: [k, n], pre: [..., n])."""
    k, n = weight.shape
    entry = _epilogue_entry("dgrad", "dgelu", grad_output.numel() // k, n, k, grad_output,
                            weight)
    out = torch.ops.megatron.lt_dgelu(grad_output.reshape(-1, k), weight, pre.reshape(-1, n),
                                      entry)
    return out.view(*grad_output.shape[:-1], n)


def _lt_gelu_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     entry: int):
    epilogue = "gelu_aux" if bias is None else "gelu_aux_bias"
    if x.is_cuda:
        entry = _resolve(entry, "forward", epilogue, x, weight, weight.shape[0])
    if entry < 0 or not _aligned(*(t for t in (x, weight, bias) if t is not None)):
        pre = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
        return torch.nn.functional.gelu(pre, approximate="tanh"), pre
    shape, algo = _ALGOS[entry]
    act = torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device)
    pre = torch.empty_like(act)
    cublaslt().matmul(shape, algo, weight, x, act, 0.0, epilogue, pre, bias)
    return act, pre


def _lt_dgelu(grad_output: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor,
              entry: int) -> torch.Tensor:
    if grad_output.is_cuda:
        entry = _resolve(entry, "dgrad", "dgelu", grad_output, weight, weight.shape[1])
    if entry < 0 or not _aligned(grad_output, weight, pre) or not pre.is_contiguous():
        return gelu_tanh_grad(grad_output @ weight, pre)
    shape, algo = _ALGOS[entry]
    out = torch.empty(shape.m, shape.n, dtype=grad_output.dtype, device=grad_output.device)
    cublaslt().matmul(shape, algo, weight, grad_output, out, 0.0, "dgelu", pre)
    return out


def _lt_gelu_forward_fake(x, weight, bias, entry):
    out = x.new_empty(x.shape[0], weight.shape[0])
    return out, torch.empty_like(out)


def _lt_dgelu_fake(grad_output, weight, pre, entry):
    return grad_output.new_empty(grad_output.shape[0], weight.shape[1])


_LIB.define("lt_gelu_forward(Tensor x, Tensor weight, Tensor? bias, int entry) "
            "-> (Tensor, Tensor)")
_LIB.define("lt_dgelu(Tensor grad_output, Tensor weight, Tensor pre, int entry) -> Tensor")
for _key in ("CUDA", "CPU"):
    _LIB.impl("lt_gelu_forward", _lt_gelu_forward, _key)
    _LIB.impl("lt_dgelu", _lt_dgelu, _key)
torch.library.register_fake("megatron::lt_gelu_forward", _lt_gelu_forward_fake, lib=_LIB)
torch.library.register_fake("megatron::lt_dgelu", _lt_dgelu_fake, lib=_LIB)
