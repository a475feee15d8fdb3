import math
import re
import sys
import time

import pytest
import torch

from megatron.config import LoggingConfig
from megatron.logging_utils import (
    TensorboardLogger,
    Timers,
    flops_per_token,
    format_iteration_line,
    format_validation_block,
    mfu,
    print_rank_0,
    print_rank_last,
    read_scalars,
    read_texts,
)
from tests.dist_utils import run_distributed


# --- console lines ---------------------------------------------------------------------
def test_iteration_line_matches_megatron_fields_exactly():
    line = format_iteration_line(
        iteration=100, train_iters=500000, consumed_samples=51200, elapsed_ms_per_iter=1234.5678,
        learning_rate=1.5e-4, global_batch_size=512, losses={"lm loss": 3.2345678901},
        loss_scale=65536.0, grad_norm=1.23456, skipped_iters=0, nan_iters=0,
    )
    expected = (
        " iteration      100/  500000 |"
        " consumed samples:        51200 |"
        " elapsed time per iteration (ms): 1234.6 |"
        " learning rate: 1.500E-04 |"
        " global batch size:   512 |"
        " lm loss: 3.234568E+00 |"
        " loss scale: 65536.0 |"
        " grad norm: 1.235 |"
        " number of skipped iterations:   0 |"
        " number of nan iterations:   0 |"
    )
    assert line == expected


def test_iteration_line_optional_fields_and_extras():
    line = format_iteration_line(
        7, 10, 56, 12.04, 0.0, 8, {"lm loss": 2.5, "zero loss": 0.0, "neg": -1.0}, 1.0,
        grad_norm=None, num_zeros=12.0, params_norm=250.12345, skipped_iters=3, nan_iters=1,
        tokens_per_s_per_gpu=12345.6, tflops_per_gpu=123.45,
    )
    expected = (
        " iteration        7/      10 | consumed samples:           56 |"
        " elapsed time per iteration (ms): 12.0 | learning rate: 0.000E+00 |"
        " global batch size:     8 | lm loss: 2.500000E+00 | loss scale: 1.0 |"
        " num zeros: 12.0 | params norm: 250.123 |"
        " number of skipped iterations:   3 | number of nan iterations:   1 |"
        " tokens/s/GPU: 12346 | TFLOP/s/GPU: 123.5 |"
    )
    assert line == expected
    assert "grad norm" not in line and "zero loss" not in line and "neg" not in line


def test_validation_block_ppl_and_dashes():
    block = format_validation_block("iteration 100", {"lm loss": 2.0, "big": 50.0})
    dash1, text, dash2 = block.split("\n")
    assert text == (
        f" validation loss at iteration 100 | lm loss value: 2.000000E+00 | "
        f"lm loss PPL: {math.exp(2.0):.6E} | big value: 5.000000E+01 | "
        f"big PPL: {math.exp(20.0):.6E} | "
    )
    assert dash1 == dash2 == "-" * (len(text) + 1)


def test_print_rank_helpers_print_when_not_distributed(capsys):
    print_rank_0("hello zero")
    print_rank_last("hello last")
    assert capsys.readouterr().out == "hello zero\nhello last\n"


# --- throughput ------------------------------------------------------------------------
def test_flops_per_token_gpt2_small():
    l, h, s, v = 12, 768, 1024, 50257
    # independent form: 3 passes x (matmuls 24 l h^2 + attention scores 4 l h s + logits 2 h V)
    reference = 3 * (24 * l * h * h + 4 * l * h * s + 2 * h * v)
    got = flops_per_token(l, h, s, v)
    assert got == pytest.approx(reference, rel=1e-12)
    assert got == pytest.approx(8.5445e8, rel=1e-4)


