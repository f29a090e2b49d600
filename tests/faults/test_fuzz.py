"""A frame fuzzer: hypothesis throws malformed, truncated, oversized, replayed, wrong-job and
wrong-incarnation frames at a real server from authenticated and unauthenticated peers; afterwards the
server must be alive, within its memory bound, and still sum correctly for a legitimate job.

`make test` sends a bounded number of messages; `make stress` (marker `slow`) a much larger run.
"""

from __future__ import annotations

import os
import struct
import time

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import RawPeer, ServerProcess, push_pull_part, rss_bytes
from torch_bps.client import Client
from torch_bps.security import ClientCredentials, new_secret
from torch_bps.wire import MAGIC, VERSION, Command, Header, Mode

MB = 1 << 20
MAX_FRAME = 1 * MB
MAX_MEMORY = 48 * MB
SLACK = 48 * MB  # interpreter, torch and ZeroMQ growth, and frames queued per connection (32 x <= 1 MiB)
LEGIT_JOB = 0x1E617_0B  # never drawn by the strategies below
JOB_IDS = st.sampled_from([1, 2, 3, LEGIT_JOB + 1]) | st.integers(0, (1 << 64) - 1)
SMALL = st.integers(0, 8) | st.integers(0, (1 << 32) - 1)


@st.composite
def plausible(draw, incarnation: int) -> list[bytes]:
    """A request that is nearly right: a real command and job, small keys and rounds, sizes off by a little."""
    command = draw(st.sampled_from([Command.HELLO, Command.INIT, Command.PUSH, Command.PUSH, Command.PULL]))
    nbytes = draw(st.sampled_from([16, 16, 4096, 4097, 0, MAX_FRAME + 8]))
    sent = draw(st.sampled_from([nbytes, nbytes, max(nbytes - 1, 0), 0, 8])) if command == Command.PUSH else 0
    h = Header(
        command=command,
        dtype=draw(st.sampled_from([1, 1, 3, 7, 9])),
        worker=draw(st.integers(0, 2)),
        num_workers=draw(st.sampled_from([2, 2, 1, 3])) if command == Command.HELLO else 0,
        incarnation=draw(st.sampled_from([incarnation, incarnation, incarnation, 0, incarnation ^ 1])),
        job_id=draw(st.sampled_from([1, 2, 3])),
        key=draw(st.integers(0, 3)),
        round=draw(st.integers(0, 3)),
        request_id=draw(st.integers(0, 100)),
        nbytes=nbytes,
        # protocol 2: a key's mode, and the byte range a PUSH writes or a PULL reads (COPY: any, maybe overlapping)
        mode=draw(st.sampled_from([Mode.SUM, Mode.COPY, Mode.COPY, 2])),
        offset=draw(st.sampled_from([0, 0, 8, nbytes, max(nbytes - 4, 0), 2**64 - 1])),
        length=draw(st.sampled_from([sent, sent, nbytes, 0, 8, 2**64 - 1])),
        # protocol 3: a codec word on a key's requests, the control block on a HELLO
        codec=draw(st.sampled_from([0, 0, 0, 1, 0x102, 3])) if command != Command.HELLO else 0,
        dense_bytes=draw(st.sampled_from([0, nbytes, 64])) if command == Command.INIT else 0,
        backups=draw(st.sampled_from([0, 0, 1, 2])) if command == Command.HELLO else 0,
        window=draw(st.sampled_from([0, 0, 2, 3, 65])) if command == Command.HELLO else 0,
        staleness=draw(st.sampled_from([0, 0, 1, 2**64 - 1])) if command == Command.HELLO else 0,
    )
    payload = [b"\x01" * sent] if command == Command.PUSH else []
    return [h.pack(), *payload]


@st.composite
def broken(draw, incarnation: int) -> list[bytes]:
    """A header with any field values, or a malformed frame, and 0-3 payloads (some over the frame limit)."""
    kind = draw(st.sampled_from(["fields", "random", "truncated", "bad_magic", "bad_version", "version_2"]))
    h = Header(
        command=draw(st.sampled_from(list(Command)) | st.integers(0, 0xFFFF)),
        status=draw(st.sampled_from([0, 1, 0xFFFF])),
        dtype=draw(st.integers(0, 10)),
        worker=draw(SMALL),
        num_workers=draw(st.sampled_from([0, 4096, 4097]) | SMALL),
        incarnation=draw(st.sampled_from([incarnation, 0]) | st.integers(0, (1 << 64) - 1)),
        job_id=draw(JOB_IDS),
        key=draw(st.integers(0, (1 << 64) - 1)),
        round=draw(st.integers(0, (1 << 64) - 1)),
        nbytes=draw(st.sampled_from([MAX_FRAME, 8 * MB]) | st.integers(0, (1 << 64) - 1)),
        mode=draw(st.integers(0, 3) | st.integers(0, (1 << 32) - 1)),
        offset=draw(st.integers(0, (1 << 64) - 1)),
        length=draw(st.integers(0, (1 << 64) - 1)),
        codec=draw(SMALL),
        behind=draw(SMALL),
        dense_bytes=draw(st.integers(0, (1 << 64) - 1)),
        backups=draw(SMALL),
        window=draw(SMALL),
        stream=draw(SMALL),
        staleness=draw(st.integers(0, (1 << 64) - 1)),
    )
    data = h.pack()
    if kind == "random":
        data = draw(st.binary(max_size=200))
    elif kind == "truncated":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "bad_magic":
        data = struct.pack("<I", MAGIC ^ draw(st.integers(1, 0xFFFFFFFF))) + data[4:]
    elif kind == "bad_version":
        data = data[:4] + struct.pack("<H", VERSION + draw(st.integers(1, 100))) + data[6:]
    elif kind == "version_2":  # a version 2 peer's 96-byte header (or garbage claiming version 2), any length
        data = data[:4] + struct.pack("<H", 2) + data[6 : draw(st.sampled_from([96, 96, 6, 10, 72, 128, 200]))]
    sizes = draw(st.lists(st.sampled_from([0, 16, MAX_FRAME + 4096 + 1]) | st.integers(0, 70000), max_size=3))
    return [data, *(b"\x7f" * n for n in sizes)]


