"""What the Hugging Face conversions leave on disk: `to-hf --output` / `from-hf --save`
already holding files (--overwrite), a full disk or an interrupt midway (the earlier export
or import stays whole), file modes, and the staging directories a stopped to-hf or
from-hf left.
The mappings and logits: tests/test_hf_interop.py."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron import hf_convert, hf_files, hf_import, hf_interop
from tests import forked_script
from tests.dist_utils import cpu_env
from tests.test_hf_interop import (
    TINY,
    _cli,
    _save_hf_model,
    _train,
    _transformers,
)

safetensors = pytest.importorskip("safetensors", reason="the HF export writes safetensors")


def test_to_hf_refuses_a_non_empty_output_unless_overwrite(tmp_path):
    """An --output holding files (another model, an earlier export) is refused before
    anything is read or written; --overwrite replaces the export's files, keeps others."""
    _train(tmp_path / "ck", "", steps=1)
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is fine
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out) == 0
    (out / "README.md").write_text("notes")
    (out / "config.json").write_text("{}")  # stands for another model's
    with pytest.raises(SystemExit, match=f"--output {out} is not empty \\(README.md, "
                       r"config.json, generation_config.json, model.safetensors\); writing "
                       r"there would replace .* or add --overwrite to replace them"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", out)
    assert (out / "config.json").read_text() == "{}"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out, "--overwrite") == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert (out / "README.md").read_text() == "notes"
    with pytest.raises(SystemExit, match="--output .*README.md is a file; pass a directory"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", out / "README.md", "--overwrite")


def test_a_full_disk_during_to_hf_or_from_hf_is_one_message(tmp_path, monkeypatch):
    """On a full disk safetensors raises its SafetensorError and torch.save a RuntimeError
    ("unexpected pos ..."): to-hf and from-hf ended in those tracebacks. Now one error line
    each, naming the file and the free space, with nothing partial left behind."""
    safetensors = pytest.importorskip("safetensors")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    _train(tmp_path / "ck", "", steps=1)
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf") == 0

    def no_space(tensors, filename, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on "
                                          "device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(safetensors_torch, "save_file", no_space)
        with pytest.raises(SystemExit) as err:
            _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "out")
    assert re.match(re.escape(f"error: writing to --output {tmp_path / 'out'} failed (OSError: "
                              f"could not write {tmp_path}/.out.staging-") + r"[\w.-]+" +
                    re.escape("/model.safetensors.tmp: Error while serializing: I/O error: "
                              "No space left on device (os error 28)); nothing was left; "),
                    str(err.value.code)), err.value.code
    assert str(err.value.code).endswith(". Free space or pass another --output")
    assert not (tmp_path / "out").exists()  # made by the export: removed again
    assert not [p for p in os.listdir(tmp_path) if ".staging-" in p]

    def full(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 10")

    from megatron import checkpoint_dirs

    measured = []  # the free space is measured once the partial output is gone
    real_free = checkpoint_dirs.free_space_text
    monkeypatch.setattr(checkpoint_dirs, "free_space_text", lambda path: measured.append(
        [p for p in os.listdir(path) if ".from-hf-" in p]) or real_free(path))
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit) as err:
        _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "imported")
    assert measured == [[]]
    assert str(err.value.code).startswith("error: writing the imported model to ")
    assert "unexpected pos 64 vs 10); it was removed; " in str(err.value.code)
    assert not (tmp_path / "imported").exists()
    assert not [p for p in os.listdir(tmp_path) if ".from-hf-" in p]


def test_a_disk_full_after_the_weights_leaves_no_truncated_tokenizer_or_config(
        tmp_path, monkeypatch):
    """The disk fills up after model.safetensors: the tokenizer copy left a truncated
    merges.txt (a tokenizer with fewer merges loads from it without a word) beside the
    complete weights, and a failed config.json write a truncated config.json. Now each
    file is written under a temporary name and renamed when complete, and a failed export
    removes what it added (the directory too when it made it)."""
    import errno

    from megatron import hf_files

    _train(tmp_path / "ck", "", steps=1)

    def half_then_full(data, f, **kwargs):
        f.write('{"model_type": ')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_files.json, "dump", half_then_full)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(SystemExit, match=rf"^error: writing to --output {out} failed "
                                             r"\(OSError: \[Errno 28\] No space left"):
            _cli("to-hf", "--load", tmp_path / "ck", "--output", out)
    assert not (tmp_path / "new").exists()
    assert os.listdir(tmp_path / "empty") == []