def test_model_flops_count_each_product_and_equal_the_formula_for_gpt():
    """The training line's and the planner's FLOPs: the issue's formula for a GPT (4h MLP,
    no query groups), and for a Llama shape twice the multiply-adds of a plain count of
    the products a token passes through (x3 for the backward)."""
    from megatron.core.config import ModelConfig
    from megatron.logging_utils import model_flops_per_token

    gpt = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                      padded_vocab_size=50304, seq_length=2048, max_position_embeddings=2048)
    assert model_flops_per_token(gpt, 2048) == pytest.approx(
        flops_per_token(24, 2048, 2048, 50304), rel=1e-12)
    llama = ModelConfig(num_layers=16, hidden_size=2048, num_attention_heads=32,
                        num_query_groups=8, ffn_hidden_size=5632, activation="swiglu",
                        padded_vocab_size=32000, untie_embeddings_and_output_weights=True,
                        seq_length=2048, max_position_embeddings=2048)
    s, h, d = 2048, 2048, 64
    macs = {"q": h * 32 * d, "k": h * 8 * d, "v": h * 8 * d, "scores": s * 32 * d,
            "values": s * 32 * d, "proj": 32 * d * h, "gate": h * 5632, "up": h * 5632,
            "down": 5632 * h}
    reference = 3 * 2 * (16 * sum(macs.values()) + h * 32000)
    assert model_flops_per_token(llama, s) == pytest.approx(reference, rel=1e-12)
    # the plain formula over-counts this shape's attention and under-counts its MLP
    assert flops_per_token(16, 2048, s, 32000) != pytest.approx(reference, rel=0.01)


def test_mfu():
    assert mfu(1000.0, 989e9) == pytest.approx(1.0)
    assert mfu(2.0e5, 8.5e8, peak_flops=312e12) == pytest.approx(2.0e5 * 8.5e8 / 312e12)


# --- timers ----------------------------------------------------------------------------
def test_timers_levels_and_elapsed():
    timers = Timers(log_level=1, log_option="minmax")
    timers("interval-time", 0).start()
    timers("forward-compute", 2).start()  # above the level: a no-op
    time.sleep(0.02)
    timers("forward-compute", 2).stop()
    timers("interval-time", 0).stop()
    assert timers.names() == ["interval-time"]
    t = timers("interval-time").elapsed(reset=False)
    assert 0.015 < t < 1.0
    assert timers("interval-time").elapsed(reset=True) == t
    assert timers("interval-time").elapsed() == 0.0
    assert timers("forward-compute", 2).elapsed() == 0.0


def test_timer_elapsed_while_running_keeps_running():
    timers = Timers(0)
    timers("a", 0).start()
    time.sleep(0.01)
    first = timers("a").elapsed(reset=True)
    time.sleep(0.01)
    timers("a").stop()
    assert first > 0.005 and timers("a").elapsed() > 0.005


def test_timers_reject_bad_options():
    with pytest.raises(ValueError, match="log option"):
        Timers(0, "median")
    with pytest.raises(ValueError, match="log level"):
        Timers(3)


def test_timers_log_string_single_process():
    timers = Timers(2, "minmax")
    timers("forward-backward", 1).start()
    time.sleep(0.01)
    timers("forward-backward", 1).stop()
    text = timers.log_string(["forward-backward", "never-started"], normalizer=2.0)
    lines = text.split("\n")
    assert lines[0] == "(min, max) time across ranks (ms):"
    assert len(lines) == 2
    m = re.fullmatch(r"    forward-backward \.{31}: \((\d+\.\d\d), (\d+\.\d\d)\)", lines[1])
    assert m and m.group(1) == m.group(2) and 4.0 < float(m.group(1)) < 500.0
    assert timers.log_string(["forward-backward"]) is None  # reset by the previous call


def _timers_worker(rank, world_size, option):
    timers = Timers(0, option)
    timers("step", 0).start(barrier=True)
    time.sleep(0.02 * (rank + 1))
    timers("step", 0).stop()
    if rank == 0:
        timers("only-rank0", 0).start()
        timers("only-rank0", 0).stop()
    maxes = timers.max_times(["step"], normalizer=1.0, reset=False)
    return timers.log_string(["step", "only-rank0", "missing"], normalizer=1.0), maxes


