"""Smoke tests of the emulated cluster (benchmarks/cluster): build, exchange bytes, leave nothing behind.

The namespace tests need root and iproute2 and are skipped otherwise; the theory and split tests run
everywhere. Together well under a minute.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.cluster import (
    NamespaceError,
    byteps,
    cli,
    cpu,
    netns,
    procs,
    scaling_model,
    sweep,
    tcp_matrix,
    theory,
    topology,
)
from benchmarks.cluster import report as report_mod
from benchmarks.cluster.topology import IFNAME, Cluster, Shaping, _bridge_port, calibrate
from benchmarks.cluster.workers import ddp_train
from tests.helpers import REPO

needs_netns = pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason()))


def _ours(run_id: str) -> tuple[list[str], str]:
    """Return the namespaces and root-namespace links of run `run_id` that still exist."""
    spaces = [ns for ns in netns.list_namespaces() if ns.endswith(f"-{run_id}")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    return spaces, "\n".join(line for line in links.splitlines() if "bps" in line)


@needs_netns
@pytest.mark.timeout(60)
def test_two_workers_one_server_exchange_bytes_and_leave_nothing():
    with Cluster(n_workers=2, n_servers=1, rate_mbit=500) as cluster:
        run_id = cluster.run_id
        assert len(_ours(run_id)[0]) == 4  # bridge + w0 + w1 + s0
        got = calibrate(cluster, seconds=1.0)  # 0.5 s is too short on a busy machine: TCP's slow start shows
    # Shaped: a stream gets close to the rate, and not over it (a broken tbf would give GBit/s).
    assert 0.6 < got["ratio"] < 1.02, got
    spaces, links = _ours(run_id)
    assert spaces == [] and links == ""
    assert not os.path.exists(netns.pidfile_path(run_id))


_LOCAL_STREAM_WORKER = textwrap.dedent("""
    import json, sys, torch
    from torch_bps.client import Client
    from torch_bps.wire import Partition
    worker = int(sys.argv[2])
    t = torch.full((1 << 18,), float(worker + 1))
    with Client([sys.argv[1]], 77, worker, 2, timeout=60) as c:
        c.push_pull_batch([Partition(t, 0)]).wait()
        print("RESULT " + json.dumps({"local": c.stream_local(0), "ready": c.stream_ready(0), "sum": t[0].item()}))