def test_pretrain_gpt_cli_trains_from_an_imported_model(tmp_path):
    """`pretrain_gpt.py --load` of a from-hf 'release' checkpoint: loads at iteration 0 with
    a fresh optimizer, trains, saves iteration 2."""
    _save_hf_model(tmp_path / "hf", "gpt2")
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
    _, flags = hf_interop.megatron_flags_from_hf(json.loads((tmp_path / "hf" / "config.json")
                                                            .read_text()))
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "pretrain_gpt.py"), *flags, *TINY.split(),
           "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "out"), "--save-interval", "2",
           "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0"]
    proc = forked_script.run(cmd, cpu_env(), timeout=120, cwd=root)  # its imports come free
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "successfully loaded checkpoint" in out and "at iteration 0" in out
    assert len(re.findall(r"iteration\s+\d+/\s*2 \|.*lm loss", out)) == 2, out[-3000:]
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "2"


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("fail_at", ["tokenizer", "swap"])
def test_a_failed_overwrite_leaves_the_earlier_export_whole(tmp_path, monkeypatch, fail_at):
    """to-hf --overwrite over an earlier export wrote file by file: a full disk at the
    tokenizer copy left the new weights and config.json beside the earlier export's
    tokenizer files, a mixed export. Now it is written beside --output and swapped in
    whole: a failure leaves the earlier export byte for byte, no staging directory, and
    says so."""
    import errno

    _train(tmp_path / "ck", "", steps=1)
    out = tmp_path / "hf"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out) == 0
    (out / "vocab.json").write_text('{"old": 0}')  # the earlier export's tokenizer
    (out / "README.md").write_text("notes")
    before = _tree(out)
    _train(tmp_path / "ck2", "--seed 5", steps=1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fail_at == "tokenizer":
        monkeypatch.setattr(hf_convert, "tokenizer_files", lambda args: {"merges.txt": "x"})
        monkeypatch.setattr(hf_convert.shutil, "copyfile", full)
    else:
        real = os.rename

        def rename(src, dst):  # the new export cannot be renamed in: moved back
            if ".staging-" in str(src) and str(dst) == str(out):
                full()
            return real(src, dst)

        monkeypatch.setattr(hf_files.os, "rename", rename)
    with pytest.raises(SystemExit) as err:
        _cli("to-hf", "--load", tmp_path / "ck2", "--output", out, "--overwrite")
    assert _tree(out) == before
    assert f"failed (OSError: [Errno 28] No space left on device); --output {out} is as it " \
           "was" in str(err.value.code)
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck2", "hf"]


def test_overwrite_replaces_the_export_whole_and_keeps_other_files(tmp_path):
    """--overwrite over an earlier export: its files not written again (a tokenizer the
    new checkpoint has not) are gone, a README.md and .git are carried over; weight
    files of another format beside it are refused, named, before anything is read."""
    _train(tmp_path / "ck", "", steps=1)
    out = tmp_path / "hf"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out) == 0
    (out / "tokenizer.json").write_text("{}")  # the earlier export's tokenizer
    (out / "README.md").write_text("notes")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref")
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out, "--overwrite") == 0
    assert sorted(os.listdir(out)) == [".git", "README.md", "config.json",
                                       "generation_config.json", "model.safetensors"]
    assert (out / ".git" / "HEAD").read_text() == "ref"
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]
    (out / "pytorch_model.bin").write_bytes(b"x")
    before = _tree(out)
    with pytest.raises(SystemExit, match=f"--output {out} holds pytorch_model.bin, not files "
                       "of an export: .* Move them out of the directory"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", out, "--overwrite")
    assert _tree(out) == before


def test_export_without_generation_config_removes_an_earlier_one(tmp_path):
    """--overwrite replaces an export: a generation_config.json of the earlier model (its
    end-of-document id) must not stay beside the new one's weights."""
    pytest.importorskip("safetensors")
    state = {"w": torch.zeros(2)}
    hf_files.save_hf_checkpoint(str(tmp_path), state, {"a": 1}, {"eos_token_id": 7})
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 7
    hf_files.save_hf_checkpoint(str(tmp_path), state, {"a": 2})
    assert not (tmp_path / "generation_config.json").exists()
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 2}


