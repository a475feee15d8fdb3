"""Tensor-parallel generation on 2 gloo ranks against the one-process path: the cached
decoding's logits (prefill + one-token steps) equal the full tp = 1 forward within 1e-5 of
the largest logit (fp32) and are the same tensor on both ranks; greedy `generate_batch`
tokens equal tp = 1's; checkpoints saved at tp 1 and at tp 2 x pp 2 give generate.py's
one-process greedy text under torchrun-style ranks at tp 2; beam search gives tp = 1's
hypotheses, the same on both ranks, with and without the cache; the server on 2 ranks
answers as one process (text; log-probs and beam scores within 1e-5; beam and top_p decay
requests too), and stopping rank 0 ends rank 1; the layouts generation does not run are
refused by name (pipeline layouts: tests/test_generate_pp.py; data-parallel replicas:
tests/test_generate_dp.py); before the process group rank 0 alone reads the checkpoint's
arguments, and a wrong --iteration or a damaged checkpoint is its one message."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.kv_cache import KVCache, forward_incremental
from megatron.core.tensor_parallel import shard_of_full_weight
from tests.dist_utils import free_port, run_distributed
from tests.test_generate import _run_cli, _train
from tests.test_kv_cache import MAX_POS, _model, _tokens
from tests.test_text_generation_http import _put_bytes
from tools import generate
from tools import run_text_generation_server as server_mod
from tools import text_generation_ranks as ranks_mod
from tools.beam_search import beam_search
from tools.generate_tp import check_generation_layout

PROMPTS = ([4, 9, 1, 30], [7], [3, 3, 8, 2, 11, 5, 60])


def _tp_shard(full: GPTModel, world_size: int) -> GPTModel:
    """`full` rebuilt with tensor-parallel size `world_size` over the world: each
    parameter this rank's slice of the full one (partition dim and stride as built)."""
    model = GPTModel(full.config, tp_group=dist.group.WORLD, device="meta")
    state = {}
    for name, prm in model.named_parameters():
        value = full.state_dict()[name]
        if getattr(prm, "tensor_model_parallel", False):
            value = shard_of_full_weight(value, prm.partition_dim, prm.partition_stride,
                                         dist.get_rank(), world_size)
        state[name] = value.clone()
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _decode_worker(rank, world_size, variants):
    out = {}
    for variant in variants:
        full = _model(variant)
        model = _tp_shard(full, world_size)
        ids = _tokens(MAX_POS)
        cache = KVCache(model.config.num_layers, MAX_POS)
        parts = [forward_incremental(model, ids[:, :7], cache)[0]]
        parts += [forward_incremental(model, ids[:, i:i + 1], cache)[0]
                  for i in range(7, MAX_POS)]
        prompts = [list(p) for p in PROMPTS]
        # a stop token the beams meet: the second greedy token after PROMPTS[0]
        beam_kw = dict(stop_token=generate.generate(full, prompts[0], 2, greedy=True,
                                                    vocab_limit=100)[1],
                       vocab_limit=100, length_penalty=0.7)
        with torch.no_grad():
            out[variant] = {
                "beam": beam_search(model, prompts[0], 3, 8, **beam_kw),
                "beam_no_cache": beam_search(model, prompts[0], 3, 8, use_cache=False,
                                             **beam_kw),
                "beam_tp1": beam_search(full, prompts[0], 3, 8, **beam_kw),
                "cached": torch.cat(parts), "full_tp1": full(ids)[0],
                "full_tp2": generate.gather_vocab(model, model(ids))[0],
                "cached_k_heads": cache.keys[0].shape[1],
                "batch": generate.generate_batch(model, prompts, 8, greedy=True,
                                                 vocab_limit=100),
                "batch_tp1": generate.generate_batch(full, prompts, 8, greedy=True,
                                                     vocab_limit=100),
                "no_cache": generate.generate(model, prompts[0], 6, greedy=True,
                                              use_cache=False),
                "no_cache_tp1": generate.generate(full, prompts[0], 6, greedy=True,
                                                  use_cache=False)}
    return out


VARIANTS = ("gpt2", "llama")


@pytest.fixture(scope="module")
def decoded():
    """What `_decode_worker` returns on each of 2 ranks."""
    return run_distributed(_decode_worker, 2, VARIANTS)


