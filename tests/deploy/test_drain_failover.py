"""A rolling update, in small: SIGTERM to one of a job's two summation servers mid-training drains it (it exits 0
once no round is in flight, well before its --drain-timeout) and the job fails over to the standby with no lost
step: its parameters end bit-identical to an uninterrupted run's (two workers' sums cannot differ in order)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers import REPO, _free_port, start_servers, stop_servers

pytestmark = pytest.mark.timeout(300)

SCRIPT = os.path.join(REPO, "tests", "deploy", "train.py")
STEPS = 20
DRAIN_TIMEOUT = 30.0


def torchrun(out: str, servers: list[str], env: dict[str, str] | None = None, step_sleep: float = 0.0):
    """Start tests/deploy/train.py on two workers under torchrun; return the process (stdout and stderr merged)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), SCRIPT, "--out", out, "--steps", str(STEPS), "--step-sleep",
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


def test_sigterm_drains_a_server_and_the_job_fails_over_with_no_lost_step(tmp_path):
    *servers, standby = start_servers(3, extra_args=("--drain-timeout", str(DRAIN_TIMEOUT)))
    try:
        addresses = [s.address for s in servers]
        proc = torchrun(str(tmp_path / "baseline"), addresses)
        baseline, records = finish(proc, lines_of(proc), str(tmp_path / "baseline"), [])
        assert records == []

        out = str(tmp_path / "drained")
        proc = torchrun(out, addresses, env={"BPS_STANDBY_SERVERS": standby.address}, step_sleep=0.1)
        lines, seen = lines_of(proc), []
        deadline = time.monotonic() + 120
        while not any(line.startswith("rank 0 step 5") for line in seen):
            assert time.monotonic() < deadline, "the job did not reach step 5 within 120 s:\n" + "".join(seen)[-4000:]
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "the job ended before step 5:\n" + "".join(seen)[-4000:]
            seen.append(line)
        sent = time.monotonic()
        servers[0].proc.send_signal(signal.SIGTERM)
        assert servers[0].proc.wait(timeout=DRAIN_TIMEOUT + 10) == 0
        drained_in = time.monotonic() - sent
        params, records = finish(proc, lines, out, seen)
    finally:
        stop_servers([*servers, standby])
    output = "".join(seen)
    assert drained_in < DRAIN_TIMEOUT / 3, f"the drain took {drained_in:.1f} s: it waited for its deadline"
    assert [r["lost"] for r in records] == [[servers[0].address]], output[-3000:]
    assert records[0]["standby"] == [standby.address]
    assert set(records[0]["servers"]) == {servers[1].address, standby.address}
    assert all(f"rank {r} step {STEPS - 1}" in output for r in (0, 1))
    assert params.keys() == baseline.keys()
    for name, value in params.items():
        assert torch.equal(value, baseline[name]), f"{name} differs from the uninterrupted run"