""")


@needs_netns
@pytest.mark.timeout(120)
def test_the_local_stream_reaches_a_server_in_its_own_network_namespace_only():
    """A server's local stream is an abstract unix socket, scoped by network namespace: the worker on the
    server's host takes it, the worker on another host (namespace) finds nothing there and takes TCP, and the
    sum is right on both."""
    with Cluster(n_workers=2, n_servers=0, rate_mbit=500) as cluster:
        w0, w1 = cluster.workers
        servers, addresses = byteps.start_servers(cluster, [w0], 9100)
        try:
            workers = [cluster.spawn(f"local-stream worker {i}", h, [sys.executable, "-c", _LOCAL_STREAM_WORKER,
                                                                     addresses[0], str(i)])
                       for i, h in enumerate((w0, w1))]  # fmt: skip
            got = procs.wait_all(workers, 90, "local-stream workers")
        finally:
            for p in servers:
                p.kill()
    assert [r["local"] for r in got] == [True, False], got
    assert all(r["ready"] and r["sum"] == 3.0 for r in got), got


@needs_netns
@pytest.mark.timeout(60)
def test_every_host_runs_the_congestion_control_asked_for_and_a_refused_one_is_named():
    machine = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    allowed = open("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read().split()
    wanted = next((cc for cc in allowed if cc != machine), None)
    if wanted is None:
        pytest.skip(f"no congestion control other than the machine's {machine} may be chosen in a namespace")
    with Cluster(n_workers=2, n_servers=1, tcp_congestion=wanted) as cluster:
        assert cluster.congestion_control() == wanted
        for host in cluster.hosts:
            path = "/proc/sys/net/ipv4/tcp_congestion_control"
            assert netns.ip("netns", "exec", host.netns, "cat", path).strip() == wanted, host
    assert open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip() == machine  # the root is untouched
    with pytest.raises(NamespaceError, match="'no-such-cc' cannot be set in bps-w0-.*tcp_allowed_congestion_control"):
        with Cluster(n_workers=1, n_servers=0, tcp_congestion="no-such-cc"):
            pass


@needs_netns
def test_the_hosts_egress_queues_may_be_deeper_than_the_switch_ports():
    """tbf reports a queue as the latency it adds at the rate: a host's egress at host_queue_ms, its switch port's
    at queue_ms; by default both at 20 ms."""

    def latencies_ms(cluster: Cluster) -> tuple[float, float]:
        host = cluster.workers[0]
        egress = json.loads(netns.tc("-j", "qdisc", "show", "dev", IFNAME, netns=host.netns))[0]
        port = json.loads(netns.tc("-j", "qdisc", "show", "dev", _bridge_port(host), netns=cluster.bridge_ns))[0]
        return egress["options"]["lat"] / 1000, port["options"]["lat"] / 1000

    with Cluster(n_workers=1, n_servers=0, rate_mbit=100, host_queue_ms=120) as cluster:
        assert latencies_ms(cluster) == (120, 20)
    with Cluster(n_workers=1, n_servers=0, rate_mbit=100) as cluster:
        assert latencies_ms(cluster) == (20, 20)


@needs_netns
@pytest.mark.timeout(60)
def test_exception_inside_the_block_still_cleans_up():
    with pytest.raises(RuntimeError, match="boom"), Cluster(n_workers=2, n_servers=1) as cluster:
        run_id = cluster.run_id
        cluster.spawn("sleeper", cluster.servers[0], [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("boom")
    assert _ours(run_id) == ([], "")


@needs_netns
@pytest.mark.timeout(60)
def test_sigterm_cleans_up():
    script = textwrap.dedent(
        """
        import time
        from benchmarks.cluster.topology import Cluster
        with Cluster(n_workers=2, n_servers=1) as c:
            print(c.run_id, flush=True)
            time.sleep(50)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        run_id = child.stdout.readline().strip()
        assert len(_ours(run_id)[0]) == 4
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    assert _ours(run_id) == ([], "")


@needs_netns
@pytest.mark.timeout(60)
def test_cleanup_leftovers_removes_a_dead_runs_namespace():
    dead = netns.namespace_name("w0", netns.new_run_id())  # no pid file: as if its run was SIGKILLed
    netns.ip("netns", "add", dead)
    try:
        assert dead in netns.cleanup_leftovers(verbose=False)
    finally:
        netns.ip("netns", "delete", dead, check=False)
    assert dead not in netns.list_namespaces()


def test_theory_endpoints():
    n, size, rate = 4, 64 << 20, 500e6
    assert theory.t_opt_s(n, 0, size, rate) == pytest.approx(theory.allreduce_bound_s(n, size, rate))
    assert theory.t_opt_s(n, n, size, rate) == pytest.approx(size * 8 / rate)  # the PS time M/B
    assert theory.t_opt_s(n, n + 3, size, rate) == pytest.approx(size * 8 / rate)  # x = 1 for k >= n
    times = [theory.t_opt_s(n, k, size, rate) for k in range(n + 1)]
    assert times == sorted(times, reverse=True)


