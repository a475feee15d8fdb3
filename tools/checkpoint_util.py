#!/usr/bin/env python
"""Megatron-LM's resharding command line, run by this framework's resharding.

    python tools/checkpoint_util.py --model-type GPT --loader megatron --saver megatron \\
        --load-dir IN --save-dir OUT \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1

takes the command line of Megatron-LM 23.05's `tools/checkpoint_util.py` and runs
`tools/checkpoint_convert.py reshard` (megatron/checkpoint_reshard.py) on the latest
checkpoint under IN (the one its tracker file names):

- OUT gets the model AND the optimizer state (fp32 main weights, Adam moments, step, loss
  scaler), the scheduler, the iteration and the consumed-sample counters: strictly more than
  Megatron's saver, which writes the model weights only. A run that should start with a
  fresh optimizer loads OUT with --no-load-optim; --no-load-optim here leaves the optimizer
  state out of OUT, as Megatron's saver does (for a checkpoint whose optimizer state
  cannot be resharded: its groups split by other weight-decay rules). RNG states are kept when tp and pp do not
  change. OUT has no virtual pipeline stages, as Megatron's saver writes none
  (`checkpoint_convert.py reshard --target-num-layers-per-virtual-pipeline-stage` for
  those).
- A target size left out keeps the checkpoint's, as Megatron does. The target sizes may
  also be spelt --target-tensor-model-parallel-size / --target-pipeline-model-parallel-size
  (checkpoint_convert.py reshard's names).
- The vocabulary is re-padded for the target tensor-parallel size from the size of the
  checkpoint's tokenizer whenever that is known here (NullTokenizer, GPT2BPETokenizer, or
  a tokenizer built from its stored files: SentencePiece, Hugging Face).
  --true-vocab-size / --vocab-file then change nothing (they are checked against it); they
  matter when the tokenizer's size is not known here (its files have moved): the
  vocabulary is then re-padded from them instead of from the saved padded size.
- --megatron-path, --max-queue-size and --no-checking are accepted and ignored: nothing is
  imported from Megatron-LM, no loader/saver processes pass tensors through a queue, and
  every shard is checked as it is read.
- An OUT that already holds a checkpoint is refused (a resume from it would go back to the
  converted iteration); Megatron's command line has no --overwrite: delete it or choose
  another --save-dir (`checkpoint_convert.py reshard --overwrite` replaces one).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import checkpoint_reshard as reshard_lib
from megatron.checkpoint_dirs import (
    TRACKER_FILENAME,
    is_iteration_dir_name,
    list_checkpoints,
    misplaced_load_message,
    same_dir,
    tracker_path,
)
from megatron.checkpoint_foreign import dist_backend
from megatron.entry_state import project_warnings_in_one_line
from tools import checkpoint_convert

FLAGS = ("--target-tensor-parallel-size", "--target-pipeline-parallel-size")
PLUGIN = "megatron"  # the only --loader / --saver: Megatron's checkpoint layout


def build_parser() -> argparse.ArgumentParser:
    from megatron.cli_suggest import SuggestingParser

    ap = SuggestingParser(description=__doc__, allow_abbrev=False,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-type", required=True, choices=["GPT", "BERT"],
                    help="GPT (this framework is GPT only; BERT is refused)")
    ap.add_argument("--loader", default=PLUGIN, help="only 'megatron': Megatron-LM's layout, "
                    "as written by Megatron-LM or by this framework's pretrain_gpt.py")
    ap.add_argument("--saver", default=PLUGIN, help="only 'megatron'")
    ap.add_argument("--load-dir", required=True, help="checkpoint directory to read (its "
                    "tracker's iteration)")
    ap.add_argument("--save-dir", required=True, help="directory to write; not one that "
                    "already holds a checkpoint")
    # The -model- spellings are pretrain_gpt.py's and checkpoint_convert.py reshard's.
    ap.add_argument("--target-tensor-parallel-size", "--target-tensor-model-parallel-size",
                    dest="target_tensor_parallel_size", type=int, default=None,
                    help="default: the checkpoint's")
    ap.add_argument("--target-pipeline-parallel-size", "--target-pipeline-model-parallel-size",
                    dest="target_pipeline_parallel_size", type=int, default=None,
                    help="default: the checkpoint's")
    ap.add_argument("--true-vocab-size", type=int, default=None,
                    help="vocabulary size before padding; changes nothing when the "
                         "checkpoint's tokenizer size is known here (it must then agree), "
                         "else the vocabulary is re-padded from it")
    ap.add_argument("--vocab-file", default=None, help="a GPT-2 vocab.json whose number of "
                    "entries is the --true-vocab-size")
    checkpoint_convert.add_no_load_optim_argument(ap)
    ap.add_argument("--megatron-path", default=None, help="accepted and ignored (nothing is "
                    "imported from Megatron-LM)")
    ap.add_argument("--max-queue-size", type=int, default=None,
                    help="accepted and ignored (no loader/saver queue)")
    ap.add_argument("--no-checking", action="store_true",
                    help="accepted and ignored (every shard is checked as it is read)")
    return ap


def check_plugins(a: argparse.Namespace) -> None:
    """SystemExit for --model-type BERT and for a --loader / --saver other than Megatron's."""
    if a.model_type != "GPT":
        raise SystemExit(f"error: --model-type {a.model_type}: this framework trains and "
                         "converts GPT models only; pass --model-type GPT")
    for flag, value in (("--loader", a.loader), ("--saver", a.saver)):
        if value not in (PLUGIN, f"{flag[2:]}_{PLUGIN}"):
            raise SystemExit(f"error: {flag} {value}: the only {flag[2:]} here is '{PLUGIN}' "
                             f"(Megatron-LM's checkpoint layout); for Hugging Face models use "
                             f"tools/checkpoint_convert.py from-hf / to-hf")


