#!/usr/bin/env python
"""Checkpoint conversion tool: one subcommand per conversion.

    python tools/checkpoint_convert.py reshard --load CKPT --save OUT \\
        --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 \\
        [--target-num-layers-per-virtual-pipeline-stage K] [--iteration I] \\
        [--target-use-distributed-optimizer | --target-no-distributed-optimizer]
        [--no-load-optim]

A target size left out keeps the saved one. `reshard` rewrites a checkpoint saved by
pretrain_gpt.py with any (tp, pp, virtual
stages, distributed optimizer or not) for another layout, model AND optimizer state (fp32
main weights, Adam moments, step, loss scaler, scheduler and counters), so that a run with
the target layout loads it directly (no resharding on load). The data-parallel size is
free: the distributed optimizer's `distrib_optim.pt` loads with any dp. The model shape
comes from the `args` stored in the checkpoint; the precision stays the saved one. The
vocabulary is re-padded for the target tp (`--make-vocab-size-divisible-by` x tp), the
padding rows cut or added as copies of the last row (the training loss counts padding
rows, so a run resumed with more of them starts at a slightly higher loss: README,
"Checkpoints"). RNG states are per rank: they are kept when tp and pp do
not change, else the resumed run starts fresh ones. An optimizer state that cannot be
matched to the parameters (groups split by other weight-decay rules) stops the reshard
with one line; --no-load-optim leaves the optimizer state out. The output is written to
`OUT/iter_XXXXXXX.tmp/`, renamed into place, then the tracker file is written. An OUT
that already holds a checkpoint is refused (a resume from it would go back to the
converted iteration) unless --overwrite is given, for every subcommand that writes one;
`to-hf` likewise refuses an --output directory that is not empty. While it writes, a
subcommand holds --save's lock (megatron/save_lock.py), as a training run holds its own:
a run saving into OUT, or another conversion into it, makes it stop with one line naming
that holder (and a run started meanwhile stops naming the conversion).

    python tools/checkpoint_convert.py to-megatron --load CKPT --save OUT [--iteration I]

`to-megatron` writes the same checkpoint in the form Megatron-LM 23.05 itself writes and
loads (`args` an argparse.Namespace, the model state nested under `language_model`); the
files of `reshard` and of training load with `torch.load(..., weights_only=True)` instead.
Checkpoints in Megatron-LM's form load here directly (`--load`, `reshard`).
"""
# Subcommands are registered in SUBCOMMANDS: name -> (add_arguments(parser), run(args) -> exit
# status).
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megatron import checkpoint_reshard as reshard_lib
from megatron import hf_convert, hf_import
from megatron.arguments_inputs import home_not_expanded
from megatron.checkpoint_dirs import (
    free_space_text,
    is_legacy_model_file,
    model_file,
    no_rank_dirs_message,
    same_dir,
)
from megatron.checkpoint_files import (
    load_checkpoint_file,
    megatron_distrib_payload,
    megatron_payload,
)
from megatron.checkpoint_identity import (
    distrib_file_problem,
    file_identity,
    rank_file_problem,
    split_distrib_identity,
    with_distrib_identity,
)
from megatron.checkpointing import (
    MODEL_FILENAME,
    TRACKER_FILENAME,
    interrupt_behind,
    iteration_dir_name,
    list_checkpoints,
    move_into_place,
    rank_dir_name,
    tracker_path,
    write_tracker,
)
from megatron.entry_state import project_warnings_in_one_line
from megatron.save_lock import SaveDirLock
from megatron.write_errors import no_room_error, room_fix, write_error_text
from tools.interruptible import run_interruptible


# ---------------------------------------------------------------------------- reshard
def add_reshard_arguments(p: argparse.ArgumentParser) -> None:
    """Reshard a checkpoint to another tensor / pipeline / virtual-pipeline layout."""
    p.add_argument("--load", required=True, help="checkpoint directory to read")
    p.add_argument("--save", required=True, help="directory to write (not --load)")
    # The spellings without -model- are Megatron-LM's tools/checkpoint_util.py's.
    p.add_argument("--target-tensor-model-parallel-size", "--target-tensor-parallel-size",
                   dest="target_tensor_model_parallel_size", type=int, default=None,
                   help="default: the saved tensor-parallel size")
    p.add_argument("--target-pipeline-model-parallel-size", "--target-pipeline-parallel-size",
                   dest="target_pipeline_model_parallel_size", type=int, default=None,
                   help="default: the saved pipeline-parallel size")
    p.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per virtual stage (interleaved schedule); default: none")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    opt = p.add_mutually_exclusive_group()
    opt.add_argument("--target-use-distributed-optimizer", dest="target_distributed",
                     action="store_true", default=None,
                     help="write the optimizer for --use-distributed-optimizer")
    opt.add_argument("--target-no-distributed-optimizer", dest="target_distributed",
                     action="store_false", help="write it for the plain optimizer")
    add_no_load_optim_argument(p)
    add_overwrite_argument(p)


