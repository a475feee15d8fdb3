"""'did you mean --flag?' for every command line of the project.

argparse answers a mistyped flag with 'unrecognized arguments: --max-new-tokns' (Python
before 3.14 suggests nothing for an option name), or, when the flag was a required one,
with 'the following arguments are required: --output' that never names the typo.
`SuggestingParser` adds the closest known flag to both; `unknown_arguments_message` is the
same text for parsers that collect unknown arguments themselves (megatron/arguments.py).
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Iterable, List, Mapping, Optional, Sequence


def option_strings(parser: argparse.ArgumentParser) -> List[str]:
    """Every flag `parser` knows, its sub-commands' included."""
    options = []
    for action in parser._actions:
        options += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options += option_strings(sub)
    return list(dict.fromkeys(options))


def _folded(flag: str) -> str:
    return flag.lower().replace("_", "-")


def close_flag(token: str, options: Iterable[str]) -> Optional[str]:
    """The known flag closest to `token` (`--flag` or `--flag=value`), or None."""
    name = token.split("=", 1)[0]
    if not name.startswith("-"):
        return None
    # Help is never the fix for a mistyped flag, and a `--name` typo is another `--name`
    # (`--hf` is nearer to `-h` than to `--input` by letters alone).
    options = [o for o in options if o not in ("-h", "--help")
               and (o.startswith("--") or not name.startswith("--"))]
    # Megatron's odd spellings (`--DDP-impl`, `--local_rank`, `--override-opt_param-scheduler`)
    # typed in another case or with `-` for `_`: `--ddp-impl` is `--DDP-impl`, though
    # `--data-impl` is nearer by letters.
    same = [o for o in options if _folded(o) == _folded(name)]
    if same:
        return same[0]
    close = difflib.get_close_matches(name, options, n=1)
    if close and difflib.SequenceMatcher(None, name, close[0]).ratio() >= 0.9:
        return close[0]  # a letter off: `--num-layer`, `--gpu` (not `--gpu-memory-gb`)
    # A flag that begins with the typed name's words: `--exit-signal` (a later Megatron
    # flag) is `--exit-signal-handler`, not `--exit-interval` (nearer by letters alone).
    longer = sorted((o for o in options if o.startswith(name + "-")), key=len)
    if longer:
        return longer[0]
    return close[0] if close else None


_NEGATIONS = ("no-", "disable-")


def _same_switch(name: str, core: str) -> bool:
    """Whether `name` spells the switch `core`: the same words, or a letter off (Megatron's
    `--no-log-learnig-rate-to-tensorboard` turns off what `--log-learning-rate-to-...`
    asks for), or `core` with a leading verb (`--apply-X`, `--add-X`)."""
    if name == core or name.endswith("-" + core):
        return True
    return difflib.SequenceMatcher(None, name, core).ratio() >= 0.9


def _opposite_switch(token: str, close: str) -> Optional[str]:
    """Whether `close` is the switch that does the opposite of what `token` asks: 'on'
    (`close` is Megatron's `--no-X` / `--disable-X` for a feature on by default, `token` a
    positive spelling of it: `--X`, `--apply-X`, `--add-X`) or 'off' (`token` is `--no-X`
    for a switch `--X` that turns something on). None otherwise."""
    name = token.split("=", 1)[0].lstrip("-")
    flag = close.lstrip("-")
    for negation in _NEGATIONS:
        if flag.startswith(negation) and not name.startswith(_NEGATIONS):
            core = flag[len(negation):]
            return "on" if _same_switch(name, core) else None
        if name.startswith(negation) and not flag.startswith(_NEGATIONS):
            core = name[len(negation):]
            return "off" if _same_switch(flag, core) else None
    return None


def flag_hint(token: str, options: Iterable[str]) -> Optional[str]:
    """What to tell the user of an unknown flag `token`: 'did you mean --flag?', or, when
    the closest flag is the opposite switch (`--bias-gelu-fusion` and Megatron's
    `--no-bias-gelu-fusion`), that the token asks for the default: following a 'did you
    mean' there would have turned the feature the other way. None: no close flag."""
    close = close_flag(token, options)
    if close is None:
        return None
    default = _opposite_switch(token, close)
    if default is None:
        return f"did you mean {close}?"
    other = "off" if default == "on" else "on"
    return f"not a flag: {default} by default, so drop it; {close} turns it {other}"


def unknown_arguments_message(unknown: Sequence[str], options: Iterable[str],
                              known: Optional[Mapping[str, str]] = None) -> str:
    """'unrecognized arguments: --num-layer (did you mean --num-layers?) 2'. `known`: what
    to say of particular unknown flags (another release's), instead of the closest flag."""
    options = list(options)
    known = known or {}
    parts = []
    for token in unknown:
        hint = known.get(token.split("=", 1)[0]) or flag_hint(token, options)
        parts.append(f"{token} ({hint})" if hint else token)
    return "unrecognized arguments: " + " ".join(parts)


def _unknown_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> List[str]:
    """The tokens of `argv` that look like flags `parser` does not know (nor abbreviates)."""
    options = option_strings(parser)
    unknown = []
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not name.startswith("--") or name in options:
            continue
        if parser.allow_abbrev and any(o.startswith(name) for o in options):
            continue
        unknown.append(token)
    return unknown


class SuggestingParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors name the closest flag of each unknown one:
    'unrecognized arguments: --promt (did you mean --prompt?) x', and a missing required
    flag beside a misspelling of it ('... required: --output; --ouptut is not a flag: did
    you mean --output?'). Sub-commands (add_subparsers) get the same class."""

    _argv: Sequence[str] = ()

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments_message(extras, option_strings(self)))
        return ns

    def error(self, message: str):  # noqa: D401 - argparse API
        if "required" in message:
            options = option_strings(self)
            for token in _unknown_flags(self._argv, self):
                hint = flag_hint(token, options)
                hint = "" if hint is None else ": " + hint.removeprefix("not a flag: ")
                message += f"; {token.split('=', 1)[0]} is not a flag{hint}"
        super().error(message)
