"""The command-line surface: Megatron-LM 23.05 flags -> validated config dataclasses.

    config = parse_and_validate(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", 1)))

Steps, each its own function:
  1. `parse_args`: argparse over the flag table (`arguments_table.py`; the --help texts in
     `arguments_help.py`), values from `--config FILE.yaml` (`arguments_yaml.py`)
     underneath the command line, removed old flags rejected by name, unknown flags
     answered with the closest known one.
  2. `apply_deprecated`: `--model-parallel-size`, `--batch-size`, `--warmup`,
     `--checkpoint-activations` mapped to their replacements with a warning.
  3. `check_not_supported`: every flag of another model family or of a feature not built,
     set to a non-default value, is listed in ONE error with the reason.
  4. `validate_args` (arguments_validate.py): single-value ranges (arguments_ranges.py),
     cross-flag rules with the world size, run length and lr schedule
     (arguments_schedule.py), data-path/split syntax and tokenizer files
     (arguments_inputs.py), derived values (data-parallel size, global batch, ffn size,
     padded vocab ...).
  5. `build_config`: the dataclasses of megatron/config.py plus `Config.args` (plain data).

User errors raise `ArgumentsError` (a SystemExit with status 2) after printing
`<prog>: error: <message>` to stderr, once per launch: a mistake in the flags is printed by
rank 0 alone, an error that depends on the machine (a file, CUDA) by each node's first
process (`arguments_common.prints_error`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from megatron.arguments_common import (
    FLAG_SPECS,
    ArgumentsError,
    FlagSpec,
    machine_checks,
    messages_for_rank,
    note,
    prints_error,
    warn,
)
from megatron.arguments_help import flag_help, group_description, metavar
from megatron.arguments_report import (
    count_parameters,
    dry_run_report,
    find_missing_inputs,
    format_args_dump,
    run_dry_run,
)
from megatron.arguments_table import (
    ALIASES,
    ALLOWED_IN_REJECTED_GROUPS,
    EXTRA_GROUP,
    MEGATRON_DESCRIPTION,
    MEGATRON_GROUPS,
    NO_EFFECT,
    NO_EFFECT_QUIET_VALUES,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
    REMOVED,
    later_flag_hint,
)
from megatron.arguments_validate import (
    build_config,
    default_vocab_size,
    pad_vocab_size,
    validate_args,
)
from megatron.arguments_yaml import (
    _choices_from_command_line,
    _modern_spelling,
    _run_length_from_command_line,
    _yaml_value,
    load_yaml_config,
)
from megatron.cli_suggest import option_strings, unknown_arguments_message
from megatron.config import Config
from megatron.custom_script_api import module_getattr

# Megatron-LM's core_transformer_config_from_args: one clear ImportError
__getattr__ = module_getattr("megatron.arguments")

__all__ = [
    "ArgumentsError",
    "apply_deprecated",
    "build_config",
    "build_parser",
    "check_not_supported",
    "count_parameters",
    "default_vocab_size",
    "dry_run_report",
    "find_missing_inputs",
    "format_args_dump",
    "load_yaml_config",
    "note",
    "pad_vocab_size",
    "parse_and_validate",
    "parse_args",
    "run_dry_run",
    "validate_args",
    "wait_for_printing_rank",
    "warn",
]

_KIND_TYPES: Dict[str, Callable] = {"int": int, "float": float, "str": str, "bool": bool}


def _int_or_float(text: str):
    """Type of the deprecated `--warmup`: int when it looks like one, else float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


# --help's first line: the 250 flags' usage block would fill 300 lines before the groups.
USAGE = "%(prog)s [-h] [--config FILE] [--FLAG [VALUE ...] ...]"
EPILOG = ("Deprecated, removed, refused and ignored flags, and where this framework reads a "
          "flag differently from Megatron-LM 23.05: MIGRATING.md.")


