"""bps-server's probes and SIGTERM drain, spoken to by hand: /healthz and /readyz on the metrics port, a new job
refused while draining, an open round finished before the server exits 0 (torch_bps/server/drain.py)."""

from __future__ import annotations

import re
import signal
import time
import urllib.error
import urllib.request

import pytest
import torch

from tests.helpers import RawPeer, ServerProcess
from torch_bps.wire import Command, Status

pytestmark = pytest.mark.timeout(90)

FLOAT32 = 1  # the wire's dtype code (docs/protocol.md)
N = 256


def probe(base: str, path: str) -> tuple[int, str]:
    """GET base + path; return (HTTP status, body)."""
    try:
        with urllib.request.urlopen(base + path, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def server():
    """A fresh server with its metrics port (and so its probes) on a free port; yields (server, http://HOST:PORT)."""
    server = ServerProcess(extra_args=("--metrics-port", "0", "--drain-timeout", "60", "--log-level", "INFO"))
    line = server.proc.stdout.readline()
    m = re.search(r"metrics at (http://\S+)/metrics", line)
    assert m, line
    yield server, m.group(1)
    server.kill()


def _request(peer: RawPeer, command: int, *payload: bytes, **fields):
    return peer.request(command, *payload, key=3, nbytes=N * 4, dtype=FLOAT32, **fields)


def test_probes_say_live_and_ready(server):
    _, base = server
    assert probe(base, "/healthz") == (200, "ok\n")
    assert probe(base, "/readyz") == (200, "ready\n")
    assert probe(base, "/metrics")[0] == 200
    assert probe(base, "/nothing")[0] == 404


def test_sigterm_refuses_new_jobs_finishes_the_open_round_and_exits_0(server, job_id):
    proc, base = server
    a, b = (RawPeer(proc.address, job_id, w, 2) for w in range(2))
    for p in (a, b):
        assert p.hello().status == Status.OK
        assert _request(p, Command.INIT)[0].status == Status.OK
    x, y = torch.arange(N, dtype=torch.float32), torch.full((N,), 0.5)
    assert _request(a, Command.PUSH, x.numpy().tobytes(), round=0)[0].status == Status.OK  # round 0 is open
    proc.proc.send_signal(signal.SIGTERM)
    # The drain waits for a job heard from within the last 2 s (drain.IDLE_AFTER_S): b's INITs keep it heard.
    deadline = time.monotonic() + 10
    while probe(base, "/readyz")[0] != 503:
        assert time.monotonic() < deadline, "/readyz still says ready 10 s after SIGTERM"
        assert _request(b, Command.INIT)[0].status == Status.OK
        time.sleep(0.05)
    assert _request(b, Command.INIT)[0].status == Status.OK
    status, body = probe(base, "/readyz")
    assert status == 503 and "draining" in body, body
    assert probe(base, "/healthz") == (200, "ok\n")  # draining is alive: no liveness restart
    newcomer = RawPeer(proc.address, job_id + 1, 0, 1)
    header, rest = newcomer.request(Command.HELLO, num_workers=1)
    assert header.status == Status.UNKNOWN_JOB and b"draining" in rest[0], (header, rest)
    newcomer.close()
    assert proc.alive(), "the server stopped with round 0 open"
    # The round in flight finishes: b pushes, both pull the sum; then nothing is open and the server exits 0.
    assert _request(b, Command.PUSH, y.numpy().tobytes(), round=0)[0].status == Status.OK
    for p in (a, b):
        header, rest = _request(p, Command.PULL, round=0)
        assert header.status == Status.OK, rest
        assert torch.equal(torch.frombuffer(bytearray(rest[0]), dtype=torch.float32), x + y)
    assert proc.proc.wait(timeout=10) == 0
    a.close()
    b.close()


def test_sigterm_with_no_job_exits_0_at_once(server):
    proc, _ = server
    start = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=10) == 0
    assert time.monotonic() - start < 5


def test_drain_stops_at_its_deadline_with_a_round_open(job_id):
    """A round that never finishes (its other worker never pushes) holds the drain until --drain-timeout, not longer;
    the jobs' failover finishes such rounds elsewhere."""
    proc = ServerProcess(extra_args=("--drain-timeout", "1.5"))
    try:
        a = RawPeer(proc.address, job_id, 0, 2)
        assert a.hello().status == Status.OK and _request(a, Command.INIT)[0].status == Status.OK
        assert _request(a, Command.PUSH, bytes(N * 4), round=0)[0].status == Status.OK
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        while time.monotonic() - start < 1.0:  # keep the job heard from, so that only the deadline ends the drain
            assert _request(a, Command.INIT)[0].status == Status.OK
            time.sleep(0.05)
        assert proc.alive(), "the drain stopped with round 0 open"
        assert proc.proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 6
        a.close()
    finally:
        proc.kill()


def test_an_embedded_server_stops_at_once_on_sigterm(job_id):
    """A server a job started for itself (--exit-with-parent) has nobody to hand the job to: no drain."""
    proc = ServerProcess(extra_args=("--exit-with-parent", "--drain-timeout", "60"))
    try:
        a = RawPeer(proc.address, job_id, 0, 2)
        assert a.hello().status == Status.OK and _request(a, Command.INIT)[0].status == Status.OK
        assert _request(a, Command.PUSH, bytes(N * 4), round=0)[0].status == Status.OK  # round 0 stays open
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while proc.alive() and time.monotonic() < deadline:  # the job stays heard from: a drain would wait 60 s
            a.send(Command.INIT, key=3, nbytes=N * 4, dtype=FLOAT32)
            time.sleep(0.1)
        assert proc.proc.wait(timeout=1) == 0
        a.close()
    finally:
        proc.kill()