def _tp_split_sizes(args: dict) -> Dict[str, int]:
    """What tensor parallelism splits, by name -> size: heads, key/value groups, the MLP."""
    sizes = {"--num-attention-heads": int(args["num_attention_heads"])}
    if args.get("group_query_attention") and args.get("num_query_groups"):
        sizes["--num-query-groups"] = int(args["num_query_groups"])
    if args.get("ffn_hidden_size"):
        sizes["--ffn-hidden-size"] = int(args["ffn_hidden_size"])
    return sizes


TARGET_FLAGS = ("--target-tensor-model-parallel-size", "--target-pipeline-model-parallel-size")


def check_target_layout(args: dict, tp: int, pp: int, virtual: bool = False,
                        flags: Tuple[str, str] = TARGET_FLAGS) -> None:
    """SystemExit before any work when the saved model cannot be split for the target: tp
    must divide the heads, the key/value groups and the MLP width (the vocabulary is
    re-padded for tp), pp the layers (over pp - 1 stages with a standalone embedding stage,
    which `virtual` stages drop; those are checked by `_virtual_stages`). `flags` are the
    names of the (tp, pp) options the messages cite."""
    sizes = _tp_split_sizes(args)
    bad = [f"{name} {size}" for name, size in sizes.items() if size % tp]
    if bad:
        common = math.gcd(*sizes.values())
        fits = [str(d) for d in range(1, common + 1) if common % d == 0]
        raise SystemExit(f"error: {flags[0]} {tp} does not divide the "
                         f"saved model's {' and '.join(bad)}; tensor parallelism splits them "
                         f"evenly. Use a size that divides them: {', '.join(fits)}")
    layers = int(args["num_layers"])
    standalone = args.get("standalone_embedding_stage") and pp > 1 and not virtual
    stages = pp - 1 if standalone else pp
    if layers % stages:
        first = 1 if args.get("standalone_embedding_stage") and not virtual else 0
        fits = [1] + [d + first for d in range(1, layers + 1) if layers % d == 0 and d + first > 1]
        raise SystemExit(f"error: {flags[1]} {pp} does not divide "
                         f"the saved model's {layers} layers over {stages} stage(s); every "
                         f"stage needs the same number of layers. Use a size that fits: "
                         f"{', '.join(map(str, fits))}")


