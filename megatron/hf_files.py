"""Hugging Face model directories on disk: writing an export (safetensors, sharded above a
size, with its index, config.json and generation_config.json; an earlier export's weight
files replaced only once every new one is written; `make_staging` / `install_export` put
a whole export in place of an earlier one) and reading one for import (config.json
checked before any weight is read, then safetensors or weights-only `pytorch_model*.bin`).
The state-dict mappings themselves are in megatron/hf_interop.py."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import re
import shlex
import shutil
import socket
import stat
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_files import refused_object
from megatron.hf_interop import FAMILIES, hf_family

SAFETENSORS_INDEX = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def save_hf_checkpoint(out_dir: str, state: Dict[str, torch.Tensor], config: dict,
                       generation_config: Optional[dict] = None,
                       max_shard_bytes: int = 5 * 2**30) -> List[str]:
    """Write `state` as safetensors (`model.safetensors`, or `model-0000k-of-0000N` shards
    plus `model.safetensors.index.json` above `max_shard_bytes`) and `config.json`
    (+ `generation_config.json`) into `out_dir`. Returns the weight file names. The weight
    files are written under `.tmp` names first and replace an earlier export's only when
    all are written: an interrupted or failed write removes its own and leaves the earlier
    export as it was."""
    os.makedirs(out_dir, exist_ok=True)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    _write_weight_files(out_dir, dict(zip(names, shards)))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        _write_json(os.path.join(out_dir, SAFETENSORS_INDEX), index)
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation_path = os.path.join(out_dir, "generation_config.json")
    if generation_config is not None:
        _write_json(generation_path, generation_config)
    elif os.path.exists(generation_path):  # an earlier export's: not this model's
        os.remove(generation_path)
    return names


def _write_weight_files(out_dir: str, files: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """Each {file name: tensors} as safetensors in `out_dir`, replacing the weight files of
    an earlier export there (as save_pretrained does) once every new one is written. A file
    that cannot be written (safetensors' error too) is an OSError, the new files removed."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    written = []
    try:
        for name, shard in files.items():
            written.append(os.path.join(out_dir, name + ".tmp"))
            try:
                save_file(shard, written[-1], metadata={"format": "pt"})
            except SafetensorError as exc:  # a full disk: the I/O error it is
                raise OSError(f"could not write {written[-1]}: {exc}") from exc
    except BaseException:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        raise
    mode = _new_file_mode()
    for path in written:  # safetensors >= 0.8 writes through a temporary file of mode 0600
        os.chmod(path, mode)
    for old in os.listdir(out_dir):
        if old == SAFETENSORS_INDEX or _WEIGHT_FILE.fullmatch(old):
            os.remove(os.path.join(out_dir, old))
    for path in written:
        os.replace(path, path[:-len(".tmp")])


_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "tokenizer.model")
_EXPORT_NAMES = frozenset(("config.json", "generation_config.json", SAFETENSORS_INDEX)
                          + _TOKENIZER_NAMES)
# Files a Hugging Face loader would read as the model's weights or tokenizer beside (or in
# place of) an export's own: another format's weights, their index, added tokens.
_LOADER_READS = re.compile(r".+\.safetensors|pytorch_model.*\.bin|.+\.index\.json|"
                           r"added_tokens\.json|tf_model\.h5|flax_model\.msgpack")


def export_file(name: str) -> bool:
    """Whether `name` is one of the files an export writes (or its `.tmp` name)."""
    base = name[:-len(".tmp")] if name.endswith(".tmp") else name
    return base in _EXPORT_NAMES or bool(_WEIGHT_FILE.fullmatch(base))


def other_entries(directory: str) -> Tuple[List[str], List[str]]:
    """(kept, refused): the entries of `directory` that are not an export's files, split in
    those an --overwrite carries over into the new export (a README.md, .git, notes) and
    those it refuses (`_LOADER_READS`: a loader would read them with the new export)."""
    names = sorted(n for n in os.listdir(directory) if not export_file(n))
    refused = [n for n in names if _LOADER_READS.fullmatch(n)]
    return [n for n in names if n not in refused], refused


