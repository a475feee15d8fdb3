"""Run a script (pretrain_gpt.py) as a process forked from the test process: what
`python script args` does after its imports, less their cost.

Each fresh rank process pays some 5-6 s of CPU importing torch, megatron and torch._dynamo
(which torch's optimizer constructor imports) on a 2-core machine: most of a short run.
A forked child has them already. It starts as a fresh interpreter would: `env` as its whole
environment, `sys.argv = [script, *args]`, stdout and stderr to a file, the default
signal dispositions, warnings filters and root logger, none of the test process's exit
functions; the script then runs as `__main__` (pretrain_gpt.py ends its own process,
megatron/process_exit.py). A SystemExit or an exception that escapes it ends the child as
the interpreter would: the message or traceback on stderr, status 1 (or the code).

For tests of what a process prints and how it exits, not of the imports; a test of a
launcher (torchrun) starts real processes. Its workers are fresh processes too, unless
the test has them forked from the launcher (`fork_torchrun_workers`, `ForkedPopen`).
"""
from __future__ import annotations

import atexit
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = str(ROOT / "pretrain_gpt.py")


def warm_imports() -> None:
    """Import here what a rank and torchrun import, so that each forked child inherits
    it (`start` does, once)."""
    if "pretrain_gpt" in sys.modules:
        return
    import torch.distributed.run  # noqa: F401

    import megatron.training  # noqa: F401
    import pretrain_gpt  # noqa: F401


def _as_fresh_interpreter(env: Mapping[str, str], outputs: Optional[Sequence[str]],
                          argv: list) -> None:
    """In the child: the state a new `python script args` would start with (`outputs`
    None: stdout and stderr stay where they are)."""
    for target, path in zip((1, 2), outputs or ()):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.setitimer(signal.ITIMER_REAL, 0)  # pytest-timeout's alarm
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM, signal.SIGHUP,
                signal.SIGQUIT):  # pytest-timeout's, torchrun's handlers
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the test process's exit functions and finalizers are not the child's
    for info in weakref.finalize._registry.values():
        info.atexit = False
    weakref.finalize._registered_with_atexit = False
    warnings.resetwarnings()
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                     ResourceWarning):  # Python's default filters
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the parent's pool is gone
    sys.argv = list(argv)


def start(script: str, args: Sequence[str], env: Mapping[str, str], stdout_path,
          stderr_path=None, module: bool = False, new_session: bool = False,
          cwd=None) -> int:
    """Fork a child that runs `script` (with `module`: the module of that name, as
    `python -m`) with `args` as `__main__`, its stdout to the file `stdout_path` and its
    stderr to `stderr_path` (default: the same file); with `new_session` it leads a
    process group of its own (as Popen's start_new_session); with `cwd` it starts in that
    directory. Returns its pid."""
    warm_imports()
    pid = os.fork()
    if pid:
        return pid
    outputs = [str(stdout_path), str(stderr_path or stdout_path)]
    _run_child(script, args, env, outputs, module, new_session, cwd)


def _run_child(script: str, args: Sequence[str], env: Mapping[str, str],
               outputs: Optional[Sequence[str]], module: bool, new_session: bool, cwd) -> None:
    """In a forked child: run `script` as `__main__` (see `start`; `outputs` None: keep
    the stdout and stderr it inherited) and end the process with its exit status."""
    code = 1
    try:
        if new_session:
            os.setsid()
        if cwd is not None:
            os.chdir(cwd)
        _as_fresh_interpreter(env, outputs, [script, *args])
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        from megatron.process_exit import exit_status

        code = exit_status(exc.code)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def start_command(cmd: Sequence[str], env: Mapping[str, str], stdout_path, stderr_path=None,
                  new_session: bool = False, cwd=None) -> int:
    """`start` for a command line `[sys.executable, script, *args]` or
    `[sys.executable, "-m", module, *args]` (torchrun: its workers are fresh processes)."""
    assert cmd[0] == sys.executable, cmd
    module = cmd[1] == "-m"
    target, args = (cmd[2], cmd[3:]) if module else (cmd[1], cmd[2:])
    return start(target, args, env, stdout_path, stderr_path, module, new_session, cwd)


def start_ranks(script: str, args: Sequence[str], env: Mapping[str, str], port: int,
                outputs: Sequence[Sequence]) -> List[int]:
    """`script` with `args` as ranks 0..n-1 of n = len(outputs), each forked (`start`) with
    `env` plus the env:// rendezvous torchrun's workers see (MASTER_* on `port`, RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), but no launcher; rank r's stdout and stderr
    to outputs[r] ((stdout path,) or (stdout path, stderr path)). Returns their pids."""
    world = str(len(outputs))
    return [start(script, args, dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=world,
                                     LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port)), *paths)
            for r, paths in enumerate(outputs)]


