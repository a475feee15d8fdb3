"""The training loop's Megatron behaviours, in one process through `pretrain()`:

* an exit condition (--exit-interval, a signal with --exit-signal-handler,
  --exit-duration-in-mins counted from the process start) saves, prints the exit line and
  ends the program there: no "[after training is done]", no final evaluation;
* iteration lines only every --log-interval (none for a last or exit iteration off it),
  while TensorBoard still gets every --tensorboard-log-interval iteration, params-norm too;
* at the end the validation set, then the test set (also with --skip-train, then without
  TensorBoard scalars);
* the level-0 timers (setup, load-checkpoint, save-checkpoint) and the level-2
  forward-compute / backward-compute timers in Megatron's block format.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import re
import shutil
import signal
import threading
import time
import types

import pytest
import torch

import megatron.training as training
from megatron.arguments import parse_and_validate, run_dry_run
from megatron.checkpointing import read_tracker
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.initialize import initialize_distributed, set_random_seed
from megatron.logging_utils import read_scalars
from tests.test_gpt_dataset import make_corpus
from tests.test_logging_utils import _CountingStream
from tests.test_save_lock import _backdate

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--tokenizer-type NullTokenizer --vocab-size 256 --eval-interval 5 --eval-iters 2 "
    "--num-workers 0 --use-cpu-initialization"
).split()
MOCK = BASE + ["--mock-data"]


def _pretrain(argv, capsys, process_start_time=None, base=MOCK):
    """(stdout, trainer) of one run of `pretrain()` as pretrain_gpt.py runs it."""
    cfg = parse_and_validate(base + list(argv), world_size=1, env={"RANK": "0"},
                             cuda_available=False)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    kwargs = {} if process_start_time is None else {"process_start_time": process_start_time}
    tr = training.pretrain(cfg, rt, **kwargs)
    return capsys.readouterr().out, tr


def _logged_iterations(out: str) -> list:
    return [int(i) for i in re.findall(r"^ iteration\s+(\d+)/", out, re.M)]


def _final_blocks(out: str) -> list:
    return re.findall(r"validation loss at iteration (\d+) on (\d+)-sample draw from (\w+) set",
                      out)


def test_parameter_count_line_is_one_write(monkeypatch):
    """Every tensor/pipeline rank prints its parameter count: written as text, then
    newline, two ranks' lines ran together on one line under torchrun."""
    import sys

    cfg = parse_and_validate(MOCK + ["--train-iters", "1"], world_size=1, env={"RANK": "0"},
                             cuda_available=False)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    stream = _CountingStream()
    monkeypatch.setattr(sys, "stdout", stream)
    training.build_model(cfg, rt)
    lines = [w for w in stream.writes if "number of parameters" in w]
    assert len(lines) == 1 and re.fullmatch(
        r" > number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): "
        r"\d+\n", lines[0]), stream.writes


