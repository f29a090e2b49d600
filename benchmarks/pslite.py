"""Run ps-lite's own push/pull benchmark (`tests/test_benchmark`, mode 1) on loopback and read its goodput.

ps-lite is not built by this repository: pass the directory of a checkout built as
/work/shared/notes/environment.md says (bytedance/ps-lite, `make DEPS_PATH=/usr USE_RDMA=0 USE_UCX=0 USE_FABRIC=0
USE_CUDA=0 ps tests/test_benchmark`). One scheduler, one server and one worker process run on 127.0.0.1 over
ZeroMQ. Per iteration the worker issues a push and then a pull of each of its 40 keys of S bytes without
waiting (80 requests in flight), then waits for all of them; the server acknowledges pushes and answers pulls
from a buffer per key without summing. Goodput counts S once per key per iteration, as ps-lite prints it.

May import: the standard library only.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import statistics
import subprocess
import threading
import time

KEYS = 40  # test_benchmark's NUM_KEY_PER_SERVER default: keys per iteration with one server
# ps-lite's line per LOG_DURATION iterations: "Application goodput: 4.2 Gbps. Avg latency = ... ns per key".
GOODPUT = re.compile(r"Application goodput: ([0-9.eE+-]+) Gbps")


class PsLite:
    """ps-lite's test_benchmark, built in `root` (a ps-lite checkout)."""

    def __init__(self, root: str):
        self.binary = os.path.join(root, "tests", "test_benchmark")
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(f"{self.binary} is not an executable: build ps-lite's tests/test_benchmark first")

    def goodput(self, size: int, budget: float, min_iters: int = 3, timeout: float = 120.0) -> float:
        """Run one scheduler, server and worker with keys of `size` bytes; return bytes/s over the median iteration.

        Every iteration is logged (LOG_DURATION=1); the first is dropped as the warm-up, as `timed` drops its
        first call, and the run is stopped once `budget` seconds of iterations (at least `min_iters`) were read.
        """
        env = {
            **os.environ,
            "DMLC_NUM_WORKER": "1",
            "DMLC_NUM_SERVER": "1",
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(_free_port()),
            "DMLC_INTERFACE": "lo",
            "DMLC_NODE_HOST": "127.0.0.1",
            "DMLC_ENABLE_RDMA": "zmq",  # plain ZeroMQ over TCP
            "DMLC_GROUP_SIZE": "1",  # without it the server never starts
            "BENCHMARK_NTHREAD": "1",
            "NUM_KEY_PER_SERVER": str(KEYS),
            "LOG_DURATION": "1",
        }
        argv = [self.binary, str(size), "0", "1"]  # mode 1: push then pull of every key, all in flight
        procs = [
            subprocess.Popen(argv, env={**env, "DMLC_ROLE": role}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE if role == "worker" else subprocess.DEVNULL, text=True)
            for role in ("scheduler", "server", "worker")
        ]  # fmt: skip
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(procs[2].stderr, lines), daemon=True).start()
        seconds: list[float] = []
        try:
            deadline = time.monotonic() + timeout
            while len(seconds) < min_iters + 1 or sum(seconds[1:]) < budget:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if line is None:
                    raise RuntimeError(f"ps-lite's worker exited (code {procs[2].wait()}) after {len(seconds)} lines")
                if m := GOODPUT.search(line):
                    seconds.append(KEYS * size * 8 / (float(m.group(1)) * 1e9))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ps-lite gave {len(seconds)} iterations in {timeout}s")
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
        return KEYS * size / statistics.median(seconds[1:])


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
