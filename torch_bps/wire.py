"""The wire format shared by the summation server and the push/pull client.

Every message is a ZeroMQ multipart message: one fixed 128-byte header frame, then at most one frame of
payload (raw tensor bytes, a UTF-8 error message, or a fixed table of counters). Nothing received from
a peer is ever unpickled. docs/protocol.md is the normative description; this module and
cpp_ext/transport/wire.h must agree with it byte for byte (tests/transport/test_wire.py checks the C++ side).

Buffer lifetime: a payload sent zero-copy must stay untouched until ZeroMQ releases it (the C++ client
holds a tensor reference until then; the server sends only tensors it never writes again).

May import: the standard library, torch (for dtype codes) and torch_bps.errors only.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from torch_bps.errors import ProtocolError

MAGIC = 0x31535042  # b"BPS1" little-endian
VERSION = 3
# magic, version, command, status, dtype, worker, codec, wait_ms, mode, behind, then 9 u64s (incarnation ..
# dense_bytes); then the control block: num_workers, backups, window, stream, staleness
HEADER = struct.Struct("<IHHHHIIIII9QIIIIQ")
HEADER_SIZE = HEADER.size  # 128
# Magic, version, command and status sit at bytes 0-9 in every version: a peer of another version is told so in its
# own framing (docs/protocol.md, "Versions").
VERSIONED_PREFIX = 10
REPLY = 0x80  # a reply's command is the request's command | REPLY


class Command(enum.IntEnum):
    HELLO = 1  # worker introduces itself: job_id, worker, num_workers
    INIT = 2  # declare a key: nbytes and dtype; idempotent, checked across workers
    PUSH = 3  # SUM key: add payload into (job, key, round); COPY key: write it at `offset`
    PULL = 4  # fetch bytes [offset, offset + length) of (job, key, round); answered once every worker pushed it
    STATS = 5  # server counters, for tests and benchmarks


# A HELLO reply's `stream`: the stream port (bits 0-15), and this bit if the server also listens on its local
# stream, an abstract unix socket named after its incarnation (docs/protocol.md, "The stream transport").
STREAM_LOCAL = 1 << 16
# The peer address a server's core gives a request that came on its local stream (no IP: a unix socket).
LOCAL_PEER = "local"


class Status(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1  # malformed header, wrong magic, wrong frame count
    BAD_VERSION = 2
    BAD_COMMAND = 3
    WRONG_INCARNATION = 4  # the request belongs to an earlier start of this server
    UNKNOWN_JOB = 5  # no HELLO for this job yet
    JOB_MISMATCH = 6  # HELLO disagrees with the job's worker count, or worker id out of range
    UNKNOWN_KEY = 7
    KEY_MISMATCH = 8  # size or dtype differs from the key's declaration
    BAD_ROUND = 9  # round already freed, or too far ahead
    INTERNAL = 10
    WORKER_LOST = 11  # the round can never close: a worker of the job disconnected before pushing it
    ROUND_TIMEOUT = 12  # a PULL waited its wait_ms for workers that have not pushed
    OVER_QUOTA = 16  # the job's memory quota or the server's bound would be exceeded (see server/limits.py)


class Mode(enum.IntEnum):
    """What a key's rounds do with pushes, fixed by its INIT."""

    SUM = 0  # every worker pushes the whole key; the round's result is the sum
    COPY = 1  # each worker writes a byte range (maybe empty); the ranges must tile the key; bytes are copied
    MODEL = 2  # each worker's pushes are added, in order and once each, into one running total (asynchronous)


class Codec(enum.IntEnum):
    """How a compressed SUM key's pushes and pulls are laid out (docs/protocol.md, "Compressed keys"). A key's codec
    word (INIT/PUSH/PULL's `codec` field) is the codec in bits 0-7 and, for TOPK, the row width in bits 8-31."""

    NONE = 0
    ONEBIT = 1  # an fp32 scale, then a sign bit per element (1: negative), padded to 4 bytes
    TOPK = 2  # k u32 row indices, then k rows of `width` fp32 values
    RANDOMK = 3  # k fp32 values at random_indices(key, round, n, k)


def codec_word(codec: Codec, width: int = 1) -> int:
    """Return the codec word of a key (0 for an uncompressed one). Example: codec_word(Codec.TOPK) == 0x102."""
    return int(codec) | (width << 8 if codec == Codec.TOPK else 0)