def ignored_notes(a: argparse.Namespace) -> List[str]:
    """One line per given flag that is accepted and ignored."""
    notes = []
    if a.megatron_path is not None:
        notes.append(f"--megatron-path {a.megatron_path} ignored: nothing is imported from "
                     "Megatron-LM")
    if a.max_queue_size is not None:
        notes.append(f"--max-queue-size {a.max_queue_size} ignored: there is no loader/saver "
                     "queue")
    if a.no_checking:
        notes.append("--no-checking ignored: every shard is checked as it is read")
    return notes


def check_save_dir(load: str, save: str) -> None:
    """SystemExit when --save-dir is --load-dir, a file, or already holds a checkpoint."""
    if same_dir(save, load):
        raise SystemExit(f"error: --save-dir {save} is --load-dir; the source stays untouched: "
                         "choose another --save-dir")
    if os.path.exists(save) and not os.path.isdir(save):
        raise SystemExit(f"error: --save-dir {save} is a file; pass a directory")
    from megatron.arguments_inputs import home_not_expanded

    tilde = home_not_expanded("--save-dir", save)
    if tilde:
        raise SystemExit(f"error: {tilde}")
    found = checkpoint_convert.held_checkpoints(save)
    if found:
        raise SystemExit(f"error: --save-dir {save} already holds a checkpoint: "
                         f"{', '.join(found)}; writing there would replace a directory of the "
                         f"same name and the tracker. Delete {save} or choose another "
                         "--save-dir")


def check_load_dir(load: str) -> None:
    """SystemExit when --load-dir has no tracker file, with a fix in this command line's
    flags: it reads the iteration the tracker names, as Megatron-LM's does, and has no
    --iteration (checkpoint_convert.py reshard has)."""
    if os.path.isfile(tracker_path(load)):
        return
    def other(root: str) -> str:
        return f"python tools/checkpoint_convert.py reshard --load {root} --iteration N ..."

    if is_iteration_dir_name(os.path.basename(os.path.normpath(load))) and \
            dist_backend(load) is None:
        parent = os.path.dirname(os.path.normpath(load)) or "."
        raise SystemExit(f"error: --load-dir {load} is one checkpoint's iteration directory; "
                         f"--load-dir takes the directory above it: --load-dir {parent} (the "
                         f"iteration its {TRACKER_FILENAME} names is read; for another one: "
                         f"{other(parent)})")
    misplaced = misplaced_load_message(load, "--load-dir") if os.path.exists(load) else None
    if misplaced is not None:
        raise SystemExit(f"error: {misplaced}")
    found = list_checkpoints(load)
    if found:
        raise SystemExit(f"error: --load-dir {load} has no {TRACKER_FILENAME} (it names the "
                         f"iteration to read) but holds {', '.join(found)}; write the iteration "
                         f"into {tracker_path(load)} or pick one with: {other(load)}")
    from megatron.arguments_inputs import missing_home_hint

    tilde = missing_home_hint(load)
    raise SystemExit(f"error: no checkpoint under --load-dir {load}: {tracker_path(load)} does "
                     f"not exist and {load} holds no iter_XXXXXXX or release directory{tilde}")