def test_scaling_model_interpolates_the_measured_worker_costs():
    measured = scaling_model.WORKER_US_PER_PARTITION
    for size, us in measured.items():
        assert scaling_model.worker_us_per_partition(size) == pytest.approx(us)
    sizes = sorted(measured)
    for lo, hi in zip(sizes, sizes[1:], strict=False):  # halfway between two measured sizes: halfway in cost
        assert scaling_model.worker_us_per_partition((lo + hi) / 2) == pytest.approx((measured[lo] + measured[hi]) / 2)
    slope = (measured[sizes[-1]] - measured[sizes[-2]]) / (sizes[-1] - sizes[-2])
    beyond = scaling_model.worker_us_per_partition(4 * sizes[-1])
    assert beyond == pytest.approx(measured[sizes[-1]] + slope * 3 * sizes[-1])  # the last pair's slope


@needs_netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,by_share,lead", [("rounds", False, 0), ("free", False, 0), ("free", True, 0),
                                                ("rounds", True, 128 << 10)])  # fmt: skip
def test_plain_tcp_runner_moves_a_steps_bytes_at_the_links_pace(mode, by_share, lead):
    """The step's bytes over the shaped links can take no less than t_opt (minus the tbf burst); a runner that
    dropped a flow or a step would come in under it, and one whose servers' lead locked them up would time out."""
    size, rate = 4 << 20, 500
    with Cluster(n_workers=2, n_servers=1, rate_mbit=rate) as cluster:
        job = byteps.BytepsJob(cluster, tuple(cluster.workers), tuple(cluster.servers), size, 3, 1, 60.0)
        got = tcp_matrix.run_tcp_matrix(job, mode=mode, buffers_by_share=by_share, lead_bytes=lead)
    ratio = got.seconds_per_step / theory.t_opt_s(2, 1, size, rate * 1e6)
    assert 0.9 < ratio < 3.0, ratio
    assert set(got.cpu) == {"w0", "w1", *(f"{h} server (whole run)" for h in ("s0", "w0", "w1"))}


