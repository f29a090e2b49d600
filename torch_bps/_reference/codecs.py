"""The server's arithmetic on a compressed key, in numpy: what cpp_ext/server/codecs.h does, bit for bit.

A round decodes each push, in the order they arrived, into an fp32 accumulator; at close the accumulator (scaled by
n / contributors in a backup round) plus the key's residual is encoded once, and what the encoding dropped becomes
the residual of the next round. docs/protocol.md ("Compressed keys") states the layouts; the error texts are the
C++ texts.

May import: the standard library, numpy and torch_bps.wire.
"""

from __future__ import annotations

import numpy as np

from torch_bps.wire import Codec, codec_name, random_indices


class Spec:
    """A compressed key's declaration: codec word, dense fp32 elements, wire bytes, key (random-k's seed)."""

    def __init__(self, word: int, dense_bytes: int, wire_bytes: int, key: int = 0):
        self.word, self.codec = word, word & 0xFF
        self.width = word >> 8 if self.codec == Codec.TOPK else 1
        self.elements, self.wire_bytes, self.key = dense_bytes // 4, wire_bytes, key

    @property
    def k(self) -> int:
        if self.codec == Codec.TOPK:
            return self.wire_bytes // (4 * (1 + self.width))
        return self.wire_bytes // 4 if self.codec == Codec.RANDOMK else 0

    @property
    def rows(self) -> int:
        return self.elements // self.width

    def indices(self, round_: int) -> np.ndarray:
        return random_indices(self.key, round_, self.elements, self.k).numpy()


def check_payload(s: Spec, payload: bytes) -> str:
    """Why this push is malformed, or ""."""
    if len(payload) != s.wire_bytes:
        return f"a {codec_name(s.word)} push carries {s.wire_bytes} bytes, not {len(payload)}"
    if s.codec == Codec.ONEBIT:
        scale = np.frombuffer(payload, np.float32, 1)[0]
        if not (np.isfinite(scale) and scale >= 0):
            return f"onebit scale {_g(scale)} is not finite and >= 0"
        return ""
    values = np.frombuffer(payload, np.float32)
    if s.codec == Codec.TOPK:
        rows = np.frombuffer(payload, np.uint32, s.k)
        bad = np.nonzero(rows >= s.rows)[0]
        if bad.size:
            j = int(bad[0])
            return f"topk row {j}'s index {int(rows[j])} is out of range ({s.rows} rows)"
        values = values[s.k :]
    bad = np.nonzero(~np.isfinite(values))[0]
    if bad.size:
        return f"value {int(bad[0])} is {_g(values[bad[0]])}, not finite"
    return ""


def decode_add(s: Spec, round_: int, payload: bytes, acc: np.ndarray) -> None:
    """acc += the push's decoded values, element by element in the payload's order (fp32)."""
    if s.codec == Codec.ONEBIT:
        scale = np.frombuffer(payload, np.float32, 1)[0]
        bits = np.unpackbits(np.frombuffer(payload, np.uint8)[4:], bitorder="little")[: s.elements].astype(bool)
        acc += np.where(bits, -scale, scale).astype(np.float32)
    elif s.codec == Codec.TOPK:
        rows = np.frombuffer(payload, np.uint32, s.k).astype(np.int64)
        values = np.frombuffer(payload, np.float32)[s.k :].reshape(s.k, s.width)
        wide = acc.reshape(s.rows, s.width)
        for j, row in enumerate(rows):  # in order: a repeated row adds twice, as the C++ loop does
            wide[row] += values[j]
    elif s.codec == Codec.RANDOMK:
        acc[s.indices(round_)] += np.frombuffer(payload, np.float32)


def encode(s: Spec, round_: int, x: np.ndarray) -> bytes:
    """Encode x; leave x - decode(the encoding) in x (the residual)."""
    if s.codec == Codec.ONEBIT:
        # The C++ adds |x| in double, element i into lane i % 8 in index order, then the 8 lanes in order; cumsum
        # is a sequential sum, and the zeros padding the last row change no lane.
        wide = np.zeros(-(-s.elements // 8) * 8, np.float64)
        wide[: s.elements] = np.abs(x.astype(np.float64))
        total = np.cumsum(np.cumsum(wide.reshape(-1, 8), axis=0)[-1])[-1]
        scale = np.float32(total / s.elements)
        negative = x < 0
        bits = np.packbits(negative, bitorder="little").tobytes()
        x -= np.where(negative, -scale, scale).astype(np.float32)
        out = scale.tobytes() + bits
        return out + b"\0" * (s.wire_bytes - len(out))
    if s.codec == Codec.TOPK:
        wide = x.reshape(s.rows, s.width)
        score = np.cumsum(np.abs(wide), axis=1, dtype=np.float32)[:, -1]  # fp32, in column order
        score = np.where(np.isnan(score), np.float32(np.inf), score)
        order = np.lexsort((np.arange(s.rows), -score))  # largest first, the lower index on a tie
        chosen = np.sort(order[: s.k])
        values = wide[chosen].copy()
        wide[chosen] -= values
        return chosen.astype(np.uint32).tobytes() + values.astype(np.float32).tobytes()
    idx = s.indices(round_)
    values = x[idx].copy()
    x[idx] -= values
    return values.tobytes()


class CodecKey:
    """One compressed key's server state: its residual, kept across rounds."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.residual = np.zeros(spec.elements, np.float32)

    def round(self, pushes: list[bytes], round_: int, scale: float = 1.0) -> bytes:
        """The result of a round of these (checked) pushes, in arrival order; the residual moves on."""
        acc = np.zeros(self.spec.elements, np.float32)
        for p in pushes:
            decode_add(self.spec, round_, p, acc)
        if scale != 1.0:
            acc *= np.float32(scale)
        x = acc + self.residual
        out = encode(self.spec, round_, x)
        self.residual = x
        return out


def _g(value) -> str:
    """printf's %g, as the C++ messages write a float."""
    return "%g" % float(value)  # noqa: UP031 - the C++ texts are printf's