def _vocab_file_size(path: str) -> int:
    """The number of entries of a GPT-2 vocab.json; SystemExit naming the file otherwise."""
    from megatron.arguments_common import ArgumentsError
    from megatron.arguments_validate import default_vocab_size

    try:
        return default_vocab_size(argparse.Namespace(tokenizer_type="GPT2BPETokenizer",
                                                     vocab_file=path))
    except ArgumentsError as exc:
        raise SystemExit(f"error: {exc.message}; --vocab-file takes a GPT-2 vocab.json") \
            from None


def choose_vocab_size(args: dict, true_vocab_size: Optional[int],
                      vocab_file: Optional[str]) -> Tuple[Optional[int], Optional[str]]:
    """(the vocabulary size before padding to re-pad from, or None for reshard's own
    choice; a note to print, or None) from --true-vocab-size / --vocab-file and the
    checkpoint's `args`. SystemExit when they disagree with each other or with the
    checkpoint's tokenizer, or exceed the saved embedding rows."""
    given, source = true_vocab_size, f"--true-vocab-size {true_vocab_size}"
    if vocab_file is not None:
        given = _vocab_file_size(vocab_file)
        if true_vocab_size is not None and true_vocab_size != given:
            raise SystemExit(f"error: --true-vocab-size {true_vocab_size} and --vocab-file "
                             f"{vocab_file} ({given} entries) disagree; pass only one of them")
        source = f"--vocab-file {vocab_file} ({given} entries)"
    if given is None:
        return None, None
    padded = int(args["padded_vocab_size"])
    if not 1 <= given <= padded:
        raise SystemExit(f"error: {source}: the checkpoint's word embedding has {padded} rows; "
                         f"the vocabulary size before padding is between 1 and {padded}")
    tokenizer = checkpoint_convert.tokenizer_vocab_size(args)
    kind = args.get("tokenizer_type")
    if tokenizer is None:
        return given, (f"vocabulary re-padded from {source}: the size of the checkpoint's "
                       f"tokenizer ({kind}) is not known here")
    if given != tokenizer:
        raise SystemExit(f"error: {source} disagrees with the checkpoint's tokenizer ({kind}, "
                         f"{tokenizer} tokens), from which the vocabulary is re-padded (and a "
                         f"run with that tokenizer pads it); drop the flag or pass {tokenizer}")
    return None, (f"{source} changes nothing: the vocabulary is re-padded from the "
                  f"checkpoint's tokenizer ({kind}, {tokenizer} tokens) already")


def _target_sizes(a: argparse.Namespace, saved: reshard_lib.Layout) -> Tuple[int, int]:
    tp = saved.tp if a.target_tensor_parallel_size is None else a.target_tensor_parallel_size
    pp = saved.pp if a.target_pipeline_parallel_size is None else a.target_pipeline_parallel_size
    for flag, value in zip(FLAGS, (tp, pp)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    return tp, pp


def run(a: argparse.Namespace) -> int:
    """Check the command line, then reshard (see the module docstring); returns 0."""
    check_plugins(a)
    for note in ignored_notes(a):
        print(f"note: {note}")
    check_save_dir(a.load_dir, a.save_dir)
    check_load_dir(a.load_dir)
    # the reshard looks it up again and prints the note about an `.old` copy: once
    iter_dir, _, _ = reshard_lib.locate_iteration(a.load_dir, note=lambda _: None)
    saved, path, first = reshard_lib.inspect_checkpoint(iter_dir)
    args = first.get("args")
    if not isinstance(args, dict) or not args:
        raise SystemExit(f"error: {path} has no 'args': the model shape is unknown")
    tp, pp = _target_sizes(a, saved)
    checkpoint_convert.check_target_layout(args, tp, pp, flags=FLAGS)
    orig_vocab_size, vocab_note = choose_vocab_size(args, a.true_vocab_size, a.vocab_file)
    if vocab_note:
        print(f"note: {vocab_note}")
    if saved.vpp > 1:
        print(f"note: the checkpoint has {saved.vpp} virtual pipeline stages per rank; the "
              "output has none, as Megatron's saver writes")
    out = checkpoint_convert.reshard(a.load_dir, a.save_dir, tp, pp,
                                     orig_vocab_size=orig_vocab_size,
                                     with_optimizer=not a.no_load_optim)
    checkpoint_convert.print_reshard_summary(a.load_dir, out)
    return 0


def main(argv=None) -> int:
    from megatron.initialize import announce_broken_triton

    a = build_parser().parse_args(argv)
    announce_broken_triton(0)  # one process: it prints
    with project_warnings_in_one_line():  # a merges file's unread line: one line
        return checkpoint_convert.run_conversion("checkpoint_util.py", lambda: run(a))


if __name__ == "__main__":
    sys.exit(main())