class Forked:
    """A Popen-like handle on a command line forked by `start_command` (a `Child`) whose
    stdout and stderr (with `merge_stderr`: both in `stdout`) are captured in memory files
    (no file is left anywhere) and read as text into `stdout` and `stderr` once it has
    ended."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], cwd=None,
                 merge_stderr: bool = False, new_session: bool = False):
        self.args, self.stdout, self.stderr = list(cmd), None, None
        self._fds = [os.memfd_create(name) for name in ("stdout", "stderr")[:2 - merge_stderr]]
        paths = [f"/proc/{os.getpid()}/fd/{fd}" for fd in self._fds]
        self._child = Child(start_command(cmd, env, *paths, new_session=new_session, cwd=cwd))
        self.pid = self._child.pid

    @property
    def returncode(self):
        return self._child.returncode

    def poll(self):
        if self._fds and self._child.poll() is not None:
            self._read_output()
        return self.returncode

    def _read_output(self) -> None:
        texts = []
        for fd in self._fds:
            os.lseek(fd, 0, os.SEEK_SET)
            with open(fd, "rb", closefd=True) as stream:
                texts.append(stream.read().decode(errors="replace"))
        self._fds = []
        self.stdout, self.stderr = (texts + [None])[:2]

    def send_signal(self, sig: int) -> None:
        self._child.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Its exit status; one still running after `timeout` seconds is killed (SIGKILL)
        and the wait fails (see `wait`)."""
        try:
            return self._child.wait(timeout)
        finally:
            if self._fds:
                self._read_output()


def run(cmd: Sequence[str], env: Mapping[str, str], timeout: float, cwd=None
        ) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
    timeout=timeout)` with the command forked (`Forked`)."""
    proc = Forked(cmd, env, cwd=cwd)
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout), proc.stdout, proc.stderr)


def wait(pids: List[int], timeout: float) -> List[int]:
    """Each child's exit status (-N: killed by signal N), in the order of `pids`; children
    still running after `timeout` seconds are killed (SIGKILL) and the wait fails."""
    deadline, statuses = time.monotonic() + timeout, {}
    while len(statuses) < len(pids):
        for pid in pids:
            done, status = (0, 0) if pid in statuses else os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = os.waitstatus_to_exitcode(status)
        if len(statuses) < len(pids) and time.monotonic() > deadline:
            for pid in set(pids) - set(statuses):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise AssertionError(f"a forked process still ran after {timeout} s")
        time.sleep(0.05)
    return [statuses[pid] for pid in pids]


class Child:
    """A Popen-like handle on a forked child (`start`'s or `start_command`'s pid), for a
    test that polls or signals it: poll, send_signal, kill, wait. Unlike Popen's, `wait`
    past its timeout kills the child and fails (as `wait` above)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a reaped (perhaps reused) pid
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float = 3600.0) -> int:
        if self.poll() is None:
            [self.returncode] = wait([self.pid], timeout)
        return self.returncode


class ForkedPopen(subprocess.Popen):
    """`subprocess.Popen` for a Python command line (`[sys.executable, "-u", script, *args]`
    or `[..., "-m", module, ...]`, torchrun's worker) that forks this process in place of
    fork + exec: the child runs it as `start`'s do, in a session of its own (as torchrun
    asks: it ends its workers with killpg), stdout and stderr inherited or, where torchrun
    redirects them (--redirects), the files it opened. Every other file
    descriptor it inherited is pointed at /dev/null (as close_fds would close it, while no
    stale object of this process can close a reused number): a forked rank holds no socket
    of its launcher's store open. Poll, wait and signals are Popen's own."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       *rest) -> None:
        args = list(args)
        assert args[0] == sys.executable and preexec_fn is None, args
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = rest[3:9]
        assert p2cread == p2cwrite == c2pread == errread == -1, "pipes are not forked"
        flags = [a for a in args[1:] if a in ("-u", "-m")]
        target, script_args = args[1 + len(flags)], args[2 + len(flags):]
        warm_imports()
        pid = os.fork()
        if pid:
            self.pid, self._child_created = pid, True
            return
        for source, target_fd in ((c2pwrite, 1), (errwrite, 2)):  # torchrun's --redirects
            if source != -1:
                os.dup2(source, target_fd)
        _release_inherited_fds()
        _run_child(target, script_args, env, None, "-m" in flags, True, cwd)


def _release_inherited_fds() -> None:
    """Point every file descriptor above 2 at /dev/null (see ForkedPopen)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd != devnull:
            try:
                os.dup2(devnull, fd)
            except OSError:  # the listing's own descriptor, closed since
                pass


def fork_torchrun_workers(monkeypatch) -> None:
    """Torchrun agents started from now on (in this process, or forked from it by
    `start_command`) fork their workers from themselves (ForkedPopen) until `monkeypatch`
    is undone: each rank has the imports of torch and megatron already. For tests of
    what ranks print and how they and their launcher end, not of a worker's start-up."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    monkeypatch.setattr(subprocess_handler, "Popen", ForkedPopen)