def make_staging(output: str, kind: str = "staging") -> str:
    """A new empty directory beside `output` (in its parent, created if missing) that the
    export is written into before `install_export` moves it to `output`; its name carries
    this host and process (`.NAME.staging-HOST-PID-XXXXXXXX`; `kind` "from-hf": from-hf's
    temporary directory beside its --save, `.NAME.from-hf-HOST-PID-XXXXXXXX`). The writer
    holds it (`hold_directory`) until it is moved in, which tells `leftover_exports` /
    `leftover_imports` a live one from one left by a stopped conversion."""
    target = os.path.realpath(output)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.{kind}-{_owner()}",
                            dir=parent)


def _owner() -> str:
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}-"


class hold_directory:
    """An exclusive flock on the directory `path` (it goes with the directory when renamed),
    held until `close()` or the process ends (kill -9 included); nothing where the file
    system does not lock (`leftover_exports` then removes nothing)."""

    def __init__(self, path: str):
        self.fd: Optional[int] = None
        with contextlib.suppress(OSError):
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_QUIET_S = 60  # a directory changed since is never taken for a stopped writer's
_KINDS = ("staging", "old", "from-hf")  # the directories a conversion leaves beside its output


def _stopped_writer(path: str) -> bool:
    """Whether `path` was made on this host by a writer that no longer runs: its name has
    this host, it is unchanged for a minute and no process holds it (`hold_directory`).
    False where unsure (another host, an older name, a file system without locks)."""
    host = _owner().split("-")[0]
    kinds = "|".join(map(re.escape, _KINDS))
    if not re.search(rf"\.({kinds})-{re.escape(host)}-\d+-[^-]+$", path):
        return False
    try:
        quiet = time.time() - os.stat(path).st_mtime >= _QUIET_S
    except OSError:
        return False
    return quiet and _held(path) is False


def leftover_exports(output: str) -> List[str]:
    """Deal with what a stopped to-hf (kill -9, a power loss) left beside `output`: its
    `.NAME.staging-*` directories and the `.NAME.old-*` earlier export moved aside while
    swapping. Those of a writer that provably no longer runs (`_stopped_writer`) are
    removed; the others are named with the command that removes them. Returns the lines
    to print. SystemExit when `output` is missing and an `.old-*` holds the export that
    was there (stopped between the two renames): how to restore it."""
    target = os.path.realpath(output)
    lines = []
    for kind, path in _left_beside(output, ("staging", "old")):
        if kind == "old" and not os.path.lexists(target) and not _held(path):
            raise SystemExit(
                f"error: --output {output} is missing, and {path} holds the export that was "
                "there: a to-hf replacing it was stopped between moving it aside and moving "
                f"the new one in. Restore it: mv {shlex.quote(path)} {shlex.quote(output)} "
                f"(then run again with --overwrite), or drop it: rm -rf {shlex.quote(path)}")
        what = ("the staging directory of a to-hf into --output" if kind == "staging" else
                "an earlier export moved aside by a to-hf that replaced --output")
        lines.append(_remove_or_name(path, f"{what} {output}", "to-hf"))
    return lines


def leftover_imports(save: str) -> List[str]:
    """Deal with what a stopped from-hf (kill -9, a power loss) left beside `save`: its
    `.NAME.from-hf-*` temporary directories, each a full copy of a model. As
    `leftover_exports`: those of a writer that provably no longer runs are removed, the
    others named with the command that removes them. Returns the lines to print."""
    return [_remove_or_name(path, f"the temporary directory of a from-hf into --save {save}",
                            "from-hf") for _, path in _left_beside(save, ("from-hf",))]


def _left_beside(output: str, kinds: Tuple[str, ...]) -> List[Tuple[str, str]]:
    """(kind, path) of the directories `.NAME.KIND-*` beside `output` (NAME its own)."""
    target = os.path.realpath(output)
    parent, base = os.path.dirname(target), os.path.basename(target)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    found = []
    for name in names:
        kind = next((k for k in kinds if name.startswith(f".{base}.{k}-")), None)
        path = os.path.join(parent, name)
        if kind is not None and os.path.isdir(path):
            found.append((kind, path))
    return found


