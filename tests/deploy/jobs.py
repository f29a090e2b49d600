"""Launching tests/deploy/train.py for the deploy tests: torchrun with given servers, its output line by line."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import torch

from tests.helpers import REPO, _free_port

SCRIPT = os.path.join(REPO, "tests", "deploy", "train.py")


def torchrun(out: str, servers: list[str], steps: int, env: dict[str, str] | None = None, step_sleep: float = 0.0):
    """Start tests/deploy/train.py on two workers under torchrun; return the process (stdout and stderr merged)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), SCRIPT, "--out", out, "--steps", str(steps), "--step-sleep",
           str(step_sleep)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "BPS_LOCAL_REDUCE": "0", "BPS_TIMEOUT": "30",
           "BPS_SERVERS": ",".join(servers), "BPS_FAILOVER_TIMEOUT": "30", **(env or {})}  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's output, line by line, from a thread (None once it closes)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def finish(proc: subprocess.Popen, lines: queue.Queue, out: str, seen: list[str]) -> tuple[dict, list]:
    """Wait for the job to end (150 s at most); return (its final parameters, its failover records)."""
    deadline = time.monotonic() + 150
    while (line := lines.get(timeout=max(deadline - time.monotonic(), 0.1))) is not None:
        seen.append(line)
    assert proc.wait(timeout=30) == 0, "".join(seen)[-6000:]
    with open(out + ".json") as f:
        return torch.load(out + ".pt"), json.load(f)