# --------------------------------------------------------------------------- exits
def test_exit_interval_saves_prints_and_ends_the_program(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    out, tr = _pretrain(["--train-iters", "10", "--log-interval", "2", "--exit-interval", "3",
                         "--save", ck, "--save-interval", "100"], capsys)
    assert read_tracker(ck) == (3, False)
    assert out.rstrip().splitlines()[-1].startswith("[exiting program at iteration 3] datetime: ")
    assert tr.exit_reason == "[exiting program at iteration 3]"
    assert "[after training is done]" not in out and not _final_blocks(out)
    assert _logged_iterations(out) == [2]  # no line for the exit iteration 3


def test_save_dir_with_later_checkpoints_warns_at_startup(tmp_path, capsys):
    """A restart that forgot --load (or a --finetune into the same --save) starts at
    iteration 0 and its first save points the tracker back: said before training, not
    found out at the next resume. A resume with --load is silent."""
    ck = str(tmp_path / "ck")
    flags = ["--train-iters", "10", "--eval-iters", "0", "--save", ck, "--save-interval", "2"]
    _pretrain(flags + ["--exit-interval", "4"], capsys)
    out, _ = _pretrain(flags + ["--exit-interval", "2"], capsys)
    assert (f"WARNING: --save {ck} already holds checkpoints up to iteration 4 (its "
            "latest_checkpointed_iteration.txt), and this run starts at iteration 0") in out
    assert f"To resume instead, pass --load {ck}" in out
    assert read_tracker(ck) == (2, False)  # what the warning announced
    out, _ = _pretrain(flags + ["--exit-interval", "4", "--load", ck], capsys)
    assert "already holds checkpoints" not in out


def test_a_requeued_finetune_is_told_to_drop_finetune_to_resume(tmp_path, capsys):
    """A fine-tuning job requeued with its command line (--load BASE --finetune, or --load
    = --save --finetune) restarts at iteration 0; the warning said 'pass --load SAVE',
    which with --finetune kept restarts at 0 again."""
    base, ck = str(tmp_path / "base"), str(tmp_path / "ck")
    flags = ["--train-iters", "10", "--eval-iters", "0", "--save-interval", "2"]
    _pretrain(flags + ["--save", base, "--exit-interval", "2"], capsys)
    tune = flags + ["--save", ck, "--finetune", "--exit-interval", "4"]
    _pretrain(tune + ["--load", base], capsys)
    for load in (base, ck):
        out, _ = _pretrain(tune + ["--load", load], capsys)
        assert (f"To resume instead, pass --load {ck} without --finetune (which restarts at "
                "iteration 0 from any --load); to keep both") in out, load


def test_unfinished_saves_in_the_save_dir_are_removed_at_startup(tmp_path, capsys,
                                                                  monkeypatch):
    """A save killed mid-write (SIGKILL after a preemption's grace time, an async save's
    writer dying) leaves iter_N.tmp; a restart that never saves iteration N again kept it
    for good, with a warning at every start. The run holds --save's lock (no other run
    writes there), so it removes it with one line; where the file system cannot lock, it
    only warns (another run may be writing it). A live run holding the lock:
    tests/test_save_lock.py."""
    from megatron import save_lock

    ck = tmp_path / "ck"
    flags = ["--train-iters", "10", "--eval-iters", "0", "--save", str(ck), "--save-interval",
             "2", "--load", str(ck)]
    _pretrain(flags + ["--exit-interval", "2"], capsys)

    def stale(name):
        (ck / name / "mp_rank_00").mkdir(parents=True)
        (ck / name / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x" * 1024)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    stale("iter_0000003.tmp")
    with monkeypatch.context() as m:  # no locks: kept
        m.setattr(save_lock.fcntl, "flock", no_locks)
        out, _ = _pretrain(flags + ["--exit-interval", "4"], capsys)
    assert (f"WARNING: --save {ck} holds iter_0000003.tmp: unfinished checkpoint save(s) of a "
            "process killed while writing (0.00 GiB); nothing loads them, but --save's file "
            "system does not lock files, so another run may be writing them") in out
    assert (ck / "iter_0000003.tmp").is_dir() and read_tracker(str(ck)) == (4, False)
    stale("release.tmp")
    for name in ("iter_0000003.tmp", "release.tmp"):  # nothing written lately: see
        _backdate(ck / name, 601)  # tests/test_save_lock.py for one written to lately
    out, _ = _pretrain(flags + ["--exit-interval", "6"], capsys)
    removed = [line for line in out.splitlines() if line.startswith("removed ")]
    assert removed == [f"removed iter_0000003.tmp, release.tmp from --save {ck} (0.00 GiB): "
                       "unfinished checkpoint save(s) of an earlier run, stopped while writing "
                       "them or before moving them into place; nothing loads them, this run "
                       "holds the directory's save lock and nothing was written to them for "
                       "600 s, so no other run is writing them"]
    assert "WARNING: --save" not in out
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                      "latest_checkpointed_iteration.txt"]
    out, _ = _pretrain(flags + ["--exit-interval", "8"], capsys)
    assert "unfinished checkpoint save" not in out


def test_copies_an_interrupted_replace_left_in_the_save_dir_are_reported_at_startup(
        tmp_path, capsys):
    """iter_N.old is what a re-save of N moved aside: beside iter_N a leftover of the
    checkpoint's size, without it the only copy of N. Nothing said so (only .tmp was
    reported); the only copy of an iteration the tracker does not name stays unloaded."""
    ck = tmp_path / "ck"
    flags = ["--train-iters", "10", "--eval-iters", "0", "--save", str(ck), "--save-interval",
             "2", "--load", str(ck)]
    _pretrain(flags + ["--exit-interval", "4"], capsys)
    shutil.copytree(ck / "iter_0000004", ck / "iter_0000004.old")  # stopped after the move
    os.rename(ck / "iter_0000002", ck / "iter_0000002.old")  # stopped before it
    out, _ = _pretrain(flags + ["--exit-interval", "6"], capsys)
    assert (f"WARNING: --save {ck} holds iter_0000004.old (0.00 GiB): the earlier copy of "
            "iter_0000004 that a save replaced before it was stopped; iter_0000004 is the "
            "complete new one, delete iter_0000004.old to free the space") in out
    assert (f"WARNING: --save {ck} holds iter_0000002.old, the only copy of iter_0000002 (a "
            f"save replacing it was stopped): `mv {ck / 'iter_0000002.old'} "
            f"{ck / 'iter_0000002'}` keeps it") in out
    assert (ck / "iter_0000002.old").is_dir(), "never removed: the only copy"


def test_megatron_event_lines_in_order(capsys):
    """pretrain_gpt.py prints Megatron-LM's `[<event>] datetime: YYYY-MM-DD HH:MM:SS `
    lines, which log parsers key on, in Megatron's order."""
    import pretrain_gpt

    assert pretrain_gpt.main(MOCK + ["--train-iters", "1", "--eval-iters", "0"]) == 0
    out = capsys.readouterr().out
    events = re.findall(r"^\[(.+)\] datetime: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d $", out, re.M)
    assert events == ["after megatron is initialized",
                      "after model, optimizer, and learning rate scheduler are built",
                      "after dataloaders are built", "before the start of training step",
                      "after training is done"]
    assert out.index("time to initialize megatron (seconds): ") < out.index("[after megatron")


def _event_line_after_a_slow_rank(rank: int, world: int, marker: str) -> tuple:
    """Rank 1 prints a line (as the last rank prints the final iteration line) 1.5 s
    late; rank 0 prints an event line at once. (rank 0's output, whether rank 1's line
    was out when rank 0 printed)."""
    import contextlib
    import io

    if rank == 1:
        time.sleep(1.5)
        with open(marker, "w") as f:
            f.write("iteration 3/3\n")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        training.print_datetime("after training is done")
    return buf.getvalue(), os.path.exists(marker)


def test_an_event_line_waits_for_every_rank(tmp_path):
    """Megatron's print_datetime is a barrier, then rank 0's line: "[after training is
    done]" never comes before the last rank's final iteration line in the job's output.
    Without the barrier rank 0 printed it while the last rank was still logging (seen at
    tp2pp2 and dp4 under torchrun: the line came before the final iteration line)."""
    from tests.dist_utils import run_distributed

    marker = str(tmp_path / "rank1_line")
    (out0, seen0), (out1, _) = run_distributed(_event_line_after_a_slow_rank, 2, marker)
    assert re.fullmatch(r"\[after training is done\] datetime: \S+ \S+ \n", out0), out0
    assert out1 == ""  # rank 0 only
    assert seen0, "rank 0 printed the event line before rank 1's earlier line was out"


def test_training_is_done_before_the_final_save(tmp_path, capsys):
    """Megatron prints `[after training is done]` when the loop ends, then saves the
    final checkpoint, then evaluates: the datetime line marks the end of the training
    steps, not of the save."""
    ck = str(tmp_path / "ck")
    out, _ = _pretrain(["--train-iters", "3", "--log-interval", "1", "--save", ck,
                        "--save-interval", "2"], capsys)
    done = out.index("[after training is done]")
    assert out.index("saving checkpoint at iteration       2") < done
    assert done < out.index("saving checkpoint at iteration       3") < out.index(
        "from validation set")


def test_sigterm_ends_the_program_with_status_0(tmp_path, capsys, monkeypatch):
    import pretrain_gpt

    ck = str(tmp_path / "ck")
    original = training.train_step

    def step_then_sigterm(tr, data, **kwargs):
        if tr.state.iteration == 3:  # arrives during iteration 4
            os.kill(os.getpid(), signal.SIGTERM)
        return original(tr, data, **kwargs)

    monkeypatch.setattr(training, "train_step", step_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    assert pretrain_gpt.main(MOCK + ["--train-iters", "100", "--log-interval", "3",
                                     "--exit-signal-handler", "--save", ck, "--save-interval", "1000"]) == 0
    out = capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) == before, "the handler is removed again"
    assert read_tracker(ck) == (4, False)
    assert out.rstrip().splitlines()[-1].startswith(
        "[exiting program after receiving SIGTERM.] datetime: ")
    assert "[after training is done]" not in out and not _final_blocks(out)
    assert _logged_iterations(out) == [3]
    assert "without saving" not in out  # --save is set: no warning


def test_exit_duration_counts_from_the_process_start(capsys):
    out, tr = _pretrain(["--train-iters", "10", "--log-interval", "3",
                         "--exit-duration-in-mins", "1"], capsys,
                        process_start_time=time.time() - 61.0)
    assert tr.state.iteration == 1, "the first check already finds more than a minute"
    assert re.search(r"^\[exiting program after 1\.0\d* minutes\] datetime: ", out, re.M)
    assert "[after training is done]" not in out and not _final_blocks(out)
    assert _logged_iterations(out) == []  # iteration 1 is off --log-interval 3


def test_signal_handler_without_save_warns_at_startup(capsys, caplog):
    """Warned by the flag checks (so by --dry-run too), once, before training starts."""
    out, _ = _pretrain(["--train-iters", "1", "--exit-signal-handler", "--eval-iters", "0"],
                       capsys)
    assert caplog.text.count("--exit-signal-handler without --save") == 1
    assert "--exit-signal-handler without --save" not in out


def test_a_stop_inside_the_run_still_tears_it_down(tmp_path, capsys, monkeypatch):
    """A SystemExit or an error inside the loop (a NaN stop, a startup check) used to skip
    the teardown: the signal handlers stayed installed, the TensorBoard writer unclosed
    (its queued events unwritten), and the loaders ran on."""
    def stop(tr, *loaders):
        tr.tb.log_training(1, 8, 1e-3, 8, {"lm loss": 4.5}, 1.0, None, None, None, 1)
        raise SystemExit("stopped inside the run")

    monkeypatch.setattr(training, "_train_and_evaluate", stop)
    before = signal.getsignal(signal.SIGTERM)
    threads = set(threading.enumerate())
    tb = str(tmp_path / "tb")
    with pytest.raises(SystemExit, match="stopped inside the run"):
        _pretrain(["--train-iters", "4", "--exit-signal-handler", "--tensorboard-dir", tb,
                   "--tensorboard-queue-size", "1000"], capsys)
    assert signal.getsignal(signal.SIGTERM) is before
    assert read_scalars(tb)["lm loss"] == [(1, 4.5)]
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) <= threads



