"""The client's stream transport (docs/protocol.md, "The stream transport").

First against a small protocol peer written here (a pyzmq ROUTER and a plain TCP listener in one thread, that
answers one worker: a round's result is its push), which can misbehave on purpose: refuse AUTH, never answer,
answer from another incarnation, drop the stream mid-round. Then end to end against real summation servers.
Real sockets throughout, nothing mocked.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import struct
import threading
import time

import pytest
import torch
import zmq

from tests.helpers import ServerProcess, push_pull_part, run_ranks
from torch_bps.client import Client, default_credentials, job_id_from_name
from torch_bps.config import Config
from torch_bps.errors import ConfigError, TransportError
from torch_bps.security import ClientCredentials, derive, new_secret
from torch_bps.wire import HEADER_SIZE, STATS_FIELDS, Command, Header, Mode

pytestmark = pytest.mark.timeout(120)

MORE = 1 << 63
GREETING = b"BPS-STREAM-1"
INCARNATION = 0x1234_5678_9ABC_DEF0


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_message(conn: socket.socket) -> list[bytes] | None:
    """One message of the stream framing (8-byte little-endian length word, bit 63: MORE); None once closed."""
    frames = []
    while True:
        word = _read_exactly(conn, 8)
        if word is None:
            return None
        (value,) = struct.unpack("<Q", word)
        data = _read_exactly(conn, value & ~MORE)
        if data is None:
            return None
        frames.append(data)
        if not value & MORE:
            return frames


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def encode(frames: list[bytes]) -> bytes:
    """One message in the stream framing."""
    return b"".join(struct.pack("<Q", len(f) | (MORE if i + 1 < len(frames) else 0)) + f for i, f in enumerate(frames))


def write_message(conn: socket.socket, frames: list[bytes], pause: float = 0.0, split: int = 4) -> None:
    """Write one message; pause > 0: its first `split` bytes (default: half a length word), then the rest that
    much later."""
    out = encode(frames)
    if pause > 0:
        conn.sendall(out[:split])
        time.sleep(pause)
        out = out[split:]
    conn.sendall(out)


class FakeServer:
    """A server for one worker on loopback: ZeroMQ (no auth) and, if `offer`, a stream listener.

    offer: the stream port the HELLO reply offers: True (its listener), False (none) or a port number.
    on_auth: "accept", "close" (refused) or "silent" (never answers).
    stream_incarnation: what the stream's HELLO reply says (default: the server's).
    drop_at_pull: close the stream instead of answering a PULL of this round (once).
    pause_in_replies: seconds to wait on the stream between the first 4 bytes of each PULL reply and the rest.
    stall_in_payload: seconds to wait on the stream in the middle of each PULL reply's payload.
    mechanism: ZeroMQ's: "off", "token" (PLAIN) or "curve" (with the server keys of `secret`); its ZAP handler
    admits everyone: the stream's AUTH is recorded, not checked.
    burst: on the stream, hold every reply until no request came for 30 ms, then write them in one burst, INIT
    replies first; never answer a PULL (as a round whose other workers died would not be).
    """

    def __init__(self, offer=True, on_auth="accept", stream_incarnation=INCARNATION, drop_at_pull=None,
                 pause_in_replies=0.0, mechanism="off", secret="", stall_in_payload=0.0, burst=False):  # fmt: skip
        self.ctx = zmq.Context()
        self.zap = self.ctx.socket(zmq.REP)  # RFC 27: libzmq asks it about every PLAIN or CURVE connection
        self.zap.bind("inproc://zeromq.zap.01")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if mechanism == "token":
            self.router.plain_server = True
        elif mechanism == "curve":
            keys = derive(secret, "server")
            self.router.curve_server = True
            self.router.curve_secretkey, self.router.curve_publickey = keys.secret, keys.public
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.stream_port = self.listener.getsockname()[1]
        self.offer = self.stream_port if offer is True else int(offer)
        self.on_auth, self.stream_incarnation, self.drop_at_pull = on_auth, stream_incarnation, drop_at_pull
        self.pause_in_replies, self.stall_in_payload = pause_in_replies, stall_in_payload
        self.burst, self.held, self.last_request = burst, ([], []), 0.0  # held: (INIT replies, the others)
        self.requests = {"zmq": collections.Counter(), "stream": collections.Counter()}
        self.auths: list[list[bytes]] = []
        self.streams_accepted = 0
        self.keys: dict[tuple[int, int], bytearray] = {}
        self.conns: dict[int, tuple[socket.socket, list[str]]] = {}  # fd -> (an open stream, [its state])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for conn, _ in self.conns.values():
            conn.close()
        self.listener.close()
        self.router.close()
        self.zap.close()
        self.ctx.term()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def answer(self, frames: list[bytes], via: str) -> list[bytes] | None:
        h = Header.unpack(frames[0])
        self.requests[via][Command(h.command).name] += 1
        if h.command == Command.HELLO:
            incarnation = INCARNATION if via == "zmq" else self.stream_incarnation
            return [h.reply(incarnation=incarnation, stream=self.offer if via == "zmq" else 0).pack()]
        if h.command == Command.PUSH:
            self.keys.setdefault((h.key, h.round), bytearray(h.nbytes))[h.offset : h.offset + h.length] = frames[1]
        if h.command == Command.PULL:
            if via == "stream" and h.round == self.drop_at_pull:
                self.drop_at_pull = None
                return None  # the caller closes the stream
            data = bytes(self.keys[(h.key, h.round)][h.offset : h.offset + h.length])
            return [h.reply().pack(), data]
        if h.command == Command.STATS:
            return [h.reply().pack(), bytes(8 * len(STATS_FIELDS))]
        return [h.reply().pack()]

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.listener, zmq.POLLIN)
        poller.register(self.zap, zmq.POLLIN)
        while not self._stop.is_set():
            quiet = time.monotonic() - self.last_request > 0.03
            if self.burst and self.conns and (self.held[0] or self.held[1]) and quiet:
                conn = next(iter(self.conns.values()))[0]
                conn.sendall(b"".join(encode(frames) for frames in self.held[0] + self.held[1]))  # one write
                self.held = ([], [])
            for item, _ in poller.poll(10 if self.burst else 50):
                if item is self.zap:
                    _version, request_id, *_ = self.zap.recv_multipart()
                    self.zap.send_multipart([b"1.0", request_id, b"200", b"OK", b"anyone", b""])
                elif item is self.router:
                    peer, *frames = self.router.recv_multipart()
                    self.router.send_multipart([peer, *self.answer(frames, "zmq")])
                elif item == self.listener.fileno():
                    conn, _ = self.listener.accept()
                    self.streams_accepted += 1
                    self.conns[conn.fileno()] = (conn, ["auth"])
                    poller.register(conn, zmq.POLLIN)
                else:
                    conn, state = self.conns[item]  # pyzmq's poller names a plain socket by its fd
                    if not self._serve(conn, state):
                        poller.unregister(conn)
                        del self.conns[item]
                        conn.close()

    def _serve(self, conn: socket.socket, state: list[str]) -> bool:
        """Read and answer one message of a stream; False: close it."""
        frames = read_message(conn)
        if frames is None:
            return False
        if state[0] == "auth":
            self.auths.append(frames)
            if self.on_auth == "close":
                return False
            if self.on_auth == "accept":
                write_message(conn, [GREETING, b"200"])
                state[0] = "open"
            return True
        if state[0] != "open":
            return True
        reply = self.answer(frames, "stream")
        if reply is None:
            return False
        if self.burst:
            self.last_request = time.monotonic()
            command = Header.unpack(frames[0]).command
            if command != Command.PULL:
                self.held[command != Command.INIT].append(reply)
            return True
        if self.stall_in_payload and len(reply) > 1:
            with contextlib.suppress(OSError):  # the client may close the stream meanwhile
                write_message(conn, reply, split=HEADER_SIZE + 16 + len(reply[1]) // 2, pause=self.stall_in_payload)
            return True
        write_message(conn, reply, self.pause_in_replies if len(reply) > 1 else 0.0)
        return True


def sums(client: Client, rounds: int, n: int = 1000, key: int = 7) -> None:
    for rnd in range(rounds):
        t = torch.arange(n, dtype=torch.float32) + rnd
        assert torch.equal(push_pull_part(client, t.clone(), key).wait(), t)


# ---- against the protocol peer above ----


def test_requests_go_on_a_ready_stream_and_sums_come_back():
    with FakeServer() as srv, Client([srv.address], 1, 0, 1, auth=False, stream=True, timeout=10) as c:
        assert c.stream_ready(0)  # hello() waited for it
        assert srv.auths == [[GREETING, b"NULL"]]
        sent0, received0 = c.bytes_sent()[0], c.bytes_received()[0]
        stream0 = c.stream_bytes()[0]
        sums(c, 3, n=1000)
        big = torch.randn(3 << 20)  # 12 MiB: many partial writes and reads
        assert torch.equal(push_pull_part(c, big.clone(), 9).wait(), big)
        assert c.server_stats(0) == dict.fromkeys(STATS_FIELDS, 0)
        # Every request went on the stream (ZeroMQ carried the HELLO only), counted in the totals too.
        assert srv.requests["zmq"] == {"HELLO": 1}
        assert srv.requests["stream"] == {"HELLO": 1, "INIT": 2, "PUSH": 4, "PULL": 4, "STATS": 1}
        payload = 3 * 4000 + 4 * big.numel()
        sent = c.bytes_sent()[0] - sent0
        assert sent == c.stream_bytes()[0][0] - stream0[0] == 2 * HEADER_SIZE + 9 * HEADER_SIZE + payload
        received = c.bytes_received()[0] - received0
        assert received == c.stream_bytes()[0][1] - stream0[1] == 11 * HEADER_SIZE + payload + 8 * len(STATS_FIELDS)


def test_token_auth_sends_the_dealers_identity_and_token_in_auth():
    secret = new_secret()
    credentials = ClientCredentials.for_servers(secret, [secret], "token")
    with FakeServer(mechanism="token") as srv, Client([srv.address], 1, 0, 1, auth=credentials, stream=True) as c:
        assert c.stream_ready(0)
        assert srv.auths == [[GREETING, b"PLAIN", credentials.client.public, credentials.tokens[0]]]
        sums(c, 1)
        assert srv.requests["stream"]["PUSH"] == 1


def test_curve_never_opens_a_stream_even_if_offered():
    """A stream is not encrypted: under CURVE the client keeps to ZeroMQ, whatever the server offers."""
    secret = new_secret()
    credentials = ClientCredentials.for_servers(secret, [secret], "curve")
    with (
        FakeServer(mechanism="curve", secret=secret) as srv,
        Client([srv.address], 1, 0, 1, auth=credentials, stream=True) as c,
    ):
        sums(c, 2)
        assert not c.stream_ready(0) and c.stream_bytes() == [(0, 0)]
        assert srv.streams_accepted == 0 and srv.requests["zmq"]["PUSH"] == 2


def test_zmq_transport_opens_no_stream():
    with FakeServer() as srv, Client([srv.address], 1, 0, 1, auth=False, stream=False) as c:
        sums(c, 2)
        assert not c.stream_ready(0) and c.stream_bytes() == [(0, 0)]
        assert srv.streams_accepted == 0 and srv.requests["stream"] == {}


@pytest.mark.parametrize("settings", [{"backups": 1, "window": 3}, {"staleness": 2}, {"staleness": None}],
                         ids=["backups", "staleness", "async"])  # fmt: skip
def test_a_job_with_backup_workers_or_staleness_gets_its_stream(settings):
    """The stream's HELLO says what the ZeroMQ one said: else the server refuses it (JOB_MISMATCH) and the job stays
    on ZeroMQ."""
    server = ServerProcess(auth=False)
    try:
        with Client([server.address], 9, 0, 2, auth=False, stream=True, **settings) as c:
            assert c.stream_ready(0)
    finally:
        server.stop()


def test_a_server_offering_no_stream_is_used_over_zmq():
    with FakeServer(offer=False) as srv, Client([srv.address], 1, 0, 1, auth=False, stream=True) as c:
        sums(c, 2)
        assert not c.stream_ready(0) and srv.streams_accepted == 0
        assert srv.requests["zmq"]["PUSH"] == 2


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"offer": unused_port()}, "cannot connect"),
        ({"on_auth": "close"}, "during AUTH"),
        ({"stream_incarnation": 99}, "incarnation 0x0000000000000063"),
    ],
    ids=["connect-refused", "auth-refused", "other-incarnation"],
)
def test_a_stream_that_fails_to_open_leaves_the_server_on_zmq(settings, said, capfd):
    with FakeServer(**settings) as srv, Client([srv.address], 1, 0, 1, auth=False, stream=True, timeout=10) as c:
        sums(c, 2)
        assert not c.stream_ready(0)
        assert srv.requests["zmq"]["PUSH"] == 2 and srv.requests["stream"]["PUSH"] == 0
    lines = [line for line in capfd.readouterr().err.splitlines() if "no stream to server" in line]
    assert len(lines) == 1 and srv.address in lines[0] and said in lines[0], lines


def test_a_stream_never_admitted_times_out_and_zmq_carries_on(capfd):
    with FakeServer(on_auth="silent") as srv:
        t0 = time.monotonic()
        with Client([srv.address], 1, 0, 1, auth=False, stream=True, timeout=10) as c:
            assert 9 < time.monotonic() - t0 < 20  # hello() waited for the stream's 10 s, no longer
            sums(c, 1)
            assert not c.stream_ready(0) and srv.requests["zmq"]["PUSH"] == 1
    assert "not ready within 10 s" in capfd.readouterr().err


def test_a_dropped_stream_fails_the_round_at_once_then_a_new_stream_opens():
    with FakeServer(drop_at_pull=1) as srv, Client([srv.address], 1, 0, 1, auth=False, stream=True, timeout=30) as c:
        sums(c, 1, n=10)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=rf"lost the connection to server {srv.address} \(its stream closed"):
            push_pull_part(c, torch.ones(10), 7).wait()
        assert time.monotonic() - t0 < 5
        # Re-HELLO on ZeroMQ (same incarnation), then a new stream; requests meanwhile fail or go on ZeroMQ.
        deadline = time.monotonic() + 10
        while not c.stream_ready(0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stream_ready(0) and srv.streams_accepted == 2
        assert srv.requests["zmq"]["HELLO"] == 2
        pushes = srv.requests["stream"]["PUSH"]
        t = torch.arange(10.0)
        assert torch.equal(push_pull_part(c, t.clone(), 7).wait(), t)
        assert srv.requests["stream"]["PUSH"] == pushes + 1


def test_a_message_arriving_in_pieces_does_not_spin_the_io_thread():
    """Half a length word waits in the stream's buffer for a second: the IO thread sleeps in poll meanwhile
    (StreamConn::hasBuffered() is false then), it does not poll with timeout 0 until the rest arrives."""
    with FakeServer(pause_in_replies=1.0) as srv, Client([srv.address], 1, 0, 1, auth=False, stream=True) as c:
        t = torch.arange(100.0)
        cpu = time.process_time()  # every thread of this process: the client's IO thread and the peer's
        assert torch.equal(push_pull_part(c, t.clone(), 3).wait(), t)
        assert time.process_time() - cpu < 0.4
        assert srv.requests["stream"]["PULL"] == 1


def test_credit_returned_by_buffered_replies_sends_queued_parts_at_once():
    """A burst of 64 INIT replies, then 64 push acknowledgements: the poll that saw the burst parses the INITs (a
    read takes 64 messages), and the next loop's step parses the acknowledgements from the stream's buffer. Their
    credit admits the queued parts; nothing else will ever wake the loop (no PULL is answered), so they must go
    before it blocks in poll (client_io.cpp: `credit_.ready()`), not after the 60 s timeout."""
    with (
        FakeServer(burst=True) as srv,
        Client([srv.address], 1, 0, 1, auth=False, stream=True, timeout=60, credit_bytes=64 * 4) as c,
    ):
        parts = [(torch.ones(1), key, None, None, Mode.SUM, None, 0, 0) for key in range(3 * 64)]
        failed = []
        c.push_pull_batch(parts, on_done=failed.append)
        deadline = time.monotonic() + 10
        while srv.requests["stream"]["PUSH"] < len(parts) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.requests["stream"]["PUSH"] == len(parts), srv.requests["stream"]
    assert len(failed) == 1 and "client was closed" in str(failed[0])  # its last replies were never sent


def test_a_pull_that_times_out_mid_reply_leaves_its_destination_alone():
    """The stream reads a PULL reply's payload straight into the destination tensor. When the request fails
    (here its deadline passes) with half the payload read, the rest must not land in a tensor the caller got
    back with an error and may be using again: the client closes the stream, and carries on after a re-HELLO."""
    n = 1 << 16  # 256 KiB of float32: the reply's payload is read straight into `out`
    with FakeServer(stall_in_payload=4.0) as srv, Client([srv.address], 1, 0, 1, auth=False, stream=True,
                                                         timeout=0.5) as c:  # fmt: skip
        out = torch.zeros(n)
        with pytest.raises(Exception, match="timed out"):
            push_pull_part(c, torch.ones(n), 3, out=out).wait()  # the PULL's deadline: 0.5 s + 2 s of grace
        seen = out.clone()
        assert seen.any(), "the first half of the reply was read into out"
        time.sleep(2.5)  # the fake server sends the rest now
        assert torch.equal(out, seen), "nothing landed after the request failed"
        assert wait_for(lambda: c.stream_ready(0), 10.0), "a new stream opened after the re-HELLO"


def wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_abandon_and_close_close_the_stream():
    with FakeServer() as srv:
        with Client([srv.address], 1, 0, 1, auth=False, stream=True, failover=True) as c:
            assert c.stream_ready(0) and wait_for(lambda: len(srv.conns) == 1)
            c.abandon(0, "failed over by a test")
            assert not c.stream_ready(0)
            assert wait_for(lambda: not srv.conns)  # the peer saw it close
            with pytest.raises(TransportError, match="failed over by a test"):
                push_pull_part(c, torch.ones(4), 1).wait()
            assert srv.streams_accepted == 1  # and no new one
        with Client([srv.address], 2, 0, 1, auth=False, stream=True) as c:
            assert c.stream_ready(0) and wait_for(lambda: len(srv.conns) == 1)
        assert wait_for(lambda: not srv.conns)


def test_close_with_a_stream_opening_never_hangs():
    with FakeServer(on_auth="silent") as srv:
        c = Client.__new__(Client)  # hello() would wait 10 s for the stream: close from another thread meanwhile
        done = threading.Event()

        def connect():
            try:
                Client.__init__(c, [srv.address], 1, 0, 1, auth=False, stream=True)
            except Exception:
                pass
            done.set()

        threading.Thread(target=connect, daemon=True).start()
        time.sleep(0.5)
        t0 = time.monotonic()
        c._impl.close()
        assert done.wait(5) and time.monotonic() - t0 < 5


# ---- end to end: real summation servers (bps-server processes) ----

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


def worker_data(worker: int, rnd: int, key: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * worker + 10 * rnd + key)
    n = 5000 + 997 * key
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 50, (n,), generator=g).to(dtype)


def run_job(address: str, job_id: int, stream: bool, auth, num_workers: int = 2, rounds: int = 3):
    """num_workers clients (threads, each its own sockets) push_pull every dtype's key for `rounds` rounds.
    Returns (per worker {(key, round): result}, per worker ZeroMQ bytes sent during the job, per worker stream
    bytes sent during the job)."""
    clients = [Client([address], job_id, w, num_workers, auth=auth, stream=stream, timeout=30)
               for w in range(num_workers)]  # fmt: skip
    try:
        before = [(c.bytes_sent()[0], c.stream_bytes()[0][0]) for c in clients]
        results: list[dict] = [{} for _ in clients]
        for rnd in range(rounds):
            futures = []
            for w, c in enumerate(clients):
                for key, dtype in enumerate(DTYPES):
                    futures.append((w, key, push_pull_part(c, worker_data(w, rnd, key, dtype), key)))
            for w, key, f in futures:
                results[w][(key, rnd)] = f.wait()
        ready = [c.stream_ready(0) for c in clients]
        after = [(c.bytes_sent()[0], c.stream_bytes()[0][0]) for c in clients]
    finally:
        for c in clients:
            c.close()
    zmq_bytes = [(a[0] - a[1]) - (b[0] - b[1]) for a, b in zip(after, before, strict=True)]
    stream_bytes = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return results, zmq_bytes, stream_bytes, ready


@pytest.mark.parametrize("auth", [True, False], ids=["token", "off"])
def test_sums_over_streams_are_those_over_zmq(auth):
    server = ServerProcess(auth=auth)
    try:
        creds = None if auth else False  # None: the pool credential of the suite (BPS_AUTH=token)
        by_zmq, zmq_bytes, stream_bytes, ready = run_job(server.address, job_id_from_name(f"zmq-{auth}"), False, creds)
        assert not any(ready) and stream_bytes == [0, 0] and all(b > 0 for b in zmq_bytes)
        by_stream, zmq_bytes, stream_bytes, ready = run_job(server.address, job_id_from_name(f"st-{auth}"), True, creds)
        # Every request of the job went on the streams: ZeroMQ carried nothing after HELLO.
        assert all(ready) and zmq_bytes == [0, 0] and all(b > 3 * 5000 for b in stream_bytes)
        for w in range(2):
            for (key, rnd), got in by_stream[w].items():
                want = worker_data(0, rnd, key, DTYPES[key]) + worker_data(1, rnd, key, DTYPES[key])
                assert torch.equal(got, by_zmq[w][(key, rnd)]) and torch.equal(got, want), (w, key, rnd)
    finally:
        server.stop()


def test_curve_server_offers_no_stream_and_zmq_carries_the_job():
    server = ServerProcess(extra_args=("--auth", "curve"))
    try:
        credentials = ClientCredentials.for_pool(os.environ["BPS_POOL_CREDENTIAL"], 5, 1, "curve")
        with Client([server.address], 5, 0, 1, auth=credentials, stream=True) as c:
            sums(c, 2)
            assert not c.stream_ready(0) and c.stream_bytes() == [(0, 0)]
    finally:
        server.stop()


def test_a_server_with_streams_off_is_used_over_zmq(capfd):
    server = ServerProcess(extra_args=("--stream", "off"))
    try:
        with Client([server.address], 6, 0, 1, stream=True) as c:
            sums(c, 2)
            assert not c.stream_ready(0) and c.stream_bytes() == [(0, 0)]
        assert "no stream" not in capfd.readouterr().err  # none offered: none tried
    finally:
        server.stop()


@pytest.mark.parametrize("local", [True, False], ids=["local-stream", "tcp-stream"])
def test_a_killed_server_fails_the_rounds_on_its_stream_at_once(local):
    server = ServerProcess()
    try:
        with Client([server.address], 7, 0, 2, stream=True, local_stream=local, timeout=60) as c:
            assert c.stream_ready(0) and c.stream_local(0) == local
            waiting = [push_pull_part(c, torch.zeros(100), key) for key in range(4)]  # no second worker: they wait
            time.sleep(0.3)
            t0 = time.monotonic()
            server.kill()
            for f in waiting:
                with pytest.raises(TransportError, match=server.address):
                    f.wait()
            assert time.monotonic() - t0 < 5
            assert not c.stream_ready(0)
    finally:
        server.kill()


@pytest.mark.parametrize("local", [True, False], ids=["local-stream", "tcp-stream"])
def test_a_stream_dropping_while_a_forked_child_holds_its_socket_does_not_spin_the_io_thread(local):
    """A fork (a DataLoader's workers) copies the client's sockets into the child. When a stream then drops, the
    client closes its socket, but the socket lives on in the child: left in the IO thread's epoll set, its hang-up
    would be reported on every wait, a busy loop. The client removes it from the set before closing it."""
    server = ServerProcess()
    child = None
    try:
        with Client([server.address], 8, 0, 2, local_stream=local, timeout=60) as c:
            assert c.stream_ready(0) and c.stream_local(0) == local
            waiting = push_pull_part(c, torch.zeros(100), 0)  # no second worker: it waits
            child = os.fork()
            if child == 0:  # holds every socket of the parent until killed
                time.sleep(60)
                os._exit(0)
            server.kill()
            with pytest.raises(TransportError, match=server.address):
                waiting.wait()
            t0, cpu0 = time.monotonic(), time.process_time()
            time.sleep(1.0)
            busy = (time.process_time() - cpu0) / (time.monotonic() - t0)
            assert busy < 0.3, f"the client used {busy:.2f} cores while idle after its stream dropped"
    finally:
        if child:
            os.kill(child, 9)
            os.waitpid(child, 0)
        server.kill()


def test_a_server_on_this_machine_is_reached_over_its_local_stream():
    """The server offers its local stream (a unix socket named after its incarnation) beside the TCP port: a client
    on the same machine takes it, and the sums are those over TCP; BPS_TRANSPORT=tcp (local_stream=False) keeps
    the TCP stream."""
    server = ServerProcess()
    t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: a frame longer than the socket buffers
    try:
        for local in (True, False):
            with Client([server.address], job_id_from_name(f"local-{local}"), 0, 1, local_stream=local) as c:
                assert c.stream_ready(0) and c.stream_local(0) == local
                for key in range(3):
                    assert torch.equal(push_pull_part(c, t.clone(), key).wait(), t)
                sent, received = c.stream_bytes()[0]
                assert sent > 3 * t.nbytes and received > 3 * t.nbytes  # the payloads went on the stream
    finally:
        server.stop()


def _local_stream_socket(server: ServerProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(f"\0torch_bps/stream/{server.incarnation:016x}")
    return s


def test_the_local_stream_closes_on_garbage_and_on_a_wrong_token_and_serves_on():
    """Anyone on the machine can connect to an abstract socket: the local stream admits only what the TCP stream
    admits (AUTH first, the same token), and a stranger's garbage or wrong token costs its own connection only."""
    server = ServerProcess()
    try:
        garbage = _local_stream_socket(server)
        garbage.sendall(struct.pack("<Q", 1 << 40) + os.urandom(64))  # a 1 TiB frame, before AUTH
        assert garbage.recv(64) == b"", "the server should close a connection whose first frame is absurd"
        wrong = _local_stream_socket(server)
        frames = [b"BPS-STREAM-1", b"PLAIN", b"worker", b"not-the-token"]
        wrong.sendall(b"".join(struct.pack("<Q", len(f) | (1 << 63 if i < 3 else 0)) + f for i, f in enumerate(frames)))
        assert wrong.recv(64) == b"", "the server should refuse a wrong token on the local stream, as on TCP"
        with Client([server.address], job_id_from_name("local-after-garbage"), 0, 1) as c:
            assert c.stream_local(0)
            assert torch.equal(push_pull_part(c, torch.ones(1000), 0).wait(), torch.ones(1000))
    finally:
        server.stop()


def test_a_local_stream_moves_big_frames_through_shared_memory_and_the_socket_when_full():
    """On the local stream, big frames go through the worker's shared rings (cpp_ext/transport/shared_ring.h) and only
    their length words through the socket. While the 8 MiB rings have room, every payload goes through them, both
    ways. 40 keys of 0.8-2 MB in flight overfill them: the frames that find no room take the socket, in order with
    the others (how many depends on how fast the server drains, so only that both paths carried bytes is checked); a
    frame that does not fit before a ring's end starts at its beginning; and every sum (each key its own values) is
    exact. Without shared memory (BPS_TRANSPORT=unix) nothing goes through it."""
    server = ServerProcess()
    tensors = [torch.arange(200_000 + 7919 * key, dtype=torch.float32) * (key + 1) for key in range(40)]
    few = tensors[:4]  # 3.4 MB each way: room in the rings
    try:
        for shared in (True, False):
            with Client([server.address], job_id_from_name(f"shared-{shared}"), 0, 1, shared_memory=shared) as c:
                assert c.stream_local(0) and c.stream_shared(0) == shared
                futures = [push_pull_part(c, t.clone(), key) for key, t in enumerate(few)]
                for t, f in zip(few, futures, strict=True):
                    assert torch.equal(f.wait(), t)
                roomy = c.stream_shared_bytes()[0]
                assert roomy == (2 * sum(t.nbytes for t in few) if shared else 0), roomy  # every payload, both ways
                for _ in range(3):  # the rings wrap around several times
                    futures = [push_pull_part(c, t.clone(), key) for key, t in enumerate(tensors)]
                    for t, f in zip(tensors, futures, strict=True):
                        assert torch.equal(f.wait(), t)
                sent, received = c.stream_bytes()[0]
                through_rings = c.stream_shared_bytes()[0]
                if shared:
                    assert roomy < through_rings < sent + received, (roomy, through_rings, sent + received)
                else:
                    assert through_rings == 0
    finally:
        server.stop()


def test_frames_that_fill_a_shared_ring_exactly_or_outgrow_it_sum_right():
    """The rings' edges, one key at a time (each push and its sum's reply alone in a ring): 2 MiB frames that fill
    the 8 MiB ring exactly and start over at its beginning with nothing skipped; a frame of the whole ring; one 4
    bytes longer than the ring, which only the socket can carry."""
    server = ServerProcess()
    try:
        with Client([server.address], job_id_from_name("ring-edges"), 0, 1) as c:
            assert c.stream_shared(0)
            for key, numel in enumerate([1 << 19] * 6 + [1 << 21, (1 << 21) + 1]):
                t = torch.arange(numel, dtype=torch.float32) + key
                before = c.stream_shared_bytes()[0]
                assert torch.equal(push_pull_part(c, t.clone(), key).wait(), t), (key, numel)
                through_rings = c.stream_shared_bytes()[0] - before
                assert through_rings == (2 * t.nbytes if numel <= 1 << 21 else 0), (key, through_rings)
    finally:
        server.stop()


SHARED = 1 << 62  # a frame's length word: its bytes are in the sender's shared ring
RING = 8 << 20  # cpp_ext/transport/shared_ring.h: kSharedRingBytes, after a 4 KiB control page


def _shared_memory(size: int = 4096 + 2 * RING, seal: bool = True) -> int:
    import fcntl

    fd = os.memfd_create("test-rings", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _auth_on_local_stream(server: ServerProcess, job_id: int, fd: int | None) -> tuple[socket.socket, list[bytes]]:
    """Connect to the server's local stream, AUTH (passing `fd` beside it), return the socket and the answer."""
    creds = default_credentials(job_id, 1)
    frames = [GREETING, b"PLAIN", creds.client.public, creds.tokens[0]] if creds else [GREETING, b"NULL"]
    auth = b"".join(struct.pack("<Q", len(f) | (MORE if i + 1 < len(frames) else 0)) + f for i, f in enumerate(frames))
    s = _local_stream_socket(server)
    if fd is None:
        s.sendall(auth)
    else:
        socket.send_fds(s, [auth], [fd])
    return s, read_message(s)


def test_the_server_maps_only_sound_shared_memory_and_closes_a_stream_that_lies_about_it():
    """The server's side of shared memory against a hostile worker on its machine: memory it could shrink under
    the server (SIGBUS) or of another size is not taken (AUTH's answer has no "shared": the socket carries all);
    a frame flagged as shared on a stream without shared memory, or longer than the ring, closes that stream. The
    server serves on."""
    server = ServerProcess()
    job = job_id_from_name("shared-hostile")
    try:
        for fd, taken in ((_shared_memory(seal=False), False), (_shared_memory(size=4096), False),
                          (_shared_memory(), True)):  # fmt: skip
            s, answer = _auth_on_local_stream(server, job, fd)
            os.close(fd)
            assert answer == [GREETING, b"200", b"shared"] if taken else answer == [GREETING, b"200"], answer
            s.sendall(struct.pack("<Q", SHARED | (RING + 1)))  # longer than any ring, or no ring at all
            assert s.recv(64) == b"", "the server should close a stream whose shared frame cannot be"
            s.close()
        s, answer = _auth_on_local_stream(server, job, None)
        assert answer == [GREETING, b"200"]
        s.sendall(struct.pack("<Q", SHARED | 4096))
        assert s.recv(64) == b""
        with Client([server.address], job, 0, 1) as c:
            assert c.stream_shared(0)
            assert torch.equal(push_pull_part(c, torch.ones(1 << 16), 0).wait(), torch.ones(1 << 16))
    finally:
        server.stop()


def test_transport_setting(monkeypatch):
    monkeypatch.delenv("BPS_TRANSPORT", raising=False)
    assert Config.resolve().transport == "stream"
    assert Config.resolve(transport="zmq").transport == "zmq"
    monkeypatch.setenv("BPS_TRANSPORT", "zmq")
    assert Config.resolve().transport == "zmq"
    monkeypatch.setenv("BPS_TRANSPORT", "tcp")
    assert Config.resolve().transport == "tcp"
    monkeypatch.setenv("BPS_TRANSPORT", "unix")
    assert Config.resolve().transport == "unix"
    monkeypatch.setenv("BPS_TRANSPORT", "quic")
    with pytest.raises(ConfigError, match=r"BPS_TRANSPORT='quic'.*stream.*tcp.*zmq"):
        Config.resolve()
    with pytest.raises(ConfigError, match="'quic'"):
        Client(["127.0.0.1:1"], 1, 0, 1)  # the Client's default comes from BPS_TRANSPORT too
    monkeypatch.delenv("BPS_TRANSPORT")
    with pytest.raises(ConfigError, match="'udp'"):
        Config.resolve(transport="udp")


def _all_reduce_on_streams(rank, world, gloo):
    import torch.distributed as dist

    from torch_bps.runtime import _RUNTIMES

    t = torch.full((100_000,), float(rank + 1))
    dist.all_reduce(t)
    client = _RUNTIMES["default"]._client
    servers = len(client.servers)
    return t[:2].tolist(), [client.stream_ready(s) for s in range(servers)], [b for b, _ in client.stream_bytes()]


def test_a_job_with_bps_transport_stream_runs_on_streams():
    """BPS_TRANSPORT=stream reaches the runtime's client: every embedded server's stream is ready and carried bytes."""
    for total, ready, sent in run_ranks(_all_reduce_on_streams, 2, env={"BPS_TRANSPORT": "stream"}):
        assert total == [3.0, 3.0] and all(ready) and all(b > 0 for b in sent), (ready, sent)