class _Parser(argparse.ArgumentParser):
    """argparse with short errors: no 240-flag usage block, a pointer to --help instead."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise ArgumentsError(f"{message} (see --help)")


def _add_flag(group, spec: FlagSpec, suppress_defaults: bool) -> None:
    kw: Dict[str, Any] = {"dest": spec.dest}
    kw["default"] = argparse.SUPPRESS if suppress_defaults else spec.default
    kind = spec.kind
    if kind in ("true", "false"):
        kw["action"] = "store_" + kind
    elif kind == "list":
        kw["nargs"] = "*"
    elif kind == "+int":
        kw.update(nargs="+", type=int)
    elif kind == "num":
        kw["type"] = _int_or_float
    elif kind != "raw":
        kw["type"] = _KIND_TYPES[kind]
    if spec.choices is not None:
        kw["choices"] = list(spec.choices)
    if metavar(spec) is not None:
        kw["metavar"] = metavar(spec)
    kw["help"] = flag_help(spec)
    group.add_argument(spec.flag, *ALIASES.get(spec.flag, ()), **kw)


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The argparse parser: Megatron's groups in Megatron's order, then our extension group.

    With `suppress_defaults` no default is set, so a parse returns only the flags given.
    """
    parser = _Parser(description=MEGATRON_DESCRIPTION, allow_abbrev=False, usage=USAGE,
                     epilog=EPILOG)
    for title, _ in MEGATRON_GROUPS + (EXTRA_GROUP,):
        group = parser.add_argument_group(title=title, description=group_description(title))
        for spec in FLAG_SPECS.values():
            if spec.group == title:
                _add_flag(group, spec, suppress_defaults)
    return parser


# ------------------------------------------------------------------------- parsing


def _check_removed(argv: Sequence[str]) -> None:
    """Flags of older Megatron-LM releases: one error naming all of them, and their modern
    spelling with the values given (an old script's `--activations-checkpoint-method
    uniform --activations-checkpoint-num-layers 2` is one fix, not two runs and a
    `<value>` to fill in)."""
    found = []
    for i, token in enumerate(argv):
        name, eq, value = token.partition("=")
        if name not in REMOVED:
            continue
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        found.append((name, value))
    if found:
        names = " and ".join(name for name, _ in found)
        modern = " ".join(_modern_spelling(name, value) for name, value in found)
        raise ArgumentsError(f"{names} {'was' if len(found) == 1 else 'were'} removed from "
                             f"Megatron-LM before 23.05; use {modern}")


def _check_one_config(argv: Sequence[str]) -> None:
    """Two --config files: argparse keeps the last, so the other's flags were lost in
    silence. An error naming both."""
    paths = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == "--config"]
    paths += [token.split("=", 1)[1] for token in argv if token.startswith("--config=")]
    if len(set(paths)) > 1:
        raise ArgumentsError(f"--config is given twice ({', '.join(paths)}) and only one file "
                             "is read; merge them into one file, or pass the other file's "
                             "flags on the command line")


def parse_args(argv: Sequence[str], extra_options: Sequence[str] = ()
               ) -> Tuple[argparse.Namespace, Set[str]]:
    """argv (+ the `--config` YAML underneath it) -> (namespace, dests set explicitly).

    Command-line flags override the YAML file; a dest counts as explicit when the command
    line or the YAML file set it. An unknown flag is an error naming the closest of
    Megatron's flags and `extra_options` (a tool's own flags, parsed before).
    """
    argv, switched_off, given = probe_args(argv, extra_options)
    parser = build_parser()
    yaml_values: Dict[str, Any] = {}
    _check_one_config(argv)
    if getattr(given, "config", None):
        with machine_checks():  # the file may be missing on some node
            yaml_values = load_yaml_config(given.config, parser)
        yaml_values = _run_length_from_command_line(yaml_values, vars(given), given.config)
        yaml_values = _choices_from_command_line(yaml_values, vars(given), given.config)
        parser.set_defaults(**yaml_values)
    parser.set_defaults(**switched_off)
    ns = parser.parse_args(argv)
    return ns, set(vars(given)) | set(yaml_values) | set(switched_off)


def probe_args(argv: Sequence[str], extra_options: Sequence[str] = ()
               ) -> Tuple[List[str], Dict[str, Any], argparse.Namespace]:
    """(argv without its `--SWITCH=false` tokens, {dest: value} of those, the flags given
    as a namespace); ArgumentsError for a removed flag (by name) or an unknown one (the
    closest of Megatron's flags and `extra_options`). A tool checks its own flags after
    this, so that a mistyped flag is named before "--FLAG is required"."""
    argv = list(argv)
    _check_removed(argv)
    argv, switched_off = _switches_set_off(argv, build_parser())
    probe = build_parser(suppress_defaults=True)
    given, unknown = probe.parse_known_args(argv)
    if unknown:
        options = option_strings(probe) + list(extra_options)
        later = {t.split("=", 1)[0]: later_flag_hint(t.split("=", 1)[0]) for t in unknown}
        raise ArgumentsError(unknown_arguments_message(
            unknown, options, {flag: hint for flag, hint in later.items() if hint}))
    return argv, switched_off, given