def test_tp2_decoding_equals_tp1(decoded):
    """gpt2: learned positions, GeLU, tied output; llama: rotary, SwiGLU, 2 query groups
    (one per rank), untied output."""
    results = decoded
    for variant in VARIANTS:
        r0, r1 = results[0][variant], results[1][variant]
        ref = r0["full_tp1"]
        assert r0["cached"].shape == ref.shape == (MAX_POS, 128)
        scale = ref.abs().max()
        for key in ("cached", "full_tp2"):
            err = float((r0[key] - ref).abs().max() / scale)
            assert err < 1e-5, (variant, key, err)
            assert torch.equal(r0[key], r1[key]), (variant, key)  # the same on every rank
        assert r0["cached_k_heads"] == (2 if variant == "gpt2" else 1)  # local groups
        assert r0["batch"] == r1["batch"] == r0["batch_tp1"], variant
        assert r0["no_cache"] == r0["no_cache_tp1"], variant


def test_tp2_beam_search_equals_tp1(decoded):
    """Beam search (width 3, 8 tokens, a stop token the beams meet) on the tp = 2 shards:
    the same hypotheses and scores on both ranks (bit for bit: the same all-gathered
    logits), with and without the cache, and tp = 1's hypotheses (scores within 1e-5)."""
    for variant in VARIANTS:
        r0, r1 = decoded[0][variant], decoded[1][variant]
        want = r0["beam_tp1"]
        assert len(want) == 3 and any(len(ids) < 8 for ids, _ in want), want  # a stop
        for key in ("beam", "beam_no_cache"):
            assert r0[key] == r1[key], (variant, key)
            assert [ids for ids, _ in r0[key]] == [ids for ids, _ in want], (variant, key)
            assert [s for _, s in r0[key]] == pytest.approx([s for _, s in want], abs=1e-5)


# --------------------------------------------------------------------- checkpoints
def _generate_worker(rank, world_size, ckpt, flags):
    buf = io.StringIO()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    with contextlib.redirect_stdout(buf):
        assert generate.main(["--load", ckpt, "--tensor-model-parallel-size", "2", "--json",
                              *flags], environ=env) == 0
    return buf.getvalue()


def _bad_prompt_worker(rank, world_size, ckpt):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    try:
        generate.main(["--load", ckpt, "--tensor-model-parallel-size", "2", "--prompt",
                       "hello"], environ=env)
    except SystemExit as exc:
        return exc.code
    return None


def test_a_bad_prompt_is_printed_once_at_tp2(ckpt_tp1):
    """A prompt the tokenizer refuses fails alike on every rank after the load: rank 0
    exits with the message (printed once), the other ranks with status 1 in silence."""
    codes = run_distributed(_bad_prompt_worker, 2, ckpt_tp1)
    assert "NullTokenizer expects space-separated integers" in codes[0] and codes[1] == 1


def _own_group_worker(rank, world_size, ckpt):
    """generate.py as torchrun starts it: no process group before main (the harness's is
    closed first); whether main leaves one behind."""
    import torch.distributed as dist

    dist.destroy_process_group()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    with contextlib.redirect_stdout(io.StringIO()):
        assert generate.main(["--load", ckpt, "--tensor-model-parallel-size", "2",
                              *FLAGS[:4]], environ=env) == 0
    return dist.is_initialized()


def test_generate_closes_the_group_it_made(ckpt_tp1):
    """generate.py destroys the process group it initialised before it returns: a gloo
    group left to the interpreter's exit aborted about one tp 2 run in three on 2 CPU cores
    ('terminate called without an active exception') after the output, and torchrun
    reported the run as failed."""
    assert run_distributed(_own_group_worker, 2, ckpt_tp1) == [False, False]


def _startup_worker(rank, world_size, runs, local_ranks):
    """generate.py at tp 2 as torchrun starts it (no process group before main, the
    rendezvous address in its environment, LOCAL_RANK `local_ranks[rank]`), once per
    (checkpoint, flags, port) of `runs`: for each, (its exit status, what it printed to
    stderr, the files opened and directories listed under the checkpoint before the
    process group existed)."""
    import sys

    dist.destroy_process_group()  # run_distributed's: start as the entry point does
    state: dict = {}

    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and \
                isinstance(args[0], str) and args[0].startswith(state["root"]) and \
                not dist.is_initialized():
            state["reads"] += 1

    sys.addaudithook(hook)
    results = []
    for ckpt, flags, port in runs:
        state.update(root=ckpt, reads=0)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "LOCAL_RANK": str(local_ranks[rank]), "MASTER_PORT": str(port)}
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                status = generate.main(["--load", ckpt, "--tensor-model-parallel-size", "2",
                                        *flags], environ=env)
        except SystemExit as exc:
            status = exc.code
        results.append({"status": status, "stderr": err.getvalue(), "reads": state["reads"]})
    return results


