"""The client's limits on bytes in flight per server, against real summation-server processes on loopback.

Two limits keep n workers' traffic within what one link can queue (issue 17): a credit per server in the
IO thread's scheduling (server_credit_bytes), counted here by the client's own counters, which count PUSH
bytes apart from the credit; and the socket buffers of every server connection (socket_buffer_bytes), read
back from the kernel with `ss`. Nothing is mocked.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers import push_pull_part, start_servers, stop_servers
from torch_bps.address import split_host_port
from torch_bps.client import Client
from torch_bps.config import Config
from torch_bps.engine.placement import MIN_RECEIVE_WINDOW, Server, receive_buffers
from torch_bps.runtime import _client
from torch_bps.wire import Mode

pytestmark = pytest.mark.timeout(120)

PART = 16 << 10  # bytes per partition
_SYS_PIDFD_GETFD = 438  # the same number on every architecture


def _parts(t: torch.Tensor, numel: int) -> list[tuple]:
    """`t` cut into SUM partitions of `numel` elements, keys 0.. (so key % servers picks the server)."""
    return [(p, i, None, None, Mode.SUM, None, 0, 0) for i, p in enumerate(t.split(numel))]


def _wait(client: Client, future, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not future.done():
        if time.monotonic() > deadline:
            pytest.fail(f"batch unfinished after {seconds}s; the client's scheduler: {client.scheduler_stats()}")
        time.sleep(0.01)
    future.wait()


@pytest.mark.parametrize("server_credit", [PART, 4 * PART])
def test_push_bytes_toward_one_server_never_exceed_its_credit(servers, job_id, server_credit):
    """A total credit of 1 MiB would put 21 partitions in flight toward each of 3 servers at once; the server
    credit holds each to its share, while the total still goes past one server's share (other servers' pushes
    go meanwhile). Counted from the PUSH leaving to its acknowledgement, apart from the credit, so a credit
    never taken or returned twice shows up as more bytes in flight."""
    addresses = [s.address for s in servers]
    with Client(addresses, job_id, 0, 1, timeout=30, credit_bytes=1 << 20, server_credit_bytes=server_credit) as c:
        for step in range(3):
            t = torch.arange(64 * PART // 4, dtype=torch.float32) + step
            want = t.clone()
            _wait(c, c.push_pull_batch(_parts(t, PART // 4), priority=step))
            assert torch.equal(t, want)  # a job of one: the sum is the tensor
        s = c.scheduler_stats()
    assert s["parts_sent"] == s["parts_acknowledged"] == 3 * 64, s
    assert s["credit_in_flight"] == s["push_bytes_in_flight"] == s["queued"] == 0, s
    assert s["server_credit_bytes"] == server_credit, s
    assert s["peak_server_push_bytes_in_flight"] <= server_credit, s
    assert s["peak_server_credit_in_flight"] <= server_credit, s
    assert s["peak_push_bytes_in_flight"] > server_credit, s  # the servers' shares were in flight together


def test_without_server_credit_one_server_gets_the_whole_credit(servers, job_id):
    """The control: the same batches with no server credit put far more than a partition toward one server."""
    addresses = [s.address for s in servers]
    with Client(addresses, job_id, 0, 1, timeout=30, credit_bytes=1 << 20) as c:
        _wait(c, c.push_pull_batch(_parts(torch.ones(64 * PART // 4), PART // 4)))
        s = c.scheduler_stats()
    assert s["server_credit_bytes"] == 0 and s["peak_server_push_bytes_in_flight"] > 4 * PART, s


def _client_buffers(port: int) -> list[tuple[int, int]]:
    """(rcvbuf, sndbuf) of every TCP connection on loopback toward `port` (the client ends), from ss."""
    out = subprocess.run(
        ["ss", "-tnmH", "state", "established", "dst", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    return [(int(rb), int(tb)) for rb, tb in re.findall(r"skmem:\(r\d+,rb(\d+),t\d+,tb(\d+)", out)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_socket_buffers_are_set_on_every_server_connection(server, job_id):
    """SO_RCVBUF and SO_SNDBUF reach the kernel (which doubles them), on the connection the client opened."""
    port = split_host_port(server.address)[1]
    before = set(_client_buffers(port))
    with Client([server.address], job_id, 0, 1, timeout=30, socket_buffer_bytes=24 << 10) as c:
        assert torch.equal(push_pull_part(c, torch.ones(1 << 16), 0).wait(), torch.ones(1 << 16))
        mine = [b for b in _client_buffers(port) if b not in before] or _client_buffers(port)
    assert (48 << 10, 48 << 10) in mine, mine  # the kernel stores twice the value asked for


def _loopback_sockets() -> list[tuple[int, int, int, int]]:
    """(local port, peer port, rcvbuf, sndbuf) of every established TCP socket on loopback, from ss."""
    out = subprocess.run(["ss", "-tnmH", "state", "established"], capture_output=True, text=True, timeout=10).stdout
    found = re.findall(r"127\.0\.0\.1:(\d+)\s+127\.0\.0\.1:(\d+)\s+skmem:\(r\d+,rb(\d+),t\d+,tb(\d+)", out)
    return [tuple(map(int, f)) for f in found]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_receive_buffers_are_set_per_server_on_both_ends_of_the_stream(job_id):
    """A worker's receive buffer toward each server is its own (`receive_buffer_bytes`); the server's side of a
    stream gets `--receive-buffer-bytes`. The kernel stores twice the value asked for."""
    servers = start_servers(2, extra_args=("--receive-buffer-bytes", "20000"))
    try:
        before = set(_loopback_sockets())
        with Client([s.address for s in servers], job_id, 0, 1, timeout=30, socket_buffer_bytes=24 << 10,
                    receive_buffer_bytes=[14000, 30000], local_stream=False) as c:  # TCP's buffers  # fmt: skip
            assert c.stream_ready(0) and c.stream_ready(1)
            for key, server in enumerate((0, 1)):
                assert torch.equal(
                    push_pull_part(c, torch.ones(1 << 14), key, server=server).wait(), torch.ones(1 << 14)
                )
            new = [s for s in _loopback_sockets() if s not in before]
    finally:
        stop_servers(servers)
    zmq_ports = {s.port for s in servers}
    streams = [s for s in new if s[0] not in zmq_ports and s[1] not in zmq_ports]  # (local, peer, rb, tb)
    client_ends = sorted((rb, tb) for _, _, rb, tb in streams if (rb, tb) in {(28000, 48 << 10), (60000, 48 << 10)})
    server_ends = [rb for _, _, rb, _ in streams if rb == 40000]
    assert client_ends == [(28000, 48 << 10), (60000, 48 << 10)], streams
    assert len(server_ends) == 2, streams


def _duplicate_fd(pid: int, fd: int) -> int:
    """A duplicate of process `pid`'s file descriptor `fd` in this one (pidfd_getfd: Linux 5.6, ptrace rights)."""
    if pid == os.getpid():
        return os.dup(fd)
    pidfd = os.pidfd_open(pid)
    try:
        dup = ctypes.CDLL(None, use_errno=True).syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if dup < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_getfd({pid}, {fd})")
        return dup
    finally:
        os.close(pidfd)


