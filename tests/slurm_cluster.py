"""A throwaway one-node Slurm cluster on this machine, for testing batch scripts for real.

`start_cluster(workdir)` writes a munge key and a `slurm.conf` under `workdir` (1 node: this
machine, with the topology `slurmd -C` detects; one partition; no cgroups, no accounting),
starts `munged`, `slurmctld` and `slurmd` in the foreground as child processes (free ports, a
private munge socket, state and spool under `workdir`, so a system Slurm is not touched) and
waits until the node is idle. `SlurmCluster.stop()` cancels every job, waits for them to end
and terminates the three daemons it started. Needs root (SlurmUser=root) and Debian's
`slurmctld slurmd slurm-client munge` packages; `missing_reason()` says what is absent.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from tests.dist_utils import free_port

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue",
            "scancel", "sinfo")
INSTALL_HINT = "apt-get install -y slurmctld slurmd slurm-client munge (as root)"


class SlurmStartError(RuntimeError):
    """A daemon did not come up; the message carries the end of its log."""


def missing_reason() -> Optional[str]:
    """Why a local cluster cannot run here (missing binaries, not root), or None."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root (SlurmUser=root); not root"
    return None


def _node_name() -> str:
    """The short hostname when it resolves (jobs use it as the rendezvous address)."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def _node_hardware() -> str:
    """`CPUs=... RealMemory=...` of this machine as slurmd sees it (falls back to nproc)."""
    try:
        out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
        line = out.splitlines()[0]
        return " ".join(w for w in line.split() if not w.startswith("NodeName="))
    except (OSError, IndexError, subprocess.SubprocessError):
        return f"CPUs={os.cpu_count() or 1}"


def write_slurm_conf(workdir: Path, node: str, munge_socket: Path) -> Path:
    """Write `workdir/slurm.conf` for a one-node cluster on 127.0.0.1; returns its path."""
    for sub in ("state", "spool", "log", "run"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    conf = f"""\
ClusterName=localtest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool
SlurmctldPidFile={workdir}/run/slurmctld.pid
SlurmdPidFile={workdir}/run/slurmd.pid
SlurmctldLogFile={workdir}/log/slurmctld.log
SlurmdLogFile={workdir}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 {_node_hardware()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    path = workdir / "slurm.conf"
    path.write_text(conf)
    return path


class SlurmCluster:
    """Handles to the running daemons plus small client helpers (sbatch, job fields)."""

    def __init__(self, workdir: Path, conf: Path, node: str):
        self.workdir, self.conf, self.node = workdir, conf, node
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        self.daemons: List[subprocess.Popen] = []

    # ------------------------------------------------------------------ clients
    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """Run a Slurm client command against this cluster; returns stdout."""
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def sbatch(self, script: str, *args: str, env: Optional[Dict[str, str]] = None,
               sbatch_args: tuple = (), cwd: Optional[str] = None) -> int:
        """Submit `script args...` with extra environment `env`; returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *sbatch_args, script, *args],
                              env=dict(self.env, **(env or {})), capture_output=True,
                              text=True, timeout=30, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> Dict[str, str]:
        """`scontrol show job` fields (JobState, Restarts, ...) as a dict; {} once forgotten."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, done: Callable[[Dict[str, str]], bool],
                 timeout: float, what: str) -> Dict[str, str]:
        """Poll the job until `done(fields)`; AssertionError naming `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info and done(info):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: {what} not reached in {timeout:.0f} s; last "
                             f"state {info.get('JobState')}\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The end of the daemons' logs, for failure messages."""
        parts = []
        for name in ("log/munged.stderr", "munge/munged.log", "log/slurmctld.stderr",
                     "log/slurmctld.log", "log/slurmd.stderr", "log/slurmd.log"):
            path = self.workdir / name
            if path.exists() and path.stat().st_size:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # ----------------------------------------------------------------- lifetime
    def _spawn(self, *cmd: str) -> None:
        with open(self.workdir / "log" / f"{cmd[0]}.stderr", "ab") as err:
            self.daemons.append(subprocess.Popen(list(cmd), env=self.env,
                                                 stdin=subprocess.DEVNULL,
                                                 stdout=err, stderr=subprocess.STDOUT))

    def _wait_until(self, ok: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead:
                raise SlurmStartError(f"{', '.join(dead)} exited while waiting for {what}\n"
                                      f"{self.log_tail()}")
            if ok():
                return
            time.sleep(0.3)
        raise SlurmStartError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                              f"{self.log_tail()}")

    def stop(self, timeout: float = 30) -> None:
        """Cancel all jobs, wait for them to leave the node, terminate the daemons."""
        try:
            if any(d.poll() is None for d in self.daemons[1:]):
                self.run("scancel", "--full", "--user=root", check=False)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    out = self.run("squeue", "-h", "-t", "R,CG,S", "-o", "%i", check=False)
                    if not out.strip():
                        break
                    time.sleep(0.5)
        finally:
            for daemon in reversed(self.daemons):  # slurmd, slurmctld, then munged
                if daemon.poll() is None:
                    daemon.terminate()
                    try:
                        daemon.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait(timeout=15)
            self.daemons.clear()


def start_cluster(workdir: Path, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and slurmd for a one-node cluster under `workdir`.

    Raises SlurmStartError (with the daemons' logs) when one does not come up; whatever
    was started is stopped again before raising.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o755)
    for parent in workdir.parents:  # munged refuses a socket path others cannot traverse
        if not os.stat(parent).st_mode & 0o001:
            raise SlurmStartError(f"munged needs a socket path everyone can traverse; "
                                  f"{parent} is not (use a directory under /tmp)")
    key_dir = workdir / "munge"
    key_dir.mkdir(mode=0o700, exist_ok=True)
    key = key_dir / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30)
    sock = workdir / "run" / "munge.sock"
    node = _node_name()
    conf = write_slurm_conf(workdir, node, sock)
    os.chmod(workdir / "run", 0o755)
    cluster = SlurmCluster(workdir, conf, node)
    try:
        cluster._spawn("munged", "--foreground", f"--socket={sock}", f"--key-file={key}",
                       f"--pid-file={workdir}/run/munged.pid",
                       f"--log-file={key_dir}/munged.log", f"--seed-file={key_dir}/munged.seed")
        cluster._wait_until(sock.exists, timeout, "the munge socket")
        cluster._spawn("slurmctld", "-D", "-i", "-f", str(conf))
        cluster._wait_until(lambda: cluster.run("scontrol", "ping", check=False).count("UP") > 0,
                            timeout, "slurmctld to answer")
        cluster._spawn("slurmd", "-D", "-N", node, "-f", str(conf))
        cluster._wait_until(
            lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%T", check=False),
            timeout, "the node to become idle")
    except BaseException:
        cluster.stop()
        raise
    return cluster
