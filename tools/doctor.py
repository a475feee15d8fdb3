#!/usr/bin/env python
"""Check that a machine (or a whole torchrun job) is ready to train, before a long run finds out.

    python tools/doctor.py                                  # this machine
    torchrun --nproc-per-node 8 tools/doctor.py             # + communication checks
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST ... tools/doctor.py

Alone it reports Python, torch, CUDA, cuDNN and NCCL versions, whether apex and Transformer
Engine are installed, the GPUs and their memory, the environment variables that matter
(CUDA_DEVICE_MAX_CONNECTIONS, NCCL_*, CUBLAS*, MASTER_ADDR/PORT, WORLD_SIZE, ...) with warnings, and
whether the rendezvous port MASTER_ADDR:MASTER_PORT is free (alone) or reachable (under
torchrun).

Under torchrun (WORLD_SIZE > 1) every rank then runs, on the backend training would use (nccl
with GPUs, else gloo): a check-in, a barrier, an all-reduce, an all-gather and a ring of
send/recv, each result checked, and a timed all-reduce of --size-mb megabytes (bandwidth in
GB/s). Before each step the ranks check in through the job's TCPStore; rank 0 waits at most
--timeout seconds and names the ranks that did not answer instead of hanging (the others
name rank 0 if it is the one missing). A collective that starts but does not finish within
--timeout is reported by megatron.watchdog. `--simulate-hang-rank R` makes rank R sleep
instead of checking in, to see that report.

Exit status: 0 when every check passed, 1 when one failed (124 when a collective hung).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import socket
import sys
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
            "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "OMP_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME",
            "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF")
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUBLAS", "TORCH_BLAS_")
# debugging switches copied into launch scripts that slow every step of a training run
SLOW_DEBUG_VARS = (
    ("CUDA_LAUNCH_BLOCKING", "every CUDA kernel launch waits for the kernel to finish, so "
     "nothing overlaps and training runs several times slower"),
    ("TORCH_NCCL_BLOCKING_WAIT", "the host blocks in each collective's wait until it "
     "completes, so communication no longer overlaps compute"),
    ("NCCL_BLOCKING_WAIT", "(the old name of TORCH_NCCL_BLOCKING_WAIT) the host blocks in "
     "each collective's wait until it completes, so communication no longer overlaps compute"))
# what each package of requirements.txt is needed for (the rest: every run)
PACKAGE_USES = {"sentencepiece": "SentencePiece tokenizers", "tensorboard": "--tensorboard-dir",
                "tiktoken": "GPT2BPETokenizer", "tokenizers": "HuggingFaceTokenizer",
                "zstandard": ".zst input to tools/preprocess_data.py",
                "safetensors": "Hugging Face conversion", "pyyaml": "--config files"}
PACKAGE_MODULES = {"pyyaml": "yaml"}  # distribution name -> import name where they differ
REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "requirements.txt")
MIN_SHM_BYTES = 1 << 30  # below this DataLoader workers die of bus errors at modest batches
MIN_OPEN_FILES = 1024
DEFAULT_PORT = 29500


# ------------------------------------------------------------------------------ machine
def _package(name: str) -> str:
    """'installed <version>' or 'not installed' without importing the package."""
    if importlib.util.find_spec(name) is None:
        return "not installed"
    try:
        from importlib.metadata import version

        dist_name = {"transformer_engine": "transformer-engine"}.get(name, name)
        return f"installed {version(dist_name)}"
    except Exception:
        return "installed"


def versions() -> List[Tuple[str, str]]:
    """(name, value) rows: Python, torch, CUDA, cuDNN, NCCL, apex, Transformer Engine."""
    import torch

    cuda_build = torch.version.cuda
    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", f"{torch.__version__} ({'CUDA ' + cuda_build if cuda_build else 'CPU'} build)"),
            ("CUDA", "available" if torch.cuda.is_available() else "not available")]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    rows.append(("cuDNN", str(cudnn) if cudnn else "-"))
    try:
        v = torch.cuda.nccl.version() if cuda_build else "-"
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        nccl = "-"
    rows.append(("NCCL", nccl))
    rows.append(("apex", _package("apex") + " (optional: fused kernels)"))
    rows.append(("transformer_engine", _package("transformer_engine") + " (optional: fp8)"))
    return rows


def gpus() -> List[str]:
    """One line per visible GPU: index, name, memory, compute capability."""
    import torch

    if not torch.cuda.is_available():
        return ["none (CPU only: the gloo backend is used)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                     f"compute capability {p.major}.{p.minor}")
    return lines


def environment(env: Dict[str, str]) -> List[Tuple[str, str]]:
    """The variables that matter, set or not (NCCL_* and TORCH_NCCL_* only when set)."""
    rows = [(k, env.get(k, "(not set)")) for k in ENV_VARS]
    rows += sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIXES))
    return rows


def env_warnings(env: Dict[str, str], num_gpus: int) -> List[str]:
    """Advice about the environment: the mistakes that cost a run."""
    out = []
    if num_gpus and env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        out.append("CUDA_DEVICE_MAX_CONNECTIONS is not 1: tensor-parallel communication will not "
                   "overlap with compute as intended (Megatron requires 1; the launch scripts "
                   "export it)")
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"):
        if env.get(var, "0") not in ("0", ""):
            out.append(f"{var}={env[var]}: a transport is disabled; expect lower bandwidth")
    if env.get("NCCL_DEBUG") is None and num_gpus:
        out.append("NCCL_DEBUG is not set: set NCCL_DEBUG=WARN (or INFO) when chasing a hang")
    local = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
    if num_gpus and local > num_gpus:
        out.append(f"LOCAL_WORLD_SIZE {local} processes on this node but only {num_gpus} GPUs "
                   "are visible: ranks would share a GPU")
    lt = env.get("TORCH_BLAS_PREFER_CUBLASLT", "0") not in ("0", "")
    if lt and (env.get("CUBLAS_WORKSPACE_CONFIG", "").startswith(":0:")
               or env.get("CUBLASLT_WORKSPACE_SIZE") == "0"):
        out.append("TORCH_BLAS_PREFER_CUBLASLT with a zero cuBLAS workspace: cuBLASLt fails "
                   "without one ('OOM trying to allocate workspace for cublaslt'); unset one")
    if int(env.get("WORLD_SIZE", "1") or 1) > 1 and "OMP_NUM_THREADS" not in env:
        out.append("OMP_NUM_THREADS is not set: several processes per node may oversubscribe "
                   "the CPU cores")
    return out


def debug_var_warnings(env: Dict[str, str]) -> List[str]:
    """Debugging switches left set: each slows every training step."""
    out = [f"{var}={env[var]}: {why}; a debugging switch: unset it for training"
           for var, why in SLOW_DEBUG_VARS if env.get(var, "0").strip() not in ("0", "")]
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        out.append("TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is first checked for "
                   "consistency across the ranks (extra communication each call); a debugging "
                   "switch: unset it (or OFF) for training")
    return out


def cpu_warnings(env: Dict[str, str], num_cpus: int) -> List[str]:
    """CPU oversubscription: the node's processes times their OpenMP threads against its
    cores (LOCAL_WORLD_SIZE: torchrun's processes on this node)."""
    local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if not threads.isdigit() or local * int(threads) <= num_cpus:
        return []
    return [f"{local} process(es) on this node x OMP_NUM_THREADS={threads} = "
            f"{local * int(threads)} threads for {num_cpus} CPU cores: they compete for the "
            f"cores and every step slows; set OMP_NUM_THREADS={max(1, num_cpus // local)}"]


def cuda_warnings(env: Dict[str, str], cuda_build: bool, num_gpus: int) -> List[str]:
    """A CUDA build of torch that sees no GPU because CUDA_VISIBLE_DEVICES hides them all."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if not cuda_build or num_gpus or visible is None:
        return []
    return [f"CUDA_VISIBLE_DEVICES={visible!r} leaves this CUDA build of torch no GPU: "
            "training would run on the CPU with gloo; unset it or list GPU indices (e.g. "
            "0,1,2,3)"]


def host_limit_warnings(shm_free: Optional[int], open_files: int) -> List[str]:
    """/dev/shm's free bytes (None: no /dev/shm) and the soft open-files limit, both of
    which DataLoader workers (--num-workers > 0) use up."""
    out = []
    if shm_free is not None and shm_free < MIN_SHM_BYTES:
        out.append(f"/dev/shm has {shm_free / 2**20:.0f} MiB free: DataLoader workers "
                   "(--num-workers > 0) pass batches through it and die of a bus error when "
                   "it fills; in a container raise --shm-size (e.g. 16g), or train with "
                   "--num-workers 0")
    if open_files < MIN_OPEN_FILES:
        out.append(f"the open-files limit is {open_files} (ulimit -n): DataLoader workers "
                   "and the ranks' connections fail with 'Too many open files'; raise it "
                   "before the launch, e.g. ulimit -n 65536")
    return out


def _host_limits() -> Tuple[Optional[int], int]:
    """(free bytes of /dev/shm or None, soft RLIMIT_NOFILE) of this machine."""
    try:
        st = os.statvfs("/dev/shm")
        shm_free: Optional[int] = st.f_bavail * st.f_frsize
    except OSError:
        shm_free = None
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError):
        soft = -1
    return shm_free, soft if soft >= 0 else MIN_OPEN_FILES  # RLIM_INFINITY is -1


def _version_tuple(text: str) -> Tuple[int, ...]:
    found = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(x) for x in found.group(0).split(".")) if found else ()


def requirement_problems(lines: List[str], installed) -> Tuple[List[str], List[str]]:
    """(problems, warnings) for requirements.txt's `lines`: a package that is missing or
    older than its `>=` bound. `installed(name)`: its version, or None when this Python
    cannot import it. torch and numpy are problems (every run needs them), the others
    warnings (each is needed by one feature: PACKAGE_USES)."""
    problems: List[str] = []
    warnings: List[str] = []
    for line in lines:
        found = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:>=\s*([0-9][\w.]*))?", line.split("#")[0])
        if not found or line.lstrip().startswith("-"):
            continue
        name, minimum = found.group(1), found.group(2)
        have = installed(name)
        use = PACKAGE_USES.get(name)
        to = problems if use is None and name in ("torch", "numpy") else warnings
        needed = f" (needed for {use})" if use else ""
        if have is None:
            to.append(f"{name} is not installed{needed}: pip install '{name}"
                      f"{'>=' + minimum if minimum else ''}' (or pip install -r requirements.txt)")
        elif minimum and have != "?" and _version_tuple(have) < _version_tuple(minimum):
            to.append(f"{name} {have} is older than requirements.txt's {name}>={minimum}"
                      f"{needed}: pip install -U '{name}>={minimum}'")
    return problems, warnings


def _installed(name: str) -> Optional[str]:
    """The installed version of distribution `name` ('?' when unknown), None when its
    module cannot be imported from this Python."""
    try:
        if importlib.util.find_spec(PACKAGE_MODULES.get(name, name)) is None:
            return None
    except (ImportError, ValueError):  # a broken or blocked installation
        return None
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "?"


def package_checks() -> Tuple[List[str], List[str]]:
    """requirement_problems for this checkout's requirements.txt (none without one)."""
    try:
        with open(REQUIREMENTS) as f:
            lines = f.read().splitlines()
    except OSError:
        return [], []
    return requirement_problems(lines, _installed)


def check_port(addr: str, port: int, timeout: float = 1.0) -> Tuple[str, str]:
    """(state, explanation) for addr:port: 'listening', 'free', 'closed', 'no answer' or
    'unresolvable'. 'free' is only tested for this machine's addresses."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return "unresolvable", f"cannot resolve {addr}: {exc}"
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(sockaddr)
            return "listening", "something accepts connections there"
        except socket.timeout:
            return "no answer", "no reply within the timeout (firewall, or the wrong address)"
        except OSError:
            pass
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(sockaddr)
            return "free", "nothing listens there and this machine can bind it"
        except OSError:
            return "closed", "the host refuses connections: nothing listens there yet"


def _expects_listening(env: Dict[str, str]) -> Optional[bool]:
    """True when the rendezvous store must already be up (torchrun's agent hosts it, or a
    rank other than 0 of a launched job), False when nothing may listen yet (no launcher, or
    rank 0 that creates the store itself), None when either is fine."""
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or int(env.get("RANK", "0") or 0) != 0:
        return True
    return None if env.get("TORCHELASTIC_RUN_ID") else False


def rendezvous_lines(env: Dict[str, str], wait_s: float = 0.0) -> Tuple[List[str], List[str]]:
    """(report lines, problems) for MASTER_ADDR:MASTER_PORT. Where the store must be up, it
    is polled for up to `wait_s` seconds (rank 0 may still be starting)."""
    addr = env.get("MASTER_ADDR", "localhost")
    raw_port = (env.get("MASTER_PORT") or str(DEFAULT_PORT)).strip()
    if not (raw_port.isascii() and raw_port.isdigit()) or not 1 <= int(raw_port) <= 65535:
        # a launch with it fails too (torchrun: invalid int; the store: out of range)
        return [f"{addr}:{raw_port} not checked"], [
            f"MASTER_PORT={raw_port!r} is not a TCP port number (1-65535); set e.g. "
            f"MASTER_PORT={DEFAULT_PORT}"]
    port = int(raw_port)
    expect = _expects_listening(env)
    deadline = time.monotonic() + wait_s
    state, why = check_port(addr, port)
    while expect and state not in ("listening", "unresolvable") and time.monotonic() < deadline:
        time.sleep(0.2)
        state, why = check_port(addr, port)
    problems = []
    if state == "unresolvable":  # every rank must reach the store by this name
        problems.append(f"MASTER_ADDR={addr}: {why}; set it to the first node's hostname "
                        "or IP address, as this node resolves it")
    elif expect and state != "listening":
        problems.append(f"the rendezvous store {addr}:{port} is not reachable from this node "
                        f"({state}); check MASTER_ADDR/--master-addr and the firewall")
    if expect is False and state == "listening":
        problems.append(f"port {port} on {addr} is in use: a new job there fails with 'address "
                        "already in use'; pick another --master-port or stop the old job")
    return [f"{addr}:{port} {state}: {why}"], problems


def machine_report(env: Dict[str, str], wait_s: float = 0.0) -> Tuple[str, List[str]]:
    """The text printed by rank 0 (or the only process) and the problems found."""
    import torch

    out = ["megatron doctor"]
    out += [f"  {k:<20} {v}" for k, v in versions()]
    out += ["GPUs"] + [f"  {line}" for line in gpus()]
    out += ["environment"] + [f"  {k:<32} {v}" for k, v in environment(env)]
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    package_problems, warnings = package_checks()
    warnings += env_warnings(env, num_gpus) + debug_var_warnings(env)
    warnings += cpu_warnings(env, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else os.cpu_count() or 1)
    warnings += cuda_warnings(env, bool(torch.version.cuda), num_gpus)
    warnings += host_limit_warnings(*_host_limits())
    out += [f"WARNING: {w}" for w in warnings]
    lines, problems = rendezvous_lines(env, wait_s)
    problems = package_problems + problems
    out += ["rendezvous"] + [f"  {line}" for line in lines]
    return "\n".join(out), problems


# ------------------------------------------------------------------------ communication
class CheckIn:
    """Store-based check-in before each step: rank 0 waits for every rank with a timeout and
    publishes a verdict; the others wait for the verdict. Nobody blocks for longer than the
    timeout (plus a grace for the others), whoever is missing."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, grace_s: float = 5.0):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.grace_s = grace_s  # the others wait this much longer than rank 0

    def _wait_for(self, keys: List[str], deadline: float) -> List[str]:
        """Keys still missing at the deadline (polls the store, never blocks in get)."""
        while True:
            missing = [k for k in keys if not self.store.check([k])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.01)

    def __call__(self, step: str, info: str = "") -> Tuple[Optional[str], Dict[int, str]]:
        """(None or the failure message, {rank: info} on rank 0) for `step`."""
        prefix = f"doctor/{step}"
        self.store.set(f"{prefix}/rank{self.rank}", info or "-")
        verdict = f"{prefix}/verdict"
        if self.rank == 0:
            keys = [f"{prefix}/rank{r}" for r in range(self.world_size)]
            missing = self._wait_for(keys, time.monotonic() + self.timeout_s)
            if missing:
                ranks = sorted(keys.index(k) for k in missing)
                msg = (f"rank(s) {ranks} did not answer within {self.timeout_s:g} s at step "
                       f"'{step}'; those processes are stuck or dead")
                self.store.set(verdict, "FAIL " + msg)
                return msg, {}
            self.store.set(verdict, "ok")
            return None, {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        wait = self.timeout_s + self.grace_s
        if self._wait_for([verdict], time.monotonic() + wait):
            return (f"rank 0 did not answer within {wait:g} s at step "
                    f"'{step}'; rank 0 is stuck or dead"), {}
        value = self.store.get(verdict).decode()
        return (None if value == "ok" else value[5:]), {}


def _device(backend: str):
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_collectives(rank: int, world: int, backend: str) -> List[Tuple[str, bool, str]]:
    """Barrier, all-reduce, all-gather and a send/recv ring; (name, ok, detail) each.

    Collectives: barrier; all-reduce SUM of rank + 1 (expects W(W+1)/2); all-gather of
    [rank] * 4 (expects ranks in order); batch_isend_irecv ring r -> r+1 (expects r-1)."""
    import torch
    import torch.distributed as dist

    dev = _device(backend)
    results = []
    t0 = time.perf_counter()
    dist.barrier()
    results.append(("barrier", True, f"{(time.perf_counter() - t0) * 1e3:.1f} ms"))
    t = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    results.append(("all-reduce", bool((t == want).all()), f"sum {t[0].item():g}, expected {want:g}"))
    parts = [torch.empty(4, device=dev) for _ in range(world)]
    dist.all_gather(parts, torch.full((4,), float(rank), device=dev))
    got = [p[0].item() for p in parts]
    results.append(("all-gather", got == [float(r) for r in range(world)], f"got {got}"))
    send = torch.full((4,), float(rank), device=dev)
    recv = torch.empty(4, device=dev)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    prev = (rank - 1) % world
    results.append(("send/recv", recv[0].item() == prev,
                    f"received {recv[0].item():g} from rank {prev} in a ring"))
    return results


def bandwidth(world: int, backend: str, size_mb: float, iters: int) -> str:
    """Time an all-reduce of `size_mb` MB of fp32: algorithm and bus bandwidth in GB/s."""
    import torch
    import torch.distributed as dist

    dev = _device(backend)
    n = max(int(size_mb * 1e6 / 4), 1)
    t = torch.ones(n, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dist.all_reduce(t)  # warm-up (connections, buffers)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    sync()
    seconds = (time.perf_counter() - start) / iters
    algbw = n * 4 / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world
    return (f"all-reduce of {n * 4 / 1e6:.0f} MB fp32: {seconds * 1e3:.2f} ms, "
            f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s")


def _rank_info(local_rank: int) -> str:
    import torch

    dev = f"cuda:{local_rank} {torch.cuda.get_device_name(local_rank)}" \
        if torch.cuda.is_available() else "cpu"
    return f"host {socket.gethostname()}, local rank {local_rank}, pid {os.getpid()}, {dev}"


def _init(rank: int, world: int, local_rank: int, timeout_s: float) -> Optional[str]:
    """Initialise the default process group; the backend, or None after printing why not."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    try:
        kwargs = {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s + 60), **kwargs)
    except Exception as exc:
        print(f"FAIL rank {rank}: process-group initialisation failed: {exc}\n  did every node "
              "start torchrun with the same --nnodes, --master-addr and --master-port?", flush=True)
        return None
    return backend


def communication(args, env: Dict[str, str]) -> int:
    """Initialise the process group, check in, run the collectives; rank 0 prints the
    report, every rank prints its own failures. Returns the exit status."""
    import torch.distributed as dist

    from megatron.watchdog import CollectiveWatchdog

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    backend = _init(rank, world, local_rank, args.timeout)
    if backend is None:
        return 1
    store = dist.distributed_c10d._get_default_store()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"communication (backend {backend}, world size {world})", flush=True)
    if args.simulate_hang_rank == rank:
        time.sleep(args.timeout * 10 + 60)
    checkin = CheckIn(store, rank, world, args.timeout)
    for step in ("check-in", "barrier"):
        err, infos = checkin(step, _rank_info(local_rank))
        if err:
            print(f"FAIL rank {rank}: {err}", flush=True)
            say("result: some checks FAILED", flush=True)
            os._exit(1)  # a peer is gone: leaving through the process group could hang
        if step == "check-in":
            for r, info in sorted(infos.items()):
                say(f"  rank {r}: {info}", flush=True)
    watchdog = CollectiveWatchdog(store, rank, world, args.timeout)
    with watchdog.watch("doctor collectives (barrier, all-reduce, all-gather, send/recv)"):
        results = run_collectives(rank, world, backend)
    failures = 0
    for name, ok, detail in results:
        failures += not ok
        if rank == 0 or not ok:
            print(f"  {name:<11} {'ok' if ok else 'FAIL'}: {detail}"
                  + ("" if rank == 0 else f" (rank {rank})"), flush=True)
    with watchdog.watch(f"all-reduce of {args.size_mb:g} MB (bandwidth)"):
        line = bandwidth(world, backend, args.size_mb, args.iters)
    say(f"  {'bandwidth':<11} {line}", flush=True)
    watchdog.close()
    dist.destroy_process_group()
    return 1 if failures else 0


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """ap.error (exit 2) for a value the checks cannot run with: a timeout of no time
    fails every rank at once, and no timed all-reduce gives no bandwidth."""
    for flag, value, ok, need in (
            ("--timeout", args.timeout, args.timeout > 0, "a number of seconds > 0"),
            ("--size-mb", args.size_mb, args.size_mb is None or args.size_mb > 0, "> 0"),
            ("--iters", args.iters, args.iters >= 1, ">= 1")):
        if not ok:
            ap.error(f"{flag} {value} must be {need}")


def _srun_tasks(env: Dict[str, str]) -> Optional[str]:
    """megatron.initialize's error for srun tasks started without torchrun, in doctor's
    words (the communication checks need torchrun's variables, as training does)."""
    from megatron.srun_tasks import srun_tasks_without_launcher

    message = srun_tasks_without_launcher(
        env, "tools/doctor.py", "checks alone, so no communication is tested (pretrain_gpt.py "
        "would train alone in each)")
    return None if message is None else message.removeprefix("error: ")


def main(argv=None) -> int:
    from megatron.cli_suggest import SuggestingParser

    ap = SuggestingParser(description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for the other ranks at each step (default 60)")
    ap.add_argument("--size-mb", type=float, default=None,
                    help="all-reduce size for the bandwidth test (default 256 on GPU, 16 on CPU)")
    ap.add_argument("--iters", type=int, default=5, help="timed all-reduces (default 5)")
    ap.add_argument("--simulate-hang-rank", type=int, default=None,
                    help="testing: this rank sleeps instead of checking in")
    args = ap.parse_args(argv)
    _check_args(ap, args)
    import torch

    env = dict(os.environ)
    if args.size_mb is None:
        args.size_mb = 256.0 if torch.cuda.is_available() else 16.0
    from megatron.srun_tasks import launcher_variable_problems

    bad = launcher_variable_problems(env)
    if bad:  # every check below reads them
        print("\n".join(f"FAIL: {p}" for p in bad) + "\nresult: some checks FAILED",
              flush=True)
        return 1
    rank = int(env.get("RANK", "0") or 0)
    stray = _srun_tasks(env)
    if stray is not None:  # every task would check alone, and pass: task 0 says so
        if env.get("SLURM_PROCID", "0") in ("", "0"):
            print(f"{machine_report(env)[0]}\nFAIL: {stray}\nresult: some checks FAILED",
                  flush=True)
        return 1
    problems: List[str] = []
    if rank == 0:
        text, problems = machine_report(env, args.timeout)
        print(text, flush=True)
    else:
        _, problems = rendezvous_lines(env, args.timeout)
    for p in problems:
        print(f"FAIL rank {rank}: {p}", flush=True)
    status = 1 if problems else 0
    if int(env.get("WORLD_SIZE", "1") or 1) > 1:
        status = max(status, communication(args, env))
    if rank == 0:
        print("result: " + ("all checks passed" if status == 0 else "some checks FAILED"), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