def _switches_set_off(argv: List[str], parser: argparse.ArgumentParser
                      ) -> Tuple[List[str], Dict[str, Any]]:
    """`--SWITCH=false` on the command line turns off a switch that a --config file turns
    on (a preset's `bf16: true`, for an fp32 try-out): Megatron's switches have no
    --no-SWITCH. Returns argv without those tokens (`--SWITCH=true` becomes the bare
    switch) and {dest: value} for them, read as the same `SWITCH: false` in a file."""
    actions = {opt: a for a in parser._actions if a.nargs == 0 and a.dest != "help"
               for opt in a.option_strings}
    opposite = {a.dest for a in actions.values() if a.const is False}
    out: List[str] = []
    off: Dict[str, Any] = {}
    for token in argv:
        name, _, value = token.partition("=")
        action = actions.get(name)
        if action is None or value.lower() not in ("true", "false"):
            out.append(token)
        elif value.lower() == "true":
            out.append(name)
        else:
            tri_state = action.default is None and action.dest in opposite
            off[action.dest] = _yaml_value(name, action, False, "", tri_state)
    return out, off


# --------------------------------------------------------------------- deprecated


def _move(ns, explicit: Set[str], old: str, new: str, value=None) -> None:
    """Copy deprecated `old` into `new`; an explicit different `new` value is a conflict."""
    value = getattr(ns, old) if value is None else value
    old_flag, new_flag = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
    if new in explicit and getattr(ns, new) != value:
        raise ArgumentsError(f"{old_flag} {getattr(ns, old)} conflicts with {new_flag} "
                             f"{getattr(ns, new)}; drop the deprecated {old_flag}")
    warn(f"{old_flag} is deprecated; using {new_flag} {value}")
    setattr(ns, new, value)


def apply_deprecated(ns: argparse.Namespace, explicit: Set[str]) -> Dict[str, str]:
    """Map deprecated flags onto their replacements (one warning each) and return
    {dest: deprecated flag that set it}, for later messages.

    `--warmup W` (an old fraction-of-iterations flag): W < 1 -> `--lr-warmup-fraction W`,
    W >= 1 -> `--lr-warmup-iters W`.
    `--checkpoint-activations` -> `--recompute-granularity full --recompute-method uniform`.
    """
    origins: Dict[str, str] = {}
    if ns.model_parallel_size is not None:
        _move(ns, explicit, "model_parallel_size", "tensor_model_parallel_size")
        origins["tensor_model_parallel_size"] = "--model-parallel-size"
    if ns.batch_size is not None:
        _move(ns, explicit, "batch_size", "micro_batch_size")
        origins["micro_batch_size"] = "--batch-size"
    if ns.warmup is not None:
        if not math.isfinite(ns.warmup):  # int(nan) / int(inf) would be a traceback
            raise ArgumentsError(f"--warmup {ns.warmup} is not a finite number; pass a "
                                 "fraction below 1 (--lr-warmup-fraction) or a number of "
                                 "iterations (--lr-warmup-iters)")
        if ns.warmup < 0:  # read as --lr-warmup-fraction, whose error names another flag
            raise ArgumentsError(f"--warmup {ns.warmup} is negative; pass a fraction from 0 "
                                 "to below 1 (read as --lr-warmup-fraction) or a number of "
                                 "iterations, 1 or more (--lr-warmup-iters); 0: no warmup")
        if ns.warmup >= 1 and ns.warmup != int(ns.warmup):  # int(1.5) would be 1 silently
            raise ArgumentsError(f"--warmup {ns.warmup}: 1 or more counts iterations, so it "
                                 "must be a whole number; pass --lr-warmup-iters "
                                 f"{math.ceil(ns.warmup)} (or a fraction below 1, read as "
                                 "--lr-warmup-fraction)")
        if ns.warmup < 1:
            _move(ns, explicit, "warmup", "lr_warmup_fraction", float(ns.warmup))
            origins["lr_warmup_fraction"] = "--warmup"
        else:
            _move(ns, explicit, "warmup", "lr_warmup_iters", int(ns.warmup))
            origins["lr_warmup_iters"] = "--warmup"
    if ns.checkpoint_activations:
        _check_checkpoint_activations(ns, explicit)
        for dest, value in (("recompute_granularity", "full"), ("recompute_method", "uniform")):
            if dest not in explicit:
                setattr(ns, dest, value)
                origins[dest] = "--checkpoint-activations"
        method = (f"with the given --recompute-method {ns.recompute_method}"
                  if "recompute_method" in explicit else "--recompute-method uniform")
        warn(f"--checkpoint-activations is deprecated; using --recompute-granularity full "
             f"{method}")
    return origins


