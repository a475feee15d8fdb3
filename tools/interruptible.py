"""Ctrl-C and SIGTERM for the tools that write files (preprocess_data.py, merge_datasets.py,
make_corpus.py, checkpoint_convert.py, checkpoint_util.py): both end the tool with one line
and the shell's status (130, 143) once the partial output is removed. SIGTERM (a
scheduler's time limit, `kill`, `timeout`) would otherwise end the process on the spot,
with the partial files left behind and nothing said."""
from __future__ import annotations

if __name__ == "__main__":
    raise SystemExit("tools/interruptible.py is a library module (Ctrl-C and SIGTERM for the "
                     "tools that write files); run python tools/preprocess_data.py --help")

import signal
import sys
import threading
from typing import Callable

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
TERMINATED = 143  # ... by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the tool is, and handled as Ctrl-C is: the writers' cleanup
    (`finally`, `except BaseException`) removes their partial files."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def run_interruptible(run: Callable[[], object], message: Callable[[str], str]) -> int:
    """`run()` (its int result is the status; anything else is 0). Ctrl-C or SIGTERM:
    print `message(how)` ('by SIGTERM' or '(Ctrl-C)') to stderr and return 143 or 130.
    SIGTERM is caught only on the main thread (elsewhere a handler cannot be set)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        status = run()
        return status if isinstance(status, int) else 0
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(message("by SIGTERM" if terminated else "(Ctrl-C)"), file=sys.stderr)
        return TERMINATED if terminated else INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
