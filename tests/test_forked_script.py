"""tests/forked_script.py's ForkedPopen: a Popen whose child forks this process in place of
fork + exec (torchrun's workers in tests/test_rank_failures.py)."""
from __future__ import annotations

import os
import socket
import sys

from tests import forked_script

CHILD = """
import os, sys
fd = int(os.environ["LISTENING_FD"])
print("argv", sys.argv[1:], "env", os.environ["ONLY"], "keys", len(os.environ))
print("session leader", os.getsid(0) == os.getpid())
print("inherited socket now", os.readlink("/proc/self/fd/%d" % fd))
sys.exit(3)
"""


def test_a_forked_popen_runs_the_script_as_a_fresh_interpreter_would(tmp_path, capfd):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    with socket.socket() as listening:  # as torchrun's store, open in the launcher
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        env = {"ONLY": "yes", "LISTENING_FD": str(listening.fileno())}
        proc = forked_script.ForkedPopen([sys.executable, "-u", str(script), "a", "b"],
                                         env=env, start_new_session=True)
        assert proc.pid != os.getpid()
        assert proc.wait(timeout=60) == 3
        assert listening.fileno() >= 0  # this process's descriptor is untouched
    out = capfd.readouterr().out
    assert "argv ['a', 'b'] env yes keys 2" in out, out
    assert "session leader True" in out, out
    assert "inherited socket now /dev/null" in out, out