def test_rank_0_alone_reads_the_checkpoint_arguments_before_the_group(ckpt_tp1):
    """generate.py on two ranks: before the process group, rank 0 reads the tracker and
    its model file for both, and rank 1 gets the arguments through the rendezvous store
    (each rank read them: at thousands of ranks, thousands of reads of the same files),
    which then makes the group (the generation runs)."""
    [(first,), (second,)] = run_distributed(_startup_worker, 2,
                                            [(ckpt_tp1, FLAGS[:4], free_port())], (0, 1))
    assert (first["status"], second["status"]) == (0, 0), (first, second)
    assert first["reads"] >= 3 and second["reads"] == 0, (first, second)


def test_a_bad_checkpoint_or_iteration_is_one_message_for_every_rank(ckpt_tp1, tmp_path):
    """Two ranks on two nodes (LOCAL_RANK 0 each): a wrong --iteration or a damaged
    rank-0 model file is rank 0's read, printed by rank 0 alone (each node printed it,
    naming its rank and host), and every rank exits with status 1 without reading."""
    import shutil

    damaged = str(tmp_path / "damaged")
    shutil.copytree(ckpt_tp1, damaged)
    with open(os.path.join(damaged, "latest_checkpointed_iteration.txt")) as f:
        latest = int(f.read())
    model_file = os.path.join(damaged, f"iter_{latest:07d}", "mp_rank_00", "model_optim_rng.pt")
    with open(model_file, "wb") as f:
        f.write(b"not a checkpoint")
    runs = [(ckpt_tp1, ("--iteration", str(latest + 5), *FLAGS[:2]), free_port()),
            (damaged, FLAGS[:2], free_port())]
    ranks = run_distributed(_startup_worker, 2, runs, (0, 0))
    words = (f"error: --iteration {latest + 5}: under torchrun the training loader reads "
             f"the tracker's iteration ({latest})", model_file)
    for (first, second), word in zip(zip(*ranks), words):
        assert (first["status"], second["status"]) == (1, 1), (first, second)
        assert word in first["stderr"] and first["stderr"].count("error:") == 1, first
        assert second["stderr"] == "" and second["reads"] == 0, second


def _train_worker(rank, world_size, save_dir, extra):
    _train(save_dir, extra, world_size=world_size, rank=rank, steps=2)


# vocabulary 101 padded to 128 at tp 1 and tp 2: its ids span both ranks' halves
VOCAB_FLAGS = "--make-vocab-size-divisible-by 32"
FLAGS = ("--prompt", "5 6 7", "--max-new-tokens", "10", "--greedy", "--no-stop-at-eod")