def codec_name(word: int) -> str:
    """Name a codec word as error messages do ("onebit", "topk (width 1)", "no codec")."""
    codec = word & 0xFF
    if codec == Codec.TOPK:
        return f"topk (width {word >> 8})"
    return {0: "no codec", 1: "onebit", 3: "randomk"}.get(codec, f"codec {codec}")


def codec_wire_bytes(word: int, elements: int, k: int = 0) -> int:
    """Return the bytes a push and a pull of a key of `elements` fp32 carry under `word` (k: rows or values sent)."""
    codec, width = word & 0xFF, word >> 8 or 1
    if codec == Codec.ONEBIT:
        return 4 + 4 * -(-elements // 32)
    return 4 * k * (1 + width) if codec == Codec.TOPK else 4 * k


def check_codec(word: int, dense_bytes: int, wire_bytes: int) -> str:
    """Return why a key of `dense_bytes` (fp32) carrying `wire_bytes` cannot have codec `word`, or ""."""
    codec, width, n = word & 0xFF, word >> 8, dense_bytes // 4
    if n == 0:
        return "a compressed key holds at least one fp32 element"
    if codec == Codec.ONEBIT:
        want = codec_wire_bytes(word, n)
        return "" if wire_bytes == want else f"onebit over {n} elements carries {want} bytes, not {wire_bytes}"
    if codec == Codec.TOPK:
        row = 4 * (1 + width)
        if width == 0 or n % width:
            return f"topk rows of width {width} do not divide {n} elements"
        if wire_bytes % row or not 0 < wire_bytes // row <= n // width:
            return f"topk carries 1 to {n // width} rows of {row} bytes, not {wire_bytes} bytes"
        return ""
    if codec == Codec.RANDOMK:
        if wire_bytes % 4 or not 0 < wire_bytes // 4 <= n:
            return f"randomk carries 1 to {n} fp32 values, not {wire_bytes} bytes"
        return ""
    return f"unknown codec {codec} (1: onebit, 2: topk, 3: randomk)"


_U64_MASK = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _U64_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64_MASK
    return z ^ (z >> 31)


def random_indices(key: int, round_: int, n: int, k: int) -> torch.Tensor:
    """Return random-k's k distinct indices (int64) of a key's round, as both ends derive them: (a + i * s) mod n,
    with a and s (coprime with n) drawn from (key, round) by splitmix64. No index travels."""
    h1 = _splitmix((key * 0x9E3779B97F4A7C15 + round_) & _U64_MASK)
    h2 = _splitmix(h1)
    a, s = h1 % n, (h2 % n) | 1
    while math.gcd(s, n) != 1:
        s += 2
    return (a + torch.arange(k, dtype=torch.int64) * (s % n)) % n


# dtype codes on the wire; the table is part of the protocol (never renumber).
DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float64,
    3: torch.float16,
    4: torch.bfloat16,
    5: torch.int32,
    6: torch.int64,
    7: torch.uint8,
    8: torch.int8,
}
DTYPE_CODES: dict[torch.dtype, int] = {dt: code for code, dt in DTYPES.items()}

# STATS payload: this many little-endian uint64 counters, in this order (docs/protocol.md says what each counts).


class Partition(NamedTuple):
    """One partition of a collective, the one record the engine, the failover router and the client pass around:
    push `tensor` into `key` at element `offset` and pull the key's result from element `out_offset` into `out`.

    A SUM key is pushed whole (offset 0, `tensor` of `key_numel` elements) and pulled into `out` (default:
    `tensor` itself); a COPY key takes each worker's range at its offset and needs `out`. `server` indexes the
    client's servers (None: `key % servers`). The C++ client's PartSpec (cpp_ext/client/options.h) is this record:
    the same fields, in this order and unit (elements); it checks once that a partition fits its key.

    Example: `Partition(grad[:n], key=7, server=0)` sums `grad[:n]` in place.
    """

    tensor: torch.Tensor
    key: int
    server: int | None = None
    out: torch.Tensor | None = None
    mode: Mode = Mode.SUM
    key_numel: int | None = None  # default: tensor.numel()
    offset: int = 0
    out_offset: int = 0
    codec: int = 0  # a compressed key's codec word: `tensor` and `out` then hold its encoded bytes (as fp32)
    dense_numel: int = 0  # a compressed key's fp32 elements, which the encoded bytes stand for


