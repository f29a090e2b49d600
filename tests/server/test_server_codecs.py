"""Compressed keys on a real server process, spoken to by hand: sums both ways, bad declarations, hostile pushes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import RawPeer, error_of, peers
from torch_bps._reference import codecs as ref
from torch_bps.wire import Codec, Command, Status, codec_wire_bytes, codec_word

pytestmark = pytest.mark.timeout(120)

N = 1000  # dense fp32 elements per key
FP32 = 1


def _init(ps, key, word, wire, dense=4 * N):
    return [p.request(Command.INIT, key=key, nbytes=wire, dtype=FP32, codec=word, dense_bytes=dense) for p in ps]


def _push(p, key, rnd, word, data: bytes, wire=None):
    return p.request(Command.PUSH, data, key=key, round=rnd, nbytes=wire or len(data), dtype=FP32, codec=word)


def _pull(p, key, rnd, word, wire):
    return p.request(Command.PULL, key=key, round=rnd, nbytes=wire, dtype=FP32, codec=word)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])  # small integers: top-k chooses among ties
@pytest.mark.parametrize("codec", [Codec.ONEBIT, Codec.TOPK, Codec.RANDOMK])
def test_rounds_of_a_compressed_key_are_the_references(server, job_id, codec, ties):
    word = codec_word(codec)
    wire = codec_wire_bytes(word, N, 50)
    a, b = peers(server, job_id, 2)
    assert all(h.status == Status.OK for h, _ in _init([a, b], 3, word, wire))
    reference = ref.CodecKey(ref.Spec(word, 4 * N, wire, key=3))
    gen = np.random.default_rng(0)
    for rnd in range(3):
        pushes = []
        for p in (a, b):
            x = gen.standard_normal(N).astype(np.float32)
            if ties:
                x = np.round(x).astype(np.float32)
            payload = ref.encode(ref.Spec(word, 4 * N, wire, key=3), rnd, x)  # any valid encoding will do
            pushes.append(payload)
            assert _push(p, 3, rnd, word, payload)[0].status == Status.OK
        want = reference.round(pushes, rnd)
        for p in (a, b):
            h, rest = _pull(p, 3, rnd, word, wire)
            assert h.status == Status.OK and rest == [want], rest


def test_a_random_k_sum_is_the_same_whatever_round_the_server_counts(server, job_id):
    """A key that a failover moved starts again at round 0 on its new server while the workers' count of its rounds
    goes on, so the server derives other indices than the workers encoded at. Nothing changes: a random-k round
    sums each value into one element and sends every element it summed (its residual stays zero), so the sum is
    the pushes' values added in place, which each worker decodes at its own indices."""
    word = codec_word(Codec.RANDOMK)
    wire = codec_wire_bytes(word, N, 50)
    a, b = peers(server, job_id, 2)
    assert all(h.status == Status.OK for h, _ in _init([a, b], 6, word, wire))
    spec, gen = ref.Spec(word, 4 * N, wire, key=6), np.random.default_rng(1)
    for rnd in range(3):  # the workers' rounds 41 to 43 of the key, the server's 0 to 2
        payloads = [ref.encode(spec, 41 + rnd, gen.standard_normal(N).astype(np.float32)) for _ in "ab"]
        for p, payload in zip((a, b), payloads, strict=True):
            assert _push(p, 6, rnd, word, payload)[0].status == Status.OK
        values = [np.frombuffer(x, np.float32) for x in payloads]
        for p in (a, b):
            h, rest = _pull(p, 6, rnd, word, wire)
            assert h.status == Status.OK
            np.testing.assert_array_equal(np.frombuffer(rest[0], np.float32), values[0] + values[1])


def test_a_request_in_another_codec_is_refused_naming_both(server, job_id):
    a, b = peers(server, job_id, 2)
    onebit, topk = codec_word(Codec.ONEBIT), codec_word(Codec.TOPK)
    assert _init([a], 4, onebit, codec_wire_bytes(onebit, N))[0][0].status == Status.OK
    status, text = error_of(_init([b], 4, topk, codec_wire_bytes(topk, N, 16))[0])
    assert status == Status.KEY_MISMATCH
    assert "declared compressed with onebit over 1000 fp32 elements" in text and "topk (width 1)" in text, text
    status, text = error_of(_push(b, 4, 0, 0, b"\0" * (4 * N)))
    assert status == Status.KEY_MISMATCH and "uncompressed (no codec)" in text and "onebit" in text, text