@pytest.fixture(scope="module")
def ckpt_tp1(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp1")
    _train(path, VOCAB_FLAGS, steps=2)
    return str(path)


def test_tp1_and_tp2pp2_checkpoints_generate_at_tp2(ckpt_tp1, tmp_path):
    ckpt_tp2pp2 = str(tmp_path / "tp2pp2")
    run_distributed(_train_worker, 4, ckpt_tp2pp2,
                    f"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 {VOCAB_FLAGS}")
    for ckpt in (ckpt_tp1, ckpt_tp2pp2):
        alone = _run_cli("--load", ckpt, *FLAGS)
        assert len(alone["generated_ids"]) == 10
        out = run_distributed(_generate_worker, 2, ckpt, FLAGS)
        assert out[1] == ""  # rank 0 prints
        assert json.loads(out[0]) == alone, ckpt
        sampled = ("--prompt", "5 6 7", "--max-new-tokens", "10", "--temperature", "1.5",
                   "--seed", "3", "--no-stop-at-eod")
        out = run_distributed(_generate_worker, 2, ckpt, sampled)
        assert json.loads(out[0]) == _run_cli("--load", ckpt, *sampled), ckpt


# -------------------------------------------------------------------------- server
def _serve_worker(rank, world_size, ckpt, port, pid_dir,
                  layout=("--tensor-model-parallel-size", "2")):
    """One rank of the server at `layout` (its pid in pid_dir/rank<R>, for the stop)."""
    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    ranks_mod.HEARTBEAT_S = 0.2  # idle messages between the requests too
    with contextlib.redirect_stdout(io.StringIO()):
        return server_mod.main(["--load", ckpt, *layout, "--port", str(port)], environ=env)


def _pid(pid_dir, rank: int) -> int:
    with open(os.path.join(pid_dir, f"rank{rank}")) as f:
        return int(f.read())


def _wait_for_server(url, deadline, ranks: threading.Thread, pid_dir, world_size=2):
    """Poll until the server answers. The first request waits until both ranks have
    started (written their pid files): the ranks are forked from another thread of this
    process, and a child forked while this thread is inside an import (urlopen imports
    lazily) inherits that module's import lock held, and hangs on its own next import."""
    from tools.text_generation_cli import put

    while (time.monotonic() < deadline and ranks.is_alive() and not all(
            os.path.exists(os.path.join(pid_dir, f"rank{r}")) for r in range(world_size))):
        time.sleep(0.1)
    while time.monotonic() < deadline and ranks.is_alive():
        try:
            return put(url, {"prompts": ["1"], "tokens_to_generate": 1}, timeout=60)
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no server at {url} (the ranks ended: {not ranks.is_alive()})")


@contextlib.contextmanager
def two_rank_server(worker, ckpt: str, tmp_path, world_size: int = 2):
    """The server of `worker(rank, world, ckpt, port, tmp)` on 2 ranks (or `world_size`)
    in a background thread; yields its URL once it answers. On the way out Ctrl-C goes to
    rank 0, whose stop the other ranks must follow within 60 s (else all are killed and the
    test fails); then every rank must have returned 0 and nothing raised."""
    port, results, errors = free_port(), [], []

    def run():
        try:
            results.extend(run_distributed(worker, world_size, ckpt, port, str(tmp_path)))
        except Exception as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/api"
    try:
        try:
            ready = _wait_for_server(url, time.monotonic() + 120, thread, str(tmp_path),
                                     world_size)
        except TimeoutError as exc:  # name what the ranks raised
            raise TimeoutError(f"{exc}; the ranks' errors: {errors}") from None
        assert ready[0] == 200, (ready, errors)
        yield url
    finally:
        with contextlib.suppress(OSError):  # rank 0 stops; rank 1 must follow
            os.kill(_pid(tmp_path, 0), signal.SIGINT)
        thread.join(60)
    if thread.is_alive():  # do not leave the ranks behind
        for rank in range(world_size):
            with contextlib.suppress(OSError):
                os.kill(_pid(tmp_path, rank), signal.SIGKILL)
        pytest.fail("the other ranks did not stop within 60 s after rank 0 was interrupted")
    assert not errors, errors
    assert results == [0] * world_size


def test_server_on_two_ranks(ckpt_tp1, tmp_path):
    from tools.text_generation_api import parse_request, run_request
    from tools.text_generation_cli import put

    with two_rank_server(_serve_worker, ckpt_tp1, tmp_path) as url:
        body = {"prompts": ["5 6 7", "9 8 7 6 5"], "tokens_to_generate": 8, "top_k": 1,
                "logprobs": True}
        status, text = put(url, body, timeout=60)
        assert status == 200, text
        got = json.loads(text)
        a, ns, explicit = server_mod.parse_args(["--load", ckpt_tp1])
        engine, _ = server_mod.build_engine(a, ns, explicit, environ={})
        want = run_request(engine, parse_request(body))
        assert got["text"] == want["text"] and got["segments"] == want["segments"]
        for g, w in zip(got["logprobs"], want["logprobs"]):
            assert g == pytest.approx(w, abs=1e-5)
        status, text = put(url, {"prompts": ["5 999"]}, timeout=60)  # 400, ranks in step
        assert status == 400 and "outside the vocabulary" in text
        assert put(url, body, timeout=60)[1] == json.dumps(got)
        nested = b'{"prompts": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        assert _put_bytes(url, nested)[0] == 400  # refused on rank 0: nothing broadcast
        assert put(url, body, timeout=60)[1] == json.dumps(got)
        for extra in ({"prompts": ["5 6 7"], "beam_width": 3, "tokens_to_generate": 6},
                      {"temperature": 1.5, "top_p": 0.9, "top_p_decay": 0.5,
                       "top_p_bound": 0.3, "random_seed": 3}):  # fields on every rank
            one = dict(body, logprobs=False, top_k=0, **extra)
            status, text = put(url, one, timeout=60)
            assert status == 200, text
            want = run_request(engine, parse_request(one))
            got = json.loads(text)
            assert got["text"] == want["text"], extra
            assert set(got) == set(want)
            assert got.get("scores", []) == pytest.approx(want.get("scores", []), abs=1e-5)


def _rank0_fails_alone_worker(rank, world_size, ckpt, port, pid_dir):
    """_serve_worker whose rank 0 alone fails a request of prompt "66 66 ..." before
    its forward (as an out-of-memory error on one GPU), leaving rank 1 in its collectives."""
    from tools import text_generation_api as api_mod

    real = api_mod.generate_batch

    def generate_batch(model, all_ids, *args, **kwargs):
        if rank == 0 and all_ids[0][:2] == [66, 66]:
            raise RuntimeError("injected: out of memory on rank 0 alone")
        return real(model, all_ids, *args, **kwargs)

    api_mod.generate_batch = generate_batch
    ranks_mod.FINISHED_WAIT_S = 5.0
    return _serve_worker(rank, world_size, ckpt, port, pid_dir)


def test_a_request_failing_on_rank0_alone_stops_the_server(ckpt_tp1, tmp_path):
    """Rank 0 answers 500 and, the other rank being stuck in the request's collectives,
    stops serving within FINISHED_WAIT_S, and every rank ends (the next request and
    Ctrl-C waited for the process group's timeout: rank 0 in its next broadcast)."""
    from tools.text_generation_cli import put

    port, errors = free_port(), []

    def run():
        try:
            run_distributed(_rank0_fails_alone_worker, 2, ckpt_tp1, port, str(tmp_path))
        except Exception as exc:  # the ranks fail: expected
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/api"
    try:
        assert _wait_for_server(url, time.monotonic() + 120, thread, str(tmp_path))[0] == 200
        status, text = put(url, {"prompts": ["66 66 5"], "tokens_to_generate": 3}, timeout=60)
        assert status == 500 and "out of memory on rank 0 alone" in text
        thread.join(90)
    finally:
        if thread.is_alive():
            for rank in range(2):
                with contextlib.suppress(OSError):
                    os.kill(_pid(tmp_path, rank), signal.SIGKILL)
            thread.join(30)
            pytest.fail("the ranks did not end after rank 0 failed a request alone")
    assert errors and "timed out" in str(errors[0]).lower(), errors


# ------------------------------------------------------------------------ refusals
def test_layouts_generation_does_not_run(ckpt_tp1):
    """The tp-only layouts (pp > 1: tests/test_generate_pp.py)."""
    check_generation_layout("x", 1, 1, 1)
    check_generation_layout("x", 4, 4, 1)
    check_generation_layout("x", 4, 2, 1)  # 2 data-parallel replicas: tests/test_generate_dp.py
    with pytest.raises(SystemExit, match="world size 6 with --tensor-model-parallel-size 4 x "
                                         "--pipeline-model-parallel-size 1 = 4: the world "
                                         "size must be a multiple of 4"):
        check_generation_layout("x", 6, 4, 1)
    with pytest.raises(SystemExit, match="world size 1 with --tensor-model-parallel-size 2"):
        generate.main(["--load", ckpt_tp1, "--prompt", "5", "--tensor-model-parallel-size",
                       "2"], environ={})


def test_layout_mistakes_under_torchrun_print_once(ckpt_tp1, capsys):
    """Under torchrun a layout generation does not run, or --device, was printed by every
    rank (the same error twice on 2 processes); now rank 0 prints it, as pretrain_gpt.py
    prints a flag error, and every rank exits with status 1."""
    for rank in (0, 1):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        for main, argv, words in (
                (server_mod.main, ["--pipeline-model-parallel-size", "2",
                                   "--tensor-model-parallel-size", "2"],
                 "error: world size 2 with --tensor-model-parallel-size 2 x "
                 "--pipeline-model-parallel-size 2 = 4"),
                (server_mod.main, ["--tensor-model-parallel-size", "4"],
                 "error: world size 2 with --tensor-model-parallel-size 4"),
                (generate.main, ["--prompt", "5", "--tensor-model-parallel-size", "4"],
                 "error: world size 2 with --tensor-model-parallel-size 4"),
                (generate.main, ["--prompt", "5", "--tensor-model-parallel-size", "2",
                                 "--device", "cpu"],
                 "error: --device cpu: under torchrun each rank uses cuda:LOCAL_RANK")):
            with pytest.raises(SystemExit) as exc:
                main(["--load", ckpt_tp1, *argv], environ=env)
            assert exc.value.code == 1
            err = capsys.readouterr().err
            assert (words in err) == (rank == 0) and err.count("error:") == (rank == 0), err