def _stream_socket(receive_buffer: int, pid: int | None = None) -> socket.socket:
    """A duplicate of process `pid`'s (default: this one's) one connected TCP socket whose kernel receive buffer
    is `receive_buffer`."""
    pid = pid or os.getpid()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            fd = _duplicate_fd(pid, int(name))
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
            continue  # closed since (the listing's own)
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not a socket; a leaked copy of, say, the forkserver's pipe would keep it alive
            continue
        if s.type == socket.SOCK_STREAM and s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == receive_buffer:
            try:
                s.getpeername()  # a listener has none
                return s
            except OSError:
                pass
        s.close()
    raise AssertionError(f"no connected socket with a {receive_buffer}-byte receive buffer in process {pid}")


def _check_push_pull(client: Client, t: torch.Tensor) -> None:
    assert torch.equal(push_pull_part(client, t, 0, server=0).wait(), t)


def _sample_low_water(stream: socket.socket, push_pull) -> list[int]:
    """Every SO_RCVLOWAT of `stream` read while `push_pull()` runs (then `stream` is closed)."""
    marks: list[int] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            marks.append(stream.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        push_pull()
    finally:
        done.set()
        sampler.join()
        stream.close()
    return marks


def test_a_locked_receive_buffer_keeps_the_low_water_mark_under_a_quarter_of_it(job_id):
    """While a pull's reply arrives, the client waits for its missing bytes (SO_RCVLOWAT), but on a receive buffer
    it set (locked) never for more than a quarter of it: the kernel would allow half, and a queue that full
    overflows the buffer's accounting and drops packets. Sampled from a duplicate of the client's stream socket
    during a 12 MiB reply."""
    servers = start_servers(1)
    big = torch.ones(3 << 20)  # 12 MiB: one frame, under the server's 16 MiB bound
    try:
        with Client([servers[0].address], job_id, 0, 1, timeout=60, receive_buffer_bytes=[24_000],
                    local_stream=False) as c:  # TCP's low-water mark  # fmt: skip
            assert c.stream_ready(0)
            stream = _stream_socket(48_000)  # the kernel stores twice the value asked for
            marks = _sample_low_water(stream, lambda: _check_push_pull(c, big))
    finally:
        stop_servers(servers)
    assert max(marks) > 1, "never sampled the client waiting for a frame's rest"
    assert max(marks) <= 12_000, sorted(set(marks))[-5:]


def test_a_servers_locked_receive_buffer_keeps_the_low_water_mark_under_a_quarter_of_it(job_id):
    """The same cap on the server's side (`bps-server --receive-buffer-bytes`): while a 12 MiB push arrives, the
    server's stream waits for at most a quarter of its locked buffer. Sampled from a duplicate of the server
    process's accepted socket (pidfd_getfd)."""
    servers = start_servers(1, extra_args=("--receive-buffer-bytes", "24000"))
    big = torch.ones(3 << 20)
    try:
        with Client([servers[0].address], job_id, 0, 1, timeout=60, local_stream=False) as c:
            assert c.stream_ready(0)
            stream = _stream_socket(48_000, servers[0].proc.pid)
            marks = _sample_low_water(stream, lambda: _check_push_pull(c, big))
    finally:
        stop_servers(servers)
    assert max(marks) > 1, "never sampled the server waiting for a frame's rest"
    assert max(marks) <= 12_000, sorted(set(marks))[-5:]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_the_runtime_sizes_each_receive_buffer_by_its_servers_share(job_id):
    """The backend's client (runtime._client) turns BPS_SOCKET_BUFFER_BYTES and the placement's weights into one
    receive buffer per server: 20,000 x 0.8 x 1.47 toward the dedicated server, the 8-segment floor toward the
    colocated one; the send buffers stay 20,000 (the kernel doubles each)."""
    servers = start_servers(2)
    try:
        weights = [Server(servers[0].address, True, 0.8), Server(servers[1].address, False, 0.2)]
        before = set(_loopback_sockets())
        config = Config.resolve(socket_buffer_bytes=20_000, transport="tcp")  # TCP's buffers
        with _client(config, [w.address for w in weights], job_id, 0, 1, None, dedicated=True, weights=weights) as c:
            assert c.stream_ready(0) and c.stream_ready(1)
            new = [s for s in _loopback_sockets() if s not in before]
    finally:
        stop_servers(servers)
    want = receive_buffers(20_000, weights)
    assert want == [23_529, MIN_RECEIVE_WINDOW], want
    client_ends = sorted(rb for _, _, rb, tb in new if tb == 40_000 and rb != 40_000)
    assert client_ends == sorted(2 * b for b in want), new


def test_a_server_refuses_a_negative_receive_buffer_naming_the_flag():
    cmd = [sys.executable, "-m", "torch_bps.server", "--host", "127.0.0.1", "--port", "0", "--auth", "off",
           "--receive-buffer-bytes", "-1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--receive-buffer-bytes -1 is not in [0, 2^31)" in done.stderr, done.stderr


def test_flow_settings_are_checked(server, job_id):
    with pytest.raises(ValueError, match="server_credit_bytes"):
        Client([server.address], job_id, 0, 1, server_credit_bytes=-1)
    with pytest.raises(ValueError, match="socket_buffer_bytes"):
        Client([server.address], job_id, 0, 1, socket_buffer_bytes=-5)
    with pytest.raises(ValueError, match=r"one size in \[0, 2\^31\) per server \(1\)"):
        Client([server.address], job_id, 0, 1, receive_buffer_bytes=[1, 2])
    with pytest.raises(ValueError, match="receive_buffer_bytes"):
        Client([server.address], job_id, 0, 1, receive_buffer_bytes=[-1])
