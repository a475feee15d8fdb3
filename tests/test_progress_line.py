"""The ` progress: ...` line after each iteration line: its share and its ETA in the one
measure the run is defined by. A sample-based run (--train-samples, ramped or not) counts
consumed samples up to what it will have consumed at --train-iters (Megatron drops the
partial last batch of --train-samples); an iteration-based run counts iterations. Under
--rampup-batch-size the share counted iterations while the ETA counted samples, so half
the iterations read 50% with far less than half of the samples done."""
from __future__ import annotations

import re

from megatron.arguments import parse_and_validate
from megatron.interval_log import progress_line, run_progress
from megatron.microbatches import current_global_batch_size, samples_of_steps

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "512", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1"]
RAMP = ["--global-batch-size", "8", "--train-samples", "80", "--rampup-batch-size", "2", "2",
        "24"]
# 2 2 24 to 8: steps of 2, 2, 2, 2, 4, 4, 6, 6, then 6 of 8 (14 iterations, 76 samples:
# the 4 samples left of --train-samples 80 are not a whole batch)
SIZES = [2, 2, 2, 2, 4, 4, 6, 6] + [8] * 6
TOTAL = sum(SIZES)
PROGRESS = re.compile(r" progress: ([0-9.]+)% \((\d+)/(\d+) (\w+)\) \| elapsed \S+ \| "
                      r"ETA (\S+) \|")


def _run(argv, capsys):
    """pretrain_gpt on `argv`: [(iteration, consumed samples, skipped, progress match)]
    for each iteration line and the progress line after it."""
    import pretrain_gpt

    assert pretrain_gpt.main(BASE + argv) == 0
    lines = capsys.readouterr().out.splitlines()
    out = []
    for line, after in zip(lines, lines[1:]):
        if line.startswith(" iteration "):
            it = int(line.split("iteration")[1].split("/")[0])
            consumed = int(line.split("consumed samples:")[1].split("|")[0])
            skipped = int(line.split("number of skipped iterations:")[1].split("|")[0])
            out.append((it, consumed, skipped, PROGRESS.match(after)))
    return out


def _check_share(rows, total):
    for it, consumed, _, m in rows:
        assert m is not None, it
        assert m.group(4) == "samples" and (int(m.group(2)), int(m.group(3))) == (consumed,
                                                                                  total)
        assert m.group(1) == f"{100.0 * consumed / total:.1f}", (it, consumed, m.group(0))


def test_rampup_share_counts_samples(capsys):
    """Iteration 7 of 14 (50% of the iterations) has 22 of 76 samples: 28.9%."""
    rows = _run(RAMP, capsys)
    assert [c for _, c, _, _ in rows] == [sum(SIZES[:i + 1]) for i in range(14)]
    _check_share(rows, TOTAL)
    assert rows[6][3].group(1) == "28.9"
    assert rows[-1][3].group(1) == "100.0" and rows[-1][3].group(5) == "00:00:00"


def test_resumed_rampup_run_counts_from_the_checkpoints_samples(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    first = _run(RAMP + ["--save", ck, "--save-interval", "6", "--exit-interval", "6"], capsys)
    assert [c for _, c, _, _ in first] == [sum(SIZES[:i + 1]) for i in range(6)]
    rows = _run(RAMP + ["--load", ck], capsys)
    assert rows[0][:2] == (7, 22) and rows[-1][:2] == (14, TOTAL)
    _check_share(rows, TOTAL)


def test_fp16_skipped_iterations_count_their_samples(capsys):
    """Megatron counts a skipped (overflowed) step's batch as consumed: so does the share."""
    rows = _run(RAMP + ["--fp16"], capsys)
    assert sum(s for _, _, s, _ in rows) > 0
    _check_share(rows, TOTAL)


def test_run_progress_measure():
    cfg = parse_and_validate(BASE + RAMP, world_size=1, env={"RANK": "0"}, cuda_available=False)
    assert run_progress(cfg, 0, 0, 0, 0) == (0, TOTAL, 0, "samples")
    assert run_progress(cfg, 14, TOTAL, 0, 0) == (TOTAL, TOTAL, 0, "samples")
    # resumed at iteration 6 (16 samples) and now at 8 (28): from the consumed count
    assert run_progress(cfg, 8, 28, 6, 16) == (28, TOTAL, 16, "samples")
    # a NaN rollback to iteration 4 kept the 28 consumed samples: 10 more steps to take
    assert run_progress(cfg, 4, 28, 0, 0) == (28, 28 + samples_of_steps(28, 10, (2, 2, 24), 8),
                                              0, "samples")
    # --train-samples without ramp-up: 44 // 8 = 5 steps, 40 samples
    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "44"],
                             world_size=1, env={"RANK": "0"}, cuda_available=False)
    assert run_progress(cfg, 2, 16, 0, 0) == (16, 40, 0, "samples")
    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-iters", "30"],
                             world_size=1, env={"RANK": "0"}, cuda_available=False)
    assert run_progress(cfg, 12, 96, 10, 80) == (12, 30, 10, "iterations")


def test_samples_of_steps():
    assert samples_of_steps(0, 14, (2, 2, 24), 8) == TOTAL
    assert samples_of_steps(6, 5, (2, 2, 24), 8) == 2 + 4 + 4 + 6 + 6
    assert samples_of_steps(30, 3, (2, 2, 24), 8) == 24
    assert samples_of_steps(5, 3, None, 8) == 24 and samples_of_steps(5, -2, None, 8) == 0
    # against a step-by-step walk, from scratch and off-schedule (a resumed run's count),
    # with whole and fractional samples per increment
    for ramp, gbs in (((2, 2, 24), 8), ((4, 4, 50), 16), ((3, 6, 101), 33), ((8, 8, 7), 64)):
        for consumed in (0, 1, 5, 13, 49, 50, 51, 100):
            walked = consumed
            for steps in range(40):
                assert samples_of_steps(consumed, steps, ramp, gbs) == walked - consumed, \
                    (ramp, gbs, consumed, steps)
                walked += current_global_batch_size(walked, ramp, gbs)


def test_progress_line_eta_in_one_measure():
    """ETA = elapsed / done since the loop started x left, in the share's own unit."""
    line = progress_line(120, 300, 0, 60.0)
    assert "40.0% (120/300 iterations)" in line and "ETA 00:01:30" in line
    assert "ETA 00:01:30" in progress_line(120, 300, 100, 10.0)  # 20 since the resume, in 10 s
    # resumed at 800 samples: 320 more in 15 s, 9,280 left
    line = progress_line(1120, 10400, 800, 15.0, "samples")
    assert "10.8% (1120/10400 samples)" in line and "ETA 00:07:15" in line
    assert "ETA ?" in progress_line(100, 300, 100, 5.0)  # nothing done yet: unknown
    assert "ETA 00:00:00" in progress_line(300, 300, 0, 5.0)
