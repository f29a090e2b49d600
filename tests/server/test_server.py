"""The summation server, spoken to by hand over real sockets (pyzmq DEALER peers, a real server process)."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import PROTOCOL_CODES, REPO, RawPeer, ServerProcess, declare, error_of, peers, pull, push
from torch_bps.wire import DTYPES, HEADER, HEADER_SIZE, MAGIC, REPLY, STATS_FIELDS, VERSION, Command, Header, Status

pytestmark = pytest.mark.timeout(120)


def test_hello_returns_incarnation_and_checks_worker_count(server, job_id):
    a, b = peers(server, job_id, 2)
    assert a.incarnation == server.incarnation == b.incarnation
    liar = RawPeer(server.address, job_id, 0, 3)
    status, msg = error_of(liar.request(Command.HELLO, num_workers=3))
    assert status == Status.JOB_MISMATCH and "declared with 2" in msg
    out_of_range = RawPeer(server.address, job_id + 1, 5, 2)
    assert error_of(out_of_range.request(Command.HELLO, num_workers=2))[0] == Status.JOB_MISMATCH


V2_HEADER = struct.Struct("<IHHHHIIIII8Q")  # protocol version 2's 96-byte header, as a version 2 worker packs it


def test_a_version_2_worker_is_refused_in_its_own_framing_naming_both_versions(server, job_id):
    """A version 2 HELLO (num_workers at 16, backups in `mode`) gets a reply a version 2 worker can read: its own
    96-byte header back, BAD_VERSION, its request_id, and a message naming both versions. The server serves on."""
    old = RawPeer(server.address, job_id, 0, 2)
    hello = V2_HEADER.pack(MAGIC, 2, Command.HELLO, 0, 0, 0, 2, 0, 1, 4, 0, job_id, 0, 0, 41, 0, 0, 0)
    old.send_frames([hello])
    assert old.sock.poll(5000), "a version 2 worker waits for no reply"
    reply, message = old.sock.recv_multipart()
    assert len(reply) == 96 and V2_HEADER.unpack(reply)[:4] == (MAGIC, 2, Command.HELLO | REPLY, Status.BAD_VERSION)
    assert V2_HEADER.unpack(reply)[14] == 41  # its request_id
    assert "protocol version 2, this side speaks 3" in message.decode()
    assert RawPeer(server.address, job_id, 0, 1).hello().status == Status.OK  # nothing of the job was made


@pytest.mark.parametrize("backups, rounds, words", [(2, 4, "2 backup workers of 2"), (1, 65, "65 live rounds"),
                                                    (1, 1, "1 live rounds"), (0, 3, "3 live rounds"),
                                                    (2**32 - 1, 2**32 - 1, "backup workers of 2")])  # fmt: skip
def test_a_hello_asking_for_backups_or_a_window_the_job_cannot_have_is_refused(server, job_id, backups, rounds, words):
    peer = RawPeer(server.address, job_id, 0, 2)
    status, msg = error_of(peer.request(Command.HELLO, num_workers=2, backups=backups, window=rounds))
    assert status == Status.JOB_MISMATCH and words in msg, msg
    assert peer.hello().status == Status.OK  # the job was never made: a sound HELLO makes it


UNBOUNDED = 2**64 - 1  # a HELLO's staleness that bounds nothing
MODEL = 2  # a key's mode: a running total, each worker's pushes added in order and once


def _hello(p, **fields) -> tuple[int, str]:
    h, rest = p.request(Command.HELLO, num_workers=p.num_workers, **fields)
    p.incarnation = h.incarnation
    return error_of((h, rest))


def _model_request(p, command, rnd, t=None, nbytes=16):
    data = [t.view(torch.uint8).numpy().tobytes()] if t is not None else []
    return p.request(command, *data, key=3, round=rnd, nbytes=nbytes, dtype=1, mode=MODEL)


def test_a_model_key_adds_every_workers_updates_once_and_in_order(server, job_id):
    a, b = (RawPeer(server.address, job_id, w, 2) for w in range(2))
    for p in (a, b):
        assert _hello(p, staleness=UNBOUNDED)[0] == Status.OK
        assert _model_request(p, Command.INIT, 0)[0].status == Status.OK
    one = torch.ones(4)
    assert _model_request(a, Command.PUSH, 0, one)[0].status == Status.OK
    assert _model_request(a, Command.PUSH, 0, one)[0].status == Status.OK  # resent: never added twice
    status, msg = error_of(_model_request(a, Command.PUSH, 2, one))  # skips round 1: an update would be lost
    assert status == Status.BAD_ROUND and "its round 1 was never pushed" in msg
    assert _model_request(b, Command.PUSH, 0, 2 * one)[0].status == Status.OK
    assert _model_request(a, Command.PUSH, 1, 4 * one)[0].status == Status.OK
    h, rest = _model_request(b, Command.PULL, 0)
    assert h.status == Status.OK and torch.equal(torch.frombuffer(bytearray(rest[0]), dtype=torch.float32), 7 * one)


def test_model_keys_and_staleness_a_job_cannot_have_are_refused(server, job_id):
    peer = RawPeer(server.address, job_id, 0, 2)
    status, msg = _hello(peer, backups=1, staleness=2)
    assert status == Status.JOB_MISMATCH and "1 backup workers and staleness 2" in msg, msg
    assert _hello(peer, staleness=2)[0] == Status.OK
    other = RawPeer(server.address, job_id, 1, 2)  # mixing modes within one job: refused, naming both
    status, msg = _hello(other, staleness=UNBOUNDED)
    assert status == Status.JOB_MISMATCH and f"staleness {UNBOUNDED}, but" in msg and "and 2" in msg, msg
    status, msg = error_of(peer.request(Command.INIT, key=3, nbytes=8, dtype=5, mode=MODEL))  # int32
    assert status == Status.KEY_MISMATCH and "a MODEL key is float32 or float64, not int32" in msg, msg
    assert _model_request(peer, Command.INIT, 0)[0].status == Status.OK
    status, msg = error_of(peer.request(Command.PUSH, b"\0" * 8, key=3, nbytes=16, dtype=1, mode=MODEL, length=8))
    assert status == Status.KEY_MISMATCH and "a MODEL key is pushed whole" in msg, msg


@pytest.mark.parametrize("dtype", list(PROTOCOL_CODES), ids=lambda d: str(d).removeprefix("torch."))
def test_sum_of_three_workers(server, job_id, dtype):
    ps = peers(server, job_id, 3)
    # Floats: multiples of 1/8 with sums up to 31.5 (8 significant bits): exact even in bf16, yet with low bits
    # set, so a sum done in another type is seen. Integers: the same without the 1/8.
    unit = 0.125 if dtype.is_floating_point else 1
    data = [((torch.arange(1000) % 43) * (w + 1) * unit).to(dtype) for w in range(3)]
    declare(ps, 7, data[0])
    for p, t in zip(ps, data, strict=True):
        assert push(p, 7, 0, t)[0].status == Status.OK
    expected = data[0] + data[1] + data[2]  # exact for floats; integers wrap (int8) as the server's add does
    for p in ps:
        assert torch.equal(pull(p, 7, 0, data[0]), expected)


def test_pull_waits_for_every_worker_and_duplicates_never_count(server, job_id):
    a, b = peers(server, job_id, 2)
    t = torch.ones(10)
    declare([a, b], 1, t)
    push(a, 1, 0, t)
    push(a, 1, 0, t)  # resent: must neither close the round nor be added twice
    rid = a.send(Command.PULL, key=1, round=0, nbytes=40, dtype=PROTOCOL_CODES[torch.float32])
    with pytest.raises(TimeoutError):
        RawPeer.recv_any(_with_timeout(a, 0.3))
    push(b, 1, 0, 2 * t)
    h, rest = a.recv(rid)
    assert h.status == Status.OK and torch.equal(torch.frombuffer(bytearray(rest[0]), dtype=torch.float32), 3 * t)


def _with_timeout(peer, seconds):
    peer.timeout_ms = int(seconds * 1000)
    return peer


def test_rounds_never_mix_when_a_fast_worker_runs_ahead(server, job_id):
    fast, slow = peers(server, job_id, 2)
    t = torch.zeros(100)
    declare([fast, slow], 3, t)
    push(fast, 3, 0, t + 1)
    push(slow, 3, 0, t + 10)
    assert torch.equal(pull(fast, 3, 0, t), t + 11)
    push(fast, 3, 1, t + 100)  # round 1 starts while slow has not pulled round 0
    assert torch.equal(pull(slow, 3, 0, t), t + 11)  # round 0 untouched by round 1's push
    push(slow, 3, 1, t + 1000)
    assert torch.equal(pull(slow, 3, 1, t), t + 1100)
    assert torch.equal(pull(fast, 3, 1, t), t + 1100)


def test_at_most_two_rounds_alive(server, job_id):
    fast, slow = peers(server, job_id, 2)
    t = torch.ones(4)
    declare([fast, slow], 9, t)
    push(fast, 9, 0, t)
    push(slow, 9, 0, t)
    pull(fast, 9, 0, t)
    push(fast, 9, 1, t)
    status, msg = error_of(push(fast, 9, 2, t))  # slow never pulled round 0
    assert status == Status.BAD_ROUND and "oldest live round is 0" in msg and "key 9" in msg
    pull(slow, 9, 0, t)  # frees round 0
    status, msg = error_of(push(slow, 9, 0, t))
    assert status == Status.BAD_ROUND and "already completed" in msg


def test_mismatched_size_or_dtype_is_refused_and_others_keep_working(server, job_id):
    a, b = peers(server, job_id, 2)
    t = torch.ones(8)
    declare([a], 4, t)
    status, msg = error_of(b.request(Command.INIT, key=4, nbytes=64, dtype=PROTOCOL_CODES[torch.float32]))
    assert status == Status.KEY_MISMATCH and "expected 32 bytes of float32" in msg and "received 64 bytes" in msg
    # a pushed round 0 and waits for the sum; b's push has the wrong dtype: refused, and a's pull fails
    # at once instead of waiting for a push that can never come.
    push(a, 4, 0, t)
    rid = a.send(Command.PULL, key=4, round=0, nbytes=32, dtype=PROTOCOL_CODES[torch.float32])
    status, msg = error_of(push(b, 4, 0, torch.ones(4, dtype=torch.float64)))
    assert status == Status.KEY_MISMATCH and "key 4" in msg and "float64" in msg
    status, msg = error_of(a.recv(rid))
    assert status == Status.KEY_MISMATCH and "another worker's push was refused" in msg and "float64" in msg
    status, _ = error_of(b.request(Command.PULL, key=4, round=0, nbytes=32, dtype=PROTOCOL_CODES[torch.float32]))
    assert status == Status.KEY_MISMATCH
    bad_len = b.request(Command.PUSH, b"\0" * 31, key=4, round=1, nbytes=32, dtype=PROTOCOL_CODES[torch.float32])
    assert error_of(bad_len)[0] == Status.KEY_MISMATCH
    # The failed rounds close and free; the key works again once the workers agree.
    error_of(a.request(Command.PULL, key=4, round=1, nbytes=32, dtype=PROTOCOL_CODES[torch.float32]))
    push(a, 4, 2, t)
    push(b, 4, 2, t)
    assert torch.equal(pull(b, 4, 2, t), 2 * t)
    assert torch.equal(pull(a, 4, 2, t), 2 * t)
    other = peers(server, job_id + 99, 1)
    declare(other, 4, t)
    push(other[0], 4, 0, t)
    assert torch.equal(pull(other[0], 4, 0, t), t)  # other jobs never noticed


def test_unknown_key_job_and_incarnation(server, job_id):
    (a,) = peers(server, job_id, 1)
    assert error_of(push(a, 12345, 0, torch.ones(2)))[0] == Status.UNKNOWN_KEY
    stranger = RawPeer(server.address, job_id + 7, 0, 1)
    stranger.incarnation = server.incarnation
    assert error_of(push(stranger, 1, 0, torch.ones(2)))[0] == Status.UNKNOWN_JOB
    a.incarnation ^= 0xFF
    status, msg = error_of(push(a, 1, 0, torch.ones(2)))
    assert status == Status.WRONG_INCARNATION and "restarted" in msg


def test_two_jobs_share_a_server_with_the_same_keys(server, job_id):
    j1 = peers(server, job_id, 1)
    j2 = peers(server, job_id + 1, 2)
    declare(j1, 0, torch.ones(3))
    declare(j2, 0, torch.ones(5))  # same key, other job, other size
    push(j1[0], 0, 0, torch.ones(3))
    for p in j2:
        push(p, 0, 0, torch.ones(5))
    assert torch.equal(pull(j1[0], 0, 0, torch.ones(3)), torch.ones(3))
    assert torch.equal(pull(j2[1], 0, 0, torch.ones(5)), 2 * torch.ones(5))


def test_stats_count_pushes_and_summed_bytes(server, job_id):
    ps = peers(server, job_id, 2)
    t = torch.ones(1 << 16)
    declare(ps, 0, t)
    before = _stats(ps[0])
    for p in ps:
        push(p, 0, 0, t)
    pull(ps[0], 0, 0, t)
    after = _stats(ps[0])
    assert after["pushes"] - before["pushes"] == 2
    assert after["bytes_summed"] - before["bytes_summed"] == t.numel() * 4  # one add of the second push
    assert after["sum_ns"] > before["sum_ns"]


def _stats(p):
    h, rest = p.request(Command.STATS)
    assert h.status == Status.OK
    return dict(zip(STATS_FIELDS, struct.unpack(f"<{len(STATS_FIELDS)}Q", rest[0]), strict=True))


def test_restarted_server_refuses_old_incarnation(job_id):
    s = ServerProcess()
    try:
        (a,) = peers(s, job_id, 1)
        declare([a], 0, torch.ones(2))
        s.restart()
        status, msg = error_of(push(a, 0, 0, torch.ones(2)))
        assert status == Status.WRONG_INCARNATION, msg
    finally:
        s.stop()


frames_strategy = st.lists(st.binary(max_size=100), min_size=0, max_size=4)
header_fields = st.fixed_dictionaries(
    {
        "command": st.integers(0, 0xFFFF),
        "status": st.integers(0, 0xFFFF),
        "dtype": st.integers(0, 0xFFFF),
        "worker": st.integers(0, 0xFFFFFFFF),
        "num_workers": st.integers(0, 0xFFFFFFFF),
        "codec": st.sampled_from([0, 1, 0x102, 3]) | st.integers(0, 0xFFFFFFFF),
        "backups": st.sampled_from([0, 1]) | st.integers(0, 0xFFFFFFFF),
        "window": st.sampled_from([0, 2, 3]) | st.integers(0, 0xFFFFFFFF),
        "staleness": st.sampled_from([0, 2**64 - 1]) | st.integers(0, 2**64 - 1),
        "dense_bytes": st.integers(0, 2**64 - 1),
        "incarnation": st.integers(0, 2**64 - 1),
        "job_id": st.integers(0, 2**64 - 1),
        "key": st.integers(0, 2**64 - 1),
        "round": st.integers(0, 2**64 - 1),
        "request_id": st.integers(0, 2**64 - 1),
        "nbytes": st.integers(0, 2**64 - 1),
        "mode": st.sampled_from([0, 1, 2]) | st.integers(0, 0xFFFFFFFF),
        "offset": st.sampled_from([0, 1]) | st.integers(0, 2**64 - 1),
        "length": st.sampled_from([0, 4]) | st.integers(0, 2**64 - 1),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    frames=frames_strategy,
    fields=header_fields,
    payload=st.lists(st.binary(max_size=64), max_size=2),
    version=st.sampled_from([2, 2, 1, 3]),
)
def test_garbage_never_crashes_the_server(server, frames, fields, payload, version):
    """Random frames and random well-formed-but-wrong headers: every one is answered or dropped, never fatal."""
    peer = RawPeer(server.address, timeout=5)
    try:
        if frames:
            peer.send_frames(frames)
            h, rest = peer.recv_any()
            assert h.status == Status.BAD_FRAME and h.command == REPLY and rest
        values = [MAGIC, version, *[fields[k] for k in ("command", "status", "dtype", "worker", "codec")], 0]
        values += [fields["mode"], 0]
        values += [fields[k] for k in ("incarnation", "job_id", "key", "round", "request_id", "nbytes", "offset")]
        values += [fields[k] for k in ("length", "dense_bytes", "num_workers", "backups", "window")]
        values += [0, fields["staleness"]]
        peer.send_frames([HEADER.pack(*values), *payload])
        if not peer.sock.poll(peer.timeout_ms):
            raise TimeoutError("no reply")
        raw = peer.sock.recv_multipart()[0]  # another version's request is answered in its framing: read it raw
        status, request_id = struct.unpack_from("<H", raw, 8)[0], struct.unpack_from("<Q", raw, 64)[0]
        # Either a well-formed reply to that request, or a refusal.
        assert request_id == fields["request_id"] or status != Status.OK
        assert version == VERSION or (status == Status.BAD_VERSION and raw[10:] == HEADER.pack(*values)[10:])
    finally:
        peer.close()
    # The server survives: a fresh HELLO is answered.
    probe = RawPeer(server.address, job_id=2**63 + 1, timeout=5)
    assert probe.hello().status == Status.OK
    probe.close()


def test_dtype_table_matches_protocol_doc():
    assert {c: str(d).removeprefix("torch.") for c, d in DTYPES.items()} == {
        1: "float32", 2: "float64", 3: "float16", 4: "bfloat16", 5: "int32", 6: "int64", 7: "uint8", 8: "int8",
    }  # fmt: skip
    assert HEADER_SIZE == 128
    h = Header(command=Command.PUSH, worker=3, job_id=9, key=5, round=2, request_id=11, nbytes=400, mode=1, offset=8,
               length=16)  # fmt: skip
    assert Header.unpack(h.pack()) == h


def _pushed(peer: RawPeer, key: int, data: torch.Tensor) -> None:
    """INIT and PUSH round 0 of key (float32)."""
    nbytes = data.numel() * 4
    h, _ = peer.request(Command.INIT, key=key, nbytes=nbytes, dtype=PROTOCOL_CODES[torch.float32])
    assert h.status == Status.OK, h
    h, _ = peer.request(
        Command.PUSH, data.numpy().tobytes(), key=key, nbytes=nbytes, dtype=PROTOCOL_CODES[torch.float32]
    )
    assert h.status == Status.OK, h


def test_a_disconnected_worker_fails_waiting_pulls_naming_it_and_closed_rounds_still_answer(server, job_id):
    a, b = RawPeer(server.address, job_id, 0, 2), RawPeer(server.address, job_id, 1, 2)
    a.hello(), b.hello()
    _pushed(a, 1, torch.ones(4))
    _pushed(b, 1, torch.ones(4))  # round 0 of key 1 closes: b's leaving must not fail it
    _pushed(a, 2, torch.ones(4))  # b never pushes key 2
    waiting = a.send(Command.PULL, key=2, nbytes=16, dtype=PROTOCOL_CODES[torch.float32])
    b.close()
    t0 = time.monotonic()
    h, rest = a.recv(waiting)
    assert h.status == Status.WORKER_LOST and time.monotonic() - t0 < 3, (h, rest)
    assert f"worker 1 of job {job_id:#x} (at 127.0.0.1) disconnected" in rest[0].decode(), rest
    h, rest = a.request(Command.PULL, key=1, nbytes=16, dtype=PROTOCOL_CODES[torch.float32])
    assert h.status == Status.OK and torch.equal(
        torch.frombuffer(bytearray(rest[0]), dtype=torch.float32), 2 * torch.ones(4)
    )
    a.close()


def test_a_pull_waiting_past_its_wait_ms_names_the_workers_that_have_not_pushed(server, job_id):
    a = RawPeer(server.address, job_id, 0, 3)
    a.hello()
    idle = RawPeer(server.address, job_id, 2, 3)  # says HELLO, never pushes (and stays connected)
    idle.hello()
    _pushed(a, 1, torch.ones(4))
    t0 = time.monotonic()
    h, rest = a.request(Command.PULL, key=1, nbytes=16, dtype=PROTOCOL_CODES[torch.float32], wait_ms=500)
    took = time.monotonic() - t0
    message = rest[0].decode()
    assert h.status == Status.ROUND_TIMEOUT and 0.5 <= took < 2, (h, took)
    assert "waiting for 2 of 3 workers" in message and "worker 1 (never said HELLO" in message, message
    assert "worker 2 (at 127.0.0.1, last request" in message, message
    a.close(), idle.close()


def test_a_stopped_worker_is_lost_after_the_heartbeat_timeout():
    """SIGSTOP: the process keeps its connection open but answers no heartbeat."""
    srv = ServerProcess(extra_args=("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1"))
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from tests.helpers import RawPeer; "
        "p = RawPeer(sys.argv[2], 5, 1, 2); p.hello(); print('ready', flush=True); time.sleep(120)"
    )
    stopped = subprocess.Popen([sys.executable, "-c", script, REPO, srv.address], stdout=subprocess.PIPE, text=True)
    try:
        assert stopped.stdout.readline().strip() == "ready"
        a = RawPeer(srv.address, 5, 0, 2)
        a.hello()
        _pushed(a, 1, torch.ones(4))
        waiting = a.send(Command.PULL, key=1, nbytes=16, dtype=PROTOCOL_CODES[torch.float32])
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        h, rest = a.recv(waiting)
        took = time.monotonic() - t0
        print(f"stopped worker lost after {took:.2f} s")
        assert h.status == Status.WORKER_LOST and 0.5 < took < 5, (h, took, rest)
        assert "worker 1 of job 0x5" in rest[0].decode()
        a.close()
    finally:
        stopped.kill()
        stopped.wait()
        srv.stop()
