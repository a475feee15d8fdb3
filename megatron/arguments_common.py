"""Shared pieces of the CLI layer: the user-error type, the warning helper and the flag index.

Used by `arguments.py`, `arguments_validate.py` and the modules it calls
(`arguments_ranges.py`, `arguments_schedule.py`, `arguments_inputs.py`) and
`arguments_report.py`; it imports only the flag tables.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Dict, Iterator, Mapping, NamedTuple, Optional, Tuple

from megatron.arguments_table import EXTRA_GROUP, MEGATRON_GROUPS

_log = logging.getLogger("megatron.arguments")


class ArgumentsError(SystemExit):
    """A mistake in the flags: exits with status 2 and prints `error: <message>`, no traceback.

    `parse_and_validate` prints the message to stderr before raising (see `prints_error`
    for which ranks print); `str(err)` and `err.message` give the text. `machine` is True
    when the error depends on this machine (its files, its CUDA) rather than on the flags
    alone (`machine_checks`).
    """

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message
        self.machine = False

    def __str__(self) -> str:
        return f"error: {self.message}"


@contextlib.contextmanager
def machine_checks() -> Iterator[None]:
    """Mark the ArgumentsErrors raised inside as depending on this machine: files read (a
    YAML config, tokenizer files, a checkpoint), CUDA present or not. Another node may see
    different files, so such an error is not left to rank 0 to report."""
    try:
        yield
    except ArgumentsError as err:
        err.machine = True
        raise


def prints_error(err: ArgumentsError, rank: int, local_rank: Optional[int]) -> bool:
    """Whether this process prints `err`. A mistake in the flags is the same on every rank
    (same command line, same world size), so rank 0 alone prints it and the others exit with
    the same status in silence: one message, not one per process. An error that depends on
    the machine is printed by rank 0 and by the first process of every node (LOCAL_RANK 0),
    or by every process when LOCAL_RANK is not set."""
    if rank == 0:
        return True
    return err.machine and (local_rank is None or local_rank == 0)


def warn(msg: str) -> None:
    """One-line warning about the flags (stderr on rank 0 unless logging is configured)."""
    _log.warning(msg)


def note(msg: str) -> None:
    """Informational line (Megatron prints these on rank 0), e.g. derived batch sizes."""
    _log.info(msg)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return f"WARNING: {text}" if record.levelno >= logging.WARNING else text


class _StreamsHandler(logging.Handler):
    """Notes on stdout, where Megatron prints them (`using world size: ...`, `setting
    global batch size ...`, ` > padded vocab ...`: log parsers and `| tee run.log` read
    them there), warnings on stderr. Each stream is looked up at each message."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def messages_for_rank(rank: int) -> Iterator[None]:
    """Show warnings/notes on rank 0 only. When nothing configured logging, print them
    ourselves: notes on stdout as bare lines, warnings on stderr prefixed `WARNING:`."""
    handler: Optional[logging.Handler] = None
    old_level = _log.level
    if not _log.hasHandlers():
        handler = _StreamsHandler()
        handler.setFormatter(_Formatter())
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)
    if rank != 0:
        _log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        if handler is not None:
            _log.removeHandler(handler)
        _log.setLevel(old_level)


class FlagSpec(NamedTuple):
    """One row of the flag tables, unpacked."""

    flag: str
    kind: str
    default: object
    choices: Optional[Tuple]
    dest: str
    group: str


def _unpack(row: tuple, group: str) -> FlagSpec:
    flag, kind, default = row[:3]
    choices = row[3] if len(row) > 3 else None
    dest = row[4] if len(row) > 4 else flag.lstrip("-").replace("-", "_")
    return FlagSpec(flag, kind, default, choices, dest, group)


def _build_index() -> Dict[str, FlagSpec]:
    index: Dict[str, FlagSpec] = {}
    for title, rows in MEGATRON_GROUPS + (EXTRA_GROUP,):
        for row in rows:
            spec = _unpack(row, title)
            assert spec.flag not in index, f"duplicate flag {spec.flag} in the tables"
            index[spec.flag] = spec
    return index


# flag -> FlagSpec, in table order (Megatron's groups first, then ours).
FLAG_SPECS: Dict[str, FlagSpec] = _build_index()


# dest -> the first flag writing it, in table order (a dict lookup: validation asks often,
# and tools/plan_layout.py validates thousands of candidate layouts).
_FIRST_FLAG: Dict[str, str] = {}
for _spec in FLAG_SPECS.values():
    _FIRST_FLAG.setdefault(_spec.dest, _spec.flag)


def flag_for_dest(dest: str) -> str:
    """The first flag writing `dest` (for messages): 'micro_batch_size' -> '--micro-batch-size'."""
    return _FIRST_FLAG.get(dest) or "--" + dest.replace("_", "-")


# flags Megatron-LM 23.05 reads as another one's other name (no deprecation): a message
# names the one the user typed
ALIASES = {"num_layers": "--encoder-num-layers", "seq_length": "--encoder-seq-length"}


def typed_flag(dest: str, origins: Optional[Mapping[str, str]] = None) -> str:
    """`dest`'s flag as the user typed it: its alias (`ALIASES`) when `origins` says the
    alias set it, else its own flag."""
    old = (origins or {}).get(dest)
    return old if old is not None and old == ALIASES.get(dest) else flag_for_dest(dest)


def spelled(ns, dest: str, origins: Optional[Mapping[str, str]] = None) -> str:
    """`dest`'s flag and value as the user typed them, for messages: '--lr-warmup-iters 3',
    or '--warmup 3 (deprecated; read as --lr-warmup-iters 3)' when a deprecated flag set it
    (`origins`: dest -> deprecated flag, as `arguments.apply_deprecated` returns)."""
    text = f"{flag_for_dest(dest)} {getattr(ns, dest)}"
    old = (origins or {}).get(dest)
    if old is None:
        return text
    if old == ALIASES.get(dest):
        return f"{old} {getattr(ns, dest)}"
    old_value = getattr(ns, old.lstrip("-").replace("-", "_"), None)
    typed = old if old_value is None or old_value is True else f"{old} {old_value}"
    return f"{typed} (deprecated; read as {text})"