def test_interrupted_export_keeps_the_earlier_one(tmp_path, monkeypatch):
    """to-hf --overwrite removed the earlier export's weights before writing the new ones:
    Ctrl-C (or a full disk) in between left neither. The new files are written under .tmp
    names and replace the old ones only when all are written; an interrupted write removes
    its own."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    old = {"a": torch.zeros(4), "b": torch.zeros(4)}
    names = hf_files.save_hf_checkpoint(str(tmp_path), old, {"v": 1}, max_shard_bytes=16)
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    real, calls = safetensors_torch.save_file, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors_torch, "save_file", interrupted)
    new = {"a": torch.ones(4), "b": torch.ones(4)}
    with pytest.raises(KeyboardInterrupt):
        hf_files.save_hf_checkpoint(str(tmp_path), new, {"v": 2}, max_shard_bytes=16)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    monkeypatch.setattr(safetensors_torch, "save_file", real)
    assert hf_files.save_hf_checkpoint(str(tmp_path), new, {"v": 2}) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_weight_files_are_as_readable_as_config_json(tmp_path, monkeypatch, umask):
    """safetensors >= 0.8 writes each file through a temporary file of mode 0600: an export
    meant for others (a shared directory, a container run as another user) had
    config.json readable and the weights not. Emulated here for any safetensors."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    real = safetensors_torch.save_file

    def private(tensors, filename, **kwargs):
        real(tensors, filename, **kwargs)
        os.chmod(filename, 0o600)

    monkeypatch.setattr(safetensors_torch, "save_file", private)
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    old = os.umask(umask)
    try:
        names = hf_files.save_hf_checkpoint(str(tmp_path), state, {"v": 1},
                                              max_shard_bytes=16)
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    assert oct(os.stat(tmp_path / "config.json").st_mode & 0o777) == oct(expected)
    assert [oct(os.stat(tmp_path / n).st_mode & 0o777) for n in names] == [oct(expected)] * 2




def _hf_model_with_tokenizer(path, words):
    """A one-layer GPT-2 saved with save_pretrained, and a WordLevel tokenizer.json of
    `words` (id = position) beside it."""
    tf = _transformers()
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(words), n_positions=16, n_embd=32,
                                     n_layer=1, n_head=4, eos_token_id=0,
                                     bos_token_id=0)).save_pretrained(str(path))
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_failed_from_hf_overwrite_leaves_the_earlier_import_whole(tmp_path, monkeypatch, tp):
    """from-hf --overwrite copied the new model's tokenizer files over <save>/tokenizer/
    before writing the checkpoint: a full disk then left the tracker naming the earlier
    import, whose recorded tokenizer was now the other model's. The tokenizer is written
    with the checkpoint and moved in with it: a failure leaves --save byte for byte."""
    from tests.write_faults import torch_save_over_quota

    _hf_model_with_tokenizer(tmp_path / "a", ["<|endoftext|>", "[UNK]", "a", "b", "c"])
    _hf_model_with_tokenizer(tmp_path / "b", ["<|endoftext|>", "[UNK]", "x", "y", "z", "w"])
    ck = tmp_path / "ck"
    assert _cli("from-hf", "--input", tmp_path / "a", "--save", ck) == 0
    before = _tree(ck)
    monkeypatch.setattr(torch, "save", torch_save_over_quota)
    with pytest.raises(SystemExit, match="Disk quota exceeded"):
        _cli("from-hf", "--input", tmp_path / "b", "--save", ck, "--overwrite",
             "--tensor-model-parallel-size", tp)
    assert _tree(ck) == before
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "ck"]
    monkeypatch.undo()
    assert _cli("from-hf", "--input", tmp_path / "b", "--save", ck, "--overwrite",
                "--tensor-model-parallel-size", tp) == 0
    assert (ck / "tokenizer" / "tokenizer.json").read_bytes() == \
        (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "release"


def _stopped_to_hf_staging(output, kind="staging"):
    """(the process, its staging directory): a process that made and holds a staging
    directory for `output` as to-hf does (`kind` "from-hf": from-hf's temporary directory
    beside its --save), then sleeps; the caller kills it (or not)."""
    code = ("import sys, time; from megatron import hf_files; "
            "p = hf_files.make_staging(sys.argv[1], sys.argv[2]); "
            "h = hf_files.hold_directory(p); "
            "open(p + '/model.safetensors.tmp', 'wb').write(b'0' * 64); "
            "print(p, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(output), kind],
                            stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    path = proc.stdout.readline().strip()
    assert os.path.isdir(path), path
    os.utime(path, (os.stat(path).st_atime - 600, os.stat(path).st_mtime - 600))
    return proc, path


def test_to_hf_removes_a_stopped_exports_staging_and_names_the_others(tmp_path, capsys):
    """A to-hf stopped by kill -9 (or a power loss) left its `.NAME.staging-*` directory
    beside --output for good, unmentioned. The next to-hf into it removes one whose
    writer provably stopped (this host, no process holds it, unchanged for a minute) and
    names the others, in use or not provably stopped, with the rm -rf that removes them."""
    _train(tmp_path / "ck", "", steps=1)
    out = tmp_path / "hf"
    dead, dead_path = _stopped_to_hf_staging(out)
    live, live_path = _stopped_to_hf_staging(out)
    try:
        dead.kill()
        dead.wait()
        older = tmp_path / ".hf.staging-x1y2z3w4"  # an older to-hf's name: no host in it
        older.mkdir()
        assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out) == 0
        printed = capsys.readouterr().out
        assert f"note: removed {dead_path}, the staging directory of a to-hf into --output " \
               f"{out}, left by a to-hf that was stopped" in printed
        for kept in (live_path, str(older)):
            assert f"note: {kept} is the staging directory of a to-hf into --output {out}, " \
                   "left by a to-hf that was stopped (kill -9, a power loss) or that still " \
                   f"runs; it is not removed, as one running may be writing it. Once none " \
                   f"runs, remove it: rm -rf {kept}" in printed
        assert sorted(os.listdir(tmp_path)) == sorted(
            [".hf.staging-x1y2z3w4", os.path.basename(live_path), "ck", "hf"])
    finally:
        live.kill()
        live.wait()
        live.stdout.close()
        dead.stdout.close()


def test_from_hf_removes_a_stopped_imports_directory_and_names_the_others(tmp_path, capsys):
    """from-hf killed with kill -9 left its `.from-hf-*` directory (a full copy of the
    model) beside --save for good, unmentioned and not tied to any --save. It is now
    `.NAME.from-hf-HOST-PID-*`, held while written; the next from-hf into that --save
    removes one whose writer provably stopped and names the others with their rm -rf."""
    _save_hf_model(tmp_path / "hf", "gpt2")
    save = tmp_path / "ck"
    dead, dead_path = _stopped_to_hf_staging(save, "from-hf")
    live, live_path = _stopped_to_hf_staging(save, "from-hf")
    try:
        assert os.path.basename(dead_path).startswith(".ck.from-hf-")
        dead.kill()
        dead.wait()
        other = tmp_path / ".other.from-hf-x-1-y"  # another --save's: not this one's business
        other.mkdir()
        assert _cli("from-hf", "--input", tmp_path / "hf", "--save", save) == 0
        printed = capsys.readouterr().out
        what = f"the temporary directory of a from-hf into --save {save}"
        assert f"note: removed {dead_path}, {what}, left by a from-hf that was stopped " \
               "(kill -9, a power loss)" in printed
        assert f"note: {live_path} is {what}, left by a from-hf that was stopped (kill -9, " \
               "a power loss) or that still runs; it is not removed, as one running may be " \
               f"writing it. Once none runs, remove it: rm -rf {live_path}" in printed
        assert str(other) not in printed
        assert sorted(os.listdir(tmp_path)) == sorted(
            [".other.from-hf-x-1-y", os.path.basename(live_path), "ck", "hf"])
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "release"
    finally:
        live.kill()
        live.wait()
        live.stdout.close()
        dead.stdout.close()


def test_from_hf_holds_its_directory_while_writing(tmp_path, monkeypatch):
    """While from-hf writes, its directory beside --save is named for that --save, this
    host and process, and held: another from-hf would not take it for a stopped one's."""
    _save_hf_model(tmp_path / "hf", "gpt2")
    seen = []
    real = hf_import._write_unsplit

    def look(root, *args):
        seen.append((os.path.basename(root), hf_files._held(root)))
        return real(root, *args)

    monkeypatch.setattr(hf_import, "_write_unsplit", look)
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
    [(name, held)] = seen
    assert re.fullmatch(rf"\.ck\.from-hf-[\w.]+-{os.getpid()}-\w+", name), name
    assert held is True
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]