def _virtual_stages(num_layers: int, pp: int, layers_per_stage: Optional[int]) -> int:
    """Model chunks per pipeline rank; SystemExit naming the sizes when they do not fit."""
    if layers_per_stage is None:
        return 1
    flag = f"--target-num-layers-per-virtual-pipeline-stage {layers_per_stage}"
    if layers_per_stage < 1:
        raise SystemExit(f"error: {flag} must be >= 1 (transformer layers in each virtual "
                         "pipeline stage); leave the flag out for no virtual stages")
    if pp < 2:  # pretrain_gpt.py refuses the flag there; Megatron-LM 23.05 needs pp > 2
        raise SystemExit(f"error: {flag} needs a target pipeline-parallel size >= 2 (it is "
                         f"{pp}; Megatron-LM 23.05 needs > 2): virtual stages split each "
                         "pipeline rank's layers. Leave the flag out, or give "
                         "--target-pipeline-model-parallel-size")
    if num_layers % pp or (num_layers // pp) % layers_per_stage:
        raise SystemExit(f"error: {flag} does not divide the {num_layers} layers over "
                         f"{pp} pipeline stages")
    return num_layers // pp // layers_per_stage


def tokenizer_vocab_size(args: dict) -> Optional[int]:
    """The vocabulary size before padding of the saved run's tokenizer: from the arguments
    and the vocab file (NullTokenizer, GPT2BPETokenizer), else from the tokenizer built
    from its stored files (SentencePiece, Hugging Face), as pretrain_gpt.py pads it; None
    when those files are not readable here."""
    from megatron.arguments_validate import default_vocab_size
    from megatron.tokenizer import build_tokenizer

    try:
        return default_vocab_size(argparse.Namespace(**args))
    except (SystemExit, OSError, ValueError, KeyError, AttributeError, TypeError):
        pass
    try:
        return build_tokenizer(args["tokenizer_type"], vocab_file=args.get("vocab_file"),
                               merge_file=args.get("merge_file"),
                               tokenizer_model=args.get("tokenizer_model"),
                               vocab_size=args.get("vocab_size"),
                               vocab_extra_ids=args.get("vocab_extra_ids") or 0).vocab_size
    except (SystemExit, OSError, ValueError, KeyError, RuntimeError, ImportError):
        return None


def _target_padded_vocab(args: dict, tp: int, orig_vocab_size: Optional[int] = None) -> int:
    """Megatron's padding rule for the target tp, from `orig_vocab_size` when given, else
    the tokenizer's size (`tokenizer_vocab_size`), else the saved padded size."""
    from megatron.arguments_validate import pad_vocab_size

    divisor = int(args.get("make_vocab_size_divisible_by") or 1)
    orig = orig_vocab_size or tokenizer_vocab_size(args)
    if orig is not None:
        return pad_vocab_size(orig, divisor, tp)
    saved = int(args["padded_vocab_size"])
    padded = pad_vocab_size(saved, divisor, tp)
    if int(args.get("tensor_model_parallel_size") or 1) != tp:
        print(f"warning: the tokenizer's vocabulary size is not known here (tokenizer "
              f"{args.get('tokenizer_type')}: its files are not readable on this machine), so "
              f"the target is padded from the saved {saved} rows to {padded}; a run at tensor "
              f"parallel size {tp} pads the real vocabulary itself and may get fewer rows, and "
              "then refuses this checkpoint. Convert where the tokenizer files (the paths "
              "stored in the checkpoint's args) are readable, or give the real size with "
              "tools/checkpoint_util.py --true-vocab-size", file=sys.stderr)
    return padded


def target_args(saved: dict, tp: int, pp: int, vpp: int, layers_per_stage: Optional[int],
                distributed: bool, orig_vocab_size: Optional[int] = None) -> dict:
    """The saved arguments with the target layout written in (the vocabulary padded from
    `orig_vocab_size` when given: see `_target_padded_vocab`)."""
    args = dict(saved)
    args.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=layers_per_stage if vpp > 1 else None,
        use_distributed_optimizer=distributed,
        standalone_embedding_stage=bool(saved.get("standalone_embedding_stage")) and pp > 1
        and vpp == 1,
        padded_vocab_size=_target_padded_vocab(saved, tp, orig_vocab_size))
    if tp == 1:
        args["sequence_parallel"] = False
    return args