def test_a_load_that_stops_the_setup_still_tears_it_down(tmp_path, capsys):
    """A --load that does not fit the run stops it inside the setup, before the loop's
    teardown: the SIGTERM handler installed there stayed installed and the TensorBoard
    writer's thread ran on (a caller of pretrain() that goes on was left with both)."""
    ck = str(tmp_path / "ck")
    _pretrain(["--train-iters", "2", "--save", ck, "--save-interval", "2",
               "--eval-iters", "0"], capsys)
    before = signal.getsignal(signal.SIGTERM)
    threads = set(threading.enumerate())
    with pytest.raises(SystemExit, match="--hidden-size: checkpoint 32, this run 64"):
        _pretrain(["--train-iters", "4", "--load", ck, "--hidden-size", "64",
                   "--exit-signal-handler", "--tensorboard-dir", str(tmp_path / "tb")], capsys)
    assert signal.getsignal(signal.SIGTERM) is before
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) <= threads

# --------------------------------------------------------------------------- log lines
def test_iteration_lines_only_every_log_interval(tmp_path, capsys):
    tb = str(tmp_path / "tb")
    out, tr = _pretrain(["--train-iters", "10", "--log-interval", "3", "--eval-iters", "0",
                         "--tensorboard-dir", tb], capsys)
    assert _logged_iterations(out) == [3, 6, 9]
    scalars = read_scalars(tb)
    assert [s for s, _ in scalars["lm loss"]] == list(range(1, 11)), "10 still written"
    assert "[after training is done]" in out


