"""A server's counters: GET /metrics in Prometheus text format, and `bps-server --stats HOST:PORT`, after known
traffic from real clients."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import pytest
import torch

from tests.helpers import REPO, RawPeer, ServerProcess, push_pull_part
from torch_bps.client import Client
from torch_bps.server.cli import parse_args
from torch_bps.server.limits import JOB_OVERHEAD, key_charge
from torch_bps.wire import STATS_FIELDS, Command, Status

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"\})? (-?[0-9.e+-]+)$')
N, ROUNDS = 10_000, 3  # float32 elements of the one key; rounds pushed by each of the two workers


def parse_prometheus(text: str) -> dict[str, dict[str, float]]:
    """Parse text exposition format 0.0.4 strictly: {family: {labels or "": value}}; HELP and TYPE come first."""
    families: dict[str, dict[str, float]] = {}
    typed: dict[str, str] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge") and name not in typed, line
            typed[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        assert name in typed, f"{name} has no TYPE line before its samples"
        assert labels not in families.setdefault(name, {}), f"{name}{labels} twice"
        families[name][labels] = value
    return families


def _traffic(address: str, job_id: int) -> None:
    """Two workers of one job push_pull one key for ROUNDS rounds, the second pulling only the first half of each
    sum (so bytes out differ from bytes in); then one refused request (an unknown key)."""
    with Client([address], job_id, 0, 2) as a, Client([address], job_id, 1, 2) as b:
        for rnd in range(ROUNDS):
            whole = push_pull_part(a, torch.full((N,), float(rnd)), 5)
            half = push_pull_part(b, torch.full((N,), float(rnd)), 5, out=torch.empty(N // 2))
            assert torch.equal(whole.wait(), torch.full((N,), 2.0 * rnd))
            assert torch.equal(half.wait(), torch.full((N // 2,), 2.0 * rnd))
        peer = RawPeer(address, job_id, 0, 2)  # the job's own identity (the pool's, for this job id)
        try:
            peer.incarnation = a.incarnations[0]
            h, _ = peer.request(Command.PULL, key=99, nbytes=4, round=0)
            assert h.status == Status.UNKNOWN_KEY
        finally:
            peer.close()


def _expected(job_id: int) -> dict:
    nbytes = 4 * N
    return {"pushes": 2 * ROUNDS, "pulls": 2 * ROUNDS, "bytes_in": 2 * ROUNDS * nbytes,
            "bytes_out": ROUNDS * (nbytes + nbytes // 2), "sums": ROUNDS, "bytes_summed": ROUNDS * nbytes, "errors": 1,
            "memory_charged": JOB_OVERHEAD + key_charge(nbytes, 2)}  # fmt: skip


@pytest.fixture
def metrics_server():
    """A fresh server (its counters are this test's alone) with its metrics on a free port."""
    server = ServerProcess(extra_args=("--metrics-port", "0"))
    line = server.proc.stdout.readline()
    m = re.search(r"metrics at (http://\S+/metrics)", line)
    assert m, line
    yield server, m.group(1)
    server.stop()


@pytest.mark.timeout(60)
def test_metrics_endpoint_serves_the_counters_after_known_traffic(metrics_server, job_id):
    server, url = metrics_server
    _traffic(server.address, job_id)
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        families = parse_prometheus(reply.read().decode())
    expected = _expected(job_id)
    names = {"pushes": "pushes_total", "pulls": "pulls_total", "bytes_in": "received_bytes_total",
             "bytes_out": "sent_bytes_total", "sums": "sums_total", "bytes_summed": "summed_bytes_total",
             "errors": "errors_total", "memory_charged": "memory_charged_bytes"}  # fmt: skip
    job = f'{{job="{job_id:#018x}"}}'
    for field, name in names.items():
        assert families[f"bps_server_{name}"][""] == expected[field], field  # the server saw this job alone
        assert families[f"bps_job_{name}"] == {job: expected[field]}, field
    assert families["bps_job_workers"] == {job: 2} and families["bps_job_keys"] == {job: 1}
    assert families["bps_server_jobs"][""] == 1 and families["bps_server_keys_waiting"][""] == 0
    assert 0 < families["bps_job_sum_seconds_total"][job] == families["bps_server_sum_seconds_total"][""] < 10
    assert families["bps_server_requests_total"][""] >= families["bps_server_wakeups_total"][""] > 0
    assert families["process_resident_memory_bytes"][""] > 10 << 20

    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)


@pytest.mark.timeout(60)
def test_stats_cli_prints_a_running_servers_counters(metrics_server, job_id):
    server, _ = metrics_server
    _traffic(server.address, job_id)
    done = subprocess.run([sys.executable, "-m", "torch_bps.server", "--stats", server.address], cwd=REPO,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = dict(re.findall(r"^  (\w+) +(\d+)$", done.stdout, re.M))
    assert list(printed) == list(STATS_FIELDS), done.stdout
    for field, value in _expected(job_id).items():
        assert int(printed[field]) == value, (field, done.stdout)
    assert int(printed["jobs"]) == 1 and int(printed["resident_bytes"]) > 10 << 20
    assert "GB/s while adding" in done.stdout and "requests per wake-up" in done.stdout


@pytest.mark.timeout(60)
def test_stats_cli_names_a_server_that_does_not_answer():
    done = subprocess.run([sys.executable, "-m", "torch_bps.server", "--stats", "127.0.0.1:1", "--auth", "off",
                           "--stats-timeout", "1.5"], cwd=REPO, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 1 and "no STATS reply from 127.0.0.1:1 within 1.5 s" in done.stderr, done.stderr


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "inf", "1e300"])  # -1: "forever" to ZeroMQ's poll; inf overflows
def test_stats_timeout_must_be_a_positive_number(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--stats", "127.0.0.1:1", "--stats-timeout", bad])
    assert exited.value.code == 2
    assert "--stats-timeout: must be a positive number" in capsys.readouterr().err
