"""The C++ header (cpp_ext/transport/wire.h, through torch_bps._C._testing) agrees byte for byte with torch_bps.wire."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_bps import _C
from torch_bps.errors import ProtocolError
from torch_bps.wire import HEADER, HEADER_SIZE, MAGIC, VERSION, Header, Status

pytestmark = pytest.mark.timeout(60)

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
headers = st.builds(
    Header,
    command=u16,
    status=u16,
    dtype=u16,
    worker=u32,
    num_workers=u32,
    wait_ms=u32,
    mode=u32,
    rounds=u32,
    incarnation=u64,
    job_id=u64,
    key=u64,
    round=u64,
    request_id=u64,
    nbytes=u64,
    offset=u64,
    length=u64,
)


def as_dict(h: Header) -> dict[str, int]:
    return dict(h.__dict__)


def test_header_size_agrees():
    assert _C._testing.HEADER_SIZE == HEADER_SIZE == 96


def test_version_2_layout_by_offset():
    """The offsets docs/protocol.md gives, read from a packed header (both sides pack alike, tested below)."""
    h = Header(command=3, dtype=7, worker=5, wait_ms=9, mode=1, key=11, round=12, nbytes=13, offset=14, length=15)
    raw = h.pack()
    assert struct.unpack_from("<IHH", raw, 0) == (MAGIC, 2, 3)
    assert struct.unpack_from("<HIIIII", raw, 10) == (7, 5, 0, 9, 1, 0)
    assert struct.unpack_from("<5Q", raw, 48) == (11, 12, 0, 13, 14)
    assert struct.unpack_from("<Q", raw, 88) == (15,)


@settings(max_examples=300, deadline=None)
@given(headers)
def test_cpp_pack_equals_python_pack(h):
    assert _C._testing.pack_header(**as_dict(h)) == h.pack()


@settings(max_examples=300, deadline=None)
@given(headers)
def test_cpp_unpack_reads_python_pack(h):
    assert _C._testing.unpack_header(h.pack()) == as_dict(h)
    assert Header.unpack(_C._testing.pack_header(**as_dict(h))) == h


def test_rounds_field_sits_at_offset_28():
    """HELLO's window of live rounds and a PULL reply's rounds closed ahead: the u32 between mode and the u64s."""
    raw = bytearray(_C._testing.pack_header(command=1, key=7, mode=1, rounds=6))
    assert struct.unpack_from("<II", raw, 24) == (1, 6)
    struct.pack_into("<I", raw, 28, 0xDEADBEEF)
    assert _C._testing.unpack_header(bytes(raw)) == as_dict(Header(command=1, key=7, mode=1, rounds=0xDEADBEEF))
    assert Header.unpack(bytes(raw)) == Header(command=1, key=7, mode=1, rounds=0xDEADBEEF)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2 * HEADER_SIZE))
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
        (b"\0" * 71, Status.BAD_FRAME, "71 bytes"),
        (b"\0" * 72, Status.BAD_FRAME, "72 bytes"),  # a version 1 header
        (HEADER.pack(MAGIC ^ 1, VERSION, 1, *[0] * 15), Status.BAD_FRAME, "magic"),
        (HEADER.pack(MAGIC, VERSION + 1, 1, *[0] * 15), Status.BAD_VERSION, "version 3"),
        (HEADER.pack(MAGIC, 1, 1, *[0] * 15), Status.BAD_VERSION, "version 1, this side speaks 2"),
    ],
)
def test_bad_headers_raise_protocol_error(data, status, words):
    with pytest.raises(ProtocolError, match=words) as info:
        _C._testing.unpack_header(data)
    assert info.value.status == status


def test_out_of_range_fields_are_refused():
    with pytest.raises(TypeError):
        _C._testing.pack_header(command=2**16)
    with pytest.raises(TypeError):
        _C._testing.pack_header(command=1, key=2**64)


@settings(max_examples=300, deadline=None)
@given(headers, u16, st.sampled_from([{}, {"nbytes": 0}, {"incarnation": 7}]))
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
