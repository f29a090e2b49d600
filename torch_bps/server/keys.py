"""The keys a server knows, and the checks INIT, PUSH and PULL pass against a key's declaration.

The first INIT of a key fixes its size, dtype, mode (SUM, COPY or MODEL) and codec (a compressed key's: its
requests' `codec`, docs/protocol.md "Compressed keys"); every later INIT, PUSH and PULL must agree, and a PUSH
or PULL must name a byte range inside the key (a SUM or MODEL key's PUSH: the whole key). These run on metadata
alone, before any payload is looked at, so a worker whose plan disagrees with the others' gets KEY_MISMATCH naming
both sides instead of a wrong result. The server's native core makes the same checks on
PUSH and PULL and hands every request that fails one to the control plane, so the words a peer reads are
always these.

May import: the standard library, torch, torch_bps.wire and torch_bps.errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_bps.errors import ProtocolError
from torch_bps.wire import DTYPES, Command, Header, Mode, Status, check_codec, codec_name

_MODES = frozenset(int(m) for m in Mode)


@dataclass
class KeyInfo:
    nbytes: int
    dtype: int
    mode: Mode
    codec: int = 0  # a compressed key's codec word (its requests' `codec`); nbytes is then what travels
    dense_bytes: int = 0  # a compressed key's fp32 partition (its INIT's `length`)


def check_init(h: Header) -> None:
    """Refuse an INIT whose dtype, size or mode no key can have."""
    what = f"INIT of job {h.job_id:#x} key {h.key}"
    if h.dtype not in DTYPES:
        raise ProtocolError(Status.KEY_MISMATCH, f"{what}: unknown dtype code {h.dtype}")
    if h.mode not in _MODES:
        raise ProtocolError(Status.KEY_MISMATCH, f"{what}: unknown mode {h.mode} (0: SUM, 1: COPY, 2: MODEL)")
    if h.mode == Mode.MODEL and not (DTYPES[h.dtype].is_floating_point and DTYPES[h.dtype].itemsize >= 4):
        # A running total of many small updates in 16 bits would drop them.
        raise ProtocolError(Status.KEY_MISMATCH, f"{what}: a MODEL key is float32 or float64, not "
                            f"{dtype_name(h.dtype)}")  # fmt: skip
    if h.nbytes % DTYPES[h.dtype].itemsize:
        raise ProtocolError(
            Status.KEY_MISMATCH, f"{what}: {h.nbytes} bytes is not a whole number of {dtype_name(h.dtype)}"
        )
    if h.codec:  # a compressed key
        why = check_codec(h.codec, h.dense_bytes, h.nbytes)
        if not why and (h.mode != Mode.SUM or DTYPES[h.dtype] != torch.float32 or h.dense_bytes % 4):
            why = "a compressed key is an fp32 SUM key"
        if why:
            raise ProtocolError(Status.KEY_MISMATCH, f"{what}: {why}")


def check_request(info: KeyInfo | None, h: Header, payload_bytes: int = 0) -> KeyInfo:
    """Return the key's info if `h` (INIT, PUSH with payload_bytes, or PULL) agrees with it; else raise."""
    codec = h.codec
    same = info is not None and (h.nbytes, h.dtype, h.mode, codec) == (info.nbytes, info.dtype, info.mode, info.codec)
    if same and h.command == Command.INIT and h.dense_bytes != info.dense_bytes and codec:
        same = False
    if same:
        if h.command == Command.INIT or _range_ok(info, h, payload_bytes):
            return info  # the hot path: no message built
    what = f"{Command(h.command).name} of job {h.job_id:#x} key {h.key} round {h.round} by worker {h.worker}"
    if info is None:
        raise ProtocolError(Status.UNKNOWN_KEY, f"{what}: key was never declared with INIT")
    if codec != info.codec or (h.command == Command.INIT and codec and h.dense_bytes != info.dense_bytes):
        raise ProtocolError(
            Status.KEY_MISMATCH,
            f"{what}: the key was declared {_codec_text(info.codec, info.dense_bytes)}, this request is "
            f"{_codec_text(codec, h.dense_bytes if h.command == Command.INIT else None)}",
        )
    if h.nbytes != info.nbytes or h.dtype != info.dtype or h.mode != info.mode:
        raise ProtocolError(
            Status.KEY_MISMATCH,
            f"{what}: expected {info.nbytes} bytes of {dtype_name(info.dtype)} ({_mode_name(info.mode)}), received "
            f"{h.nbytes} bytes of {dtype_name(h.dtype)} ({_mode_name(h.mode)})",
        )
    if h.command == Command.PUSH and payload_bytes != h.length:
        raise ProtocolError(Status.KEY_MISMATCH, f"{what}: header says {h.length} bytes, payload has {payload_bytes}")
    whole = f" (a {info.mode.name} key is pushed whole)" if info.mode != Mode.COPY and h.command == Command.PUSH else ""
    raise ProtocolError(
        Status.KEY_MISMATCH, f"{what}: bytes [{h.offset}, {h.offset + h.length}) of a {info.nbytes}-byte key{whole}"
    )


def _range_ok(info: KeyInfo, h: Header, payload_bytes: int) -> bool:
    if h.command == Command.PUSH:
        if payload_bytes != h.length or (info.mode != Mode.COPY and (h.offset, h.length) != (0, info.nbytes)):
            return False
    return h.offset + h.length <= info.nbytes


def _codec_text(word: int, dense_bytes: int | None) -> str:
    if not word:
        return "uncompressed (no codec)"
    over = f" over {dense_bytes // 4} fp32 elements" if dense_bytes is not None else ""
    return f"compressed with {codec_name(word)}{over}"


def dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if code in DTYPES else f"dtype code {code}"


def _mode_name(mode: int) -> str:
    return Mode(mode).name if mode in _MODES else f"mode {mode}"