def _tcp_matrix(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([tcp_matrix.program(), *args], capture_output=True, text=True, timeout=timeout)


def test_plain_tcp_worker_names_the_server_it_cannot_reach():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _tcp_matrix("push", "--servers", f"127.0.0.1:{port}:1000", "--timeout", "1")
    assert done.returncode != 0 and f"no connection to server 127.0.0.1:{port}" in done.stderr


def test_plain_tcp_server_reads_no_worker_further_than_the_lead_ahead_of_the_slowest():
    """With --lead-bytes a server stops reading a worker that far ahead of another which sent nothing yet: the
    unread bytes fill both ends' buffers and the worker's writes stop, well short of its step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lead, buffer = 64 << 10, 16 << 10
    argv = [tcp_matrix.program(), "serve", "--port", str(port), "--workers", "2", "--bytes", str(8 << 20),
            "--steps", "1", "--warmup", "0", "--lead-bytes", str(lead), "--socket-buffer-bytes", str(buffer),
            "--timeout", "5"]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "tcp_matrix serving"
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as fast,
            socket.create_connection(("127.0.0.1", port), timeout=10),  # the slow one: connected, sends nothing
        ):
            fast.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            fast.setblocking(False)
            sent, chunk, end = 0, b"x" * (64 << 10), time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    sent += fast.send(chunk)
                except BlockingIOError:
                    time.sleep(0.01)
            _, err = server.communicate(timeout=20)
    finally:
        server.kill()
    assert "not done by the deadline" in err, err  # the slow worker never pushed: the server gives up, naming it
    # The lead, the two ends' buffers (the kernel doubles each) and what loopback's skb accounting lets in over them.
    assert 0 < sent <= lead + 8 * buffer + (256 << 10), sent


def test_plain_tcp_server_names_a_worker_that_quits_early():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [tcp_matrix.program(), "serve", "--port", str(port), "--workers", "1", "--bytes", "100000", "--steps", "3",
            "--timeout", "20"]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "tcp_matrix serving"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
            peer.sendall(b"x" * 1234)  # then gone, a step and more short
        _, err = server.communicate(timeout=20)
    finally:
        server.kill()
    assert server.returncode != 0 and "worker 127.0.0.1 closed after 1234 bytes" in err


@pytest.mark.parametrize("n,queue", [(4, 500_000), (8, 756_072)])
def test_socket_buffers_count_servers_by_their_share_of_the_bytes(n, queue):
    """At k = 0 and k = n every server carries an equal share: queue / (3 n). Between them the colocated servers
    carry little, and the dedicated ones' connections, which carry most bytes, keep about that size (counting
    k + n servers alike gave them 16.8 KB instead of 31.5 KB at n = 8, k = 7). Queues too small for the kernel's
    own share of every connection (below)."""
    even = byteps.socket_buffer_for(queue, n, 0)
    assert even == queue // (3 * n) == byteps.socket_buffer_for(queue, n, n)
    for k in range(1, n):
        assert 0.85 * even <= byteps.socket_buffer_for(queue, n, k) <= even, k


def test_socket_buffers_are_the_kernels_where_the_queue_holds_every_connections_minimum():
    """n = 4 at 500 Mbit/s (a 1.38 MB queue): no k needs small buffers; n = 8 at 250 Mbit/s (756 KB) and n = 8's k = 0
    at 500 Mbit/s do. The connections per uplink: 2(n - 1) at k = 0, k + 2(n - 1) between, n at k = n."""
    assert [byteps.uplink_connections(4, k) for k in range(5)] == [6, 7, 8, 9, 4]
    assert [byteps.uplink_connections(8, k) for k in (0, 8)] == [14, 8]
    q500, q250 = Shaping.for_rate(500).limit_bytes, Shaping.for_rate(250).limit_bytes
    assert [byteps.socket_buffer_for(q500, 4, k) for k in range(5)] == [0] * 5
    assert all(byteps.socket_buffer_for(q250, 8, k) > 0 for k in range(9))
    assert byteps.socket_buffer_for(q500, 8, 0) > 0 and byteps.socket_buffer_for(q500, 8, 8) == 0


@pytest.mark.parametrize("n,k", [(2, 0), (2, 2), (4, 1), (4, 3), (3, 5)])
def test_split_covers_the_tensor_with_the_paper_shares(n, k):
    numel = 3_000_001
    parts = theory.split(numel, 4, n, k, partition_bytes=1 << 20)
    covered = sorted((p.start, p.start + p.length) for p in parts)
    assert covered[0][0] == 0 and covered[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    assert len({p.key for p in parts}) == len(parts)
    x = theory.dedicated_fraction(n, k)
    dedicated = sum(p.length for p in parts if p.server < k)
    assert dedicated / numel == pytest.approx(x, abs=1e-6)


def test_repeated_points_report_the_median_run_and_keep_every_run():
    times = iter([1.4, 1.2, 1.3])
    got = sweep._median_run(3, lambda: {"seconds_per_step": next(times), "cpu": {}})
    assert got["seconds_per_step"] == 1.3
    assert got["runs_seconds_per_step"] == [1.2, 1.3, 1.4]
    assert cli.make_plan(cli.parse_args([])).repeats == 3
    assert cli.make_plan(cli.parse_args(["--quick"])).repeats == 1
    assert cli.make_plan(cli.parse_args(["--quick", "--repeats", "5"])).repeats == 5
    assert cli.make_plan(cli.parse_args([])).gloo and not cli.make_plan(cli.parse_args(["--no-gloo"])).gloo


def test_the_report_gives_cpu_seconds_per_step_against_gloo():
    def point(seconds, *cores):
        return {"seconds_per_step": seconds, "cpu": {f"h{i}": {"process_cores": c} for i, c in enumerate(cores)}}

    report = {"sweep": [], "errors": [], "gloo": point(2.0, 0.1, 0.2),
              "byteps": {"points": {"0": point(1.5, 0.3, 0.1), "4": point(1.0, 0.5, 0.4)}}}  # fmt: skip
    measured = report_mod.cpu_summary(report)["measurements"]
    assert measured["gloo all_reduce"]["cpu_s_per_step"] == pytest.approx(0.6)  # (0.1 + 0.2) cores x 2 s
    assert measured["byteps k=0"]["cpu_s_per_step"] == pytest.approx(0.6)  # a faster step at more cores
    assert measured["byteps k=0"]["cpu_vs_gloo"] == pytest.approx(1.0)
    assert measured["byteps k=4"]["cpu_vs_gloo"] == pytest.approx(1.5)
    report["cpu"] = report_mod.cpu_summary(report)
    assert "0.900 CPU-s per step, 1.50x gloo's" in report_mod.format_table(report)
    del report["gloo"]
    assert "cpu_vs_gloo" not in report_mod.cpu_summary(report)["measurements"]["byteps k=4"]


def test_the_report_counts_the_kernels_softirq_threads_once_per_window():
    # Every host's window sees the same machine-wide threads: one host's figure counts, not their sum.
    def point(seconds, softirq, *cores):
        hosts = {f"h{i}": {"process_cores": c, "softirq_threads_cores": softirq} for i, c in enumerate(cores)}
        return {"seconds_per_step": seconds, "cpu": hosts}

    report = {"sweep": [], "errors": [], "gloo": point(2.0, 0.15, 0.1, 0.2),
              "byteps": {"points": {"0": point(1.5, 0.1, 0.3, 0.1)}}}  # fmt: skip
    measured = report_mod.cpu_summary(report)["measurements"]
    assert measured["gloo all_reduce"]["with_softirq_threads"] == pytest.approx(0.6 + 0.3)  # 0.15 cores x 2 s
    assert measured["byteps k=0"]["with_softirq_threads"] == pytest.approx(0.6 + 0.15)
    assert measured["byteps k=0"]["with_softirq_threads_vs_gloo"] == pytest.approx(0.75 / 0.9, abs=1e-3)
    report["cpu"] = report_mod.cpu_summary(report)
    assert "with softirq threads 0.750, 0.83x" in report_mod.format_table(report)


def test_paired_blocks_compare_each_pair_and_leave_the_idle_servers_out_of_gloos_figure():
    def block(pair, runner, seconds, worker_cores, server_cores, softirq):
        watched = {"w0 server": {"process_cores": server_cores}}
        cpu = {"process_cores": worker_cores, "softirq_threads_cores": softirq, "watched": watched}
        return {"pair": pair, "runner": runner, "seconds_per_step": seconds, "cpu": cpu}

    w0 = [block(0, "gloo", 2.0, 0.1, 0.01, 0.05), block(0, "byteps", 1.0, 0.2, 0.2, 0.0),
          block(1, "byteps", 1.0, 0.2, 0.1, 0.1), block(1, "gloo", 2.0, 0.1, 0.01, 0.0)]  # fmt: skip
    w1 = [dict(b, cpu={**b["cpu"], "watched": {}}, seconds_per_step=b["seconds_per_step"] * 1.1) for b in w0]
    got = byteps.paired_cpu([{"pairs": w0}, {"pairs": w1}])
    # Pair 0: gloo (0.1 + 0.1) cores x 2.2 s = 0.44, byteps (0.2 + 0.2 + 0.2) x 1.1 = 0.66; with the softirq
    # threads 0.55 and 0.66.
    assert got["cpu_vs_gloo"] == [pytest.approx(1.5), pytest.approx(0.55 / 0.44, abs=1e-3)]
    assert got["with_softirq_threads_vs_gloo"] == [
        pytest.approx(0.66 / 0.55, abs=1e-3),
        pytest.approx(0.66 / 0.44, abs=1e-3),
    ]
    assert got["median_cpu_vs_gloo"] == pytest.approx((1.5 + 1.25) / 2, abs=1e-3)
    assert got["servers_cores_in_gloo"] == pytest.approx(0.01)
    plan = cli.parse_args(["--paired-cpu", "4"])
    assert plan.paired_cpu == 4 and cli.parse_args([]).paired_cpu == 0


def test_fsdp_flag_trains_the_ddp_model_sharded_and_reports_one_row():
    plan = cli.make_plan(cli.parse_args(["--ks", "0,4", "--fsdp"]))
    assert plan.fsdp == dataclasses.replace(plan.ddp, wrap="fsdp")
    assert cli.make_plan(cli.parse_args([])).fsdp is None
    alone = cli.make_plan(cli.parse_args(["--no-ddp", "--fsdp"]))
    assert alone.ddp is None and alone.fsdp.wrap == "fsdp"

    cpu = {"process_cores": 0.5, "machine_busy": 0.9, "machine_softirq": 0.1}
    link = {"w0": {"tx": 150e6, "rx": 225e6}, "w1": {"tx": 160e6, "rx": 220e6}}
    gloo = {"seconds_per_step": 4.0, "cpu": {"w0": cpu}, "link_bytes_per_step": link, "tbf_drops": {}}
    bps = {**gloo, "seconds_per_step": 3.2, "server_bytes_per_step": 500e6, "ideal_bytes_per_step": 500e6}
    fsdp = {"params": 25_178_112, "batch_per_rank": 16, "steps": 5, "points": {"gloo": gloo, "byteps k=4": bps}}
    report = {"sweep": [], "errors": [], "fsdp": fsdp}
    report["cpu"] = report_mod.cpu_summary(report)
    text = report_mod.format_table(report)
    row = next(line for line in text.splitlines() if line.startswith("FSDP2"))
    assert "gloo 0.250 steps/s, link 160/225 MB" in row
    assert "byteps k=4 0.312 steps/s (1.25x gloo)" in row and "500.0 MB = 1.0000 x ideal" in row
    assert set(report["cpu"]["measurements"]) == {"fsdp gloo", "fsdp byteps k=4"}


def test_link_bytes_reads_the_interface_counters(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    before = ddp_train.link_bytes()
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as c, server.accept()[0] as peer:
            c.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(peer.recv(65536))
    after = ddp_train.link_bytes()
    assert after["tx"] - before["tx"] >= 100_000 and after["rx"] - before["rx"] >= 100_000


_SINK = """
import socket, threading
s = socket.create_server(("{ip}", 7000))
print("LISTENING", flush=True)
def drain(c):
    while c.recv(1 << 16):
        pass
