"""A rolling update, in small: SIGTERM to one of a job's two summation servers mid-training drains it (it exits 0
once no round is in flight, well before its --drain-timeout) and the job fails over to the standby with no lost
step: its parameters end bit-identical to an uninterrupted run's (two workers' sums cannot differ in order)."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from tests.deploy.train import finish, lines_of, torchrun
from tests.helpers import start_servers, stop_servers

pytestmark = pytest.mark.timeout(300)

STEPS = 20
DRAIN_TIMEOUT = 30.0


def test_sigterm_drains_a_server_and_the_job_fails_over_with_no_lost_step(tmp_path):
    *servers, standby = start_servers(3, extra_args=("--drain-timeout", str(DRAIN_TIMEOUT)))
    try:
        addresses = [s.address for s in servers]
        proc = torchrun(str(tmp_path / "baseline"), addresses, STEPS)
        baseline, records = finish(proc, lines_of(proc), str(tmp_path / "baseline"), [])
        assert records == []

        out = str(tmp_path / "drained")
        proc = torchrun(out, addresses, STEPS, env={"BPS_STANDBY_SERVERS": standby.address}, step_sleep=0.1)
        lines, seen = lines_of(proc), []
        deadline = time.monotonic() + 120
        while not any("rank 0 step 5" in line for line in seen):  # the ranks' lines may interleave
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
