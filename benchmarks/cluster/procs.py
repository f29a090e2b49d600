"""Processes inside namespaces: start with `ip netns exec`, wait with a deadline, kill by process group.

A process prints its result as one line `RESULT {json}` on stdout; stdout and stderr go to files (no pipe
can fill up and stall a worker), read back once the process is done.
May import: the standard library and benchmarks.cluster (its errors).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from benchmarks.cluster import MeasurementError, MeasurementTimeout

RESULT_PREFIX = "RESULT "
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Proc:
    """One process started in a namespace. `name` ("gloo rank 1") and `host` ("w1") go into every error."""

    name: str
    host: str
    popen: subprocess.Popen
    stdout_path: str
    stderr_path: str
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self, grace_s: float = 2.0) -> None:
        """SIGTERM the process group (the process is its leader), SIGKILL it after `grace_s`, reap it."""
        if self.popen.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def stdout(self) -> str:
        return _read(self.stdout_path)

    def stderr_tail(self, lines: int = 15) -> str:
        return "\n".join(_read(self.stderr_path).splitlines()[-lines:])

    def result(self) -> dict:
        """Return the JSON of the process's `RESULT` line; MeasurementError if it printed none."""
        for line in reversed(self.stdout().splitlines()):
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])
        raise MeasurementError(f"{self.name} on {self.host} printed no result; stderr:\n{self.stderr_tail()}")


def start(name: str, host: str, netns: str, argv: list[str], env: dict[str, str], logdir: str) -> Proc:
    """Start `argv` inside `netns` in a new session (so we can kill its whole group); return the Proc."""
    stem = os.path.join(logdir, f"{name.replace(' ', '_')}-{host}-{time.monotonic_ns()}")
    full_env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1", **env}
    with open(stem + ".out", "w") as out, open(stem + ".err", "w") as err:
        popen = subprocess.Popen(
            ["ip", "netns", "exec", netns, *argv],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    return Proc(name, host, popen, stem + ".out", stem + ".err")


def wait_all(procs: list[Proc], timeout_s: float, what: str) -> list[dict]:
    """Wait for every process to exit 0 within `timeout_s`; return their results in order.

    The first failure kills the rest at once (a dead rank would otherwise leave its peers waiting until
    their own timeouts) and raises MeasurementError naming the process, its host and its stderr.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    try:
        while pending:
            for p in list(pending):
                rc = p.poll()
                if rc is None:
                    continue
                pending.remove(p)
                if rc != 0:
                    raise MeasurementError(f"{what}: {p.name} on {p.host} exited {rc}; stderr:\n{p.stderr_tail()}")
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{p.name} on {p.host}" for p in pending)
                tails = "\n".join(f"--- {p.name}:\n{p.stderr_tail(5)}" for p in pending)
                raise MeasurementTimeout(f"{what}: no finish within {timeout_s:.0f} s ({names}); killed\n{tails}")
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
    return [p.result() for p in procs]


def wait_for_line(proc: Proc, needle: str, timeout_s: float) -> str:
    """Wait until `proc` prints a stdout line containing `needle`; return it. Raises if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.stdout().splitlines():
            if needle in line:
                return line
        if proc.poll() is not None:
            raise MeasurementError(
                f"{proc.name} on {proc.host} exited {proc.poll()} before printing {needle!r}; "
                f"stderr:\n{proc.stderr_tail()}"
            )
        time.sleep(0.05)
    raise MeasurementTimeout(f"{proc.name} on {proc.host} did not print {needle!r} within {timeout_s:.0f} s")


def _pythonpath() -> str:
    current = os.environ.get("PYTHONPATH", "")
    return REPO_ROOT + (os.pathsep + current if current else "")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
