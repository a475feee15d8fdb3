"""In-process use: pretrain_gpt.main called several times in one Python process (a notebook,
a REPL), after failed calls, from a thread, with a process group the caller made.

The calls run in one child process (a fresh interpreter, as a notebook's kernel is), which
reports what it saw as JSON: each call's losses and exit, and the process-wide settings
before and after (environment, signal handlers, warnings hooks and filters, torch's global
settings, the process group)."""
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.process_state import run_calls

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import contextlib, io, json, logging, os, re, signal, sys, tempfile, threading, time
    sys.path.insert(0, {root!r})
    HERE = os.path.dirname(os.path.abspath(__file__))  # the test's tmp directory, not /tmp

    from tests.process_state import state

    before_import = state()
    import megatron, megatron.training  # noqa: F401
    after_import = state()
    import torch, torch.distributed as dist
    import pretrain_gpt
    ARGS = {args!r}
    calls, OUT = {{}}, [""]

    def call(name, extra=(), forward=None):
        out, orig = io.StringIO(), torch.nn.Module.__call__
        if forward is not None:
            torch.nn.Module.__call__ = forward(orig)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result = pretrain_gpt.main(ARGS + list(extra))
        except BaseException as e:
            result = type(e).__name__ + ": " + str(e if not isinstance(e, SystemExit)
                                                    else e.code)
        finally:
            torch.nn.Module.__call__ = orig
        OUT[0] = out.getvalue()
        calls[name] = dict(result=result, losses=re.findall(r"lm loss: (\\S+) ", OUT[0]),
                           state=state())

    def failing_at_second_forward(error):
        def patch(orig):
            count = [0]
            def forward(self, *a, **k):
                if type(self).__name__ == "GPTModel":
                    count[0] += 1
                    if count[0] == 2:
                        raise error
                return orig(self, *a, **k)
            return forward
        return patch

    def signalled_at_second_forward(orig):
        count = [0]
        def forward(self, *a, **k):
            if type(self).__name__ == "GPTModel":
                count[0] += 1
                if count[0] == 2:  # noted by --exit-signal-handler's handler
                    os.kill(os.getpid(), signal.SIGTERM)
            return orig(self, *a, **k)
        return forward

    before = state()
    call("first")
    call("second")
    call("bad_flag", ["--no-such-flag"])
    call("raises", forward=failing_at_second_forward(RuntimeError("forward failed")))
    call("keyboard", forward=failing_at_second_forward(KeyboardInterrupt()))
    call("after_failures")
    call("sigterm", ["--exit-signal-handler"], forward=signalled_at_second_forward)
    calls["sigterm"]["stopped"] = "exiting program after receiving SIGTERM" in OUT[0]
    import megatron.checkpointing as checkpointing
    real_save, sent = checkpointing._torch_save_synced, []

    def save_interrupted(*a, **k):  # Ctrl-C while the background writer writes
        if threading.current_thread().name == "checkpoint-writer" and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # still writing when the main thread stops
        return real_save(*a, **k)

    checkpointing._torch_save_synced = save_interrupted
    save_dir = tempfile.mkdtemp(prefix="inproc_save_", dir=HERE)
    call("ctrl_c_writing", ["--save", save_dir, "--save-interval", "4", "--async-save"])
    checkpointing._torch_save_synced = real_save
    calls["ctrl_c_writing"]["said"] = re.findall(r"^(interrupted .*|waiting .*)$", OUT[0], re.M)
    calls["ctrl_c_writing"]["saved"] = sorted(os.listdir(save_dir))
    thread = threading.Thread(target=call, args=("thread", ["--exit-signal-handler"]))
    thread.start()
    thread.join()
    store = tempfile.mktemp(prefix="inproc_store_", dir=HERE)
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    call("caller_group")
    group_alive = dist.is_initialized()
    if group_alive:
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.destroy_process_group()
    print(json.dumps(dict(before_import=before_import, after_import=after_import,
                          before=before, calls=calls, group_alive=group_alive)))
