"""The doctor: its verdict rules on given measurements, and its measurements on real servers and ranks.

The emulated cluster's check (one link shaped slower than the others, named by the doctor; its prediction
against the measured step time) is benchmarks/cluster's job; here the rules and the plumbing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, ServerProcess, run_ranks
from torch_bps.doctor.verdict import Measurements, Path, judge
from torch_bps.engine.placement import t_opt

MB = 1e6
FAST, SLOW = 60 * MB, 20 * MB  # bytes/s


def _two_machines_one_server(rate: dict[str, float], **kw) -> Measurements:
    """n = 2 machines, one dedicated server "s:1"; each path as fast as its slower end's `rate`."""
    ends = {("machine 0", "s:1"): "s:1", ("machine 1", "s:1"): "s:1", ("machine 0", "m1:1"): "machine 1",
            ("machine 1", "m0:1"): "machine 0"}  # fmt: skip
    paths = [Path(int(m[-1]), server, end, min(rate[m], rate[end]), 1e-4) for (m, server), end in ends.items()]
    values = {"collective": 1.0} | kw
    return Measurements(2, ["s:1"], int(64 * MB), paths, **values)


def test_a_slow_machine_link_is_named_and_sets_the_prediction():
    m = _two_machines_one_server({"machine 0": FAST, "machine 1": SLOW, "s:1": FAST})
    v = judge(m)
    assert v.link_rates == {"machine 0": FAST, "machine 1": SLOW, "s:1": FAST}
    assert v.bandwidth == SLOW and v.predicted == t_opt(2, 1, 64 * MB, SLOW)
    assert v.limits[0].startswith("the link of machine 1 is slow: 160 Mbit/s")
    assert not any("machine 0" in why or "s:1" in why for why in v.limits)
    assert "machine 1" in v.text(m)


def test_a_slow_server_link_is_named():
    v = judge(_two_machines_one_server({"machine 0": FAST, "machine 1": FAST, "s:1": SLOW}))
    assert [why.split(":")[0] for why in v.limits if "slow" in why] == ["the link of s"]
    assert "the link of s:1 is slow" in v.limits[0]


def test_a_cpu_bound_server_is_named():
    # s:1 sums half of 64 MB (x = 0.5 at n = 2, k = 1) once (n - 1 = 1 add) at 50 MB/s: 0.64 s, against
    # t_opt = 2 * 2 * 1 * 64 MB / ((4 + 2 - 2) * 60 MB/s) = 1.07 s.
    m = _two_machines_one_server({"machine 0": FAST, "machine 1": FAST, "s:1": FAST}, sum_rates={"s:1": 50 * MB})
    assert [why[:37] for why in judge(m).limits] == ["server s:1 sums its share in 640.0 ms"]


def test_all_well_names_the_links_or_an_overhead():
    fast = {"machine 0": FAST, "machine 1": FAST, "s:1": FAST}
    predicted = t_opt(2, 1, 64 * MB, FAST)
    v = judge(_two_machines_one_server(fast, collective=predicted * 1.1, sum_rates={"s:1": 5e9}))
    assert v.limits == ["the links themselves: measured 1.10 x the paper's prediction"]
    assert v.best_k == 0  # at n = 2 every k gives the same time: the fewest servers win
    slow_job = judge(_two_machines_one_server(fast, collective=predicted * 2))
    assert slow_job.limits == [
        "not the links: measured 2.00 x the prediction with every link and server at speed; look at CPU (the "
        "machine's load, the partition size) and the step's overlap"
    ]


def test_too_few_servers_at_four_machines():
    # k = 0, n = 4: every machine's embedded server is a path from the three others
    paths = [Path(i, f"m{j}:1", f"machine {j}", FAST, 1e-4) for i in range(4) for j in range(4) if i != j]
    v = judge(Measurements(4, [], int(64 * MB), paths, t_opt(4, 0, 64 * MB, FAST)))
    assert v.best_k == 4 and v.by_k[4] == t_opt(4, 4, 64 * MB, FAST) < v.predicted
    assert v.limits == [
        f"too few dedicated servers: k = 4 would cut communication from {v.predicted * 1e3:.1f} to "
        f"{v.by_k[4] * 1e3:.1f} ms (the paper's rule; x = 1.00 of the bytes to them)"
    ]


def test_no_path_is_a_clear_error():
    with pytest.raises(ValueError, match="no path was measured"):
        judge(Measurements(1, [], 1000, [], 1.0))


def _measure(rank, world, gloo, nbytes):
    from torch_bps.doctor.measure import measure

    return measure(nbytes, 2)


@pytest.mark.timeout(120)
def test_measures_every_path_the_collective_and_the_sums():
    server = ServerProcess()
    try:
        env = {"BPS_SERVERS": server.address, "BPS_PARTITION_BYTES": str(1 << 20)}
        m, other = run_ranks(_measure, 2, int(4 * MB), backend="gloo", env=env, timeout=100)
    finally:
        server.stop()
    assert other is None
    assert m.machines == 2 and m.dedicated == [server.address] and m.nbytes == 4_000_000
    # k = 1 < n = 2: the paper's split uses both embedded servers too; each machine's own one is not a path
    got = sorted((p.machine, p.end) for p in m.paths)
    assert got == [(0, server.address), (0, "machine 1"), (1, server.address), (1, "machine 0")], got
    assert all(p.goodput > 0 and 0 < p.rtt < 1 for p in m.paths)
    assert m.collective > 0 and m.gloo > 0 and m.local_seconds is None
    assert server.address in m.sum_rates and all(rate > 0 for rate in m.sum_rates.values())
    assert judge(m).limits


@pytest.mark.timeout(120)
def test_the_command_under_torchrun(tmp_path):
    server = ServerProcess()
    out = tmp_path / "doctor.json"
    env = {**os.environ, "BPS_SERVERS": server.address, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "torch_bps.doctor", "--mb", "2", "--repeats", "1", "--json", str(out)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env, cwd=REPO)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"path machine 0 <-> {server.address}" in done.stdout and "limit: " in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["measurements"]["machines"] == 1 and report["measurements"]["local_seconds"] > 0
    assert report["verdict"]["predicted"] > 0


@pytest.mark.timeout(180)
def test_on_the_emulated_cluster_a_slow_link_is_named():
    from benchmarks.cluster import netns
    from benchmarks.cluster.topology import Cluster
    from benchmarks.doctor_cluster import run_doctor

    if reason := netns.unavailable_reason():
        pytest.skip(reason)
    # Two worker machines and a dedicated server at 200 Mbit/s; machine 1's link at 50.
    with Cluster(n_workers=2, n_servers=1, rate_mbit=200, rates={"w1": 50}) as cluster:
        report = run_doctor(cluster, 1, mb=2, repeats=2, timeout=120)
    rates, limits = report["verdict"]["link_rates"], report["verdict"]["limits"]
    server = report["measurements"]["dedicated"][0]
    assert rates["machine 1"] * 8 / 1e6 < 60 and min(rates["machine 0"], rates[server]) * 8 / 1e6 > 120, rates
    assert limits[0].startswith("the link of machine 1 is slow") and sum("is slow" in w for w in limits) == 1, report
