"""The C++ header (cpp_ext/transport/wire.h, through torch_bps._C._testing) agrees byte for byte with torch_bps.wire."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_bps import _C
from torch_bps.errors import ProtocolError
from torch_bps.wire import HEADER, HEADER_SIZE, MAGIC, VERSION, Header, Status, foreign_reply

pytestmark = pytest.mark.timeout(60)
V2 = struct.Struct("<IHHHHIIIII8Q")  # version 2's 96-byte header, as a version 2 peer sends it

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
headers = st.builds(
    Header,
    command=u16,
    status=u16,
    dtype=u16,
    worker=u32,
    codec=u32,
    wait_ms=u32,
    mode=u32,
    behind=u32,
    incarnation=u64,
    job_id=u64,
    key=u64,
    round=u64,
    request_id=u64,
    nbytes=u64,
    offset=u64,
    length=u64,
    dense_bytes=u64,
    num_workers=u32,
    backups=u32,
    window=u32,
    stream=u32,
    staleness=u64,
)


def as_dict(h: Header) -> dict[str, int]:
    return dict(h.__dict__)


def test_header_size_agrees():
    assert _C._testing.HEADER_SIZE == HEADER_SIZE == 128


# Every field of version 3 at the offset and width docs/protocol.md's table gives it.
LAYOUT = [
    ("command", 6, "H"), ("status", 8, "H"), ("dtype", 10, "H"), ("worker", 12, "I"), ("codec", 16, "I"),
    ("wait_ms", 20, "I"), ("mode", 24, "I"), ("behind", 28, "I"), ("incarnation", 32, "Q"), ("job_id", 40, "Q"),
    ("key", 48, "Q"), ("round", 56, "Q"), ("request_id", 64, "Q"), ("nbytes", 72, "Q"), ("offset", 80, "Q"),
    ("length", 88, "Q"), ("dense_bytes", 96, "Q"), ("num_workers", 104, "I"), ("backups", 108, "I"),
    ("window", 112, "I"), ("stream", 116, "I"), ("staleness", 120, "Q"),
]  # fmt: skip


def test_layout_covers_every_field_once():
    assert [name for name, _, _ in LAYOUT] == list(Header.__dataclass_fields__)
    ends = [offset + struct.calcsize("<" + kind) for _, offset, kind in LAYOUT]
    assert [offset for _, offset, _ in LAYOUT[1:]] == ends[:-1] and ends[-1] == HEADER_SIZE  # no gap, no overlap


@pytest.mark.parametrize("name, offset, kind", LAYOUT)
@pytest.mark.parametrize("pack", ["python", "cpp"])
def test_version_3_layout_by_offset(name, offset, kind, pack):
    """Each field, set alone to a value filling its width, lands at its own offset in both packers, and nowhere
    else: the rest of the frame is the magic, the version and zeros."""
    value = {"H": 0xBEEF, "I": 0xDEADBEEF, "Q": 0x0123456789ABCDEF}[kind]
    raw = Header(**{"command": 0, name: value}).pack() if pack == "python" else _C._testing.pack_header(**{name: value})
    assert struct.unpack_from("<IH", raw, 0) == (MAGIC, 3)
    assert struct.unpack_from("<" + kind, raw, offset) == (value,)
    rest = bytearray(raw)
    rest[0:6] = bytes(6)
    rest[offset : offset + struct.calcsize(kind)] = bytes(struct.calcsize(kind))
    assert rest == bytes(HEADER_SIZE)


@pytest.mark.parametrize("name, offset, kind", LAYOUT)
def test_cpp_unpack_reads_each_field_at_its_offset(name, offset, kind):
    raw = bytearray(Header(command=0).pack())
    value = {"H": 0xBEEF, "I": 0xDEADBEEF, "Q": 0x0123456789ABCDEF}[kind]
    struct.pack_into("<" + kind, raw, offset, value)
    assert _C._testing.unpack_header(bytes(raw)) == as_dict(Header(**{"command": 0, name: value}))
    assert Header.unpack(bytes(raw)) == Header(**{"command": 0, name: value})


@settings(max_examples=300, deadline=None)
@given(headers)
def test_cpp_pack_equals_python_pack(h):
    assert _C._testing.pack_header(**as_dict(h)) == h.pack()


@settings(max_examples=300, deadline=None)
@given(headers)
def test_cpp_unpack_reads_python_pack(h):
    assert _C._testing.unpack_header(h.pack()) == as_dict(h)
    assert Header.unpack(_C._testing.pack_header(**as_dict(h))) == h


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=2 * HEADER_SIZE),
        st.builds(lambda version, rest: struct.pack("<IH", MAGIC, version) + rest, u16, st.binary()),
    )
)
def test_garbage_is_refused_like_python(data):
    """Whatever Python refuses, C++ refuses with the same status; whatever Python reads, C++ reads alike."""
    try:
        expected = as_dict(Header.unpack(data))
    except ProtocolError as e:
        with pytest.raises(ProtocolError) as info:
            _C._testing.unpack_header(data)
        assert info.value.status == e.status
    else:
        assert _C._testing.unpack_header(data) == expected


@pytest.mark.parametrize(
    "data, status, words",
    [
        (b"", Status.BAD_FRAME, "0 bytes"),
        (b"\0" * 71, Status.BAD_FRAME, "magic"),  # version 3 reads the magic before the size
        (b"\0" * 9, Status.BAD_FRAME, "9 bytes"),
        (b"\0" * 72, Status.BAD_FRAME, "magic"),
        (HEADER.pack(MAGIC ^ 1, VERSION, 1, *[0] * 21), Status.BAD_FRAME, "magic"),
        (HEADER.pack(MAGIC, VERSION, 1, *[0] * 21)[:96], Status.BAD_FRAME, "96 bytes, expected 128"),
        (HEADER.pack(MAGIC, VERSION + 1, 1, *[0] * 21), Status.BAD_VERSION, "version 4, this side speaks 3"),
        (V2.pack(MAGIC, 2, 1, *[0] * 15), Status.BAD_VERSION, "version 2, this side speaks 3"),  # a version 2 peer
        (V2.pack(MAGIC, 2, 1, *[0] * 15)[:72], Status.BAD_VERSION, "version 2, this side speaks 3"),
        (struct.pack("<IHHH", MAGIC, 1, 1, 0), Status.BAD_VERSION, "version 1, this side speaks 3"),
    ],
)
def test_bad_headers_raise_protocol_error(data, status, words):
    with pytest.raises(ProtocolError, match=words) as info:
        _C._testing.unpack_header(data)
    assert info.value.status == status
    with pytest.raises(ProtocolError, match=words) as info:
        Header.unpack(data)
    assert info.value.status == status


def test_a_version_2_request_is_refused_in_its_own_framing():
    """The server answers a request of another version with that request's frame, command | REPLY and status
    BAD_VERSION: a version 2 client reads its header (and its request_id at 64) and fails naming both versions."""
    request = V2.pack(MAGIC, 2, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0xAB, 0, 0, 77, 0, 0, 0)
    reply = foreign_reply(request, Status.BAD_VERSION)
    assert len(reply) == 96 and V2.unpack(reply)[:4] == (MAGIC, 2, 1 | 0x80, Status.BAD_VERSION)
    assert reply[10:] == request[10:]  # request_id 77, job 0xAB echoed as the sender packed them
    assert Header.unpack(foreign_reply(b"BPS", Status.BAD_VERSION)).status == Status.BAD_VERSION  # too short: ours


def test_out_of_range_fields_are_refused():
    with pytest.raises(TypeError):
        _C._testing.pack_header(command=2**16)
    with pytest.raises(TypeError):
        _C._testing.pack_header(command=1, key=2**64)
    with pytest.raises(TypeError):
        _C._testing.pack_header(command=1, rounds=1)  # version 2's field, gone


@settings(max_examples=300, deadline=None)
@given(headers, u16, st.sampled_from([{}, {"nbytes": 0}, {"incarnation": 7}, {"stream": 9}]))
def test_unpack_and_reply_build_the_header_its_constructor_builds(h, status, changes):
    """Header.unpack and reply() skip the dataclass __init__ (the server builds two headers per message): what
    they build must be the header the constructor builds, field for field, equal and hashed alike."""
    parsed = Header.unpack(h.pack())
    assert parsed == h and hash(parsed) == hash(h) and parsed.__dict__ == h.__dict__
    reply = parsed.reply(status, **changes)
    expected = Header(**{**h.__dict__, "command": h.command | 0x80, "status": status, **changes})
    assert reply == expected and reply.__dict__ == expected.__dict__
    with pytest.raises(TypeError, match="no field"):
        h.reply(status, nbyte=0)