STATS_FIELDS = ("pushes", "pulls", "bytes_in", "bytes_out", "bytes_summed", "sum_ns", "errors", "sums", "requests",
                "wakeups", "keys_waiting", "jobs", "memory_charged", "resident_bytes")  # fmt: skip


@dataclass(frozen=True)
class Header:
    """One message header, its fields in wire order; each has one meaning (docs/protocol.md's table). Replies echo
    request_id, job_id, key and round of the request.

    The last five are the control block (ps-lite's `Meta.control`): what a HELLO says about its job and what the
    reply offers; zero on every other message.
    """

    command: int
    status: int = 0
    dtype: int = 0
    worker: int = 0
    codec: int = 0  # INIT/PUSH/PULL: the key's codec word (0: uncompressed)
    wait_ms: int = 0  # PULL: how long the server may hold it before answering ROUND_TIMEOUT; 0: no limit
    mode: int = 0  # INIT/PUSH/PULL: the key's Mode
    behind: int = 0  # a PULL's reply: how many later rounds of the key had already closed (how far behind it is)
    incarnation: int = 0
    job_id: int = 0
    key: int = 0
    round: int = 0  # PUSH/PULL: the key's round
    request_id: int = 0
    nbytes: int = 0  # INIT/PUSH/PULL: the key's size in bytes
    offset: int = 0  # PUSH: where the payload goes in the key; PULL: first byte wanted
    length: int = 0  # PUSH: payload bytes; PULL: bytes wanted
    dense_bytes: int = 0  # INIT of a compressed key: the fp32 partition's bytes its encoding stands for
    num_workers: int = 0  # HELLO: the job's worker count
    backups: int = 0  # HELLO: the job's backup workers b (0: none)
    window: int = 0  # HELLO: the job's live rounds per key W (0: 2)
    stream: int = 0  # HELLO reply: the stream offer (port in bits 0-15, STREAM_LOCAL); 0: none
    staleness: int = 0  # HELLO: the job's staleness bound s for MODEL keys (2**64 - 1: unbounded)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, *self.__dict__.values())

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> Header:
        """Parse a header frame; raise ProtocolError (with the Status to answer) when it is bad. The version is read
        before the size (every version's header starts alike): a peer of another version hears BAD_VERSION."""
        if len(data) < VERSIONED_PREFIX:
            raise ProtocolError(Status.BAD_FRAME, f"header frame is {len(data)} bytes, expected {HEADER_SIZE}")
        magic, version = struct.unpack_from("<IH", data)
        if magic != MAGIC:
            raise ProtocolError(Status.BAD_FRAME, f"bad magic 0x{magic:08x}")
        if version != VERSION:
            raise ProtocolError(Status.BAD_VERSION, f"protocol version {version}, this side speaks {VERSION}")
        if len(data) != HEADER_SIZE:
            raise ProtocolError(Status.BAD_FRAME, f"header frame is {len(data)} bytes, expected {HEADER_SIZE}")
        return _header(dict(zip(_FIELDS, HEADER.unpack(data)[2:], strict=True)))

    def reply(self, status: int = Status.OK, **changes: int) -> Header:
        """Return the header of the reply to this request."""
        if changes.keys() - self.__dict__.keys():
            raise TypeError(f"Header has no field(s) {sorted(changes.keys() - self.__dict__.keys())}")
        return _header({**self.__dict__, "command": self.command | REPLY, "status": int(status), **changes})


_FIELDS = tuple(Header.__dataclass_fields__)


def foreign_reply(frame: bytes, status: int) -> bytes:
    """Return the reply header to a request whose header frame is of another protocol version, in that version's
    framing: the frame itself (at most HEADER_SIZE bytes of it) with its command | REPLY and `status` at bytes 6-9,
    where every version has them, so that its sender reads the refusal instead of waiting for an answer."""
    reply = bytearray(frame[:HEADER_SIZE])
    if len(reply) < VERSIONED_PREFIX:
        return Header(command=REPLY, status=status).pack()
    command = struct.unpack_from("<H", reply, 6)[0]
    struct.pack_into("<HH", reply, 6, command | REPLY, status)
    return bytes(reply)


def _header(fields: dict) -> Header:
    """Build a Header from a complete dict of its fields without its __init__: a server builds two per message
    (a request, a reply), and a frozen dataclass's __init__ (one object.__setattr__ per field) cost more than
    all the rest of parsing and packing one. The object is the same as Header(**fields) builds."""
    h = object.__new__(Header)
    h.__dict__.update(fields)
    return h
