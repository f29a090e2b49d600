"""What the benchmarks share: a summation server on loopback, children spoken to line by line, ranks in spawned
processes, a free port.

Benchmarks import no test module: what they need of a test's harness lives here.
May import: the standard library (torch_bps only inside the processes it starts).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import selectors
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A process started with `repo` first on its path, spoken to line by line: `expect` reads its stdout up to a line
    matching a pattern, within a deadline; `say` writes a line to its stdin.

    Example: `w = Child([sys.executable, "bench.py", "_worker"], name="worker 0"); w.expect("^ready", 60); w.say("go")`.
    """

    def __init__(self, cmd: list[str], *, repo: str = REPO, cwd: str | None = None, name: str = ""):
        self.name = name or " ".join(cmd[1:4])
        env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, pattern: str, timeout: float) -> re.Match:
        """Read lines until one matches `pattern`; raise if the process ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0 and sel.select(left):
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.name} exited ({self.proc.wait(10)}) before printing {pattern!r}")
                if m := re.search(pattern, line):
                    return m
        raise TimeoutError(f"{self.name} printed no {pattern!r} within {timeout:.0f} s")

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(Child):
    """`python -m torch_bps.server` on loopback, from `repo` (this tree by default), with `args` added.

    Unless `args` say "--auth off" it authenticates with the pool credential of BPS_POOL_CREDENTIAL, set here when
    unset (the Clients of this process, and processes started after, pick the same one up). Example:
    `with Server("--max-memory-bytes", "67108864") as server: Client([server.address], ...)`.
    """

    def __init__(self, *args: str, repo: str = REPO, start_timeout: float = 60.0):
        from secrets import token_urlsafe

        os.environ.setdefault("BPS_POOL_CREDENTIAL", token_urlsafe(32))
        cmd = [sys.executable, "-m", "torch_bps.server", "--host", "127.0.0.1", "--port", "0", *args]
        super().__init__(cmd, repo=repo, cwd=repo, name=f"the server of {repo}")
        try:
            self.port = int(self.expect(r"port (\d+) incarnation", start_timeout).group(1))
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def spawn_ranks(target, world: int, *args, timeout: float = 600.0) -> list:
    """Run `target(rank, world, port, *args, results)` in `world` spawned processes (`port` free for their
    rendezvous); each puts (rank, "ok", value) or (rank, "error", text) on `results`. Returns the values by rank;
    raises with the first rank's error, or naming the ranks that sent nothing within `timeout`."""
    import queue

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world)) - set(out))
                raise TimeoutError(f"ranks {missing} of {world} sent no result within {timeout:.0f} s") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank}:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