@pytest.mark.parametrize("option", ["minmax", "max", "all"])
def test_timers_log_string_across_ranks(option):
    out = run_distributed(_timers_worker, 2, option)
    assert out[0][0] == out[1][0]  # the gathered block is the same everywhere
    text, maxes = out[1]
    lines = text.split("\n")
    step_pad = ("step ").ljust(48, ".")
    if option == "minmax":
        assert lines[0] == "(min, max) time across ranks (ms):"
        m = re.fullmatch(rf"    {re.escape(step_pad)}: \((\d+\.\d+), (\d+\.\d+)\)", lines[1])
        lo, hi = float(m.group(1)), float(m.group(2))
        assert 15 < lo < hi and hi > 35
        assert lines[2].startswith("    only-rank0 ....")
    elif option == "max":
        # Megatron keeps the min/max header when it prints only the max (log parsers key on it)
        assert lines[0] == "(min, max) time across ranks (ms):"
        assert re.fullmatch(rf"    {re.escape(step_pad)}: \d+\.\d\d", lines[1])
    else:
        assert lines[0] == "times across ranks (ms):"
        assert lines[1] == "  step:"
        assert lines[2].startswith("     rank  0: ") and lines[3].startswith("     rank  1: ")
        assert lines[4] == "  only-rank0:" and lines[5].startswith("     rank  0: ")
    assert "missing" not in text
    assert maxes["step"] > 0.035


# --- tensorboard -----------------------------------------------------------------------
def _log_two_iterations(cfg, writer_rank=True):
    tb = TensorboardLogger(cfg, is_writer_rank=writer_rank)
    tb.log_args({"num_layers": 2, "params_dtype": "torch.float32"}, 0)
    for it, samples in ((1, 8), (2, 16)):
        tb.log_training(it, samples, lr=1e-3 * it, batch_size=8, losses={"lm loss": 5.0 - it},
                        loss_scale=4096.0, grad_norm=0.5 * it, num_zeros=3.0, params_norm=10.0,
                        world_size=4, mem_stats={"reserved_bytes.all.current": 1024},
                        timers_dict={"forward-backward": 0.25})
    tb.log_validation(2, 16, {"lm loss": 3.5})
    tb.flush()
    tb.close()
    return tb


def test_a_full_disk_under_tensorboard_warns_once_and_training_goes_on(tmp_path, monkeypatch,
                                                                       capfd):
    """A full disk or quota under --tensorboard-dir mid-run: the writer thread printed a
    traceback, the next scalar raised the OSError into the training loop (the run ended
    in a traceback) and so did the writer's close at teardown. Now one warning naming the
    directory, the reason and the fix; the rest of the run logs nothing to TensorBoard."""
    import errno

    from tensorboard.summary.writer import record_writer

    real, calls = record_writer.RecordWriter.write, []

    def write(self, data):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    tb = _log_two_iterations(LoggingConfig(tensorboard_dir=str(tmp_path)))
    tb.log_validation(3, 24, {"lm loss": 3.0})  # after the failure: nothing, no error
    out, err = capfd.readouterr()
    assert out.splitlines() == [
        f"warning: cannot write TensorBoard events to --tensorboard-dir {tmp_path} (No space "
        "left on device): TensorBoard logging stopped here, training continues; free space "
        "there (or raise your quota), or pass another --tensorboard-dir"]
    assert "Traceback" not in err and not tb.enabled


