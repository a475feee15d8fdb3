"""An entry point's exit without the interpreter's teardown: `run(main)` is
`sys.exit(main())` less about a second of every process.

After `main()` has returned, the interpreter's exit does what a finished run needs -- it
waits for the threads that are not daemons (a background checkpoint writer), runs the
atexit functions (logging's flush, multiprocessing's children, weakref finalizers,
temporary directories) and flushes stdout and stderr -- and then tears down every module:
it frees all their objects, collecting garbage over them. For a process that has imported
torch that last part takes about 0.7 s (1-2 s on a loaded machine), paid by each rank of
each launch and by nothing a finished run needs. `run` does the first part as the
interpreter does, in its order, then ends the process with `os._exit`.

gc.freeze() before the exit skipped most of that time (the collections) but left Triton's
objects alive at the end, which its bindings (nanobind) then report on stderr as leaks.

An exception that `main` lets out is printed by `sys.excepthook`, as the interpreter
prints it (torch's rank prefix included), and the process then ends the same way with
status 1: a rank that failed would otherwise spend 1-5 s tearing down torch and its
process group before the launcher saw it go. KeyboardInterrupt keeps the usual exit
(the interpreter re-raises SIGINT so that a shell sees the signal).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn, Union

ExitCode = Union[int, str, None]


def run(main: Callable[[], ExitCode]) -> NoReturn:
    """`sys.exit(main())` (also for a SystemExit that `main` raises), then
    `exit_without_teardown`; any other exception but KeyboardInterrupt is printed by
    `sys.excepthook` and gives status 1."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: B902 - printed as the interpreter prints it, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_without_teardown(code)


def exit_status(code: ExitCode) -> int:
    """The exit status of `sys.exit(code)`; a message (neither None nor an int) is
    printed to stderr first, as the interpreter prints it, and gives status 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    if sys.stderr is not None:
        print(code, file=sys.stderr)
    return 1


def exit_without_teardown(code: ExitCode = 0) -> NoReturn:
    """End the process as `sys.exit(code)` would, without tearing down the modules: wait
    for the non-daemon threads, run the atexit functions (threading's own exit functions
    and the atexit module's, as the interpreter does), flush stdout and stderr, then
    `os._exit`. Should a flush fail (a closed pipe), the usual exit reports it."""
    status = exit_status(code)
    threading._shutdown()  # what the interpreter's exit calls first
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        sys.exit(status)
    os._exit(status)