@pytest.mark.parametrize(
    ("word", "wire", "dense", "words"),
    [
        (codec_word(Codec.ONEBIT), 40, 4 * N, "onebit over 1000 elements carries 132 bytes, not 40"),
        (codec_word(Codec.TOPK, 3), 16, 4 * N, "topk rows of width 3 do not divide 1000 elements"),
        (codec_word(Codec.RANDOMK), 8004, 4 * N, "randomk carries 1 to 1000 fp32 values"),
        (9, 16, 4 * N, "unknown codec 9"),
        (codec_word(Codec.RANDOMK), 16, 0, "at least one fp32 element"),
    ],
)
def test_a_bad_declaration_is_refused_naming_why(server, job_id, word, wire, dense, words):
    (a,) = peers(server, job_id, 1)
    status, text = error_of(_init([a], 5, word, wire, dense)[0])
    assert status == Status.KEY_MISMATCH and words in text and "key 5" in text, text


@pytest.mark.parametrize(
    ("codec", "payload", "words"),
    [
        (Codec.TOPK, np.array([0, 1000], np.uint32).tobytes() + np.ones(2, np.float32).tobytes(),
         "topk row 1's index 1000 is out of range (1000 rows)"),
        (Codec.ONEBIT, np.float32("nan").tobytes() + b"\xff" * 128, "onebit scale nan is not finite"),
        (Codec.RANDOMK, np.array([1, np.nan], np.float32).tobytes(), "value 1 is nan, not finite"),
    ],
)  # fmt: skip
def test_a_malformed_push_is_refused_naming_key_and_round_and_the_server_serves_on(server, job_id, codec, payload,
                                                                                   words):  # fmt: skip
    word = codec_word(codec)
    wire = len(payload)
    a, b = peers(server, job_id, 2)
    assert all(h.status == Status.OK for h, _ in _init([a, b], 6, word, wire))
    assert _push(a, 6, 0, word, b"\0" * wire)[0].status == Status.OK
    status, text = error_of(_push(b, 6, 0, word, payload))
    assert status == Status.KEY_MISMATCH
    assert f"push of job {job_id:#x} key 6 round 0 by worker 1: {words}" in text, text
    status, text = error_of(_pull(a, 6, 0, word, wire))  # the round failed for everyone, naming why
    assert status == Status.KEY_MISMATCH and words in text, text
    error_of(_pull(b, 6, 0, word, wire))
    for p in (a, b):  # the key's next round is served
        assert _push(p, 6, 1, word, b"\0" * wire)[0].status == Status.OK
    assert _pull(a, 6, 1, word, wire)[0].status == Status.OK


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(codec=st.sampled_from([Codec.ONEBIT, Codec.TOPK, Codec.RANDOMK]), garbage=st.binary(min_size=0, max_size=200),
       length=st.integers(0, 300))  # fmt: skip
def test_garbage_pushes_never_crash_the_server(server, codec, garbage, length):
    """Random bytes as a compressed push, with any length in the header: answered, never fatal."""
    word = codec_word(codec)
    wire = codec_wire_bytes(word, 64, 8)
    p = RawPeer(server.address, job_id=2**62 + 7, worker=0, num_workers=1, timeout=5)
    try:
        assert p.hello().status == Status.OK
        _init([p], 1, word, wire, 4 * 64)
        h, _ = p.request(Command.PUSH, garbage, key=1, round=0, nbytes=wire, dtype=FP32, codec=word,
                         length=length)  # fmt: skip
        assert h.status in (Status.OK, Status.KEY_MISMATCH, Status.BAD_ROUND)
    finally:
        p.close()
    probe = RawPeer(server.address, job_id=2**63 + 1, timeout=5)
    assert probe.hello().status == Status.OK
    probe.close()