""")

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "10",
        "--log-interval", "1", "--eval-iters", "0", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    script = tmp_path_factory.mktemp("inproc") / "calls.py"
    script.write_text(CHILD.format(root=str(ROOT), args=ARGS))
    return run_calls(script, 300)


def test_import_changes_nothing(report):
    """`import megatron, megatron.training` sets no environment variable, installs no
    signal handler or warnings hook and starts no thread."""
    before, after = report["before_import"], report["after_import"]
    for key in ("env", "threads", "signals", "excepthook", "formatwarning", "showwarning",
                "our_filters", "root_handlers", "dtype", "num_threads", "deterministic"):
        assert after[key] == before[key], key


def test_second_call_repeats_the_first_bitwise(report):
    first, second = report["calls"]["first"], report["calls"]["second"]
    assert first["result"] == 0 and second["result"] == 0
    assert len(first["losses"]) == 10
    assert second["losses"] == first["losses"]  # printed to 7 significant digits


def test_each_call_leaves_the_process_as_it_found_it(report):
    """Environment variables (TORCH_GLOO_LAZY_INIT and the cuBLAS workspace setting used
    to stay), threads, signal handlers, warnings hooks and filters, torch's settings, no
    process group."""
    before = report["before"]
    for name, call in report["calls"].items():
        if name == "caller_group":  # the caller's group (and torch's excepthook) stay
            continue
        for key, value in before.items():
            if not (key == "threads" and name == "thread"):  # (seen from that thread)
                assert call["state"][key] == value, (name, key)


def test_failed_calls_leave_a_good_call_unchanged(report):
    calls = report["calls"]
    assert calls["bad_flag"]["result"] == "ArgumentsError: 2"
    assert calls["raises"]["result"] == "RuntimeError: forward failed"
    assert calls["keyboard"]["result"].startswith("KeyboardInterrupt")
    assert calls["after_failures"]["losses"] == calls["first"]["losses"]


def test_a_signal_noted_in_one_call_is_forgotten_for_the_next(report):
    """A SIGTERM that --exit-signal-handler noted stops that call's training; the process
    then forgets it (megatron.signals noted it for the process's lifetime, and a later
    call under a launcher skipped its wait for the rank that prints an error)."""
    call = report["calls"]["sigterm"]
    assert call["result"] == 0 and call["stopped"]
    assert len(call["losses"]) < 10
    assert call["state"]["noted_signal"] == 0
    assert report["calls"]["thread"]["state"]["noted_signal"] == 0


def test_ctrl_c_while_the_background_writer_writes_returns_130_to_the_caller(report):
    """The command line exits at once (os._exit(130)) when Ctrl-C comes while an
    --async-save writer still writes, which ended the caller's process (a notebook's
    kernel): in-process the call waits for the writer, returns 130 and leaves no thread;
    the abandoned save is never published."""
    call = report["calls"]["ctrl_c_writing"]
    assert call["result"] == 130, call
    assert len(call["said"]) == 2 and call["said"][0].startswith(
        "interrupted ") and "the background save of the checkpoint at iteration 4" in \
        call["said"][0], call["said"]
    assert call["said"][1].startswith("waiting for the background checkpoint writer to stop")
    assert "latest_checkpointed_iteration.txt" not in call["saved"], call["saved"]
    assert not any(name.startswith("iter_0000004") and not name.endswith(".tmp")
                   for name in call["saved"]), call["saved"]


def test_exit_signal_handler_outside_the_main_thread_is_refused_clearly(report):
    result = report["calls"]["thread"]["result"]
    assert result.startswith("ValueError: --exit-signal-handler needs the main thread"), result
    assert "drop --exit-signal-handler" in result


def test_a_group_the_caller_made_is_used_and_left_alive(report):
    call = report["calls"]["caller_group"]
    assert call["result"] == 0
    assert call["losses"] == report["calls"]["first"]["losses"]
    assert report["group_alive"]


@pytest.fixture
def caller_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_caller_group_of_another_size_is_refused(caller_group):
    from megatron.initialize import check_caller_group

    check_caller_group(0, 1)
    with pytest.raises(SystemExit, match=r"rank 0 of 1, but the launcher's environment "
                                         r"says rank 0 of 2 .*destroy_process_group"):
        check_caller_group(0, 2)
    assert torch.ones(1).sum() == 1 and dist.is_initialized()
