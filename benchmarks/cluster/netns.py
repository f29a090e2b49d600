"""Thin wrappers over `ip` and `tc`, the naming scheme of namespaces, and removal of leftovers of crashed runs.

Every namespace this package creates is named `bps-<role>-<run id>` (`bps-br-1a2b3c`, `bps-w0-1a2b3c`,
`bps-s1-1a2b3c`), and a live run keeps `/run/bps-cluster/<run id>.pid` holding its pid, so that
`cleanup_leftovers` removes only what crashed runs left behind and never a run in progress.
May import: the standard library and benchmarks.cluster (its errors).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time

from benchmarks.cluster import NamespaceError

# `ip` and `tc` answer in milliseconds; a command that takes this long is stuck, not slow.
COMMAND_TIMEOUT_S = 20.0
NAMESPACE_RE = re.compile(r"^bps-(?:br|w\d+|s\d+)-(?P<run_id>[0-9a-f]{6})$")
# Namespaces are the machine's, so their runs' pid files are too: one fixed folder, whatever TMPDIR a run has.
PID_DIR = "/run/bps-cluster"
PID_RE = re.compile(r"(?P<run_id>[0-9a-f]{6})\.pid")


def new_run_id() -> str:
    """Return a fresh 6-hex-digit run id, unique enough for parallel runs on one machine."""
    return secrets.token_hex(3)


def namespace_name(role: str, run_id: str) -> str:
    """Return the namespace name of `role` ("br", "w0", "s1"...) in run `run_id`."""
    return f"bps-{role}-{run_id}"


def pidfile_path(run_id: str) -> str:
    return os.path.join(PID_DIR, f"{run_id}.pid")


def _pidfiles() -> list[tuple[str, str]]:
    """(run id, path) of every pid file."""
    names = os.listdir(PID_DIR) if os.path.isdir(PID_DIR) else []
    return [(m.group("run_id"), os.path.join(PID_DIR, n)) for n in names if (m := PID_RE.fullmatch(n))]


def unavailable_reason() -> str | None:
    """Return why namespaces cannot be built here (not root, no `ip`/`tc`), or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc); run as root or with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found on PATH)"
    return None


def run(argv: list[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run one `ip`/`tc` command with a timeout; return stdout, raise NamespaceError on failure."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NamespaceError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if check and done.returncode != 0:
        raise NamespaceError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run `ip [-n netns] args...`. Example: `ip("link", "set", "lo", "up", netns="bps-w0-1a2b3c")`."""
    return run(["ip", *(("-n", netns) if netns else ()), *args], check=check)


def tc(*args: str, netns: str, check: bool = True) -> str:
    """Run `tc -n netns args...`: only ever inside one of our namespaces."""
    return run(["tc", "-n", netns, *args], check=check)


def list_namespaces() -> list[str]:
    """Return the names of all network namespaces known to `ip netns` (ours and anyone else's)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def namespace_pids(netns: str) -> list[int]:
    """Return the pids of the processes living in `netns` (empty if it is gone)."""
    out = ip("netns", "pids", netns, check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM the given pids, then SIGKILL whichever is still alive after `grace_s`."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers signal 0; /proc tells it apart.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def delete_namespace(netns: str) -> None:
    """Kill what runs in `netns`, then delete it (its veth ends go with it, and so do their peers)."""
    kill_pids(namespace_pids(netns))
    ip("netns", "delete", netns, check=False)


def live_run_ids() -> set[str]:
    """Return the run ids whose pid file names a process that is still alive."""
    live = set()
    for run_id, path in _pidfiles():
        try:
            with open(path) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            live.add(run_id)
    return live


def cleanup_leftovers(verbose: bool = True) -> list[str]:
    """Delete the `bps-*-<id>` namespaces (and pid files) of runs that are no longer alive; return them.

    Namespaces of a live run (its pid file names a running process) are left alone.
    """
    live = live_run_ids()
    removed = []
    for netns in list_namespaces():
        m = NAMESPACE_RE.match(netns)
        if not m or m.group("run_id") in live:
            continue
        delete_namespace(netns)
        removed.append(netns)
        if verbose:
            print(f"removed leftover namespace {netns}", flush=True)
    for run_id, path in _pidfiles():
        if run_id not in live:
            try:
                os.unlink(path)
            except OSError:
                pass
    return removed