def _remove_or_name(path: str, what: str, tool: str) -> str:
    """Remove `path` when its writer provably stopped (`_stopped_writer`); the line saying
    what was done, or naming it with the command that removes it."""
    if _stopped_writer(path):
        shutil.rmtree(path, ignore_errors=True)
        return (f"note: removed {path}, {what}, left by a {tool} that was stopped (kill -9, "
                "a power loss)")
    return (f"note: {path} is {what}, left by a {tool} that was stopped (kill -9, a power "
            "loss) or that still runs; it is not removed, as one running may be writing it. "
            f"Once none runs, remove it: rm -rf {shlex.quote(path)}")


def _held(path: str) -> Optional[bool]:
    """Whether a process holds `path` (`hold_directory`): a to-hf writing or swapping it
    now; None when that cannot be told (not readable, a file system without locks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def install_export(staging: str, output: str) -> List[str]:
    """Make the complete export in `staging` the directory `output`, as a whole: the entries
    of an earlier `output` that `other_entries` keeps are moved into it, the earlier
    directory is renamed aside, `staging` renamed to `output` and the earlier one removed.
    A failure (OSError) moves everything back: `output` as it was. Returns the kept names."""
    target = os.path.realpath(output)
    umask = os.umask(0)
    os.umask(umask)
    if not os.path.isdir(target):
        os.chmod(staging, 0o777 & ~umask)  # as os.makedirs makes it (mkdtemp's is 0700)
        os.rename(staging, target)
        return []
    os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))
    held = hold_directory(target)  # goes aside with it: `leftover_exports` sees it in use
    try:
        return _swap_in(staging, target)
    finally:
        held.close()


def _swap_in(staging: str, target: str) -> List[str]:
    """`install_export` over an existing `target` (held by the caller)."""
    kept, moved, old = other_entries(target)[0], [], None
    try:
        for name in kept:
            os.rename(os.path.join(target, name), os.path.join(staging, name))
            moved.append(name)
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-{_owner()}",
                               dir=os.path.dirname(target))
        os.rename(target, old)  # onto the empty directory `old`
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
    except BaseException:
        for name in moved:
            os.rename(os.path.join(staging, name), os.path.join(target, name))
        if old is not None and os.path.isdir(old) and not os.listdir(old):
            os.rmdir(old)
        raise
    try:
        shutil.rmtree(old)
    except OSError as exc:
        print(f"WARNING: the earlier export, moved aside to {old}, could not be removed "
              f"({exc}); remove it by hand")
    return kept


def _new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under 022), as
    config.json has: weight files readable only by their writer could not be shared."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_in_place(path: str, write) -> None:
    """`write(tmp)` writes the file's content to `<path>.tmp`, renamed to `path` when
    complete: a full disk leaves no truncated file under the name (a truncated merges.txt
    loads as a tokenizer with fewer merges), the temporary file removed."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_json(path: str, data: dict) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")

    write_in_place(path, write)


_EXPECTED = ("a Hugging Face model directory as save_pretrained writes it (config.json "
             "and model.safetensors or pytorch_model.bin, or their shards and *.index.json)")


def _missing_config_message(in_dir: str) -> str:
    """Why --input `in_dir` holds no config.json, and the fix: a file given for its
    directory, a Hub model name (from-hf reads local files only), a checkpoint of
    Megatron's layout, or another directory."""
    if os.path.isfile(in_dir):
        parent = os.path.dirname(in_dir) or "."
        return (f"--input {in_dir} is a file; pass the model directory that holds it and its "
                f"config.json: --input {shlex.quote(parent)}")
    if not os.path.exists(in_dir):
        hub = "" if in_dir.startswith((".", "/", "~")) or in_dir.count("/") > 1 else (
            f"; from-hf reads a local directory, not a Hugging Face Hub name: download it "
            f"first (huggingface-cli download {in_dir} --local-dir DIR) and pass --input DIR")
        return f"--input {in_dir} does not exist{hub}"
    if os.path.isfile(os.path.join(in_dir, "latest_checkpointed_iteration.txt")):
        return (f"--input {in_dir}: no config.json there; it is a checkpoint in Megatron-LM's "
                "layout (latest_checkpointed_iteration.txt), which needs no import: pass it to "
                "--load as it is (to-hf exports it to Hugging Face)")
    return f"--input {in_dir}: no config.json there; from-hf reads {_EXPECTED}"