def _count_params_norms(monkeypatch) -> list:
    calls = []
    original = MegatronOptimizer.get_params_norm

    def counting(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(MegatronOptimizer, "get_params_norm", counting)
    return calls


def test_params_norm_at_every_tensorboard_interval(tmp_path, capsys, monkeypatch):
    calls = _count_params_norms(monkeypatch)
    tb = str(tmp_path / "tb")
    out, _ = _pretrain(["--train-iters", "10", "--log-interval", "3", "--eval-iters", "0",
                        "--tensorboard-dir", tb, "--tensorboard-log-interval", "2",
                        "--log-params-norm"], capsys)
    scalars = read_scalars(tb)
    assert [s for s, _ in scalars["params-norm"]] == [2, 4, 6, 8, 10]
    assert [s for s, _ in scalars["lm loss"]] == [2, 4, 6, 8, 10]
    assert len(calls) == 7, "taken at 2, 3, 4, 6, 8, 9, 10 only"
    printed = re.search(r"iteration\s+6/.* params norm: ([0-9.]+) \|", out).group(1)
    assert f"{dict(scalars['params-norm'])[6]:.3f}" == printed


def test_params_norm_only_at_log_lines_without_tensorboard(capsys, monkeypatch):
    calls = _count_params_norms(monkeypatch)
    out, _ = _pretrain(["--train-iters", "10", "--log-interval", "3", "--eval-iters", "0",
                        "--log-params-norm"], capsys)
    assert len(calls) == 3 and out.count(" params norm: ") == 3


# --------------------------------------------------------------------------- evaluation
def test_validation_then_test_set_at_the_end(tmp_path, capsys):
    tb = str(tmp_path / "tb")
    out, tr = _pretrain(["--train-iters", "4", "--eval-interval", "2", "--log-interval", "2",
                         "--tensorboard-dir", tb], capsys)
    assert _final_blocks(out) == [("4", "8", "validation"), ("4", "8", "test")]
    assert out.index("[after training is done]") < out.index("from validation set")
    assert tr.state.consumed_valid_samples == 3 * 8, "the test draw is not counted"
    # Megatron writes every evaluation, the test set's too, as `lm loss validation`
    steps = [s for s, _ in read_scalars(tb)["lm loss validation"]]
    assert steps == [2, 4, 4, 4]


def test_final_evaluation_reports_its_progress(capsys):
    """The final evaluation prints Megatron's 'Evaluating iter i/N' every --log-interval
    batches (it runs --eval-iters batches of each set in silence otherwise); the
    evaluations during training do not."""
    out, _ = _pretrain(["--train-iters", "5", "--log-interval", "2", "--eval-iters", "4"],
                       capsys)
    tail = out[out.index("[after training is done]"):]
    assert re.findall(r"^Evaluating iter (\d+)/(\d+)$", out, re.M) == [("2", "4"), ("4", "4")] * 2
    assert tail.index("Evaluating iter 4/4") < tail.index("from validation set")
    assert "validation loss at iteration 5 |" in out.split("[after training is done]")[0]


@pytest.mark.parametrize("split,blocks", [("80,10,10", ["validation", "test"]),
                                          ("90,10,0", ["validation"])])
def test_test_split_of_a_data_path(tmp_path, capsys, split, blocks):
    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 200, vocab=250)
    out, _ = _pretrain(["--train-iters", "2", "--log-interval", "1", "--data-path", prefix,
                        "--split", split, "--data-cache-path", str(tmp_path / "cache")],
                       capsys, base=BASE)
    assert [name for _, _, name in _final_blocks(out)] == blocks


def test_a_validation_split_without_documents_is_warned(tmp_path, capsys):
    """--eval-iters > 0 but --split gives validation no document (a small corpus, or a
    split like 100,0,0): the run says it will never evaluate, instead of staying silent."""
    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 3, vocab=250)
    out, _ = _pretrain(["--train-iters", "2", "--log-interval", "1", "--data-path", prefix,
                        "--data-cache-path", str(tmp_path / "cache")], capsys, base=BASE)
    assert ("WARNING: --split '969, 30, 1' leaves the validation split no documents of "
            "--data-path, so this run never evaluates; give the second --split number a share "
            f"of at least one document: with 3 documents in {prefix}, e.g. --split 969,200,1") in out
    assert not _final_blocks(out)
    out, _ = _pretrain(["--train-iters", "2", "--log-interval", "1", "--data-path", prefix,
                        "--data-cache-path", str(tmp_path / "cache"), "--eval-iters", "0"],
                       capsys, base=BASE)
    assert "never evaluates" not in out


