"""Protocol version 2 on a real server, by hand: COPY keys (bytes gathered, never summed) and byte ranges
(a worker pushes only its shard, pulls only its shard), with the rounds, checks and counters of SUM keys."""

from __future__ import annotations

import re
import struct
import time

import pytest
import torch

from tests.helpers import RawPeer, ServerProcess
from torch_bps.server.limits import JOB_OVERHEAD, key_charge
from torch_bps.wire import STATS_FIELDS, Command, Mode, Status

pytestmark = pytest.mark.timeout(120)

U8, F32, F16, BF16 = 7, 1, 3, 4  # dtype codes of docs/protocol.md
# Every float32 NaN class and sign, infinities, -0.0 and a denormal: an addition would quiet the signalling
# NaN 0x7f800001 into 0x7fc00001; a copy keeps every bit.
PATTERNS = struct.pack("<8I", 0x7F800001, 0xFFBFFFFF, 0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 1, 0x3F800000)


def peers(server, job_id, n):
    ps = [RawPeer(server.address, job_id, w, n) for w in range(n)]
    for p in ps:
        assert p.hello().status == Status.OK
    return ps


def init(p, key, nbytes, mode=Mode.COPY, dtype=U8):
    h, rest = p.request(Command.INIT, key=key, nbytes=nbytes, dtype=dtype, mode=mode)
    assert h.status == Status.OK, rest
    return h


def put(p, key, rnd, nbytes, offset, data: bytes, mode=Mode.COPY, dtype=U8):
    """PUSH `data` at `offset`; return the reply (header, frames)."""
    return p.request(Command.PUSH, data, key=key, round=rnd, nbytes=nbytes, dtype=dtype, mode=mode, offset=offset)


def get(p, key, rnd, nbytes, offset=0, length=None, mode=Mode.COPY, dtype=U8):
    length = nbytes - offset if length is None else length
    return p.request(Command.PULL, key=key, round=rnd, nbytes=nbytes, dtype=dtype, mode=mode, offset=offset,
                     length=length)  # fmt: skip


def stats(p) -> dict[str, int]:
    h, rest = p.request(Command.STATS)
    return dict(zip(STATS_FIELDS, struct.unpack(f"<{len(STATS_FIELDS)}Q", rest[0]), strict=True))


def test_copy_round_gathers_every_bit_and_pulls_any_range(server, job_id):
    a, b, c = peers(server, job_id, 3)
    shards = [PATTERNS, b"", bytes(range(256)) * 3]  # worker 1 contributes nothing (a broadcast's non-root)
    nbytes = sum(map(len, shards))
    offsets = [0, len(PATTERNS), len(PATTERNS)]
    for p in (a, b, c):
        init(p, 5, nbytes)
    before = stats(a)
    for p, offset, data in zip((a, b, c), offsets, shards, strict=True):
        h, rest = put(p, 5, 0, nbytes, offset, data)
        assert h.status == Status.OK, rest
    whole = b"".join(shards)
    for p in (a, b):
        h, rest = get(p, 5, 0, nbytes)
        assert h.status == Status.OK and rest[0] == whole, rest
    h, rest = get(c, 5, 0, nbytes, offset=3, length=9)  # a range, as a reduce-scatter's shard
    assert h.status == Status.OK and rest[0] == whole[3:12] and (h.offset, h.length) == (3, 9)
    after = stats(a)
    assert after["bytes_in"] - before["bytes_in"] == nbytes  # each shard up once
    assert after["bytes_out"] - before["bytes_out"] == 2 * nbytes + 9
    assert after["bytes_summed"] == before["bytes_summed"]  # nothing was added
    # The round was freed (everyone pulled): the next one starts clean, zero-copy when one push covers the key.
    for p in (a, b, c):
        h, _ = put(p, 5, 1, nbytes, 0, whole[::-1] if p is a else b"")
        assert h.status == Status.OK
    h, rest = get(b, 5, 1, nbytes)
    assert rest[0] == whole[::-1]


