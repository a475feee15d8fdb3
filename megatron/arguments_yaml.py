"""The `--config FILE.yaml` layer under the command line (`load_yaml_config`): a YAML mapping
of flag names (either spelling, with or without dashes) to values, each converted and checked
as the flag's own value; the file's size bounded (YAML_MAX_VALUES); removed flags named with
their modern spelling; a command-line run length or exclusive choice (warmup, precision, ...)
replacing the file's. `parse_args` (megatron/arguments.py) sets these values as the parser's
defaults, so the command line wins.
"""
from __future__ import annotations

import argparse
import difflib
import io
import os
import shlex
from typing import Any, Dict

from megatron.arguments_common import FLAG_SPECS, ArgumentsError, warn
from megatron.arguments_table import REMOVED, later_flag_hint


def _norm_key(key: str) -> str:
    return str(key).lstrip("-").replace("_", "-").lower()


def _option_index(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    return {
        _norm_key(opt): action
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }


def _yaml_value(key: str, action: argparse.Action, value: Any, path: str,
                tri_state: bool = False) -> Any:
    """Convert one YAML value the way argparse would convert the same text. `tri_state`:
    the switch's dest defaults to None (auto) and an opposite switch sets it False."""
    where = f"--config {path}: key '{key}'"
    if action.nargs == 0:  # store_true / store_false
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            raise ArgumentsError(f"{where} is a switch and {value!r} is a quoted string; write "
                                 f"{key}: {value.strip().lower()} (no quotes)")
        if not isinstance(value, bool):
            raise ArgumentsError(f"{where} is a switch; give true or false, not {value!r}")
        if value:
            return action.const
        if tri_state and action.const is True:  # 'compile: false' is --no-compile, not auto
            return False
        return None if action.default is None else (not action.const)
    listed = action.nargs in ("*", "+")
    if isinstance(value, dict) or (listed and isinstance(value, list) and any(
            isinstance(item, (dict, list)) for item in value)):
        raise ArgumentsError(_nested_value_message(where, key, listed, value))
    if listed and isinstance(value, str):
        # 'data-path: 0.3 a 0.7 b', 'rampup-batch-size: 32 32 1000': the words, as on the
        # command line (shell quoting keeps a path with spaces whole)
        try:
            value = shlex.split(value)
        except ValueError as exc:
            raise ArgumentsError(f"{where}: cannot split {value!r} into words ({exc}); "
                                 "give a YAML list") from None
    items = value if isinstance(value, list) else [value]
    if action.nargs is None and isinstance(value, list):
        # a text value such as --split's '969,30,1' is its words joined by commas
        hint = (f"; write {key}: {','.join(map(str, value))}"
                if action.type in (None, str) and value else "")
        raise ArgumentsError(f"{where} takes one value, got the list {value!r}{hint}")
    out = []
    for item in items:
        if action.type is bool and isinstance(item, bool):
            conv = item
        else:
            try:
                conv = action.type(str(item)) if action.type else str(item)
            except ValueError:
                kind = getattr(action.type, "__name__", "value")
                raise ArgumentsError(f"{where} expects {kind}, got {item!r}") from None
        if action.choices is not None and conv not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ArgumentsError(f"{where}: {conv!r} is not one of {choices}")
        out.append(conv)
    return out if action.nargs in ("*", "+") else out[0]


def _nested_value_message(where: str, key: str, listed: bool, value: Any) -> str:
    """A YAML mapping or nested list given as a flag's value (its Python text was the
    value: a --save directory named "{'dir': 'ckpt'}"), and for a list flag the flat list
    to write (a blend as weight: path pairs -> [w1, p1, w2, p2])."""
    if isinstance(value, dict):
        what = f"{'a list' if listed else 'one value'}, not the mapping {value!r}"
        flat = [x for pair in value.items() for x in pair]
    else:
        what = f"a list of single values, not the nested {value!r}"
        flat = [x for item in value for x in (item if isinstance(item, list) else [item])]
    scalar = all(not isinstance(x, (dict, list)) for x in flat)
    hint = f"; write {key}: [{', '.join(map(str, flat))}]" if listed and scalar else ""
    return f"{where} takes {what}{hint}"


def _read_yaml(path: str) -> Any:
    """The document of a YAML file; ArgumentsError naming the file and the fix when it is
    not UTF-8 text, not YAML (a tab: the spaces to use), or a mapping naming a flag twice
    (YAML keeps the last silently)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = io.StringIO(f.read())  # once: a pipe (`--config <(...)`) cannot seek
        text.name = f.name  # the file YAML's messages name
        node = yaml.compose(text, yaml.SafeLoader)
        _check_yaml_size(path, node)
        text.seek(0)
        data = yaml.safe_load(text)
    except UnicodeDecodeError as exc:
        raise ArgumentsError(f"--config {path}: not a UTF-8 text file (it holds byte "
                             f"{exc.object[exc.start]:#04x}); a config is a YAML text file "
                             "of flag: value lines") from None
    except yaml.YAMLError as exc:
        tab = "; replace the tab with spaces (YAML allows no tabs there)" if "'\\t'" in str(
            exc) else ""
        raise ArgumentsError(f"--config {path}: not valid YAML ({exc}){tab}") from None
    lines: Dict[str, int] = {}
    for key, _ in node.value if isinstance(node, yaml.MappingNode) else ():
        line = lines.setdefault(_norm_key(key.value), key.start_mark.line + 1)
        if line != key.start_mark.line + 1:
            raise ArgumentsError(f"--config {path}: key '{key.value}' on line "
                                 f"{key.start_mark.line + 1} names the flag of line {line} "
                                 "again; keep one of them")
    return data


# The most values a config may hold once its YAML aliases (*name) are expanded: a real
# config has a few hundred; nested aliases ("billion laughs") multiply into billions.
YAML_MAX_VALUES = 100_000


def _check_yaml_size(path: str, node) -> None:
    """ArgumentsError naming the file when the document `node` would hold more than
    YAML_MAX_VALUES values with its aliases expanded, or refers to itself (the flags
    read each value, so the expansion would be built in memory)."""
    sizes: Dict[int, float] = {}

    def size(n) -> float:
        if id(n) in sizes:  # a node met again through an alias; inf while it is open
            return sizes[id(n)]
        sizes[id(n)] = float("inf")
        items = n.value if isinstance(n.value, list) else ()
        total = 1.0
        for item in items:
            for child in (item if isinstance(item, tuple) else (item,)):
                total = min(total + size(child), float("inf"))
                if total > YAML_MAX_VALUES:
                    return total
        sizes[id(n)] = total
        return total

    if node is not None and size(node) > YAML_MAX_VALUES:
        raise ArgumentsError(f"--config {path}: its YAML aliases (*name) expand to more than "
                             f"{YAML_MAX_VALUES} values (nested or self-referring anchors, "
                             "a 'billion laughs' file?); write the values out, or use "
                             "aliases only for a few shared values")


def _yaml_kind(data: Any) -> str:
    """What a YAML document that is not a mapping holds, for messages."""
    if isinstance(data, list):
        return f"a list of {len(data)} items"
    return f"a single {type(data).__name__} value ({str(data)[:40]!r})"


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Read `--config FILE.yaml` into {dest: value}.

    Keys are flag names with or without dashes, '-' or '_' alike (`tensor-model-parallel-size`,
    `tensor_model_parallel_size`); switches take true/false; list flags take YAML lists or the command line's words on
    one line (`data-path: 0.3 a 0.7 b`); a null value (`load: ~`, `load:`) leaves the flag
    at its default. Unknown keys are an error naming the closest flag.
    """
    if os.path.isdir(path):
        raise ArgumentsError(f"--config {path}: is a directory, not a file; pass the path "
                             "of the YAML file of flag: value lines")
    if not os.path.exists(path):  # a pipe or /dev/stdin is read like a file
        # a relative path, resolved: the launch scripts run from the repository root
        where = "" if os.path.isabs(path) else f" (looked for {os.path.abspath(path)})"
        raise ArgumentsError(f"--config {path}: file not found{where}")
    data = _read_yaml(path)
    if data is None:
        warn(f"--config {path}: the file holds no flags (it is empty or only comments); "
             "nothing is read from it")
        return {}
    if not isinstance(data, dict):
        raise ArgumentsError(f"--config {path}: expected a mapping of flag: value pairs, "
                             f"not {_yaml_kind(data)}; write one 'flag: value' per line")
    index = _option_index(parser)
    # dests that a store_false switch sets False and that default to None: --compile's
    opposite = {a.dest for a in parser._actions if a.nargs == 0 and a.const is False}
    removed = {_norm_key(k): k for k in REMOVED}
    values: Dict[str, Any] = {}
    for key, value in data.items():
        norm = _norm_key(key)
        if norm == "config":
            raise ArgumentsError(f"--config {path}: a config file cannot name another --config")
        if norm in removed:
            raise ArgumentsError(f"--config {path}: key '{key}' was removed from Megatron-LM; "
                                 f"use {_modern_spelling(removed[norm], _removed_value(value))}")
        if norm not in index:
            close = difflib.get_close_matches(norm, list(index), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            later = later_flag_hint("--" + norm)
            hint = f": {later}" if later else hint
            raise ArgumentsError(f"--config {path}: unknown key '{key}'{hint}")
        action = index[norm]
        if value is None:  # `load: ~`, `tensorboard-dir:`: YAML's null is no value, not 'None'
            continue
        tri_state = action.default is None and action.dest in opposite
        values[action.dest] = _yaml_value(str(key), action, value, path, tri_state)
    return values


# The ways to give the learning-rate warmup; a run takes one (arguments_schedule.py).
# `warmup` is the deprecated --warmup (a fraction or iterations, apply_deprecated).
_WARMUP = ("lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples", "warmup")


# A run counts its length and schedule in iterations or in samples (arguments_schedule.py):
# the dests of each way.
_RUN_LENGTH = {
    "train_iters": ("train_iters", "lr_decay_iters", "lr_warmup_iters"),
    "train_samples": ("train_samples", "lr_decay_samples", "lr_warmup_samples",
                      "rampup_batch_size"),
}


def _run_length_from_command_line(yaml_values: Dict[str, Any], command_line: Dict[str, Any],
                                  path: str) -> Dict[str, Any]:
    """The command line's --train-iters (or --train-samples) overrides the run length of a
    --config file that counts the other way: the file's schedule flags of that other way
    are dropped, with a warning naming them (they could not be combined: a preset in
    samples plus `--train-iters 100` was an error naming two exclusive flags)."""
    for given, own in _RUN_LENGTH.items():
        if given not in command_line:
            continue
        other = next(dests for flag, dests in _RUN_LENGTH.items() if flag != given)
        dropped = [d for d in other if d in yaml_values and d not in command_line]
        if not dropped:
            return yaml_values
        names = ", ".join(f"--{d.replace('_', '-')} {_shown(yaml_values[d])}" for d in dropped)
        warmup_given = any(d in command_line for d in _WARMUP)
        unset = [f"--{d.replace('_', '-')}" for d in own[1:3]
                 if d not in command_line and not (warmup_given and d in _WARMUP)]
        hint = (f"; pass {' / '.join(unset)} to set the schedule in these units (default: "
                "decay over the whole run, no warmup)" if unset else "")
        warn(f"--{given.replace('_', '-')} {command_line[given]} on the command line replaces "
             f"the run length of --config {path}, which counts the other way: its {names} "
             f"ignored{hint}")
        return {k: v for k, v in yaml_values.items() if k not in dropped}
    return yaml_values


# Exclusive choices a command-line flag makes in place of a --config file's (what, dests):
# the warmup, the precision (a bf16 preset plus --fp16 on a GPU without bf16), the data (a
# config naming data-path plus --mock-data to try it out, or the other way round), and a
# deprecated flag and its replacement, either of them in the file (apply_deprecated).
_EXCLUSIVE = (("the warmup", _WARMUP), ("the precision", ("fp16", "bf16")),
              ("the data", ("mock_data", "data_path", "train_data_path")),
              ("the micro batch size", ("batch_size", "micro_batch_size")),
              ("the tensor-parallel size", ("model_parallel_size", "tensor_model_parallel_size")),
              ("the recompute", ("checkpoint_activations", "recompute_granularity",
                                 "recompute_activations")))


def _choices_from_command_line(yaml_values: Dict[str, Any], command_line: Dict[str, Any],
                               path: str) -> Dict[str, Any]:
    """A choice given on the command line overrides a --config file's exclusive one (a
    preset's `lr-warmup-samples` plus `--lr-warmup-fraction 0.01`, its `bf16: true` plus
    `--fp16`): the file's is dropped with a warning. It was an error naming two exclusive
    flags, one of them the file's, that no command-line flag could take back."""
    for what, dests in _EXCLUSIVE:
        given = [d for d in dests if d in command_line]
        dropped = [d for d in dests if d not in command_line
                   and yaml_values.get(d, False) is not False]
        if not given or not dropped:
            continue
        names = ", ".join(_flag_shown(d, yaml_values[d]) for d in dropped)
        warn(f"{_flag_shown(given[0], command_line[given[0]])} on the command line replaces "
             f"{what} of --config {path}: its {names} ignored")
        yaml_values = {k: v for k, v in yaml_values.items() if k not in dropped}
    return yaml_values


def _flag_shown(dest: str, value: Any) -> str:
    flag = "--" + dest.replace("_", "-")
    return flag if value is True else f"{flag} {_shown(value)}"


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _modern_spelling(flag: str, value: str) -> str:
    """REMOVED's replacement for `flag` with the value the user gave it (`<value>` filled
    in, or after the replacement's last flag); the table's own text without a value."""
    modern = REMOVED[flag]
    if not value:
        return modern
    if "<value>" in modern:
        return modern.replace("<value>", value)
    last = FLAG_SPECS.get(modern.split()[-1])
    return f"{modern} {value}" if last is not None and last.kind != "true" else modern


def _removed_value(value: Any) -> str:
    """A --config value of a removed flag as it reads on a command line ('' for a switch)."""
    return "" if value is None or isinstance(value, bool) else _shown(value)