def test_skip_train_evaluates_both_sets_without_tensorboard(tmp_path, capsys):
    tb = str(tmp_path / "tb")
    out, _ = _pretrain(["--train-iters", "4", "--skip-train", "--tensorboard-dir", tb], capsys)
    assert _final_blocks(out) == [("0", "8", "validation"), ("0", "8", "test")]
    assert "skipping training (--skip-train is on) ..." in out
    assert "lm loss validation" not in read_scalars(tb)
    # nothing to do at all (Megatron-LM ends as silently): said
    out, _ = _pretrain(["--skip-train", "--eval-iters", "0"], capsys)
    assert not _final_blocks(out)
    assert "WARNING: --skip-train with --eval-iters 0: nothing is evaluated either" in out


def _validation_values(out: str) -> list:
    return re.findall(r"validation loss at (.+?) \| lm loss value: (\S+)", out)


def test_skip_train_reads_the_validation_set_from_its_start(tmp_path, capsys):
    """--skip-train --load scores the first --eval-iters batches of the validation set,
    as Megatron does, not those after the checkpoint's consumed_valid_samples: the same
    weights give the same validation loss whatever evaluations their training ran."""
    ck = str(tmp_path / "ck")
    out, tr = _pretrain(["--train-iters", "4", "--eval-interval", "2", "--save", ck,
                         "--save-interval", "4"], capsys)
    in_training = _validation_values(out)  # iterations 2 and 4, then the final draw
    assert [p for p, _ in in_training[:2]] == ["iteration 2", "iteration 4"]
    path = os.path.join(ck, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    payload = torch.load(path, weights_only=True)
    assert payload["train_state"]["consumed_valid_samples"] == 16
    evaluated = []
    for consumed in (16, 0):  # the same weights, another validation counter
        payload["train_state"]["consumed_valid_samples"] = consumed
        torch.save(payload, path)
        out, _ = _pretrain(["--skip-train", "--load", ck], capsys)
        evaluated.append(_validation_values(out)[0])
    assert evaluated[0] == evaluated[1]
    assert evaluated[0][1] != in_training[2][1], "the final draw read samples 16..23"


def test_a_checkpoint_without_sample_counts_resumes_where_megatron_does(tmp_path, capsys):
    """A checkpoint past iteration 0 whose consumed-sample counters are 0 (an old or
    converted one) resumes, as in Megatron, after iteration x global batch training samples
    and (iteration // --eval-interval) x --eval-iters x global batch validation samples:
    the run goes on as the uninterrupted one (it read both sets from sample 0 again)."""
    ck = str(tmp_path / "ck")
    run = ["--train-iters", "6", "--eval-interval", "2", "--log-interval", "2"]
    whole, _ = _pretrain(run, capsys)
    _pretrain(run + ["--save", ck, "--save-interval", "4", "--exit-interval", "4"], capsys)
    path = os.path.join(ck, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    payload = torch.load(path, weights_only=True)
    assert payload["train_state"]["consumed_train_samples"] == 16
    payload["train_state"].update(consumed_train_samples=0, consumed_valid_samples=0)
    payload["args"].update(consumed_train_samples=0, consumed_valid_samples=0)
    torch.save(payload, path)
    note = ("the checkpoint at iteration 4 counts no consumed samples (an old or converted "
            "checkpoint): taking 16 training samples (its iterations x global batch 4) as "
            "consumed, as Megatron-LM does")
    cfg = parse_and_validate(MOCK + run + ["--load", ck], world_size=1, env={"RANK": "0"},
                             cuda_available=False)
    dry = capsys.readouterr().out if run_dry_run(cfg, 1) == 0 else ""
    assert f"\n  {note}\n" in dry and "resumes from iteration 4 (" in dry
    assert "), consumed samples 16\n" in dry
    out, tr = _pretrain(run + ["--load", ck], capsys)
    assert f" > {note}" in out
    assert tr.state.consumed_train_samples == 24 and tr.state.consumed_valid_samples == 32
    assert _validation_values(out) == _validation_values(whole)[2:]
    assert re.findall(r" lm loss: (\S+)", out) == re.findall(r" lm loss: (\S+)", whole)[2:]


def test_resume_with_fewer_eval_iters_than_the_validation_set_serves_stops_at_startup(
        tmp_path, capsys):
    """The validation set is sized from the current --eval-iters; consumed_valid_samples
    from the checkpoint. Resumed with fewer --eval-iters, the set (99 samples) is used up
    (160 consumed): a clear error before training, not a StopIteration at iteration 15."""
    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 200, vocab=250)
    ck = str(tmp_path / "ck")
    data = ["--data-path", prefix, "--split", "80,20,0", "--data-cache-path",
            str(tmp_path / "cache"), "--train-iters", "20", "--save", ck, "--save-interval",
            "100", "--log-interval", "5"]
    _pretrain(data + ["--eval-iters", "20", "--exit-interval", "10"], capsys, base=BASE)
    with pytest.raises(SystemExit, match=r"the validation set has 99 samples and 160 are "
                       r"already consumed .* the evaluation at iteration 15 would run out"):
        _pretrain(data + ["--eval-iters", "1", "--load", ck], capsys, base=BASE)
    assert "training ..." not in capsys.readouterr().out
    out, tr = _pretrain(data + ["--eval-iters", "20", "--load", ck], capsys, base=BASE)
    assert tr.state.iteration == 20 and tr.state.consumed_valid_samples == 400


@pytest.mark.parametrize("workers", ["0", "2"])
def test_pretrain_stops_its_loaders_when_it_returns(capsys, workers):
    """Each call of pretrain() used to leave its train/valid/test loaders running until the
    interpreter exited: a polling thread each, or --num-workers processes each (6 processes
    and 32 descriptors per call with 2 workers), growing with every call in one process."""
    threads = set(threading.enumerate())
    children = set(multiprocessing.active_children())  # earlier tests' in this process
    for _ in range(2):
        _pretrain(["--train-iters", "2", "--num-workers", workers], capsys)
        assert set(multiprocessing.active_children()) <= children
        # the loader's queue feeder threads end on their own just after the shutdown
        # (torch closes the queues without joining them): a leak outlives the grace time
        deadline = time.monotonic() + 5
        while not set(threading.enumerate()) <= threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(threading.enumerate()) <= threads


def test_memory_scalars_at_every_tensorboard_iteration(tmp_path, capsys, monkeypatch):
    """--log-memory-to-tensorboard writes the allocator's figures at each
    --tensorboard-log-interval iteration, as Megatron does (they were written only at the
    --log-interval iterations). CPU has no CUDA allocator: its statistics are faked."""
    from megatron import interval_log

    real = interval_log.memory_stats_due  # its conditions, run as on a CUDA device

    def fake(tr, iteration):
        tr_cuda = types.SimpleNamespace(tb=tr.tb, config=tr.config,
                                        rt=types.SimpleNamespace(device=torch.device("cuda")))
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "memory_stats",
                      lambda device: {"allocated_bytes.all.current": 1000 * iteration})
            return real(tr_cuda, iteration)

    monkeypatch.setattr(interval_log, "memory_stats_due", fake)
    tb = str(tmp_path / "tb")
    _pretrain(["--train-iters", "6", "--log-interval", "3", "--eval-iters", "0",
               "--tensorboard-dir", tb, "--tensorboard-log-interval", "2",
               "--log-memory-to-tensorboard"], capsys)
    assert read_scalars(tb)["mem-allocated-bytes"] == [(2, 2000.0), (4, 4000.0), (6, 6000.0)]