def test_sum_key_pulls_only_a_shard(server, job_id):
    a, b = peers(server, job_id, 2)
    x = torch.arange(8, dtype=torch.float32)
    for p in (a, b):
        init(p, 1, 32, Mode.SUM, F32)
    before = stats(a)
    for p in (a, b):
        assert put(p, 1, 0, 32, 0, x.numpy().tobytes(), Mode.SUM, F32)[0].status == Status.OK
    shards = []
    for w, p in enumerate((a, b)):
        h, rest = get(p, 1, 0, 32, offset=16 * w, length=16, mode=Mode.SUM, dtype=F32)
        assert h.status == Status.OK, rest
        shards.append(torch.frombuffer(bytearray(rest[0]), dtype=torch.float32))
    assert torch.equal(torch.cat(shards), 2 * x)
    after = stats(a)
    assert (after["bytes_in"] - before["bytes_in"], after["bytes_out"] - before["bytes_out"]) == (64, 32)


def test_pushes_that_do_not_tile_fail_the_round_for_everyone_then_the_key_recovers(server, job_id):
    a, b = peers(server, job_id, 2)
    for p in (a, b):
        init(p, 2, 8)
    waiting = a.send(Command.PULL, key=2, round=0, nbytes=8, dtype=U8, mode=Mode.COPY, length=8)
    assert put(a, 2, 0, 8, 0, b"abcd")[0].status == Status.OK
    assert put(b, 2, 0, 8, 2, b"efgh")[0].status == Status.OK  # overlaps a's bytes 2..3, leaves 6..7 unwritten
    h, rest = a.recv(waiting)
    message = rest[0].decode()
    assert h.status == Status.KEY_MISMATCH and "round 0 do not tile its 8 bytes" in message, message
    assert "worker 0: [0, 4), worker 1: [2, 6)" in message and f"job {job_id:#x} key 2" in message
    h, rest = get(b, 2, 0, 8)
    assert h.status == Status.KEY_MISMATCH and "do not tile" in rest[0].decode()
    for p, offset in ((a, 0), (b, 4)):  # round 1 agrees: served as usual
        assert put(p, 2, 1, 8, offset, b"ABCD" if p is a else b"EFGH")[0].status == Status.OK
    assert get(b, 2, 1, 8)[1][0] == b"ABCDEFGH"


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(command=Command.PUSH, mode=Mode.SUM, dtype=F32), r"received 8 bytes of float32 \(SUM\)"),
        (dict(command=Command.PUSH, offset=6), r"bytes \[6, 10\) of a 8-byte key"),
        (dict(command=Command.PULL, offset=4, length=5), r"bytes \[4, 9\) of a 8-byte key"),
        (dict(command=Command.PULL, offset=2**64 - 1, length=2), r"bytes \[18446744073709551615, "),
        (dict(command=Command.PUSH, length=3), "header says 3 bytes, payload has 4"),
    ],
)
def test_requests_outside_the_declaration_are_refused_naming_key_round_worker(server, job_id, fields, words):
    (a,) = peers(server, job_id, 1)
    init(a, 3, 8)
    command = fields.pop("command")
    payload = [b"wxyz"] if command == Command.PUSH else []
    base = dict(key=3, round=0, nbytes=8, dtype=U8, mode=Mode.COPY, length=4)
    h, rest = a.request(command, *payload, **{**base, **fields})
    message = rest[0].decode()
    assert h.status == Status.KEY_MISMATCH, message
    assert f"of job {job_id:#x} key 3 round 0 by worker 0" in message
    assert re.search(words, message), message


def test_sum_keys_take_whole_pushes_and_init_checks_the_mode(server, job_id):
    (a,) = peers(server, job_id, 1)
    init(a, 4, 8, Mode.SUM, F32)
    h, rest = put(a, 4, 0, 8, 4, b"\0" * 4, Mode.SUM, F32)
    assert h.status == Status.KEY_MISMATCH and "a SUM key is pushed whole" in rest[0].decode()
    h, rest = a.request(Command.INIT, key=4, nbytes=8, dtype=F32, mode=Mode.COPY)
    assert h.status == Status.KEY_MISMATCH and "(SUM), received 8 bytes of float32 (COPY)" in rest[0].decode()
    h, rest = a.request(Command.INIT, key=6, nbytes=8, dtype=U8, mode=7)
    assert h.status == Status.KEY_MISMATCH and "unknown mode 7" in rest[0].decode()


