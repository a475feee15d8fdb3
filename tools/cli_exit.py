"""`run(main)`: a tool's `sys.exit(main())`, quiet when the reader of its output has gone
away (`python tools/parallel_groups.py ... | head`): no BrokenPipeError traceback, and
status 141 (128 + SIGPIPE), as a shell tool killed by the closed pipe reports."""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/cli_exit.py is a library module (the exit helper of the tools); run "
                     "the tool itself, e.g. python tools/parallel_groups.py --help")

import os
import sys
from typing import Callable, NoReturn, Optional

SIGPIPE_STATUS = 141


def run(main: Callable[[], Optional[int]]) -> NoReturn:
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        status = SIGPIPE_STATUS
    sys.exit(status)