def test_memory_report_after_the_first_iteration_line(capsys, monkeypatch):
    """Megatron's one-off `[Rank r] (after N iterations) memory (MB) | ...` line follows the
    first iteration line with a learning rate above 0, from each data-parallel rank 0 (it
    was never printed). CUDA only: on CPU the device and the allocator are faked."""
    from megatron import interval_log

    real = interval_log.report_memory_once
    mib = 1024 * 1024

    def as_on_cuda(tr, stats, iteration, lr):
        rt = types.SimpleNamespace(device=torch.device("cuda"), ps=tr.rt.ps)
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            for name, mb in (("memory_allocated", 3), ("max_memory_allocated", 5),
                             ("memory_reserved", 8), ("max_memory_reserved", 13)):
                m.setattr(torch.cuda, name, lambda device=None, mb=mb: mb * mib)
            real(types.SimpleNamespace(rt=rt), stats, iteration, lr)

    monkeypatch.setattr(interval_log, "report_memory_once", as_on_cuda)
    out, _ = _pretrain(["--train-iters", "6", "--log-interval", "2", "--eval-iters", "0"],
                       capsys)
    lines = out.splitlines()
    reports = [i for i, line in enumerate(lines) if "memory (MB)" in line]
    assert [lines[i] for i in reports] == [
        "[Rank 0] (after 2 iterations) memory (MB) | allocated: 3.0 | max allocated: 5.0 | "
        "reserved: 8.0 | max reserved: 13.0"]
    assert lines[reports[0] - 2].startswith(" iteration        2/")


def test_memory_report_waits_for_a_learning_rate_and_needs_cuda(capsys):
    from megatron.interval_log import IntervalStats, report_memory_once

    ps = types.SimpleNamespace(dp_rank=0, rank=0)
    stats = IntervalStats()
    cpu = types.SimpleNamespace(rt=types.SimpleNamespace(device=torch.device("cpu"), ps=ps))
    report_memory_once(cpu, stats, 2, 1e-3)
    cuda = types.SimpleNamespace(rt=types.SimpleNamespace(device=torch.device("cuda"), ps=ps))
    report_memory_once(cuda, stats, 2, 0.0)  # fp16 warm-up steps skipped: lr still 0
    assert not stats.memory_reported and capsys.readouterr().out == ""