def test_copy_rounds_keep_rounds_apart_and_refuse_a_third(server, job_id):
    a, b = peers(server, job_id, 2)
    for p in (a, b):
        init(p, 7, 4)
    assert put(a, 7, 0, 4, 0, b"r0r0")[0].status == Status.OK
    assert put(b, 7, 0, 4, 4, b"")[0].status == Status.OK
    assert get(a, 7, 0, 4)[1][0] == b"r0r0"
    assert put(a, 7, 1, 4, 0, b"r1r1")[0].status == Status.OK  # a is a round ahead; b has not pulled round 0
    h, rest = put(a, 7, 2, 4, 0, b"r2r2")
    assert h.status == Status.BAD_ROUND and "at most two rounds" in rest[0].decode()
    assert get(b, 7, 0, 4)[1][0] == b"r0r0"  # round 1 never touched round 0's bytes
    assert put(b, 7, 1, 4, 4, b"")[0].status == Status.OK
    assert get(b, 7, 1, 4)[1][0] == b"r1r1"


def test_a_worker_lost_mid_gather_fails_the_pulls_naming_it(server, job_id):
    a, b = peers(server, job_id, 2)
    for p in (a, b):
        init(p, 8, 8)
    assert put(a, 8, 0, 8, 0, b"mine")[0].status == Status.OK
    waiting = a.send(Command.PULL, key=8, round=0, nbytes=8, dtype=U8, mode=Mode.COPY, length=8)
    b.close()  # never pushes its half
    t0 = time.monotonic()
    h, rest = a.recv(waiting)
    message = rest[0].decode()
    assert h.status == Status.WORKER_LOST and time.monotonic() - t0 < 3, message
    assert f"pull of job {job_id:#x} key 8 round 0 by worker 0" in message
    assert f"worker 1 of job {job_id:#x} (at 127.0.0.1) disconnected before pushing it" in message
    a.close()


def test_16_bit_sum_keys_are_charged_their_fp32_accumulators():
    # Each of a bf16 SUM key's two live rounds sums in an fp32 accumulator twice the key's size (a COPY key of
    # bf16 bytes has none).
    nbytes = 1 << 20
    bf16 = key_charge(nbytes, 2, dtype=BF16)
    assert bf16 == key_charge(nbytes, 2) + 4 * nbytes == key_charge(nbytes, 2, dtype=F16)
    assert key_charge(nbytes, 2, dtype=BF16, mode=Mode.COPY) == key_charge(nbytes, 2)
    assert key_charge(nbytes, 2, 4, BF16) == key_charge(nbytes, 2, 4) + 8 * nbytes  # a window of 4 rounds
    server = ServerProcess(extra_args=("--job-quota-bytes", str(JOB_OVERHEAD + bf16)))
    try:
        a = RawPeer(server.address, 0xB16, 0, 2)
        a.hello()
        h, rest = a.request(Command.INIT, key=2, nbytes=nbytes + 2, dtype=BF16, mode=Mode.SUM)
        assert h.status == Status.OVER_QUOTA and "over its quota" in rest[0].decode()
        init(a, 1, nbytes, Mode.SUM, BF16)  # exactly the quota
        h, rest = a.request(Command.INIT, key=3, nbytes=1, dtype=U8, mode=Mode.COPY)
        assert h.status == Status.OVER_QUOTA and "over its quota" in rest[0].decode()
        a.close()
    finally:
        server.stop()


def test_copy_keys_are_charged_like_sum_keys():
    quota = JOB_OVERHEAD + key_charge(1 << 20, 2)
    server = ServerProcess(extra_args=("--job-quota-bytes", str(quota)))
    try:
        a = RawPeer(server.address, 0xC0FF, 0, 2)
        a.hello()
        init(a, 1, 1 << 20)  # exactly the quota
        h, rest = a.request(Command.INIT, key=2, nbytes=1, dtype=U8, mode=Mode.COPY)
        assert h.status == Status.OVER_QUOTA and "over its quota" in rest[0].decode()
        a.close()
    finally:
        server.stop()
