"""The training loop's Megatron behaviours, in one process through `pretrain()`:

* iteration lines only every --log-interval (none for a last or exit iteration off it),
  while TensorBoard still gets every --tensorboard-log-interval iteration, params-norm too.
"""
from __future__ import annotations

import re

import megatron.training as training
from megatron.arguments import parse_and_validate
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.initialize import initialize_distributed, set_random_seed
from megatron.logging_utils import read_scalars

MOCK = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--tokenizer-type NullTokenizer --vocab-size 256 --eval-interval 5 --eval-iters 2 "
    "--num-workers 0 --use-cpu-initialization --mock-data"
).split()


def _pretrain(argv, capsys):
    """(stdout, trainer) of one run of `pretrain()` as pretrain_gpt.py runs it."""
    cfg = parse_and_validate(MOCK + list(argv), world_size=1, env={"RANK": "0"},
                             cuda_available=False)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    tr = training.pretrain(cfg, rt)
    return capsys.readouterr().out, tr


def _logged_iterations(out: str) -> list:
    return [int(i) for i in re.findall(r"^ iteration\s+(\d+)/", out, re.M)]


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