def test_timer_scalars_at_every_tensorboard_iteration(tmp_path, capsys):
    """--log-timers-to-tensorboard writes `<timer>-time` at each --tensorboard-log-interval
    iteration, as Megatron does (they were written only at iterations that are multiples of
    both --log-interval and --tensorboard-log-interval: 6 of 2, 4, 6, 8); `iteration-time`
    stays at the --log-interval iterations."""
    tb = str(tmp_path / "tb")
    _pretrain(["--train-iters", "9", "--log-interval", "3", "--eval-iters", "0",
               "--tensorboard-dir", tb, "--tensorboard-log-interval", "2",
               "--timing-log-level", "1", "--log-timers-to-tensorboard"], capsys)
    scalars = read_scalars(tb)
    for name in ("forward-backward-time", "optimizer-time"):
        assert [step for step, _ in scalars[name]] == [2, 4, 6, 8], name
        assert all(seconds > 0 for _, seconds in scalars[name]), name
    assert [step for step, _ in scalars["iteration-time"]] == [3, 6, 9]


@pytest.mark.parametrize("flags", [
    ["--initial-loss-scale", "1e9", "--min-loss-scale", "1e8", "--hysteresis", "1"],
    ["--loss-scale", "1e9"]])
def test_a_loss_scale_stuck_at_its_floor_is_warned_once(capsys, flags):
    """fp16 whose every step overflows at the smallest loss scale allowed (the dynamic one
    at --min-loss-scale, or a constant --loss-scale) never updates the model: one warning
    names the flag to lower (Megatron keeps skipping silently)."""
    out, tr = _pretrain(["--train-iters", "8", "--log-interval", "2", "--eval-iters", "0",
                         "--fp16"] + flags, capsys)
    assert tr.state.skipped_iters == 8
    assert out.count("WARNING: the optimizer skipped the step") == 1
    line = next(x for x in out.splitlines() if x.startswith("WARNING: the optimizer skipped"))
    assert ("--min-loss-scale 1e+08" in line) == ("--min-loss-scale" in flags)
    assert ("--loss-scale 1e+09" in line) == ("--loss-scale" in flags)


def test_loss_scale_floor_warning_rules():
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    from megatron.interval_log import loss_scale_floor_warning as warning

    dynamic = DynamicGradScaler(initial_scale=2.0**16, min_scale=0.1)
    assert warning(dynamic, float(torch.tensor(0.1)), 3, 3)  # float32 0.1 is the floor
    assert warning(dynamic, 0.2, 3, 3) is None  # may still back off
    assert warning(dynamic, 0.1, 2, 3) is None  # a step succeeded
    assert warning(ConstantGradScaler(1024.0), 1024.0, 3, 3)
    assert warning(None, 1.0, 3, 3) is None  # fp32 / bf16: no scaler


# --------------------------------------------------------------------------- timers
def _timer_block(out: str, names: list) -> bool:
    """Megatron's minmax block: header, then `    <name + ' ' dot-padded to 48>: (a, b)`."""
    rows = "".join(rf"\n    {re.escape((n + ' ').ljust(48, '.'))}: \(\d+\.\d\d, \d+\.\d\d\)"
                   for n in names)
    return re.search(r"^\(min, max\) time across ranks \(ms\):" + rows + "$", out, re.M) is not None


