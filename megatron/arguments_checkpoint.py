"""`--use-checkpoint-args`: model flags taken from the checkpoint under --load.

Runs once, before validation, on the parsed namespace: the flags the command line (or
YAML) left unset are copied from the `args` stored in the latest checkpoint's rank-0 file,
as Megatron-LM 23.05 does. Unlike Megatron, a flag given explicitly keeps its value (with a
warning) even for the architecture flags, since a checkpoint of another layout reshards on
load. arguments.py imports this module only when the flag is set, so parsing a command
line loads none of the checkpoint code.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional, Set

from megatron.arguments_common import ArgumentsError
from megatron.checkpoint_dirs import model_file, refuse_untracked_checkpoints, tracker_path
from megatron.checkpoint_reshard import load_shard, locate_iteration, scan_layout
from megatron.checkpointing import rank_dir_name

# Megatron-LM 23.05 copies these when the command line left them unset ...
_FILL_IF_UNSET = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length",
                  "num_attention_heads", "kv_channels", "max_position_embeddings",
                  "tokenizer_type", "num_layers_per_virtual_pipeline_stage")
# ... and these always; here (and for this framework's own model flags) an explicit
# command-line value wins with a warning: a checkpoint reshards on load.
_ARCHITECTURE = ("add_position_embedding", "use_rotary_position_embeddings", "rotary_percent",
                 "add_bias_linear", "swiglu", "untie_embeddings_and_output_weights",
                 "apply_layernorm_1p", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "position_embedding_type", "rotary_base",
                 "normalization", "group_query_attention", "num_query_groups",
                 "squared_relu", "openai_gelu", "bias_gelu_fusion", "layernorm_epsilon",
                 "apply_residual_connection_post_layernorm", "vocab_size",
                 "make_vocab_size_divisible_by", "vocab_extra_ids", "num_experts")
# (every argument megatron/checkpoint_model_args.py checks is here: its mismatch message offers
# --use-checkpoint-args as the fix)


def read_checkpoint_args(load: str) -> dict:
    """The `args` of the rank-0 file of the latest checkpoint under `load` (either naming
    scheme), memory-mapped. SystemExit when there is no checkpoint or it has no args; an
    iteration directory, or checkpoints without a tracker file, get training's fix (the
    tools' `--iteration N` is not a pretrain_gpt.py flag)."""
    if not os.path.isfile(tracker_path(load)):
        refuse_untracked_checkpoints(load)
    iter_dir, _, _ = locate_iteration(load, note=lambda _: None)  # the load restores it
    _, pp = scan_layout(iter_dir)
    path = model_file(os.path.join(iter_dir, rank_dir_name(0, 0, pp)))
    args = load_shard(path).get("args") if os.path.isfile(path) else None
    if not isinstance(args, dict):
        raise SystemExit(f"error: --use-checkpoint-args: {path} holds no arguments")
    return args


def saved_checkpoint_args(load: str) -> Optional[dict]:
    """`read_checkpoint_args(load)`, or None when `load` holds no checkpoint yet (no
    tracker file, nothing that looks like a checkpoint). ArgumentsError for the rest, a
    file or directory the file system refuses (OSError: permissions, a stale mount)
    included: under a launcher rank 0 reads for every rank, and each must end alike."""
    try:
        if not os.path.isfile(tracker_path(load)) and not _untracked(load):
            return None
        return read_checkpoint_args(load)
    except SystemExit as exc:
        raise ArgumentsError(str(exc.code).removeprefix("error: ")) from None
    except OSError as exc:
        raise ArgumentsError(
            f"--use-checkpoint-args cannot read the checkpoint under --load {load} "
            f"({type(exc).__name__}: {exc}); make its files readable to this user on every "
            f"node, or pass --load a copy that is") from None


def _untracked(load: str) -> bool:
    """Whether `load`, without a tracker file, still looks like a checkpoint (an iteration
    directory, or one holding them): `read_checkpoint_args` refuses those with the fix."""
    try:
        refuse_untracked_checkpoints(load)
    except SystemExit:
        return True
    return False


def apply_checkpoint_args(ns: argparse.Namespace, explicit: Set[str],
                          warn: Callable[[str], None] = print,
                          read: Optional[Callable[[str], Optional[dict]]] = None) -> List[str]:
    """`--use-checkpoint-args`: copy the model flags stored in the checkpoint under
    `ns.load` into `ns` wherever the command line (or YAML) left them unset (`explicit`
    lists the dests that were set). Call before validation. Returns the dests copied.
    `read(load)` gives the stored arguments (default `saved_checkpoint_args`: this process
    reads them; `take_checkpoint_args` passes one that rank 0 answers for all).
    No checkpoint under --load yet (no tracker, no iteration directory): a warning, nothing
    copied, as Megatron-LM does. ArgumentsError without --load, for iteration directories
    without a tracker, or a checkpoint without stored arguments."""
    if not ns.load:
        raise ArgumentsError("--use-checkpoint-args needs --load DIR (the checkpoint whose "
                             "arguments to use)")
    saved = (read or saved_checkpoint_args)(ns.load)
    if saved is None:
        # the first launch of a job that resumes from --load = --save (Megatron-LM goes on
        # with the command line's flags too)
        warn(f"--use-checkpoint-args: no checkpoint under --load {ns.load} yet, so the model "
             "flags are the command line's")
        return []
    copied = []
    for dest in _FILL_IF_UNSET + _ARCHITECTURE:
        if dest not in saved or not hasattr(ns, dest):
            continue
        if dest == "num_layers_per_virtual_pipeline_stage" and \
                "pipeline_model_parallel_size" in explicit:
            continue  # virtual stages belong to the checkpoint's pipeline size
        value = saved[dest]
        if dest in explicit or (dest in _FILL_IF_UNSET and getattr(ns, dest) is not None):
            if getattr(ns, dest) != value:
                warn(f"--use-checkpoint-args: --{dest.replace('_', '-')} "
                     f"{getattr(ns, dest)} from the command line is kept (the checkpoint has "
                     f"{value})")
            continue
        setattr(ns, dest, value)
        copied.append(dest)
    if "tokenizer_type" in copied:
        _check_tokenizer_files_given(ns, saved)
    return copied


