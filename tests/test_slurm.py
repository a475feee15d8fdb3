"""The Slurm batch script, run for real: a one-node Slurm (munged + slurmctld + slurmd on
localhost, see tests/slurm_cluster.py) runs scripts/slurm/pretrain_gpt.sbatch with
DEVICE=cpu (directly, and through its CPU variant pretrain_gpt_cpu.sbatch): srun starts
torchrun, torchrun starts 2 gloo ranks (TP=2) training a tiny GPT on mock data.

1. An uninterrupted job (the main script, `--gpus-per-node=0`): ran through srun and
   torchrun, tensorboard events and the final checkpoint exist.
2. Time-limit warning: `scancel --batch --signal=USR1` mid-run (what `--signal=B:USR1@120`
   does); the script sends SIGTERM to the step, the ranks save (--exit-signal-handler) at
   the iteration they reached, the script requeues the job, the requeued job loads that
   checkpoint and finishes. Every iteration 1..T is logged once and its loss equals the
   uninterrupted run's (fp32 on CPU: bit-identical printed values).
3. `scontrol requeue` from outside (SIGTERM to every process, SIGKILL after KillWait): the
   requeued job resumes from the newest checkpoint (the one the ranks save on SIGTERM, or
   the last --save-interval one) and finishes with the same losses.

Skipped (with the reason) where Slurm is not installed or cannot start; CI installs it.
"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.dist_utils import free_port
from tests.slurm_cluster import SlurmStartError, missing_reason, start_cluster

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = ROOT / "scripts" / "slurm"
# The USR1 and the requeue below stop the ranks 2-3 iterations after the one they wait
# for (8, 12): 50 leaves them over 35 iterations to spare (100 only made every job longer).
TRAIN_ITERS = 50
TINY_PRESET = """\
num-layers: 2
hidden-size: 64
num-attention-heads: 4
seq-length: 32
max-position-embeddings: 32
micro-batch-size: 4
global-batch-size: 8
lr: 1.0e-3
min-lr: 1.0e-4
lr-decay-style: cosine
lr-warmup-iters: 2
log-interval: 1
eval-iters: 0
use-cpu-initialization: true
tensor-model-parallel-size: 2
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    # not under pytest's tmp dir: munged wants a socket path that everyone can traverse
    workdir = Path(tempfile.mkdtemp(prefix="slurm-test-"))
    try:
        try:
            c = start_cluster(workdir)
        except SlurmStartError as exc:
            pytest.skip(f"could not start a local Slurm cluster: {exc}")
        try:
            yield c
        finally:
            c.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def submit(cluster, run_dir: Path, name: str, *extra: str, gpu_script: bool = False) -> tuple:
    """Submit the CPU variant (or the main script switched to CPU) with the tiny preset;
    returns (job id, its log path)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    preset = run_dir / "tiny.yaml"
    preset.write_text(TINY_PRESET)
    log = run_dir / "slurm.out"
    env = {"REPO": str(ROOT), "CONFIG": str(preset), "RUN_DIR": str(run_dir / "run"),
           "TOKENIZER_TYPE": "NullTokenizer", "VOCAB_SIZE": "200",
           "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    sbatch_args = (f"--job-name={name}", f"--output={log}")
    script = SLURM_DIR / "pretrain_gpt_cpu.sbatch"
    if gpu_script:  # the switch: DEVICE=cpu, and no GPUs asked of a CPU-only cluster
        script = SLURM_DIR / "pretrain_gpt.sbatch"
        env["DEVICE"] = "cpu"
        sbatch_args += ("--nodes=1", "--gpus-per-node=0")
    job_id = cluster.sbatch(str(script), "--train-iters", str(TRAIN_ITERS), *extra, env=env,
                            sbatch_args=sbatch_args, cwd=str(ROOT))
    return job_id, log


def finished(cluster, job_id: int, log: Path, timeout: float = 150) -> str:
    info = cluster.wait_job(job_id, lambda j: j["JobState"] in ("COMPLETED", "FAILED",
                                                                "CANCELLED", "TIMEOUT"),
                            timeout, "the end of the job")
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", (
        f"job {job_id}: {info['JobState']} (Reason={info.get('Reason')} "
        f"ExitCode={info.get('ExitCode')})\n{text[-6000:]}\n{cluster.log_tail(40)}")
    return text


def wait_for_iteration(cluster, job_id: int, log: Path, iteration: int, timeout: float = 90):
    pattern = re.compile(rf"iteration\s+{iteration}/")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and pattern.search(log.read_text(errors="replace")):
            return
        time.sleep(0.1)
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    raise AssertionError(f"job {job_id} did not reach iteration {iteration}:\n{text[-4000:]}"
                         f"\n{cluster.log_tail()}")


def release_requeued(cluster, job_id: int) -> None:
    """A requeued job waits ~2 min (its BeginTime); let it start sooner. Not at once:
    slurmd refuses a launch credential issued in the second its old one was revoked."""
    cluster.wait_job(job_id, lambda j: j["JobState"] == "PENDING" and j["Restarts"] != "0",
                     60, "PENDING after the requeue")
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def losses(log: str) -> list:
    """[(iteration, printed lm loss)] in log order."""
    return [(int(i), v) for i, v in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)]


def tracker(run_dir: Path) -> str:
    return (run_dir / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """An uninterrupted job of the main script in CPU mode: (run dir, its log)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    job_id, log = submit(cluster, run_dir, "gpt-ref", gpu_script=True)
    return run_dir, finished(cluster, job_id, log)