def test_to_hf_says_how_to_restore_an_export_left_aside(tmp_path):
    """Killed between its two renames, to-hf --overwrite left --output missing and the
    earlier export only in `.NAME.old-*`; the next to-hf wrote a new export in its place,
    saying nothing. Now it stops first and says how to restore it; with --output in place
    a stopped writer's `.old-*` is removed."""
    _train(tmp_path / "ck", "", steps=1)
    out = tmp_path / "hf"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out) == 0
    before = _tree(out)
    staging = hf_files.make_staging(out)  # the name install_export gives it, but .old-
    os.rmdir(staging)
    aside = Path(staging.replace(".staging-", ".old-"))
    os.rename(out, aside)
    with pytest.raises(SystemExit) as err:
        _cli("to-hf", "--load", tmp_path / "ck", "--output", out)
    message = str(err.value.code)
    assert message.startswith(f"error: --output {out} is missing, and {aside} holds the "
                              "export that was there: a to-hf replacing it was stopped")
    mv = shlex.split(message.split("Restore it: ")[1].split(" (then")[0])
    assert mv == ["mv", str(aside), str(out)] and not out.exists()
    os.rename(mv[1], mv[2])  # what the command does
    assert _tree(out) == before
    aside.mkdir()  # a stopped swap's earlier export, --output in place: removed
    os.utime(aside, (0, 0))
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", out, "--overwrite") == 0
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]