def take_checkpoint_args(ns: argparse.Namespace, explicit: Set[str],
                         warn: Callable[[str], None], job=None) -> List[str]:
    """`apply_checkpoint_args` for parse_and_validate. With `job` (the launch's
    megatron.startup_store.JobStore) global rank 0 alone reads the checkpoint -- its
    tracker, its directory, its rank-0 model file -- and the other ranks get the
    arguments, or its error, through the job's store: one read of those shared files per
    job, not one per rank, and an error every rank raises alike (rank 0 prints it).
    Without one (a single process, a tool) this process reads them, and its errors are
    this machine's (`machine_checks`)."""
    from megatron.arguments_common import machine_checks

    if job is None or job.world_size <= 1 or not ns.load:
        with machine_checks():
            return apply_checkpoint_args(ns, explicit, warn)
    import datetime

    from megatron.startup_store import from_rank_0

    # as initialize_distributed's: the process group's, a minute longer
    timeout = datetime.timedelta(minutes=ns.distributed_timeout_minutes, seconds=60)

    def read(load: str) -> Optional[dict]:
        try:
            return from_rank_0(job, "checkpoint_args", lambda: saved_checkpoint_args(load),
                               timeout, f"the checkpoint arguments under --load {load}")
        except ArgumentsError:
            raise
        except SystemExit as exc:  # no answer from rank 0: this rank's own trouble
            with machine_checks():
                raise ArgumentsError(str(exc.code).removeprefix("error: ")) from None

    return apply_checkpoint_args(ns, explicit, warn, read=read)


def _check_tokenizer_files_given(ns: argparse.Namespace, saved: dict) -> None:
    """The checkpoint's --tokenizer-type, taken by --use-checkpoint-args, comes without its
    files (Megatron-LM copies no paths either: the checkpoint may come from another
    machine). When they are not given, the error says so and names the files the
    checkpoint was saved with (the user never typed the --tokenizer-type it names)."""
    from megatron.arguments_common import flag_for_dest
    from megatron.arguments_inputs import tokenizer_file_dests

    missing = [d for d in tokenizer_file_dests(vars(ns)) if not getattr(ns, d)]
    if not missing:
        return
    if ns.tokenizer_type == "HuggingFaceTokenizer":
        missing = ["tokenizer_model"]  # or --vocab-file: a tokenizer.json either way
    was = [f"{flag_for_dest(d)} {saved[d]}" for d in ("vocab_file", "merge_file",
                                                       "tokenizer_model") if saved.get(d)]
    raise ArgumentsError(
        f"--use-checkpoint-args takes the checkpoint's --tokenizer-type {ns.tokenizer_type} "
        f"but not its files, and {' and '.join(flag_for_dest(d) for d in missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not given; pass "
        f"{'it' if len(missing) == 1 else 'them'}"
        + (f" (the checkpoint was saved with {' '.join(was)})" if was else ""))


_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
           "num_layers_per_virtual_pipeline_stage")


def _layout_flags(values: dict) -> str:
    return " ".join(f"--{dest.replace('_', '-')} {values[dest]}" for dest in _LAYOUT
                    if values.get(dest) is not None)


def fit_checkpoint_layout(ns: argparse.Namespace, copied: List[str], world_size: int,
                          warn: Callable[[str], None] = print) -> None:
    """The parallel sizes `apply_checkpoint_args` copied (`copied`) in a world that cannot
    hold them (a job resumed on fewer processes): clamped as Megatron-LM clamps the
    command line's, in one warning that says they are the checkpoint's -- the clamp and
    the errors after it named flags the user never typed. Virtual stages taken with the
    checkpoint's pipeline size are dropped when that size changes (they split its stages).
    The checkpoint is resharded to the layout the run uses. ArgumentsError when the
    clamped sizes still do not divide the world size."""
    taken = [dest for dest in _LAYOUT if dest in copied]
    if world_size < 1 or not taken:
        return
    saved = {dest: getattr(ns, dest) for dest in _LAYOUT}
    tp = min(ns.tensor_model_parallel_size, world_size)
    pp = min(ns.pipeline_model_parallel_size, world_size // tp)
    fits = (tp, pp) == (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"])
    if fits and world_size % (tp * pp) == 0:
        return
    if world_size % (tp * pp):
        raise ArgumentsError(
            f"--use-checkpoint-args: the checkpoint's layout ({_layout_flags(saved)}) does not "
            f"fit world size {world_size}; launch a multiple of {tp * pp} processes, or pass "
            "--tensor-model-parallel-size and --pipeline-model-parallel-size for this world "
            "size (the checkpoint is resharded on load)")
    ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size = tp, pp
    if pp != saved["pipeline_model_parallel_size"] and \
            "num_layers_per_virtual_pipeline_stage" in taken:
        ns.num_layers_per_virtual_pipeline_stage = None
    warn(f"--use-checkpoint-args: the checkpoint's layout ({_layout_flags(saved)}) does not fit "
         f"world size {world_size}; using {_layout_flags(vars(ns)) or 'no model parallelism'} "
         "(clamped as Megatron-LM clamps the parallel sizes; the checkpoint is resharded on "
         "load): pass the layout flags to choose another")
