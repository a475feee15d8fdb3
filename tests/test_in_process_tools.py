"""In-process use of the other entry points: tasks/main.py's zero-shot evaluation,
tools/tune_gemms.py and tools/benchmark.py, each called twice in one child process (a
fresh interpreter, as a notebook's kernel is). Each call must give the same numbers as
the call before and leave the process as it found it: the environment (the start-up's
TORCH_GLOO_LAZY_INIT and cuBLAS workspace setting, the benchmark's CUDA_VISIBLE_DEVICES),
the warnings hooks and filters, the signal handlers, no process group."""
import textwrap
from pathlib import Path

import pytest

from tests.process_state import run_calls
from tests.test_tokenizer import TRAIN_TEXT, train_tiny_bpe, write_bpe_files
from tests.test_zeroshot import MODEL, WIKI

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import contextlib, io, json, re, sys
    sys.path.insert(0, {root!r})
    from tests.process_state import state
    import pretrain_gpt
    import tasks.main
    from tools import benchmark, tune_gemms

    D = {d!r}
    MODEL, TOK = {model!r}, {tok!r}
    PICK = dict(  # what must repeat from one call to the next
        zeroshot=lambda out: re.findall(r"validation results on WIKITEXT103 .*", out),
        tune_gemms=lambda out: [x for x in out.splitlines() if x.startswith("| ")],
        benchmark=lambda out: [json.loads(x)["loss"] for x in out.splitlines()
                               if x.startswith("{{")])
    calls = []

    def call(name, fn, argv):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result = fn(argv)
        except BaseException as e:
            result = type(e).__name__ + ": " + str(e)
        calls.append(dict(name=name, result=result, picked=PICK[name](out.getvalue()),
                          state=state(), tail=out.getvalue()[-2000:]))

    with contextlib.redirect_stdout(io.StringIO()):
        assert pretrain_gpt.main(MODEL + TOK + [
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
            "--train-iters", "2", "--mock-data", "--save", D + "/ckpt", "--save-interval", "2",
            "--log-interval", "100", "--eval-iters", "0"]) == 0
    before = state()
    for _ in range(2):
        call("zeroshot", tasks.main.main, [
            "--task", "WIKITEXT103", "--valid-data", D + "/wiki.tokens", "--load", D + "/ckpt",
            "--no-load-optim", "--no-load-rng", "--micro-batch-size", "3", *MODEL, *TOK])
    for _ in range(2):
        call("tune_gemms", tune_gemms.main, ["--record-only", "--device", "cpu",
                                             "--preset", "tiny", "--", "--num-workers", "0"])
    for _ in range(2):
        call("benchmark", benchmark.main, ["--preset", "tiny", "--device", "cpu", "--steps",
                                           "1", "--warmup", "0", "--", "--num-workers", "0"])
    print(json.dumps(dict(before=before, calls=calls)))
""")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("inproc_tools")
    vocab_file, merge_file = write_bpe_files(d, *train_tiny_bpe(TRAIN_TEXT, 200))
    (d / "wiki.tokens").write_text(WIKI)
    script = d / "calls.py"
    script.write_text(CHILD.format(root=str(ROOT), d=str(d), model=MODEL, tok=[
        "--vocab-file", str(vocab_file), "--merge-file", str(merge_file)]))
    # no GPU either, but not the benchmark's CUDA_VISIBLE_DEVICES=""
    return run_calls(script, 600, CUDA_VISIBLE_DEVICES="-1")


@pytest.mark.parametrize("name", ["zeroshot", "tune_gemms", "benchmark"])
def test_a_second_call_repeats_the_first(report, name):
    first, second = [c for c in report["calls"] if c["name"] == name]
    assert first["result"] == 0 and second["result"] == 0, (first["tail"], second["tail"])
    assert first["picked"] and second["picked"] == first["picked"]


@pytest.mark.parametrize("name", ["zeroshot", "tune_gemms", "benchmark"])
def test_each_call_leaves_the_process_as_it_found_it(report, name):
    before = report["before"]
    assert not before["group"] and "TORCH_GLOO_LAZY_INIT" not in before["env"]
    for call in (c for c in report["calls"] if c["name"] == name):
        for key, value in before.items():
            assert call["state"][key] == value, (name, key)