def test_batch_job_trains_through_srun_and_torchrun(reference):
    run_dir, log = reference
    assert re.search(r"step \d+\.0: torchrun --node-rank 0 --nnodes 1 --nproc-per-node 2 "
                     r"--master-addr \S+ --master-port \d+", log), log[:3000]
    assert "1 node(s) [" in log and "x 2 process(es), DEVICE=cpu" in log
    assert "using world size: 2" in log and "tensor-model-parallel size: 2" in log
    assert [i for i, _ in losses(log)] == list(range(1, TRAIN_ITERS + 1))
    assert "will start from random" in log  # --load on an empty directory: a fresh start
    assert tracker(run_dir) == str(TRAIN_ITERS)
    ckpt = run_dir / "run" / "checkpoints" / f"iter_{TRAIN_ITERS:07d}"
    assert (ckpt / "mp_rank_00" / "model_optim_rng.pt").exists()
    assert (ckpt / "mp_rank_01" / "model_optim_rng.pt").exists()
    from megatron.logging_utils import read_scalars
    scalars = read_scalars(str(run_dir / "run" / "tensorboard"))
    assert [s for s, _ in scalars["lm loss"]] == list(range(1, TRAIN_ITERS + 1))


def test_usr1_saves_requeues_and_resumes(cluster, reference, tmp_path):
    job_id, log = submit(cluster, tmp_path, "gpt-usr1")
    wait_for_iteration(cluster, job_id, log, 8)
    cluster.run("scancel", "--batch", "--signal=USR1", str(job_id))
    release_requeued(cluster, job_id)
    text = finished(cluster, job_id, log)

    saved = re.search(r"successfully saved checkpoint at iteration\s+(\d+)", text)
    assert saved and "[exiting program after receiving SIGTERM.]" in text, text[-6000:]
    stopped_at = int(saved.group(1))
    assert 8 <= stopped_at < TRAIN_ITERS
    assert f"requeueing job {job_id}" in text and f"job {job_id} restart 1:" in text
    assert f"loading checkpoint from {tmp_path}/run/checkpoints at iteration {stopped_at}" in text
    assert cluster.job(job_id)["Restarts"] == "1"
    # every iteration exactly once, with the uninterrupted run's loss
    assert losses(text) == losses(reference[1])
    assert tracker(tmp_path) == str(TRAIN_ITERS)
    from megatron.logging_utils import read_scalars
    scalars = read_scalars(str(tmp_path / "run" / "tensorboard"))
    assert [s for s, _ in scalars["lm loss"]] == list(range(1, TRAIN_ITERS + 1))