while True:
    threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()
"""
_BLAST = """
import socket, time
c = socket.create_connection(("{ip}", 7000), timeout=10)
end, chunk = time.monotonic() + 1.5, b"x" * (1 << 16)
while time.monotonic() < end:
    c.sendall(chunk)
print('RESULT {{}}', flush=True)
"""


def test_proc_net_counters_parses_this_machines_tcp_counters():
    with open("/proc/net/netstat") as a, open("/proc/net/snmp") as b:
        counters = topology.proc_net_counters(a.read() + b.read())
    assert set(topology.TCP_LOSS_COUNTERS) <= set(counters)
    assert topology.proc_net_counters("Tcp: RtoMin RetransSegs\nTcp: 200 7\n") == {
        "Tcp:RtoMin": 200,
        "Tcp:RetransSegs": 7,
    }


@needs_netns
@pytest.mark.timeout(60)
def test_tcp_losses_are_counted_per_host_where_the_senders_are():
    """Two workers blast one server whose link is 20 Mbit/s: its queue overflows, the senders' TCP retransmits.
    The counters come from each host's own namespace: the server, which only acknowledges, retransmits nothing."""
    with Cluster(n_workers=2, n_servers=1, rate_mbit=500, rates={"s0": 20}) as cluster:
        server = cluster.servers[0]
        drops, losses = cluster.link_drops(), cluster.tcp_losses()
        assert set(losses) == {
            f"{h.name} {label}" for h in cluster.hosts for label in topology.TCP_LOSS_COUNTERS.values()
        }
        sink = cluster.spawn("sink", server, [sys.executable, "-c", _SINK.format(ip=server.ip)])
        procs.wait_for_line(sink, "LISTENING", 20)
        blasts = [
            cluster.spawn(f"blast {h.name}", h, [sys.executable, "-c", _BLAST.format(ip=server.ip)])
            for h in cluster.workers
        ]
        procs.wait_all(blasts, 30, "blasting s0")
        drops = sweep._delta(drops, cluster.link_drops())
        losses = sweep._delta(losses, cluster.tcp_losses())
    assert drops.get("s0 down", 0) > 0, drops
    assert losses.get("w0 retransmitted segments", 0) > 0 and losses.get("w1 retransmitted segments", 0) > 0, losses
    assert losses.get("s0 retransmitted segments", 0) == 0, losses


