"""Kill what a test session left running, however the session ended.

tests/conftest.py starts this in a session of its own with a token that every process the tests start
inherits through the environment (servers, spawned ranks, their embedded servers, torchrun's children).
It waits for its stdin to close, which happens when pytest exits for any reason: normally, through
pytest-timeout's os._exit, or killed. It then gives the session's processes a moment to exit on their own,
SIGKILLs the rest and names them on stderr, so a hung or failed test cannot leave a process behind to
hold CI's output pipes open.

Usage: python -m tests.reaper TOKEN   (the variable is ENV below)
May import: the standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

ENV = "TORCH_BPS_TEST_SESSION"
GRACE = 3.0  # seconds for processes that are already on their way out (e.g. multiprocessing's helpers)


def session_processes(token: str, keep: Callable[[str], bool] = lambda cmd: False) -> dict[int, str]:
    """Return {pid: command line} of every process whose environment carries this session's token, but
    those whose command line `keep` accepts."""
    marker = f"{ENV}={token}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if not keep(cmd):
                found[int(name)] = cmd[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def reap(token: str, grace: float = GRACE, keep: Callable[[str], bool] = lambda cmd: False) -> dict[int, str]:
    """Wait up to `grace` seconds for the session's processes to exit, SIGKILL the rest; return those."""
    deadline = time.monotonic() + grace
    while (left := session_processes(token, keep)) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed: dict[int, str] = {}
    for _ in range(10):  # a process may start another while we kill: go again until none is left
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        killed.update(left)
        time.sleep(0.1)
        left = session_processes(token, keep)
    return killed


def main(argv: list[str]) -> int:
    (token,) = argv
    sys.stdin.buffer.read()  # returns at EOF: the pytest process is gone
    killed = reap(token)
    if killed:
        lines = "".join(f"\n  {pid}: {cmd}" for pid, cmd in sorted(killed.items()))
        print(f"tests/reaper.py: killed {len(killed)} process(es) the test session left running:{lines}",
              file=sys.stderr, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
