"""The server's side of the stream transport (docs/protocol.md, "The stream transport"): offered in the HELLO
reply, admitted by the same ZAP handler, served like ZeroMQ requests, and closed on anything else. Real server
processes; the peers speak the framing by hand (tests.helpers.StreamPeer)."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import RawPeer, ServerProcess, StreamPeer
from torch_bps.client import default_credentials
from torch_bps.security import ClientCredentials, new_secret
from torch_bps.wire import STREAM_LOCAL, Command, Header, Status

pytestmark = pytest.mark.timeout(120)

KEY_BYTES = 4096


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    s.stop()


def stream_port(server: ServerProcess) -> int:
    """The stream port a HELLO over ZeroMQ is told (its reply's `length`), asked by a job of its own."""
    peer = RawPeer(server.address, 0x7E57, auth=None if server.credential else False)
    try:
        return peer.hello().stream
    finally:
        peer.close()


def sum_round(peers, key: int, round_: int) -> list[bytes]:
    """INIT (round 0), PUSH and PULL one SUM round of `key` from every peer; return each peer's pulled bytes."""
    blocks = [torch.full((KEY_BYTES // 4,), float(10 * round_ + w + 1)) for w in range(len(peers))]
    fields = dict(key=key, nbytes=KEY_BYTES, dtype=1)
    if round_ == 0:
        for p in peers:
            h, _ = p.request(Command.INIT, **fields)
            assert h.status == Status.OK, h
    for p, b in zip(peers, blocks, strict=True):
        h, _ = p.request(Command.PUSH, b.numpy().tobytes(), round=round_, **fields)
        assert h.status == Status.OK, h
    results = []
    for p in peers:
        h, payload = p.request(Command.PULL, round=round_, **fields)
        assert h.status == Status.OK, (h, payload)
        results.append(payload[0])
    expected = sum(blocks).numpy().tobytes()
    assert all(r == expected for r in results)
    return results


def test_the_hello_reply_offers_a_stream_port_unless_curve_or_off():
    plain = ServerProcess()
    curve = ServerProcess(extra_args=("--auth", "curve"))
    off = ServerProcess(extra_args=("--stream", "off"))
    try:
        offer = stream_port(plain)
        assert 0 < offer & 0xFFFF != plain.port and offer & ~0xFFFF == STREAM_LOCAL, hex(offer)  # + the local one
        pool = os.environ["BPS_POOL_CREDENTIAL"]
        credentials = ClientCredentials.for_servers(pool, [pool], "curve")
        peer = RawPeer(curve.address, 0x7E57, auth=credentials)
        assert peer.hello().stream == 0, "a stream is not encrypted: none under curve"
        peer.close()
        assert stream_port(off) == 0
    finally:
        for s in (plain, curve, off):
            s.stop()


def test_a_stream_worker_and_a_zeromq_worker_sum_together(server):
    job = 0x57_0001
    port = stream_port(server)
    zmq_peer = RawPeer(server.address, job, 0, 2)
    stream = StreamPeer(server.address, port, job, 1, 2)
    try:
        assert zmq_peer.hello().incarnation == stream.hello().incarnation == server.incarnation
        for r in range(3):
            sum_round([zmq_peer, stream], key=7, round_=r)
        h, payload = stream.request(Command.STATS)
        assert h.status == Status.OK and len(payload[0]) == 14 * 8
        pushes = struct.unpack("<14Q", payload[0])[0]
        assert pushes >= 6
    finally:
        zmq_peer.close()
        stream.close()


def test_without_authentication_a_stream_opens_with_null():
    s = ServerProcess(auth=False)
    try:
        port = stream_port(s)
        stream = StreamPeer(s.address, port, 3, 0, 1, auth=False)
        stream.hello()
        sum_round([stream], key=1, round_=0)
        stream.close()
        plain = StreamPeer(s.address, port, 3, 0, 1, auth=False, open=False)
        plain.send_frames([b"BPS-STREAM-1", b"PLAIN", b"someone", b"token"])
        assert plain.closed_by_server(), "a mechanism the server does not run is refused"
    finally:
        s.stop()


@pytest.mark.parametrize(
    "auth",
    [
        pytest.param([b"BPS-STREAM-1", b"PLAIN", b"stranger", b"0" * 64], id="wrong token"),
        pytest.param([b"BPS-STREAM-1", b"NULL"], id="no credentials"),
        pytest.param([b"BPS-STREAM-2", b"PLAIN"], id="wrong greeting"),
        pytest.param([b"\x00" * 96], id="a request before AUTH"),
    ],
)
def test_a_stream_that_does_not_authenticate_is_closed_and_gets_nothing(server, auth):
    job = 0x57_0002
    port = stream_port(server)
    stranger = StreamPeer(server.address, port, job, 0, 1, open=False)
    stranger.send_frames(auth)
    stranger.sock.settimeout(5)
    assert stranger.sock.recv(65536) == b"", "the server closes it without a word"
    stranger.close()


def test_a_strangers_stream_cannot_push_into_a_job(server):
    job = 0x57_0003
    port = stream_port(server)
    owner = StreamPeer(server.address, port, job, 0, 2)
    other = StreamPeer(server.address, port, job, 1, 2)
    # Holds the pool credential but not the job's identity: admitted, then refused the job like on ZeroMQ.
    neighbour_credentials = ClientCredentials.for_servers(new_secret(), [os.environ["BPS_POOL_CREDENTIAL"]], "token")
    neighbour = StreamPeer(server.address, port, job, 1, 2, auth=neighbour_credentials)
    try:
        owner.hello()
        other.hello()
        sum_round([owner, other], key=2, round_=0)
        neighbour.incarnation = server.incarnation
        h, payload = neighbour.request(Command.PUSH, b"\x01" * KEY_BYTES, key=2, round=1, nbytes=KEY_BYTES, dtype=1)
        assert h.status == Status.UNKNOWN_JOB, (h, payload)
        sum_round([owner, other], key=2, round_=1)  # the round the neighbour tried to poison sums right
    finally:
        for p in (owner, other, neighbour):
            p.close()


def test_a_frame_over_the_bound_or_a_fifth_frame_closes_the_stream_and_the_server_serves_on(server):
    job = 0x57_0004
    port = stream_port(server)
    huge = StreamPeer(server.address, port, job, 0, 1)
    huge.sock.sendall((1 << 40).to_bytes(8, "little"))  # 1 TiB announced: never allocated
    assert huge.closed_by_server()
    before_auth = StreamPeer(server.address, port, job, 0, 1, open=False)
    before_auth.sock.sendall((1 << 20).to_bytes(8, "little"))  # a stranger may not send 1 MiB frames
    assert before_auth.closed_by_server()
    many = StreamPeer(server.address, port, job, 0, 1)
    many.send_frames([b"x"] * 5)
    assert many.closed_by_server()
    worker = StreamPeer(server.address, port, job, 0, 1)
    worker.hello()
    sum_round([worker], key=3, round_=0)
    worker.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=300), admitted=st.booleans())
def test_garbage_on_a_stream_never_hurts_the_server(server, garbage, admitted):
    job = 0x57_0005
    port = stream_port(server)
    peer = StreamPeer(server.address, port, job, 0, 1, open=admitted)
    peer.sock.sendall(garbage)
    peer.close()
    check = StreamPeer(server.address, port, job, 0, 1)
    h = check.hello()
    assert h.status == Status.OK and h.incarnation == server.incarnation
    check.close()


def test_a_stream_whose_worker_dies_loses_that_worker_for_its_job(server):
    job = 0x57_0006
    port = stream_port(server)
    waiter = RawPeer(server.address, job, 0, 2)
    dying = StreamPeer(server.address, port, job, 1, 2)
    waiter.hello()
    dying.hello()
    fields = dict(key=4, nbytes=KEY_BYTES, dtype=1)
    for p in (waiter, dying):
        assert p.request(Command.INIT, **fields)[0].status == Status.OK
    assert waiter.request(Command.PUSH, b"\x00" * KEY_BYTES, round=0, **fields)[0].status == Status.OK
    rid = waiter.send(Command.PULL, round=0, **fields)
    dying.sock.close()  # the worker's process is gone: its stream closes
    h, payload = waiter.recv(rid)
    assert h.status == Status.WORKER_LOST, (h, payload)
    assert b"worker 1" in payload[0]
    waiter.close()


def test_a_stream_that_never_authenticates_is_closed_after_10_s(server):
    port = stream_port(server)
    idle = socket.create_connection(("127.0.0.1", port))
    idle.settimeout(15)
    assert idle.recv(1) == b""
    idle.close()


def test_a_zeromq_peer_claiming_a_streams_identity_gets_nothing():
    server = ServerProcess()
    job = 0x57_0008
    victim = StreamPeer(server.address, stream_port(server), job, 0, 1)  # the server's first stream: number 1
    credentials = default_credentials(job, 1)
    spoofer = zmq.Context.instance().socket(zmq.DEALER)
    spoofer.setsockopt(zmq.LINGER, 0)
    spoofer.setsockopt(zmq.ROUTING_ID, b"\x00S" + (1).to_bytes(8, "little"))
    spoofer.plain_username, spoofer.plain_password = credentials.client.public, credentials.tokens[0]
    spoofer.connect(f"tcp://{server.address}")
    try:
        victim.hello()
        spoofer.send_multipart([Header(command=Command.HELLO, job_id=job, num_workers=1, request_id=9).pack()])
        victim.sock.settimeout(2)
        with pytest.raises(socket.timeout):
            victim.sock.recv(1)  # the spoofer's reply did not reach the stream it named
        h = victim.hello()  # and the stream works on
        assert h.status == Status.OK
    finally:
        victim.close()
        spoofer.close()
        server.stop()