def _check_checkpoint_activations(ns, explicit: Set[str]) -> None:
    """--checkpoint-activations (full recompute of every layer) beside a modern flag that
    asks for selective recompute: a conflict, as for the other deprecated flags."""
    selective = ("--recompute-activations" if ns.recompute_activations else
                 f"--recompute-granularity {ns.recompute_granularity}"
                 if "recompute_granularity" in explicit
                 and ns.recompute_granularity not in (None, "full") else None)
    if selective is not None:
        raise ArgumentsError(
            f"--checkpoint-activations (deprecated: --recompute-granularity full "
            f"--recompute-method uniform, every layer recomputed) conflicts with {selective} "
            f"(selective recompute: the attention core only); drop the deprecated "
            f"--checkpoint-activations")


def check_not_supported(ns: argparse.Namespace, origins: Optional[Dict[str, str]] = None) -> None:
    """Raise ONE error listing every not-supported flag whose value differs from its default
    (see NOT_SUPPORTED / NOT_SUPPORTED_GROUPS in arguments_table.py), with the reason.
    Also warns once for each NO_EFFECT flag that is set."""
    origins = origins or {}
    problems = []
    for spec in FLAG_SPECS.values():
        reason = NOT_SUPPORTED.get(spec.flag)
        if reason is None and spec.flag not in ALLOWED_IN_REJECTED_GROUPS:
            reason = NOT_SUPPORTED_GROUPS.get(spec.group)
        value = getattr(ns, spec.dest)
        if reason is not None and value != spec.default:
            via = f" (set by {origins[spec.dest]})" if spec.dest in origins else ""
            problems.append(f"{spec.flag}: {reason}{via}")
        elif (spec.flag in NO_EFFECT and value != spec.default
              and value not in NO_EFFECT_QUIET_VALUES.get(spec.flag, ())):
            warn(f"{spec.flag} has no effect here: {NO_EFFECT[spec.flag]}")
    if problems:
        raise ArgumentsError("flags not supported by this framework:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------- entry


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_and_validate(
    argv: Sequence[str],
    world_size: int = 1,
    env: Optional[Mapping[str, str]] = None,
    *,
    cuda_available: Optional[bool] = None,
    vocab_size_fn: Optional[Callable[[argparse.Namespace], int]] = None,
    job_store=None,
) -> Config:
    """argv -> validated `Config`, before any process group exists.

    `env` (default os.environ) supplies RANK (warnings print on rank 0 only) and LOCAL_RANK.
    `cuda_available` (default torch.cuda.is_available()) picks the backend and the compile
    default. `vocab_size_fn(args) -> int` returns the tokenizer's vocab size before padding
    (default: `default_vocab_size`, which knows GPT2BPETokenizer and NullTokenizer).
    `job_store` (a megatron.startup_store.JobStore, from the launcher's environment): with
    --use-checkpoint-args rank 0 alone reads the checkpoint and the other ranks get its
    arguments, or its error, through the job's store; without it every rank reads them.
    Raises `ArgumentsError` (exit status 2) after printing `<prog>: error: ...` to stderr:
    on rank 0 only for a mistake in the flags; see `prints_error`.
    """
    env = os.environ if env is None else env
    rank = int(env.get("RANK", 0) or 0)
    if rank != 0 and any(a in ("-h", "--help") for a in argv):
        raise SystemExit(0)  # the help, once per launch: rank 0 prints it
    try:
        with messages_for_rank(rank):
            ns, explicit = parse_args(argv)  # --help and a mistyped flag: before torch
            if cuda_available is None:
                cuda_available = _cuda_available()
            origins = apply_deprecated(ns, explicit)
            check_not_supported(ns, origins)
            if ns.use_checkpoint_args:  # model flags from the checkpoint, before validation
                from megatron.arguments_checkpoint import (
                    fit_checkpoint_layout,
                    take_checkpoint_args,
                )

                copied = take_checkpoint_args(ns, explicit, warn, job_store)
                fit_checkpoint_layout(ns, copied, world_size, warn)
            # (local_rank stays as given, None under torchrun, as Megatron-LM's arguments
            # dump shows it: the device comes from $LOCAL_RANK, see pretrain_gpt.py)
            ns.rank, ns.world_size = rank, world_size
            validate_args(ns, world_size, explicit=explicit, cuda_available=cuda_available,
                          vocab_size_fn=vocab_size_fn, origins=origins)
            return build_config(ns)
    except ArgumentsError as err:
        _report_error(err, rank, world_size, env)
        raise


# How long a rank that leaves an argument error to another rank's message waits before it
# exits, when a launcher started it (`LAUNCHER_ENV`). torchrun (and srun
# --kill-on-bad-exit) ends every worker once one fails: a silent rank that failed first
# would end rank 0 before it printed. The first failure is then rank 0's and the launcher
# ends the waiting ranks at once; without a launcher that does, they exit (status 2)
# after this delay. Called as a library (no launcher variable), nothing waits.
SILENT_EXIT_DELAY_S = 30.0
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")  # torchrun / torch.distributed.launch, Slurm


def wait_for_printing_rank(world_size: int, env: Mapping[str, str]) -> None:
    """A rank that exits in silence, leaving the message to another rank: wait
    `SILENT_EXIT_DELAY_S` when a launcher started it (`LAUNCHER_ENV` in `env`) and the run
    has several processes. Also for the load errors ranks agree on (megatron/agreed_exit.py)."""
    if world_size > 1 and any(env.get(name) for name in LAUNCHER_ENV):
        # with --exit-signal-handler a SIGTERM (the launcher ending the job, or
        # launcher_watch's once torchrun died) is only noted: it ends the wait instead
        from megatron.signals import sleep_unless_signalled  # (imports no torch)

        sleep_unless_signalled(SILENT_EXIT_DELAY_S)


def exit_before_group(exc: SystemExit, rank: int, world_size: int, env: Mapping[str, str],
                      machine: bool = True) -> SystemExit:
    """What to raise for `exc` (a SystemExit with a message, met before any process group
    exists, e.g. a checkpoint or data file an entry point reads first): the message
    printed by the ranks `prints_error` names -- with `machine`, rank 0 and each node's
    first process, with rank and host; without, rank 0 alone -- and the others wait
    under a launcher (`wait_for_printing_rank`). Returns SystemExit(1), already reported;
    `exc` itself when it carries a status, not a message."""
    if exc.code is None or isinstance(exc.code, int):
        return exc
    err = ArgumentsError(str(exc.code).removeprefix("error: "))
    err.machine = machine
    _report_error(err, rank, world_size, env)
    return SystemExit(1)


def program_name() -> str:
    """The name an error gives the program, as argparse's default `prog`: the script's
    basename (`main.py` for tasks/main.py, as in Megatron-LM)."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "megatron"


def _report_error(err: ArgumentsError, rank: int, world_size: int, env) -> None:
    """Print `<prog>: error: ...` to stderr where `prints_error` says so; an error of this
    machine, in a run of several processes, names the rank and host that met it. A rank
    that does not print waits `SILENT_EXIT_DELAY_S` for the rank that does, under a
    launcher."""
    local_rank = env.get("LOCAL_RANK")
    local = int(local_rank) if local_rank not in (None, "") else None
    if not prints_error(err, rank, local):
        wait_for_printing_rank(world_size, env)
        return
    prog = program_name()
    where = ""
    if err.machine and world_size > 1:
        import socket

        where = f" (rank {rank} on {socket.gethostname()})"
    print(f"{prog}: {err}{where}", file=sys.stderr, flush=True)
