"""The server's compressed keys (cpp_ext/server/codecs.h in KeyRounds) against _reference/codecs.py, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_bps import _C
from torch_bps._reference import codecs as ref
from torch_bps.wire import Codec, Mode, Status, _splitmix, check_codec, codec_wire_bytes, codec_word, random_indices

pytestmark = pytest.mark.timeout(300)

NAME = "job 0x2a key 7"
KEY = 7


@st.composite
def keys(draw):
    """(codec word, dense elements, wire bytes) of a valid compressed key."""
    codec = draw(st.sampled_from([Codec.ONEBIT, Codec.TOPK, Codec.RANDOMK]))
    width = draw(st.integers(1, 3)) if codec == Codec.TOPK else 1
    rows = draw(st.integers(1, 70))
    n = rows * width
    k = draw(st.integers(1, rows if codec == Codec.TOPK else n))
    word = codec_word(codec, width)
    return word, n, codec_wire_bytes(word, n, k)


# Small integers and halves make ties and exact cancellations (top-k's tie rule, residuals of 0) common.
VALUES = st.one_of(
    st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
    st.integers(-4, 4).map(lambda v: v / 2),
)


@st.composite
def payloads(draw, word: int, n: int, wire_bytes: int) -> bytes:
    """A valid push of that key."""
    spec = ref.Spec(word, 4 * n, wire_bytes)
    if spec.codec == Codec.ONEBIT:
        scale = np.float32(abs(draw(VALUES)))
        bits = draw(st.binary(min_size=wire_bytes - 4, max_size=wire_bytes - 4))
        return scale.tobytes() + bits
    values = np.array(draw(st.lists(VALUES, min_size=spec.k * spec.width, max_size=spec.k * spec.width)), np.float32)
    if spec.codec == Codec.TOPK:  # repeated rows allowed: they add twice
        rows = draw(st.lists(st.integers(0, spec.rows - 1), min_size=spec.k, max_size=spec.k))
        return np.array(rows, np.uint32).tobytes() + values.tobytes()
    return values.tobytes()


def probe(word: int, n: int, wire_bytes: int, workers: int, backups: int = 0):
    return _C._testing.KeyRoundsProbe(workers, Mode.SUM, wire_bytes, 1, NAME, backups=backups, window=2 if not backups
                                      else 4, codec=word, dense_bytes=4 * n, key=KEY)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), keys(), st.integers(1, 4), st.integers(1, 4))
def test_rounds_match_the_reference_bit_for_bit(data, key, workers, rounds):
    word, n, wire_bytes = key
    native = probe(word, n, wire_bytes, workers)
    reference = ref.CodecKey(ref.Spec(word, 4 * n, wire_bytes, KEY))
    for rnd in range(rounds):
        pushes = [data.draw(payloads(word, n, wire_bytes)) for _ in range(workers)]
        order = data.draw(st.permutations(range(workers)))
        for w in order:
            status, message, _ = native.push(w, rnd, pushes[w], 0)
            assert status == 0, message
        expected = reference.round([pushes[w] for w in order], rnd)
        for w in range(workers):
            status, message, answers = native.pull(w, rnd, 100 + w, 0, wire_bytes)
            assert status == 0, message
            assert answers == [(100 + w, Status.OK, expected, 0)], f"round {rnd} worker {w}"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), keys())
def test_a_backup_round_is_scaled_before_it_is_encoded(data, key):
    word, n, wire_bytes = key
    native = probe(word, n, wire_bytes, 3, backups=1)
    reference = ref.CodecKey(ref.Spec(word, 4 * n, wire_bytes, KEY))
    pushes = [data.draw(payloads(word, n, wire_bytes)) for _ in range(2)]
    for w, p in enumerate(pushes):
        assert native.push(w, 0, p, 0)[0] == 0
    expected = reference.round(pushes, 0, scale=float(np.float32(3 / 2)))
    assert native.pull(0, 0, 1, 0, wire_bytes)[2] == [(1, Status.OK, expected, 0)]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(keys(), st.integers(0, 3), st.lists(VALUES, min_size=210, max_size=210))
def test_encode_matches_the_reference(key, rnd, values):
    word, n, wire_bytes = key
    x = np.array(values[:n], np.float32)
    out, residual = _C._testing.codec_encode(word, 4 * n, wire_bytes, KEY, rnd, x.tobytes())
    expected_x = x.copy()
    assert out == ref.encode(ref.Spec(word, 4 * n, wire_bytes, KEY), rnd, expected_x)
    assert residual == expected_x.tobytes()


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.integers(1, 5000), st.data())
def test_random_indices_agree_and_are_distinct(key, rnd, n, data):
    k = data.draw(st.integers(1, min(n, 300)))
    mine = random_indices(key, rnd, n, k)
    assert mine.tolist() == _C._testing.random_indices(key, rnd, n, k)
    assert len(set(mine.tolist())) == k and int(mine.max()) < n


@given(st.integers(0, 0x3FF), st.integers(0, 400), st.integers(0, 400))
def test_declarations_are_checked_alike(word, dense, wire):
    assert check_codec(word, dense, wire) == _C._testing.codec_check_declaration(word, dense, wire)


def _sampled_rows(rows: int, rnd: int) -> np.ndarray:
    """The rows whose scores set the server's top-k threshold in round `rnd` (codecs.cpp, candidateThreshold)."""
    m = min(rows, max(1024, min(rows // 64, 4096)))
    return np.array([_splitmix(rnd * m + i) * rows >> 64 for i in range(m)])  # the high word of the product


def _topk_path(word: int, n: int, wire_bytes: int, rnd: int, x: np.ndarray) -> str:
    """How the server sorts out top-k of x: among the rows reaching its sampled threshold ("candidates"), every row
    because fewer than k reach it ("fallback"), or every row because every row reaches it ("every row")."""
    spec = ref.Spec(word, 4 * n, wire_bytes)
    t = _C._testing.codec_topk_threshold(word, 4 * n, wire_bytes, rnd, x.tobytes())
    score = np.cumsum(np.abs(x.reshape(spec.rows, spec.width)), axis=1, dtype=np.float32)[:, -1]
    reached = int(np.count_nonzero(~(score < t)))  # a NaN score counts as +inf
    if reached == spec.rows:
        return "every row"
    return "candidates" if reached >= spec.k else "fallback"


def _extremes(gen, spec, rnd):  # width 2: two of +-3e38 in a row score inf, a tie at the top
    return gen.choice(np.array([3e38, -3e38, 1e-38, 0, 1, -1], np.float32), spec.elements)


def _sample_alone(gen, spec, rnd):  # only the sampled rows nonzero: fewer than k rows reach the threshold
    x = np.zeros(spec.elements, np.float32)
    x.reshape(spec.rows, spec.width)[_sampled_rows(spec.rows, rnd)] = 1
    return x


def _with_nan(gen, spec, rnd):
    x = gen.standard_normal(spec.elements).astype(np.float32)
    x[gen.integers(0, spec.elements, 5)] = np.nan
    return x


TOPK_CASES = {  # name: (width, rows, k, x, the path the server takes)
    "ties at the threshold": (1, 20000, 200, lambda gen, spec, rnd: gen.integers(-2, 3, spec.elements), "candidates"),
    "ties, width 3": (3, 6000, 60, lambda gen, spec, rnd: gen.integers(-4, 5, spec.elements) / 2, "candidates"),
    "all zero": (1, 5000, 50, lambda gen, spec, rnd: np.zeros(spec.elements), "every row"),
    "fewer than k reach the threshold": (1, 50000, 2000, _sample_alone, "fallback"),
    "k = rows": (1, 3000, 3000, lambda gen, spec, rnd: gen.standard_normal(spec.elements), "every row"),
    "k = 1 among extremes": (1, 50000, 1, _extremes, "candidates"),
    "rows scoring inf": (2, 20000, 100, _extremes, "candidates"),
    "NaN counts as +inf": (1, 20000, 100, _with_nan, "candidates"),
}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # rows scoring inf
@pytest.mark.parametrize("case", list(TOPK_CASES))
def test_topk_of_a_large_key_matches_the_reference_on_every_path(case):
    width, rows, k, make, path = TOPK_CASES[case]
    word, n = codec_word(Codec.TOPK, width), rows * width
    wire_bytes = codec_wire_bytes(word, n, k)
    spec = ref.Spec(word, 4 * n, wire_bytes, KEY)
    x = np.asarray(make(np.random.default_rng(0), spec, 1), np.float32)
    assert _topk_path(word, n, wire_bytes, 1, x) == path
    out, residual = _C._testing.codec_encode(word, 4 * n, wire_bytes, KEY, 1, x.tobytes())
    expected_x = x.copy()
    assert out == ref.encode(spec, 1, expected_x)
    assert residual == expected_x.tobytes()


def _topk_key(rows: int, k: int, workers: int):
    """A top-k key of `rows` rows of width 1 on the native core, and the reference's key beside it."""
    word = codec_word(Codec.TOPK)
    wire_bytes = codec_wire_bytes(word, rows, k)
    return probe(word, rows, wire_bytes, workers), ref.CodecKey(ref.Spec(word, 4 * rows, wire_bytes, KEY))


def _serve_round(native, reference, pushes: list[bytes], rnd: int) -> None:
    """Every worker pushes, then pulls; each pull gets the reference's sum of the round."""
    for w, p in enumerate(pushes):
        assert native.push(w, rnd, p, 0)[0] == 0
    expected = reference.round(pushes, rnd)
    for w in range(len(pushes)):
        answer = native.pull(w, rnd, w, 0, reference.spec.wire_bytes)[2]
        assert answer == [(w, Status.OK, expected, 0)], f"round {rnd}"


def test_topk_rounds_of_a_large_key_match_the_reference_on_every_path():
    """The server's close, which makes x = acc + residual while it scores the rows: a fallback, then ties."""
    rows, k, workers = 50000, 2000, 3
    native, reference = _topk_key(rows, k, workers)
    spec = reference.spec
    gen = np.random.default_rng(1)
    sampled = np.resize(_sampled_rows(rows, 0), k)  # round 0: every push on the sampled rows alone
    paths = []
    for rnd in range(3):
        pushes = []
        for _ in range(workers):
            chosen = sampled if rnd == 0 else np.sort(gen.choice(rows, k, replace=False))
            values = gen.choice([-2, -1, 1, 2], k) if rnd == 1 else gen.standard_normal(k)
            pushes.append(chosen.astype(np.uint32).tobytes() + values.astype(np.float32).tobytes())
        x = np.zeros(rows, np.float32)
        for p in pushes:
            ref.decode_add(spec, rnd, p, x)
        paths.append(_topk_path(spec.word, rows, spec.wire_bytes, rnd, x + reference.residual))
        _serve_round(native, reference, pushes, rnd)
    assert paths == ["fallback", "candidates", "candidates"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_topk_rounds_of_a_large_key_carry_their_residual_alike():
    """Twelve rounds on one key: a push on the rows that scored least lifts them into the top k, and a sum that
    overflows leaves a NaN residual, scored +inf and sent in every round after."""
    rows, k, workers = 20000, 200, 3
    native, reference = _topk_key(rows, k, workers)
    gen = np.random.default_rng(2)
    for rnd in range(12):
        chosen = [np.sort(gen.choice(rows, k, replace=False)) for _ in range(workers)]
        values = [gen.standard_normal(k) for _ in range(workers)]
        if rnd == 5:  # the rows scoring least, pushed far above every other row
            chosen[0] = np.sort(np.argsort(np.abs(reference.residual), kind="stable")[:k])
            values[0] = np.full(k, 1e3)
        if rnd == 8:  # one row's sum overflows to inf; sent, it leaves inf - inf
            chosen[1][0] = chosen[2][0] = 0
            values[1][0] = values[2][0] = 3e38
        pairs = zip(chosen, values, strict=True)
        pushes = [c.astype(np.uint32).tobytes() + v.astype(np.float32).tobytes() for c, v in pairs]
        _serve_round(native, reference, pushes, rnd)
    assert np.isnan(reference.residual[0])


def _hostile(word, n, wire_bytes, payload, expected_text):
    """Worker 1's malformed push is refused naming key, round and why; the round fails for worker 0's waiting
    pull, and the key serves the next round."""
    native = probe(word, n, wire_bytes, 2)
    assert native.push(0, 0, b"\0" * wire_bytes, 0)[0] == 0
    assert native.pull(0, 0, 5, 0, wire_bytes) == (0, "", [])
    status, message, answers = native.push(1, 0, payload, 0)
    assert status == Status.KEY_MISMATCH
    assert message == f"push of {NAME} round 0 by worker 1: {expected_text}"
    assert message.endswith(ref.check_payload(ref.Spec(word, 4 * n, wire_bytes, KEY), payload))
    assert [(t, s) for t, s, _, _ in answers] == [(5, Status.KEY_MISMATCH)]
    assert expected_text in answers[0][2]
    assert native.pull(1, 0, 6, 0, wire_bytes)[0] == Status.KEY_MISMATCH
    for w in range(2):  # the next round is served as usual
        assert native.push(w, 1, b"\0" * wire_bytes, 0)[0] == 0
    assert native.pull(0, 1, 7, 0, wire_bytes)[2][0][1] == Status.OK


def test_a_topk_row_out_of_range_is_refused():
    word, wire = codec_word(Codec.TOPK, 2), codec_wire_bytes(codec_word(Codec.TOPK, 2), 8, 2)
    payload = np.array([1, 4], np.uint32).tobytes() + np.ones(4, np.float32).tobytes()
    _hostile(word, 8, wire, payload, "topk row 1's index 4 is out of range (4 rows)")


def test_a_nan_onebit_scale_is_refused():
    word, wire = codec_word(Codec.ONEBIT), codec_wire_bytes(codec_word(Codec.ONEBIT), 40)
    nan = np.float32("nan").tobytes() + b"\0" * (wire - 4)
    _hostile(word, 40, wire, nan, "onebit scale nan is not finite and >= 0")


def test_a_negative_onebit_scale_is_refused():
    word, wire = codec_word(Codec.ONEBIT), codec_wire_bytes(codec_word(Codec.ONEBIT), 40)
    _hostile(word, 40, wire, np.float32(-2).tobytes() + b"\0" * (wire - 4), "onebit scale -2 is not finite and >= 0")


def test_an_infinite_randomk_value_is_refused():
    word, wire = codec_word(Codec.RANDOMK), codec_wire_bytes(codec_word(Codec.RANDOMK), 10, 3)
    _hostile(word, 10, wire, np.array([1, np.inf, 2], np.float32).tobytes(), "value 1 is inf, not finite")


def test_a_push_of_the_wrong_length_is_refused():
    # The server's admission checks refuse it first; the core's own check stands behind them.
    word, wire = codec_word(Codec.RANDOMK), codec_wire_bytes(codec_word(Codec.RANDOMK), 10, 3)
    _hostile(word, 10, wire, b"\0" * 8, "a randomk push carries 12 bytes, not 8")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), keys(), st.integers(2, 3))
def test_server_error_feedback_is_exact_bookkeeping(data, key, workers):
    """Over many rounds, what the pulls carried plus the residual equals what the pushes summed to (float
    tolerance): what one round's encoding drops is sent later, never lost; the native key reads the same bits."""
    word, n, wire_bytes = key
    spec = ref.Spec(word, 4 * n, wire_bytes, KEY)
    native, reference = probe(word, n, wire_bytes, workers), ref.CodecKey(spec)
    pushed, applied = np.zeros(n, np.float64), np.zeros(n, np.float64)
    for rnd in range(8):
        pushes = [data.draw(payloads(word, n, wire_bytes)) for _ in range(workers)]
        for w, p in enumerate(pushes):
            decoded = np.zeros(n, np.float32)
            ref.decode_add(spec, rnd, p, decoded)
            pushed += decoded
            assert native.push(w, rnd, p, 0)[0] == 0
        result = reference.round(pushes, rnd)
        assert {native.pull(w, rnd, w, 0, wire_bytes)[2][0][2] for w in range(workers)} == {result}
        decoded = np.zeros(n, np.float32)
        ref.decode_add(spec, rnd, result, decoded)
        applied += decoded
    tolerance = 1e-5 * (np.abs(pushed) + np.abs(applied) + np.abs(reference.residual)).max() + 1e-30
    np.testing.assert_allclose(applied + reference.residual, pushed, rtol=0, atol=tolerance * 64)


def test_bad_declarations_are_named():
    assert check_codec(codec_word(Codec.ONEBIT), 40, 12) == "onebit over 10 elements carries 8 bytes, not 12"
    assert check_codec(9, 40, 12) == "unknown codec 9 (1: onebit, 2: topk, 3: randomk)"
    assert check_codec(codec_word(Codec.TOPK, 3), 40, 16) == "topk rows of width 3 do not divide 10 elements"
    assert torch.equal(random_indices(1, 2, 1, 1), torch.zeros(1, dtype=torch.int64))