def test_process_cpu_seconds_reads_another_process_to_the_millisecond():
    # Each child burns a different amount of CPU, reports its own CPU time and waits: read from outside, it must
    # agree within 1 ms, finer than the 10 ms ticks of /proc/PID/stat (three children: a tick count lands that
    # close by chance about one time in ten).
    burn = "import sys, time\nwhile time.process_time() < {}: pass\n"
    burn += "print(time.process_time(), flush=True)\nsys.stdin.read()"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", burn.format(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for target in (0.1234, 0.1567, 0.1891)
    ]
    try:
        own = [float(c.stdout.readline()) for c in children]
        outside = [cpu.process_cpu_seconds(c.pid) for c in children]
    finally:
        for c in children:
            c.stdin.close()
            c.wait(timeout=30)
    assert all(0 <= o - n < 0.001 for n, o in zip(own, outside, strict=True)), (own, outside)
    assert cpu.process_cpu_seconds(children[0].pid) == 0.0  # gone


def test_cpu_window_measures_watched_processes_over_its_own_window_only():
    # The servers' CPU is read over the workers' timed steps: one child burns 0.3 s before the window and then
    # idles (a whole-life figure would count it), the other spins through the window. The window is 2 s: a wait
    # in the run queue reaches /proc/<pid>/schedstat only when it ends, so the last one (up to a time slice on a
    # loaded machine) is missing from the spinner's sum; 0.5 s windows fell to 0.88 under `-n 2`.
    burned = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint(flush=True)\nsys.stdin.read()"
    spin = "import time\nprint(flush=True)\nt = time.monotonic()\nwhile time.monotonic() - t < 8: pass"
    children = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for code in (burned, spin)]  # fmt: skip
    try:
        for c in children:
            c.stdout.readline()
        window = cpu.CpuWindow({"burned": children[0].pid, "spinning": children[1].pid}).start()
        time.sleep(2.0)
        got = window.stop()["watched"]
    finally:
        for c in children:
            c.kill()
            c.wait(timeout=30)
    spinning = got["spinning"]
    assert got["burned"]["process_cores"] < 0.05 < spinning["process_cores"] <= 1.05, got
    # The spinner runs or waits for a core through the whole window: on a busy machine, more of it waiting.
    assert 0.9 <= spinning["process_cores"] + spinning["process_waiting"] <= 1.1, got


def test_process_wait_seconds_counts_time_runnable_without_a_core():
    # Three busy processes pinned to one core: each runs about a third of the time and waits the rest.
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.5: pass"
    cpu0 = sorted(os.sched_getaffinity(0))[0]
    procs_ = [
        subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu0}}})\n{spin}"])
        for _ in range(3)
    ]
    time.sleep(1.0)
    waits = [cpu.process_wait_seconds(p.pid) for p in procs_]
    runs = [cpu.process_cpu_seconds(p.pid) for p in procs_]
    for p in procs_:
        p.wait(timeout=30)
    assert all(w > 0.4 and w > 1.4 * r for w, r in zip(waits, runs, strict=True)), (waits, runs)
    assert cpu.process_wait_seconds(procs_[0].pid) == 0.0  # gone