def test_tensorboard_scalars_round_trip(tmp_path):
    cfg = LoggingConfig(tensorboard_dir=str(tmp_path))
    _log_two_iterations(cfg)
    sc = read_scalars(str(tmp_path))
    assert sc["lm loss"] == [(1, 4.0), (2, 3.0)]
    assert sc["lm loss vs samples"] == [(8, 4.0), (16, 3.0)]
    assert [s for s, _ in sc["learning-rate"]] == [1, 2]
    assert sc["learning-rate vs samples"][1][1] == pytest.approx(2e-3)
    assert sc["loss-scale"] == [(1, 4096.0), (2, 4096.0)]
    assert sc["grad-norm"] == [(1, 0.5), (2, 1.0)]
    assert sc["grad-norm vs samples"] == [(8, 0.5), (16, 1.0)]
    assert sc["lm loss validation"] == [(2, 3.5)]
    assert sc["lm loss validation vs samples"] == [(16, 3.5)]
    # switched off by default
    for name in ("batch-size", "world-size", "num-zeros", "params-norm", "mem-reserved-bytes",
                 "forward-backward-time", "lm loss validation ppl"):
        assert name not in sc
    assert read_texts(str(tmp_path)) == {"num_layers": "2", "params_dtype": "torch.float32"}


def test_tensorboard_switches_and_interval(tmp_path):
    cfg = LoggingConfig(
        tensorboard_dir=str(tmp_path), tensorboard_log_interval=2,
        log_learning_rate_to_tensorboard=False, log_loss_scale_to_tensorboard=False,
        log_batch_size_to_tensorboard=True, log_world_size_to_tensorboard=True,
        log_num_zeros_in_grad=True, log_params_norm=True, log_memory_to_tensorboard=True,
        log_timers_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
    )
    tb = _log_two_iterations(cfg)
    assert not tb.enabled
    sc = read_scalars(str(tmp_path))
    assert "learning-rate" not in sc and "loss-scale" not in sc
    assert sc["lm loss"] == [(2, 3.0)]  # only iterations divisible by the interval
    assert sc["batch-size vs samples"] == [(16, 8.0)]
    assert sc["world-size"] == [(2, 4.0)]
    assert sc["num-zeros"] == [(2, 3.0)] and sc["params-norm"] == [(2, 10.0)]
    assert sc["mem-reserved-bytes"] == [(2, 1024.0)]
    assert "mem-reserved-bytes vs samples" not in sc
    assert sc["forward-backward-time"] == [(2, 0.25)]
    assert sc["lm loss validation ppl"] == [(2, pytest.approx(math.exp(3.5), rel=1e-6))]
    assert sc["lm loss validation ppl vs samples"][0][0] == 16


def test_tensorboard_noop_off_writer_rank_or_without_dir(tmp_path):
    _log_two_iterations(LoggingConfig(tensorboard_dir=str(tmp_path)), writer_rank=False)
    assert list(tmp_path.iterdir()) == []
    tb = _log_two_iterations(LoggingConfig(tensorboard_dir=None))
    assert not tb.enabled


def test_tensorboard_missing_package_warns_once(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    tb = _log_two_iterations(LoggingConfig(tensorboard_dir=str(tmp_path)))
    out = capsys.readouterr().out
    assert not tb.enabled and out.count("WARNING") == 1 and "pip install tensorboard" in out


def test_timers_cuda_device_arg_is_safe_without_cuda():
    timers = Timers(0, device="cuda" if torch.cuda.is_available() else "cpu")
    timers("x", 0).start()
    timers("x", 0).stop()
    assert timers("x").elapsed() >= 0.0


class _CountingStream:
    """A stdout that records each write call (in unbuffered mode each is one syscall)."""

    def __init__(self) -> None:
        self.writes = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_rank_printing_writes_each_line_whole(monkeypatch):
    """torchrun merges the ranks' output: a line written as text then newline let another
    rank's line land between the two (seen as a timer block glued to rank 0's next line)."""
    from megatron import logging_utils

    stream = _CountingStream()
    monkeypatch.setattr(sys, "stdout", stream)
    logging_utils.print_rank_0("iteration 1/ 2 | lm loss: 1.0")
    logging_utils.print_rank_last("(min, max) time across ranks (ms):\n    forward: (1, 2)")
    assert stream.writes == ["iteration 1/ 2 | lm loss: 1.0\n",
                             "(min, max) time across ranks (ms):\n    forward: (1, 2)\n"]
