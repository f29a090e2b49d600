"""Gradient compression with error feedback, the worker's side: one stage on each side of the network stage.

Before it, each partition of a compressible fp32 sum (a gradient bucket's large tensors, through bps_hook) is
encoded into the bytes its key carries: x = gradient + this partition's residual, payload = encode(x), and the
residual becomes x - decode(payload), so what this round drops is sent in a later one. After it, the server's
encoded sum (which the server compressed once, with its own error feedback: cpp_ext/server/codecs.h) is decoded
into the caller's tensor; every worker decodes the same bytes, so replicas stay bit-identical.

Codecs (docs/protocol.md, "Compressed keys"): "onebit" (a sign bit per element and one scale, the mean of |x|),
"topk:R" (the R * n largest |x| with their indices), "randomk:R" (R * n values at indices both ends derive from
the key and round: no index travels). Vectorized torch on the CPU.

May import: the standard library, torch, torch_bps.config and torch_bps.wire.
"""

from __future__ import annotations

import threading

import torch

from torch_bps.config import Config
from torch_bps.wire import Codec, codec_wire_bytes, codec_word, random_indices

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def parse_compressor(spec: str) -> tuple[Codec, float]:
    """Return (codec, ratio) of a Config.compressor string: "onebit", "topk:0.01", "randomk:0.01" ("" -> NONE).

    Example: parse_compressor("topk:0.01") == (Codec.TOPK, 0.01).
    """
    if not spec:
        return Codec.NONE, 0.0
    name, _, ratio = spec.partition(":")
    codecs = {"onebit": Codec.ONEBIT, "topk": Codec.TOPK, "randomk": Codec.RANDOMK}
    if name not in codecs or (name == "onebit") != (ratio == ""):
        raise ValueError(f"compressor {spec!r}: use onebit, topk:RATIO or randomk:RATIO (RATIO in (0, 1])")
    value = float(ratio) if ratio else 0.0
    if name != "onebit" and not 0 < value <= 1:
        raise ValueError(f"compressor {spec!r}: the ratio must be in (0, 1]")
    return codecs[name], value


def compressible_runs(config: Config, dtype: torch.dtype, numel: int,
                      grads: list[tuple[int, int, str]]) -> list[tuple[int, int, bool]]:  # fmt: skip
    """A flat buffer of gradients ((start, numel, parameter name) each, in buffer order) as (start, stop,
    compressible) runs: fp32 gradients of at least Config.compress_min_bytes whose names contain none of
    Config.compress_exclude are compressible, when a compressor is set."""
    runs: list[tuple[int, int, bool]] = []
    if not config.compressor or dtype != torch.float32:
        return [(0, numel, False)]
    for start, count, name in grads:
        small = count * 4 < config.compress_min_bytes
        compress = not small and not any(pattern in name for pattern in config.compress_exclude)
        if runs and runs[-1][1] == start and runs[-1][2] == compress:
            runs[-1] = (runs[-1][0], start + count, compress)
        else:
            runs.append((start, start + count, compress))
    if sum(b - a for a, b, _ in runs) != numel:  # not laid out as expected: send it whole, exact
        return [(0, numel, False)]
    return runs


class Compressor:
    """Encode partitions with per-key error feedback; decode the servers' sums.

    Args:
        spec: Config.compressor ("onebit", "topk:0.01", "randomk:0.01").

    Example:
        c = Compressor("topk:0.01")
        payload = c.encode(key, grad_part)           # pushed; the server's sum pulled into `pulled`
        c.decode(key, pulled, out=grad_part)
    """

    def __init__(self, spec: str):
        self.codec, self.ratio = parse_compressor(spec)
        self.word = codec_word(self.codec)
        self._lock = threading.Lock()
        self._residuals: dict[int, torch.Tensor] = {}
        self._rounds: dict[int, int] = {}  # key -> rounds encoded: random-k's indices of the next one

    def k(self, numel: int) -> int:
        return max(1, int(numel * self.ratio)) if self.codec != Codec.ONEBIT else 0

    def wire_numel(self, numel: int) -> int:
        """The fp32 elements a key of `numel` carries encoded (its wire bytes / 4)."""
        return codec_wire_bytes(self.word, numel, self.k(numel)) // 4

    def encode(self, key: int, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Return (the payload as fp32, its round) for this round of `key`; the key's residual moves on."""
        n = grad.numel()
        with self._lock:
            residual = self._residuals.get(key)
            rnd = self._rounds.get(key, 0)
            self._rounds[key] = rnd + 1
        x = grad + residual if residual is not None else grad.clone()
        payload = torch.zeros(self.wire_numel(n) * 4, dtype=torch.uint8)
        if self.codec == Codec.ONEBIT:
            scale = x.abs().mean()
            negative = x < 0
            payload[:4].view(torch.float32)[0] = scale
            padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
            padded[:n] = negative
            payload[4 : 4 + padded.numel() // 8] = (padded.view(-1, 8) * _BIT_WEIGHTS).sum(1).to(torch.uint8)
            x -= torch.where(negative, -scale, scale)
        elif self.codec == Codec.TOPK:
            k = self.k(n)
            idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
            payload[: 4 * k].view(torch.int32).copy_(idx)
            payload[4 * k :].view(torch.float32).copy_(x[idx])
            x[idx] = 0
        else:
            idx = random_indices(key, rnd, n, self.k(n))
            payload.view(torch.float32).copy_(x[idx])
            x[idx] = 0
        with self._lock:
            self._residuals[key] = x
        return payload.view(torch.float32), rnd

    def skip(self, key: int) -> int:
        """Count a round of `key` this worker only pulls (a backup round that closed without it); return it."""
        with self._lock:
            rnd = self._rounds.get(key, 0)
            self._rounds[key] = rnd + 1
        return rnd

    def decode(self, key: int, rnd: int, pulled: torch.Tensor, out: torch.Tensor) -> None:
        """Write the dense sum that the server's encoded result `pulled` (fp32 view) of round `rnd` stands for."""
        n, raw = out.numel(), pulled.view(torch.uint8)
        if self.codec == Codec.ONEBIT:
            scale = raw[:4].view(torch.float32)[0]
            bits = ((raw[4:].unsqueeze(1) >> _SHIFTS) & 1).flatten()[:n].bool()
            torch.where(bits, -scale, scale, out=out)
        elif self.codec == Codec.TOPK:
            k = self.k(n)
            out.zero_()
            out[raw[: 4 * k].view(torch.int32).long()] = raw[4 * k :].view(torch.float32)
        else:
            out.zero_()
            out[random_indices(key, rnd, n, self.k(n))] = pulled

    def residual(self, key: int) -> torch.Tensor | None:
        """What `key`'s encodings have not sent yet (for tests)."""
        with self._lock:
            return self._residuals.get(key)