def _stage_modules(config, pp: int, pp_rank: int, vpp: int, standalone: bool):
    """(chunks on the meta device at tp 1, their layer offsets) of one target pp rank."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.stages import stage_layout

    specs = stage_layout(config.model.num_layers, pp, pp_rank, vpp if vpp > 1 else None,
                         standalone)
    modules = [GPTModel(config.model, pre_process=s.pre_process, post_process=s.post_process,
                        num_layers=s.num_layers, layer_offset=s.layer_offset, device="meta")
               for s in specs]
    return modules, [s.layer_offset for s in specs]


def held_checkpoints(save: str) -> List[str]:
    """What of a checkpoint `save` already holds: its tracker file (with the iteration it
    names), then its iter_*/release directories; [] for none."""
    found = list_checkpoints(save)
    if os.path.isfile(tracker_path(save)):
        with open(tracker_path(save)) as f:
            found.insert(0, f"{TRACKER_FILENAME} ({f.read().strip()!r})")
    return found


# the real paths of the --save directories this process holds -> whether it created them
_LOCKED: Dict[str, bool] = {}


@contextlib.contextmanager
def save_locked(save: str, tool: str):
    """Hold `save`'s lock (megatron/save_lock.py: the one a training run holds on its
    --save) while a conversion writes into it; SystemExit naming the holder when another
    process holds it -- a run saving there, or another conversion: either would remove or
    replace this one's iter_N.tmp, or this one theirs. `save` is created for the lock and
    removed at the end when this call created it and it is still empty. Held already (a
    from-hf that reshards into its --save), it is not taken again."""
    if os.path.exists(save) and not os.path.isdir(save):
        raise SystemExit(f"error: --save {save} is a file; pass a directory")
    tilde = home_not_expanded("--save", save)
    if tilde:
        raise SystemExit(f"error: {tilde}")
    key = os.path.realpath(save)
    if key in _LOCKED:
        yield
        return
    created = not os.path.exists(save)
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as exc:  # a read-only file system, no permission: no traceback
        raise SystemExit(f"error: --save {save} cannot be used: could not create it "
                         f"({type(exc).__name__}: {exc}); pass a directory that can be "
                         "created and written to") from None
    lock = SaveDirLock(save, holder=f"run of tools/checkpoint_convert.py {tool}")
    try:
        try:
            error = lock.acquire()
        except OSError as exc:  # a read-only --save that exists
            error = (f"error: --save {save} cannot be used: could not write its lock file "
                     f"({type(exc).__name__}: {exc}); pass a directory that can be written to")
        if error is not None:
            raise SystemExit(error)
        if lock.unsupported:
            print(f"note: --save {save}: its file system does not lock files "
                  f"({lock.unsupported}), so a run writing the same directory would not be "
                  "detected", flush=True)
        _LOCKED[key] = created
        yield
    finally:
        _LOCKED.pop(key, None)
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(save)  # only when empty


def check_save(save: str, overwrite: bool = False) -> None:
    """Before any work: SystemExit when `save` is a file, or already holds a checkpoint (a
    tracker file, iter_*/release directories) and not `overwrite`. Writing there would
    replace a directory of the same name and point the tracker at the converted
    iteration: a run resuming from `save` would go back to it and later overwrite the
    newer iterations."""
    if os.path.exists(save) and not os.path.isdir(save):
        raise SystemExit(f"error: --save {save} is a file; pass a directory")
    found = held_checkpoints(save)
    if found and not overwrite:
        raise SystemExit(f"error: --save {save} already holds a checkpoint: {', '.join(found)}; "
                         "writing there would replace a directory of the same name and the "
                         "tracker. Pass an empty or new directory, or add --overwrite to "
                         "replace them")


def publish_checkpoint(save: str, tmp_dir: str, final_dir: str, iteration: int,
                       release: bool) -> None:
    """Move the written directory into place (replacing an older one, which only
    `check_save(..., overwrite=True)` lets through: each replacement is printed), tracker
    last."""
    if os.path.exists(final_dir):
        print(f"overwrite: replacing {final_dir}")
    move_into_place(save, tmp_dir, final_dir)  # an only-copy .old stays until it is in place
    tracker, value = tracker_path(save), "release" if release else str(iteration)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            before = f.read().strip()
        if before != value:
            print(f"overwrite: {tracker} said {before!r}, now {value!r}")
    write_tracker(save, iteration, release)  # fsynced, through its own temporary name


class Progress:
    """One line per finished step of a conversion (`done(name)`: the count, the name and
    the seconds so far), flushed, so that a conversion of a large model shows it is
    moving; `title` is printed first."""

    def __init__(self, total: int, title: str):
        self.total, self.count, self.start = total, 0, time.monotonic()
        print(f"{title} ...", flush=True)

    def done(self, name: str) -> None:
        self.count += 1
        print(f"  [{self.count}/{self.total}] {name} ({time.monotonic() - self.start:.0f} s)",
              flush=True)


def save_file(obj, path: str) -> None:
    """torch.save(obj, path). torch.save reports a file it cannot finish writing (a full
    disk, a quota) as a RuntimeError ("unexpected pos 20480 vs 20374", "iostream error"),
    not an OSError: raised here as the OSError it is, naming the file, which
    `partial_output` turns into its one line with the free space. The file is opened here
    so that it is closed when the write fails: torch.save given the path keeps its file
    open in the failed writer, which the error's traceback holds, so the space of the
    removed partial output stayed in use and the message said 0 bytes free."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except RuntimeError as exc:
        interrupt = interrupt_behind(exc)
        if interrupt is not None:  # Ctrl-C midway: reported as the interrupt it is
            raise interrupt from None
        inner = no_room_error(exc)  # a full disk, quota or file-size limit: say which
        if inner is not None:
            raise OSError(inner.errno, inner.strerror, path) from exc
        raise OSError(f"could not write {path}: {exc}") from exc