def test_scontrol_requeue_resumes_from_latest_checkpoint(cluster, reference, tmp_path):
    job_id, log = submit(cluster, tmp_path, "gpt-requeue", "--save-interval", "10")
    # early in the run: at ~40 ms an iteration, the job must not end before the requeue lands
    wait_for_iteration(cluster, job_id, log, 12)
    cluster.run("scontrol", "requeue", str(job_id))
    release_requeued(cluster, job_id)
    text = finished(cluster, job_id, log)

    first, second = text.split(f"job {job_id} restart 1:")
    loaded = re.search(r"loading checkpoint from \S+ at iteration (\d+)", second)
    assert loaded, second[-6000:]
    resumed_from = int(loaded.group(1))
    saved = re.findall(r"successfully saved checkpoint at iteration\s+(\d+)", first)
    assert saved and resumed_from == int(saved[-1]), first[-6000:]  # the newest one
    assert 10 <= resumed_from < TRAIN_ITERS
    ref = dict(losses(reference[1]))
    assert losses(second) == [(i, ref[i]) for i in range(resumed_from + 1, TRAIN_ITERS + 1)]
    assert tracker(tmp_path) == str(TRAIN_ITERS)


@pytest.mark.parametrize("script", ["pretrain_gpt.sbatch", "pretrain_gpt_cpu.sbatch"])
def test_run_outside_slurm_says_to_submit_it(script, tmp_path):
    """`bash scripts/slurm/...sbatch` without Slurm used to stop at `set -u` with
    'SLURM_JOB_NODELIST: unbound variable'; now it says what the script is and what to run."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["REPO"] = str(ROOT)  # where the CPU variant finds the main script
    proc = subprocess.run(["bash", str(SLURM_DIR / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "is a Slurm batch script" in proc.stderr and "submit it with sbatch" in proc.stderr
    assert "unbound variable" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # stopped before making any directory


@pytest.mark.parametrize("script", ["pretrain_gpt.sbatch", "pretrain_gpt_cpu.sbatch"])
def test_submitted_from_outside_the_checkout_says_where_to_submit(script, tmp_path):
    """sbatch from another directory: REPO defaults to the submit directory, which holds
    no pretrain_gpt.py. The main script failed in every rank ('can't open file
    pretrain_gpt.py') after srun and torchrun started; the CPU variant with bash's 'No such
    file or directory' (127). Both now stop at once (status 2), saying to submit from the
    checkout or set REPO. Slurm's variables are faked: nothing reaches srun."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "REPO"}
    env.update(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node1", SLURM_SUBMIT_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(SLURM_DIR / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "submit from the repository root" in proc.stderr
    assert "or set REPO=/path/to/checkout" in proc.stderr
    assert not (tmp_path / "runs").exists()


def _fake_slurm_job(tmp_path, extra, hostnames: str = "localhost", **env_vars):
    """pretrain_gpt.sbatch run with stand-ins for srun (records its arguments) and
    scontrol (`show hostnames` prints `hostnames`) on PATH, under a faked job
    environment; the finished process."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\nprintf '{hostnames}'\n")
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SRUN_ARGS=str(tmp_path / "srun_args"),
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1",
               REPO=str(ROOT), DEVICE="cpu", RUN_DIR=str(tmp_path / "run"))
    env.update(env_vars)
    return subprocess.run(["bash", str(SLURM_DIR / "pretrain_gpt.sbatch"), *extra], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=30)


def _fake_slurm_command_line(tmp_path, extra, **env_vars) -> list:
    """The pretrain_gpt.py command line pretrain_gpt.sbatch builds (`_fake_slurm_job`)."""
    proc = _fake_slurm_job(tmp_path, extra, **env_vars)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun_args").read_text().splitlines()
    return args[args.index("pretrain_gpt.py") + 1:]


def test_data_given_after_the_script_or_in_config_is_not_mixed_with_mock_data(tmp_path):
    """Without DATA_PATH the script passed --mock-data, so a --data-path after the script
    name (where README says extra flags go) or in the CONFIG file stopped every run with
    '--mock-data and --data-path/--train-data-path are exclusive'."""
    assert "--mock-data" in _fake_slurm_command_line(tmp_path, [])
    args = _fake_slurm_command_line(tmp_path, ["--data-path", "/data/c_text_document"])
    assert "--mock-data" not in args and args[-2:] == ["--data-path", "/data/c_text_document"]
    assert "--mock-data" not in _fake_slurm_command_line(tmp_path, ["--train-data-path=/d/t"])
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\ndata_path: [/data/c_text_document]\n")
    args = _fake_slurm_command_line(tmp_path, [], CONFIG=str(config))
    assert "--mock-data" not in args and args[:2] == ["--config", str(config)]
    args = _fake_slurm_command_line(tmp_path, [], DATA_PATH="0.5 /a 0.5 /b")
    assert args[:6] == ["--data-path", "0.5", "/a", "0.5", "/b", "--split"]


def test_tokenizer_of_the_config_is_not_overridden_by_the_script(tmp_path):
    """TOKENIZER_TYPE unset: the script passed --tokenizer-type GPT2BPETokenizer, which beat
    a CONFIG's tokenizer-type (a SentencePiece preset then asked for GPT-2's vocab files)."""
    config = tmp_path / "run.yaml"
    config.write_text("tokenizer-type: SentencePieceTokenizer\n")
    assert "--tokenizer-type" not in _fake_slurm_command_line(tmp_path, [], CONFIG=str(config))
    args = _fake_slurm_command_line(tmp_path, [], TOKENIZER_TYPE="NullTokenizer",
                                    VOCAB_SIZE="512")
    assert args[args.index("--tokenizer-type") + 1] == "NullTokenizer"


def test_save_interval_and_split_of_the_config_are_not_overridden_by_the_script(tmp_path):
    """SAVE_INTERVAL and SPLIT unset: the script's defaults (1000, 969,30,1) beat the CONFIG
    file's save-interval and split without a word."""
    config = tmp_path / "run.yaml"
    config.write_text("save_interval: 250\nsplit: 90,10,0\n")
    args = _fake_slurm_command_line(tmp_path, [], CONFIG=str(config), DATA_PATH="/d/c")
    assert "--save-interval" not in args and "--split" not in args
    args = _fake_slurm_command_line(tmp_path, [], DATA_PATH="/d/c")
    assert args[args.index("--split") + 1] == "969,30,1"
    for env, expected in (({}, "1000"), ({"SAVE_INTERVAL": "50", "CONFIG": str(config)}, "50")):
        args = _fake_slurm_command_line(tmp_path, [], **env)
        assert args[args.index("--save-interval") + 1] == expected


@pytest.mark.parametrize("hostnames, env", [
    ("node01\\nnode02\\n", {"SLURM_JOB_NODELIST": "node[01-02]"}),  # no DNS name
    ("node]\\n", {"SLURM_JOB_NODELIST": "node[01-"}),  # what scontrol makes of it
    ("", {"SLURM_JOB_NODELIST": "node[02-01]"}),  # scontrol: Invalid hostlist, status 0
    ("localhost\\n", {"MASTER_ADDR": "no-such-host.invalid"}),
])
def test_a_rendezvous_host_that_does_not_resolve_stops_the_job_at_once(tmp_path, hostnames,
                                                                       env):
    """The first node's name (or MASTER_ADDR) that does not resolve: every node's torchrun
    retried it for minutes with only c10d's `cannot be retrieved` warnings (an empty one:
    torchrun's ValueError traceback on each node). The script stops before srun
    (status 2), naming the name, the node list and the fix."""
    proc = _fake_slurm_job(tmp_path, [], hostnames=hostnames, SLURM_NNODES="2", **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    name = env.get("MASTER_ADDR", hostnames.split("\\n")[0])
    assert f"error: the rendezvous host MASTER_ADDR='{name}'" in proc.stderr
    assert "does not resolve" in proc.stderr and "set MASTER_ADDR" in proc.stderr
    assert env.get("SLURM_JOB_NODELIST", "localhost") in proc.stderr
    assert not (tmp_path / "srun_args").exists()  # srun never ran