def test_level_0_timers_setup_save_and_load(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    out, _ = _pretrain(["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
                        "--save", ck, "--save-interval", "1"], capsys)
    assert _timer_block(out, ["model-and-optimizer-setup",
                              "train/valid/test-data-iterators-setup"])
    assert out.index("done with setup ...") < out.index("model-and-optimizer-setup")
    assert out.count("    save-checkpoint ") == 2 and _timer_block(out, ["save-checkpoint"])
    assert "load-checkpoint" not in out
    out, _ = _pretrain(["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
                        "--load", ck], capsys)
    assert _timer_block(out, ["load-checkpoint"])
    assert out.index("load-checkpoint") < out.index("model-and-optimizer-setup")


@pytest.mark.parametrize("level", [1, 2])
def test_forward_and_backward_compute_timers_at_level_2(capsys, level):
    out, _ = _pretrain(["--train-iters", "2", "--log-interval", "2", "--eval-iters", "0",
                        "--timing-log-level", str(level)], capsys)
    assert ("    forward-compute ." in out) == (level == 2)
    assert ("    backward-compute ." in out) == (level == 2)
    assert "    forward-backward ." in out


# --------------------------------------------------------------------------- interval time
def _per_iteration_ms(out: str) -> list:
    return [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", out)]


def test_elapsed_time_per_iteration_leaves_out_evaluation_and_saves(tmp_path, capsys,
                                                                    monkeypatch):
    """Megatron stops its interval timer around evaluation and checkpoint saves: a slow
    evaluation (or save) inside an interval does not inflate the training time per
    iteration. Here each one moves the interval's clock 1,000 s on: 200 s per iteration
    of a 5-iteration interval had it been counted."""
    import megatron.interval_log as interval_log

    offset = [0.0]
    monkeypatch.setattr(interval_log.IntervalStats, "clock",
                        staticmethod(lambda: time.time() + offset[0]))

    def slow(fn):
        def wrapped(*args, **kwargs):
            offset[0] += 1000.0
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(training, "run_evaluation", slow(training.run_evaluation))
    monkeypatch.setattr(training.trainer_checkpoint, "save_trainer_checkpoint",
                        slow(training.trainer_checkpoint.save_trainer_checkpoint))
    out, _ = _pretrain(["--train-iters", "10", "--log-interval", "5", "--eval-interval", "3",
                        "--save", str(tmp_path / "ck"), "--save-interval", "4"], capsys)
    times = _per_iteration_ms(out)
    assert len(times) == 2 and "validation loss at iteration 3 |" in out
    assert offset[0] >= 4000.0, "evaluations at 3, 6, 9 and saves at 4, 8 went by the clock"
    assert max(times) < 100_000, times


def test_the_interval_clock_does_not_follow_wall_clock_steps():
    """'elapsed time per iteration' and the throughput come from a monotonic clock: a
    wall-clock step (NTP, a suspended VM) made one interval negative or spiked."""
    import time

    from megatron.interval_log import IntervalStats

    assert IntervalStats.clock in (time.monotonic, time.perf_counter)
    assert not time.get_clock_info("monotonic").adjustable


def test_the_iteration_lines_tflops_count_the_models_own_products(capsys, monkeypatch):
    """TFLOP/s/GPU of a SwiGLU model with query groups and another --ffn-hidden-size is
    tokens/s x the product-by-product count (model_flops_per_token), not the plain GPT
    formula (about 6% off at a Llama-70B shape). A clock that barely moves makes both
    printed rates large enough to compare to four digits."""
    import megatron.interval_log as interval_log
    from megatron.logging_utils import flops_per_token, model_flops_per_token

    ticks = [0.0]

    def clock():
        ticks[0] += 1e-6
        return ticks[0]

    monkeypatch.setattr(interval_log.IntervalStats, "clock", staticmethod(clock))
    out, tr = _pretrain(["--train-iters", "2", "--log-interval", "2", "--swiglu",
                         "--group-query-attention", "--num-query-groups", "2",
                         "--ffn-hidden-size", "128"], capsys)
    line = [x for x in out.splitlines() if x.startswith(" iteration ")][-1]
    tokens = float(re.search(r"tokens/s/GPU: (\d+)", line).group(1))
    tflops = float(re.search(r"TFLOP/s/GPU: ([\d.]+)", line).group(1))
    m, s = tr.config.model, tr.config.data.seq_length
    assert tflops == pytest.approx(tokens * model_flops_per_token(m, s) / 1e12, rel=1e-3)
    plain = flops_per_token(m.num_layers, m.hidden_size, s, m.padded_vocab_size)
    assert abs(model_flops_per_token(m, s) / plain - 1) > 0.01  # the two counts differ here


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_run_stopped_by_ctrl_c_or_an_error_keeps_its_last_tensorboard_points(
        tmp_path, capsys, monkeypatch, error):
    """The steps since the last iteration line wait on the device for the next one: a
    Ctrl-C or an error at iteration 7 of a --log-interval 4 run lost the points of 5 and
    6 (up to --log-interval - 1 iterations; Megatron writes each step as it ends)."""
    calls = []
    original = training.train_step

    def stopping(tr, *args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise error("stopped at iteration 7")
        return original(tr, *args, **kwargs)

    monkeypatch.setattr(training, "train_step", stopping)
    tb = str(tmp_path / "tb")
    with pytest.raises(error, match="stopped at iteration 7"):
        _pretrain(["--train-iters", "10", "--log-interval", "4", "--eval-iters", "0",
                   "--tensorboard-dir", tb, "--tensorboard-log-interval", "1"], capsys)
    scalars = read_scalars(tb)
    assert [s for s, _ in scalars["lm loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalars["learning-rate vs samples"]] == [4, 8, 12, 16, 20, 24]


def test_a_resumed_runs_arguments_text_shows_the_loaded_sample_counters(tmp_path, capsys):
    """Megatron's load puts the checkpoint's consumed_train/valid_samples into args before
    the arguments go to TensorBoard's text tab; a resumed run showed the parsed 0."""
    from megatron.logging_utils import read_texts

    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    flags = ["--train-iters", "8", "--eval-interval", "3", "--eval-iters", "1", "--save", ckpt,
             "--load", ckpt, "--save-interval", "100"]
    _pretrain(flags + ["--exit-interval", "4"], capsys)
    _pretrain(flags + ["--tensorboard-dir", tb], capsys)
    texts = read_texts(tb)
    assert texts["consumed_train_samples"] == "16"  # 4 iterations of 4 samples
    assert texts["consumed_valid_samples"] == "4"  # one evaluation (at 3) of one batch
    assert texts["num_layers"] == "2"


def test_an_error_after_the_points_of_a_line_are_written_does_not_write_them_twice(
        tmp_path, capsys, monkeypatch):
    """A line's points go to TensorBoard before its timer block (a collective, the likely
    place to fail when a peer is gone): the steps are not written again on the way out."""
    from megatron import interval_log

    def failing(tr, iterations):
        raise RuntimeError("the timers' all-gather failed")

    monkeypatch.setattr(interval_log, "log_timers", failing)
    tb = str(tmp_path / "tb")
    with pytest.raises(RuntimeError, match="all-gather failed"):
        _pretrain(["--train-iters", "10", "--log-interval", "4", "--eval-iters", "0",
                   "--tensorboard-dir", tb], capsys)
    assert [s for s, _ in read_scalars(tb)["lm loss"]] == [1, 2, 3, 4]