@contextlib.contextmanager
def partial_output(save: str, tmp_dir: str):
    """Yield `tmp_dir` (emptied) to write a checkpoint into; if the body fails or is
    interrupted (Ctrl-C, a full disk), remove it, and `save` too when this call created
    it and it is empty, so that no partial output stays behind (the next attempt starts
    clean either way). A write error (OSError) is then a SystemExit naming it and the
    free space."""
    created = not os.path.exists(save) or _LOCKED.get(os.path.realpath(save), False)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        yield tmp_dir
    except BaseException as exc:
        writing = os.path.isdir(tmp_dir)  # (not yet moved into place)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(save)
        if isinstance(exc, OSError) and writing:  # a full disk, a quota: no traceback
            where = (save if os.path.isdir(save) and not created
                     else os.path.dirname(os.path.abspath(save)))
            raise SystemExit(f"error: writing {tmp_dir} failed ({write_error_text(exc)}); "
                             f"its partial output was removed; {free_space_text(where)}. "
                             f"{room_fix(exc, 'another --save')}") from exc
        raise


def add_overwrite_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="allow a --save that already holds a checkpoint: a directory of the "
                        "same iteration is replaced and the tracker points at the new one")


def add_no_load_optim_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-load-optim", action="store_true",
                   help="leave the optimizer state out: the output holds the model weights, "
                        "scheduler and counters (for a checkpoint whose optimizer state "
                        "cannot be resharded); a run loading it passes --no-load-optim too")


# A checkpoint's problem the reshard cannot get past, and how to get the model out anyway.
NO_OPTIMIZER_FIX = ("pass --no-load-optim to write the model weights without the optimizer "
                    "state (a run loading the output passes --no-load-optim too)")


def reshard(load: str, save: str, tp: int, pp: int, layers_per_stage: Optional[int] = None,
            iteration: Optional[int] = None, distributed: Optional[bool] = None,
            overwrite: bool = False, orig_vocab_size: Optional[int] = None,
            with_optimizer: bool = True) -> dict:
    """Write the checkpoint under `load` (tracker's iteration unless given) to `save` with
    the target layout; `distributed` None keeps the saved optimizer kind; a checkpoint
    already in `save` is refused unless `overwrite` (`check_save`); `orig_vocab_size`, the
    vocabulary size before padding, overrides the tokenizer's for the re-padding; without
    `with_optimizer` the output holds no optimizer state. Returns a summary {iteration,
    source, target, files, notes, directory}. SystemExit naming the problem (and for an
    optimizer state that cannot be mapped, NO_OPTIMIZER_FIX) when the checkpoint cannot
    be resharded. `save`'s lock is held meanwhile (`save_locked`)."""
    if same_dir(save, load):
        raise SystemExit(f"error: --save must differ from --load (the source stays untouched): "
                         f"{save} and {load} name one directory")
    with save_locked(save, "reshard"):
        check_save(save, overwrite)
        return _reshard(load, save, tp, pp, layers_per_stage, iteration, distributed,
                        orig_vocab_size, with_optimizer)


def _reshard(load: str, save: str, tp: int, pp: int, layers_per_stage: Optional[int],
             iteration: Optional[int], distributed: Optional[bool],
             orig_vocab_size: Optional[int], with_optimizer: bool) -> dict:
    """`reshard` once `save` is locked and checked."""
    iter_dir, iteration, release = reshard_lib.locate_iteration(load, iteration)
    src = reshard_lib.SourceCheckpoint(iter_dir)
    if not src.args:
        raise SystemExit(f"error: {iter_dir} has no 'args': the model shape is unknown (was it "
                         "written by pretrain_gpt.py?)")
    src.check_complete()  # before "writing ... to <save>" is printed
    check_target_layout(src.args, tp, pp, layers_per_stage is not None)
    vpp = _virtual_stages(src.num_layers, pp, layers_per_stage)
    notes = set()
    first_file = model_file(os.path.join(iter_dir, rank_dir_name(0, 0, src.layout.pp)))
    if is_legacy_model_file(first_file):
        notes.add("a Megatron-LM 23.04-layout distributed-optimizer checkpoint: its optimizer "
                  "state (per-data-parallel optim.pt files) is not read, the output holds none "
                  "(load it with --no-load-optim)")
    if distributed is None:
        distributed = src.layout.optimizer == "distributed"
    args = target_args(src.args, tp, pp, vpp, layers_per_stage, distributed, orig_vocab_size)
    config = reshard_lib.config_from_args(args, padded_vocab_size=args["padded_vocab_size"])
    kind = None
    if src.layout.optimizer is not None and with_optimizer:
        mixed = args.get("fp16") or args.get("bf16")
        kind = "distributed" if distributed else "mixed" if mixed else "fp32"
    elif src.layout.optimizer is not None:
        notes.add("--no-load-optim: the optimizer state was left out; a run loading the "
                  "output passes --no-load-optim too and starts a fresh optimizer")
    final_dir = os.path.join(save, iteration_dir_name(iteration, release))
    try:
        with partial_output(save, final_dir + ".tmp") as tmp_dir:
            files = _write_ranks(src, tmp_dir, config, args, (tp, pp, vpp), kind, notes)
            publish_checkpoint(save, tmp_dir, final_dir, iteration, release)
    except reshard_lib.OptimizerStateError as exc:
        raise SystemExit(f"error: cannot reshard the optimizer state: {exc.problem}; "
                         f"{NO_OPTIMIZER_FIX}") from None
    except ValueError as exc:  # shapes or parameters the checkpoint's args did not tell
        raise SystemExit(f"error: cannot reshard {iter_dir}: {exc}") from None
    target = reshard_lib.Layout(tp, pp, vpp, kind)
    return {"iteration": iteration, "source": src.layout, "target": target, "files": files,
            "notes": sorted(notes), "directory": final_dir}


