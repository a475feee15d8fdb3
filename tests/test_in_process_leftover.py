"""In-process use after a run that left its process group alive on purpose (another rank's
failure, an interrupt, out of memory: its teardown could wait for ranks still in a
collective). The next call in that process must not take that group for one its caller
made: at world size 1 it is destroyed first and the call trains as a fresh process does;
with several ranks it is refused with a line naming it and the fix.

Two child processes (rank 0 and rank 1 of a gloo group, no launcher): rank 1 dies at its
second forward, so rank 0's call stops with the peer's failure and leaves the group. They
are forked from the test process (tests/forked_script.py), which has their imports."""
import contextlib
import json
import signal
import sys
import textwrap
from pathlib import Path

from tests import forked_script
from tests.dist_utils import cpu_env, free_port
from tests.test_in_process import ARGS

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import contextlib, io, json, os, re, sys
    sys.path.insert(0, {root!r})
    import torch, torch.distributed as dist
    import pretrain_gpt
    RANK, ARGS, WORLD = int(sys.argv[1]), {args!r}, {world!r}
    calls = {{}}

    def call(name, forward=None):
        out, orig = io.StringIO(), torch.nn.Module.__call__
        if forward is not None:
            torch.nn.Module.__call__ = forward(orig)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result = pretrain_gpt.main(ARGS)
        except BaseException as e:
            result = type(e).__name__ + ": " + str(e.code if isinstance(e, SystemExit) else e)
        finally:
            torch.nn.Module.__call__ = orig
        calls[name] = dict(result=result, out=out.getvalue()[-3000:],
                           losses=re.findall(r"lm loss: (\\S+) ", out.getvalue()),
                           group=dist.is_initialized(),
                           said=re.findall(r"^destroying .*$", out.getvalue(), re.M))

    def dies_at_second_forward(orig):
        count = [0]
        def forward(self, *a, **k):
            if type(self).__name__ == "GPTModel":
                count[0] += 1
                if count[0] == 2:
                    os._exit(1)  # a rank lost mid-step
            return orig(self, *a, **k)
        return forward

    if RANK == 0:
        call("alone_before")
    os.environ.update(WORLD, RANK=str(RANK))
    call("world_2", forward=dies_at_second_forward if RANK == 1 else None)
    call("world_2_again")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    call("alone_after")
    print(json.dumps(calls))
""")


def _fork_ranks(script: Path, env: dict) -> list:
    """`python script 0` and `python script 1`, forked from this process
    (tests/forked_script.py: their imports come free), their output captured."""
    return [forked_script.Forked([sys.executable, str(script), str(rank)], env, cwd=ROOT)
            for rank in (0, 1)]


def _kill_running(procs: list) -> None:
    for p in procs:
        with contextlib.suppress(ChildProcessError):  # one a timed-out wait killed and reaped
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(60)


def test_a_group_left_by_an_earlier_call_is_not_taken_for_the_callers(tmp_path):
    world = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    script = tmp_path / "calls.py"
    script.write_text(CHILD.format(root=str(ROOT), args=ARGS, world=world))
    env = cpu_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCH_GLOO_LAZY_INIT", "CUBLAS_WORKSPACE_CONFIG"):
        env.pop(name, None)
    procs = _fork_ranks(script, env)
    try:
        procs[0].wait(240)
        procs[1].wait(60)
    finally:
        _kill_running(procs)
    out, err = procs[0].stdout, procs[0].stderr
    assert procs[0].returncode == 0, err[-3000:]
    assert procs[1].returncode == 1  # died at its second forward
    calls = json.loads(out.strip().splitlines()[-1])
    stopped = calls["world_2"]
    assert stopped["result"].startswith("SystemExit: [rank 0] stopped at iteration 1: a "
                                        "collective failed"), stopped["result"]
    assert stopped["group"]  # left alive on purpose
    again = calls["world_2_again"]["result"]
    assert again.startswith("SystemExit: error: the process group (rank 0 of 2) is one that "
                            "an earlier run in this process left alive"), again
    assert "destroy_process_group()" in again and "relaunch torchrun" in again
    after, before = calls["alone_after"], calls["alone_before"]
    assert after["result"] == 0, after["out"]
    assert after["said"] == ["destroying the process group (rank 0 of 2) that an earlier run "
                             "in this process left after it stopped"], after["said"]
    assert len(before["losses"]) == 10 and after["losses"] == before["losses"]
    assert not after["group"]


ZEROSHOT_CHILD = textwrap.dedent("""
    import contextlib, io, json, os, sys
    sys.path.insert(0, {root!r})
    import torch.distributed as dist
    from tasks.zeroshot_gpt import evaluate
    RANK, ARGV = int(sys.argv[1]), {argv!r}
    seen = {{}}
    with contextlib.redirect_stdout(io.StringIO()):
        if RANK == 0:
            seen["alone"] = evaluate.main(ARGV)
        os.environ.update(RANK=str(RANK))
        seen["world_2"] = evaluate.main(ARGV, RANK, 2, RANK, os.environ)
    seen["group_after"] = dist.is_initialized()
    print(json.dumps(seen))
""")


def test_zero_shot_evaluate_main_ends_the_group_it_made(tmp_path):
    """tasks/zeroshot_gpt/evaluate.main called as a library function at world size 2
    (no group made before) ends the group it made, as tasks/main.py's main does; its
    numbers are a one-process call's."""
    from tests.test_zeroshot import NULL

    (tmp_path / "l.jsonl").write_text('{"text": "1 2 3 4 5"}\n{"text": "6 7 8 9"}\n')
    argv = ["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl")] + NULL + [
        "--global-batch-size", "4", "--use-cpu-initialization"]
    script = tmp_path / "zeroshot.py"
    script.write_text(ZEROSHOT_CHILD.format(root=str(ROOT), argv=argv))
    env = cpu_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    procs = _fork_ranks(script, env)
    try:
        for p in procs:
            p.wait(180)
    finally:
        _kill_running(procs)
    outs = [(p.stdout, p.stderr) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert seen[0]["world_2"] == seen[1]["world_2"] == seen[0]["alone"], seen
    assert seen[0]["alone"]["num_examples"] == 2
    assert not seen[0]["group_after"] and not seen[1]["group_after"]