def read_hf_config(in_dir: str) -> dict:
    """config.json of the Hugging Face model directory `in_dir`, checked before any weight
    is read: it exists, parses, and names a model_type from-hf converts. ValueError naming
    the directory, what is missing and what is expected."""
    cfg_path = os.path.join(in_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(_missing_config_message(in_dir))
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--input {in_dir}: config.json does not parse as JSON ({exc}); "
                         f"from-hf reads {_EXPECTED}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ValueError(f"--input {in_dir}: config.json has no model_type, so it is not a "
                         f"model's config; from-hf reads {_EXPECTED}, of a "
                         f"{' or '.join(FAMILIES)} model")
    try:
        hf_family(cfg)
    except ValueError as exc:
        raise ValueError(f"--input {in_dir}: {exc}") from None
    return cfg


def _hf_weight_files(in_dir: str) -> Tuple[List[str], bool]:
    """(the weight files to read, whether they are safetensors): those of
    `model.safetensors.index.json`, else `model.safetensors`, else every `*.safetensors`,
    else `pytorch_model*.bin`. ValueError when there are none, or the index names files
    that are not there or not inside `in_dir` (a crafted index naming ../ or /abs paths
    would import other files than the model's)."""
    index = os.path.join(in_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, OSError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"--input {in_dir}: {SAFETENSORS_INDEX} is not a shard index "
                             f"(its weight_map: {exc!r}); download it again") from None
        outside = [n for n in files if not _shard_name_inside(n)]
        if outside:
            raise ValueError(f"--input {in_dir}: {SAFETENSORS_INDEX} names "
                             f"{_shown_names(outside)} as shard file(s); a shard is named by a "
                             "file name inside the model directory (not a number, nor a path "
                             "that leaves it): download the model's index again")
        missing = [n for n in files if not os.path.isfile(os.path.join(in_dir, n))]
        if missing:
            raise ValueError(f"--input {in_dir}: {SAFETENSORS_INDEX} names "
                             f"{len(missing)} file(s) that are not there ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}); download every shard of "
                             "the model into the directory")
        return files, True
    if os.path.isfile(os.path.join(in_dir, "model.safetensors")):
        return ["model.safetensors"], True
    files = sorted(n for n in os.listdir(in_dir) if n.endswith(".safetensors"))
    if files:
        return files, True
    files = sorted(n for n in os.listdir(in_dir) if n.startswith("pytorch_model") and n.endswith(".bin"))
    if not files:
        raise ValueError(f"--input {in_dir}: config.json but no weights (no *.safetensors or "
                         f"pytorch_model*.bin); from-hf reads {_EXPECTED}")
    return files, False


def _shard_name_inside(name) -> bool:
    """Whether a weight_map value is a relative path that stays inside the directory."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\0" in name:
        return False
    return ".." not in os.path.normpath(name).split(os.sep)


def _shown_names(names: list) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > 3 else ""
    return ", ".join(repr(n) for n in names[:3]) + more


def load_hf_checkpoint(in_dir: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config.json contents, state dict) of a Hugging Face model directory: config.json
    checked first (`read_hf_config`), then the files of `_hf_weight_files` (a .bin loaded
    with weights_only=True). ValueError with one line for a directory that is not a model
    from-hf converts, or an unreadable weights file."""
    cfg = read_hf_config(in_dir)
    files, safetensors = _hf_weight_files(in_dir)
    state: Dict[str, torch.Tensor] = {}
    if not safetensors:
        for name in files:
            state.update(_load_bin(os.path.join(in_dir, name)))
        return cfg, state
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for name in files:
        try:
            state.update(load_file(os.path.join(in_dir, name)))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"--input {in_dir}: {name} is not a readable safetensors file "
                             f"({exc}); download it again") from None
    return cfg, state


def _load_bin(path: str) -> Dict[str, torch.Tensor]:
    """A `pytorch_model*.bin`, weights_only; ValueError naming the file and what it pickles
    beside tensors (torch's own message would advise weights_only=False, which runs it)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"--input {path} holds a pickled {refused_object(exc)}, not only tensors; weight "
            "files are read without running pickled code (unpickling this could run any "
            "code), so it is not loaded. Use the model's *.safetensors files, or a "
            "pytorch_model.bin that holds tensors only") from None


__all__ = ["SAFETENSORS_INDEX", "export_file", "hold_directory", "install_export",
           "leftover_exports", "load_hf_checkpoint", "make_staging", "other_entries",
           "read_hf_config", "save_hf_checkpoint"]