def _write_ranks(src, tmp_dir: str, config, args: dict, layout: Tuple[int, int, int],
                 kind: Optional[str], notes: set) -> int:
    """Every target rank's files of the (tp, pp, vpp) `layout` under `tmp_dir` (the
    optimizer in `kind`, None: none); returns how many files were written."""
    tp, pp, vpp = layout
    fp32_grads = bool(args.get("accumulate_allreduce_grads_in_fp32"))
    grad_dtype = (lambda prm: torch.float32) if fp32_grads else (lambda prm: prm.dtype)
    files, progress = 0, Progress(tp * pp, f"writing {_rank_files(tp * pp)} to {tmp_dir}")
    for p in range(pp):
        modules, offsets = _stage_modules(config, pp, p, vpp, args["standalone_embedding_stage"])
        for t in range(tp):
            plan = reshard_lib.plan_rank(modules, offsets, tp, t, (pp, p),
                                         module_tp_size=1, grad_dtype_of=grad_dtype)
            rank_dir = os.path.join(tmp_dir, rank_dir_name(t, p, pp))
            files += _write_rank(src, plan, kind, notes, args, rank_dir)
            progress.done(rank_dir_name(t, p, pp))
    return files


def _write_rank(src, plan, kind: Optional[str], notes: set, args: dict, rank_dir: str) -> int:
    """One target rank's files under `rank_dir`; returns how many were written. Its
    payload is freed on return, before the next rank's is built: one rank's tensors in
    memory at a time, not two."""
    payload, distrib = reshard_lib.build_rank_payload(src, plan, kind, notes)
    payload["args"] = args
    os.makedirs(rank_dir)
    save_file(payload, os.path.join(rank_dir, MODEL_FILENAME))
    if distrib is None:
        return 1
    save_file(with_distrib_identity(distrib, payload),  # its step, checked on load
              os.path.join(rank_dir, reshard_lib.DISTRIB_FILENAME))
    return 2


def _default_targets(a: argparse.Namespace) -> None:
    """A target size left out keeps the saved one (some target must be given: a size, the
    virtual stages or the optimizer's form)."""
    targets = (a.target_tensor_model_parallel_size, a.target_pipeline_model_parallel_size,
               a.target_num_layers_per_virtual_pipeline_stage, a.target_distributed)
    if all(t is None for t in targets):
        raise SystemExit("error: give --target-tensor-model-parallel-size and/or "
                         "--target-pipeline-model-parallel-size (one left out keeps the "
                         "saved size), --target-num-layers-per-virtual-pipeline-stage, or "
                         "--target-use-distributed-optimizer / "
                         "--target-no-distributed-optimizer")
    # reshard() looks it up again and prints the note about an `.old` copy: once
    iter_dir, _, _ = reshard_lib.locate_iteration(a.load, a.iteration, note=lambda _: None)
    saved = reshard_lib.SourceCheckpoint(iter_dir).layout
    if a.target_tensor_model_parallel_size is None:
        a.target_tensor_model_parallel_size = saved.tp
    if a.target_pipeline_model_parallel_size is None:
        a.target_pipeline_model_parallel_size = saved.pp