@st.composite
def messages(draw, incarnation: int) -> tuple[int, list[bytes], bool]:
    """(peer index, frames, replay: send it twice)."""
    frames = draw(plausible(incarnation) | broken(incarnation))
    return draw(st.integers(0, 3)), frames, draw(st.booleans())


class Fuzzing:
    """The server under fuzz and its four peers."""

    def __init__(self) -> None:
        limits = ("--max-frame-bytes", str(MAX_FRAME), "--max-memory-bytes", str(MAX_MEMORY), "--job-lease", "5")
        self.server = ServerProcess(extra_args=limits)
        self.rss_before = rss_bytes(self.server.proc.pid)
        self.job_secret = new_secret()
        pool = [os.environ["BPS_POOL_CREDENTIAL"]]
        self.peers = [
            RawPeer(self.server.address, auth=ClientCredentials.for_servers(self.job_secret, pool)),  # the job's own
            RawPeer(self.server.address, auth=ClientCredentials.for_servers(new_secret(), pool)),  # another job's
            RawPeer(self.server.address, auth=False),  # no credential at all
            RawPeer(self.server.address, auth=ClientCredentials.for_servers(new_secret(), ["another pool"])),
        ]
        self.sent = 0

    def send(self, peer: int, frames: list[bytes], replay: bool) -> None:
        sock = self.peers[peer].sock
        for _ in range(2 if replay else 1):
            try:  # a peer that cannot authenticate queues until its queue is full: never block on it
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            self.sent += 1
        for p in self.peers:  # drop whatever came back, never wait for it
            while p.sock.poll(0):
                p.sock.recv_multipart()

    def check(self) -> None:
        """Alive, inside the memory bound, and a legitimate job on the same server still sums right."""
        time.sleep(0.5)  # let queued frames reach the server
        assert self.server.alive()
        grown = rss_bytes(self.server.proc.pid) - self.rss_before
        assert grown < MAX_MEMORY + SLACK, f"server grew by {grown >> 20} MiB after {self.sent} messages"
        credentials = ClientCredentials.for_servers(self.job_secret, [os.environ["BPS_POOL_CREDENTIAL"]])
        clients = [Client([self.server.address], LEGIT_JOB, w, 2, timeout=30, auth=credentials) for w in range(2)]
        try:
            for rnd in range(3):
                ts = [torch.arange(20000, dtype=torch.float32) * (w + rnd) for w in range(2)]
                futures = [
                    push_pull_part(c, t.clone(), key) for c, t in zip(clients, ts, strict=True) for key in (0, 1)
                ]
                for f in futures:
                    assert torch.equal(f.wait(), ts[0] + ts[1])
                # and gathers: each worker writes its half of key 2, both read the whole
                outs = [torch.empty(40000, dtype=torch.float32) for _ in clients]
                futures = [push_pull_part(c, t, 2, out=o, mode=Mode.COPY, key_numel=40000, offset=20000 * w)
                           for w, (c, t, o) in enumerate(zip(clients, ts, outs, strict=True))]  # fmt: skip
                for f in futures:
                    assert torch.equal(f.wait(), torch.cat(ts))
        finally:
            for c in clients:
                c.close()

    def close(self) -> None:
        for p in self.peers:
            p.close()
        self.server.stop()


@pytest.fixture
def fuzzing():
    f = Fuzzing()
    yield f
    f.close()


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False, database=None)


def _fuzz_then_check(fuzzing: Fuzzing, examples: int, per_example: int) -> None:
    """Throw `examples` hypothesis examples of `per_example` messages each at the server, then check it: one test,
    so that the check never runs without the fuzzing before it (alone, or on another xdist worker)."""

    @settings(max_examples=examples, **_SETTINGS)
    @given(data=st.data())
    def fuzz(data):
        for _ in range(per_example):
            fuzzing.send(*data.draw(messages(fuzzing.server.incarnation)))

    fuzz()
    assert fuzzing.sent >= examples * per_example
    fuzzing.check()


@pytest.mark.timeout(240)
def test_fuzzed_frames_leave_the_server_alive_bounded_and_summing(fuzzing):
    _fuzz_then_check(fuzzing, 150, 10)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_stress(fuzzing):
    _fuzz_then_check(fuzzing, 2000, 25)