def run_reshard(a: argparse.Namespace) -> int:
    _default_targets(a)
    for flag, value in (("--target-tensor-model-parallel-size", a.target_tensor_model_parallel_size),
                        ("--target-pipeline-model-parallel-size",
                         a.target_pipeline_model_parallel_size)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    out = reshard(a.load, a.save, a.target_tensor_model_parallel_size,
                  a.target_pipeline_model_parallel_size,
                  a.target_num_layers_per_virtual_pipeline_stage, a.iteration,
                  a.target_distributed, a.overwrite, with_optimizer=not a.no_load_optim)
    print_reshard_summary(a.load, out)
    return 0


def print_reshard_summary(load: str, out: dict) -> None:
    """The lines a reshard prints when done: source and target layouts, files, notes."""
    print(f"resharded iteration {out['iteration']} of {load} ({out['source'].describe()}) "
          f"-> {out['directory']} ({out['target'].describe()}): {_rank_files(out['files'])}")
    for note in out["notes"]:
        print(f"  note: {note}")


# ------------------------------------------------------------------------ to-megatron
def add_to_megatron_arguments(p: argparse.ArgumentParser) -> None:
    """Rewrite a checkpoint in the form Megatron-LM 23.05 itself loads."""
    p.add_argument("--load", required=True, help="checkpoint directory to read")
    p.add_argument("--save", required=True, help="directory to write (not --load)")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    add_overwrite_argument(p)


def to_megatron(load: str, save: str, iteration: Optional[int] = None,
                overwrite: bool = False) -> dict:
    """Write the checkpoint under `load` to `save` as Megatron-LM writes it (same layout;
    `args` an argparse.Namespace, nested model state, the optimizer's groups as apex
    FusedAdam reads them, distrib_optim.pt padded for any data-parallel size:
    megatron/checkpoint_files.py).
    Megatron-LM loads such files with a plain `torch.load`; this framework loads them too.
    A checkpoint already in `save` is refused unless `overwrite`. Returns {iteration,
    files, directory}. `save`'s lock is held meanwhile (`save_locked`)."""
    if same_dir(save, load):
        raise SystemExit(f"error: --save must differ from --load (the source stays untouched): "
                         f"{save} and {load} name one directory")
    with save_locked(save, "to-megatron"):
        check_save(save, overwrite)
        return _to_megatron(load, save, iteration)


def _refuse(problem: Optional[str]) -> None:
    """SystemExit with `problem` (a file of another checkpoint), when there is one."""
    if problem:
        raise SystemExit(problem)


def _to_megatron(load: str, save: str, iteration: Optional[int]) -> dict:
    """`to_megatron` once `save` is locked and checked."""
    iter_dir, iteration, release = reshard_lib.locate_iteration(load, iteration)
    final_dir = os.path.join(save, iteration_dir_name(iteration, release))
    files = 0
    rank_dirs = [d for d in sorted(os.listdir(iter_dir))  # Megatron-LM 23.04's model files too
                 if os.path.isfile(model_file(os.path.join(iter_dir, d)))]
    if not rank_dirs:
        raise SystemExit(no_rank_dirs_message(iter_dir))
    with partial_output(save, final_dir + ".tmp") as tmp_dir:
        progress = Progress(len(rank_dirs), f"writing {_rank_files(len(rank_dirs))} to {tmp_dir}")
        first = None  # the first file's identity: every file must share it
        for rank_dir in rank_dirs:
            os.makedirs(os.path.join(tmp_dir, rank_dir))
            path = model_file(os.path.join(iter_dir, rank_dir))
            state = load_checkpoint_file(path)
            _refuse(rank_file_problem(state, path, first))
            first = first or file_identity(state, path)
            save_file(megatron_payload(state), os.path.join(tmp_dir, rank_dir, MODEL_FILENAME))
            files += 1
            extra = os.path.join(iter_dir, rank_dir, reshard_lib.DISTRIB_FILENAME)
            if os.path.isfile(extra):  # tensors keyed by ints and dtypes: the same in both
                distrib = load_checkpoint_file(extra)
                _refuse(distrib_file_problem(split_distrib_identity(distrib)[1], extra,
                                             state, path))
                save_file(megatron_distrib_payload(distrib),
                          os.path.join(tmp_dir, rank_dir, reshard_lib.DISTRIB_FILENAME))
                files += 1
            progress.done(rank_dir)
        publish_checkpoint(save, tmp_dir, final_dir, iteration, release)
    return {"iteration": iteration, "files": files, "directory": final_dir}


def megatron_23_05_gaps(args: dict) -> List[str]:
    """What of the saved model Megatron-LM 23.05 cannot build (this framework's extension
    flags, which later Megatron-LM releases spell the same way), or builds otherwise (its
    --swiglu replaces a --ffn-hidden-size off its rule): each as a phrase; [] for none."""
    gaps = []
    if args.get("normalization", "LayerNorm") != "LayerNorm":
        gaps.append(f"--normalization {args['normalization']} (it has LayerNorm only)")
    if args.get("group_query_attention"):
        gaps.append(f"--group-query-attention --num-query-groups {args.get('num_query_groups')} "
                    "(it has none)")
    rotary = args.get("position_embedding_type") in ("rope", "rope+learned")
    if rotary and float(args.get("rotary_base") or 10000) != 10000:
        gaps.append(f"--rotary-base {args['rotary_base']} (its rotary base is 10000)")
    hidden, ffn = args.get("hidden_size"), args.get("ffn_hidden_size")
    if args.get("swiglu") and hidden and ffn:
        rule = int((4 * hidden * 2 / 3) / 64) * 64
        if ffn != rule:
            gaps.append(f"--swiglu with --ffn-hidden-size {ffn} (under --swiglu it replaces "
                        f"the size with {rule})")
    return gaps


def megatron_23_05_run_gap(args: dict) -> Optional[str]:
    """Why Megatron-LM 23.05 builds the saved model and loads its weights but cannot run
    it, or None: its switch MLP expands every expert's fc2 bias, which
    --disable-bias-linear leaves out (an AttributeError at the first forward)."""
    experts = args.get("num_experts")
    if experts and args.get("add_bias_linear") is False:
        return (f"--num-experts {experts} with --disable-bias-linear: its switch MLP scales "
                "each expert's fc2 bias and stops at the first forward without one")
    return None


def run_to_megatron(a: argparse.Namespace) -> int:
    # to_megatron() looks it up again and prints the note about an `.old` copy: once
    iter_dir, _, _ = reshard_lib.locate_iteration(a.load, a.iteration, note=lambda _: None)
    first = reshard_lib.inspect_checkpoint(iter_dir)[2]
    gaps = megatron_23_05_gaps(first.get("args") or {})
    if gaps:
        print(f"warning: Megatron-LM 23.05 cannot build this model: {'; '.join(gaps)}. It "
              "will refuse these weights; later Megatron-LM releases that have these flags "
              "can load them", file=sys.stderr)
    run_gap = megatron_23_05_run_gap(first.get("args") or {})
    if run_gap:
        print(f"warning: Megatron-LM 23.05 cannot run this model ({run_gap})", file=sys.stderr)
    rng = (first.get("rng_state") or [{}])[0]
    if rng and rng.get("cuda_rng_state") is None:
        print("warning: the checkpoint's RNG states were saved by a CPU run; Megatron-LM "
              "restores CUDA generator states and stops on these: load the export with "
              "--no-load-rng (or --finetune)", file=sys.stderr)
    out = to_megatron(a.load, a.save, a.iteration, a.overwrite)
    print(f"wrote iteration {out['iteration']} of {a.load} in Megatron-LM's form -> "
          f"{out['directory']}: {_rank_files(out['files'])}")
    return 0


# ------------------------------------------------------------------------ dispatcher
Subcommand = Tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
def _rank_files(n: int) -> str:
    return "1 rank file" if n == 1 else f"{n} rank files"


SUBCOMMANDS: Dict[str, Subcommand] = {
    "reshard": (add_reshard_arguments, run_reshard),
    "to-hf": (hf_convert.add_to_hf_arguments, hf_convert.run_to_hf),
    "from-hf": (hf_import.add_from_hf_arguments, hf_import.run_from_hf),
    "to-megatron": (add_to_megatron_arguments, run_to_megatron),
}


def build_parser() -> argparse.ArgumentParser:
    from megatron.cli_suggest import SuggestingParser

    ap = SuggestingParser(description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, _) in SUBCOMMANDS.items():
        summary = (add_arguments.__doc__ or name).strip().splitlines()[0]
        add_arguments(sub.add_parser(name, help=summary, description=summary))
    return ap


def run_conversion(tool: str, run: Callable[[], int]) -> int:
    """`run()`; Ctrl-C or SIGTERM ends it with one line and status 130 or 143 once the
    partial output (an iter_N.tmp of the model's size, a staging directory) is removed."""
    return run_interruptible(run, lambda how: (
        f"{tool}: interrupted {how}; the partial output was removed (the source checkpoint "
        "is untouched): run the same command again"))


def main(argv=None) -> int:
    from megatron.initialize import announce_broken_triton

    a = build_parser().parse_args(argv)
    announce_broken_triton(0)  # one process: it prints
    with project_warnings_in_one_line():  # a merges file's unread line: one line
        return run_conversion(f"checkpoint_convert.py {a.command}",
                              lambda: SUBCOMMANDS[a.command][1](a))


if __name__ == "__main__":
    sys.exit(main())
