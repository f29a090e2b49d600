"""The caller's tensors as flat CPU buffers a Runtime can sum in place, and the sums back where they belong.

A contiguous CPU tensor is summed in its own storage (no copy). A non-contiguous one is copied into a
fresh CPU buffer and back when the sum arrives; a CUDA one goes through pinned memory (device/pinned.py).
Complex tensors travel as their real view (a sum of complex numbers is the sum of their parts).
Every check raises an error naming the op, the dtype and the backend. All in-place work goes through
`.detach()` views: torch's own backends write into parameters that require grad, and so must we. No
`.numpy()` anywhere: it would pin the storage (DDP buckets get `resize_`d by batched PowerSGD).

May import: torch, torch_bps.wire (the protocol's dtype table), torch_bps.device.pinned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from torch_bps.device.pinned import DeviceStaging, copy_on_side, staging_kind
from torch_bps.wire import DTYPES

BACKEND = "byteps"
SUPPORTED_DTYPES = frozenset(DTYPES.values())
_REAL_OF_COMPLEX = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
_CARRIED_AS = {**_REAL_OF_COMPLEX, torch.bool: torch.uint8}  # bools travel as their bytes (0 or 1)
_SUM_OPS = ("SUM", "AVG")
_GATHERED_OPS = ("MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")  # served by an all-gather and a local reduce


def op_name(op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> str:
    """The name ("SUM", "MAX"...) of a ReduceOp as found in torch's option structs."""
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


def check_reduce_op(name: str, dtype: torch.dtype, op: str) -> None:
    """Refuse reductions the service cannot compute exactly, naming the op, the dtype and the backend."""
    if op not in _SUM_OPS + _GATHERED_OPS:
        raise ValueError(f"{name}: ReduceOp.{op} is not supported by the '{BACKEND}' backend "
                         f"(supported: {', '.join(_SUM_OPS + _GATHERED_OPS)})")  # fmt: skip
    if dtype.is_complex and op not in _SUM_OPS:
        raise TypeError(f"{name}: ReduceOp.{op} is not defined on complex dtype {dtype} ('{BACKEND}' backend)")
    integral = not dtype.is_floating_point and not dtype.is_complex
    if op == "AVG" and dtype == torch.bool:
        raise TypeError(f"{name}: ReduceOp.AVG is not defined on torch.bool ('{BACKEND}' backend)")
    if op in ("BAND", "BOR", "BXOR") and not integral:
        raise TypeError(f"{name}: ReduceOp.{op} needs an integer dtype, got {dtype} ('{BACKEND}' backend)")


def check_tensor(name: str, t: torch.Tensor) -> None:
    """Raise a clear error if the summation service cannot carry `t`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__} ('{BACKEND}' backend)")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: {t.layout} tensors are not supported by the '{BACKEND}' backend (dense only)")
    if _CARRIED_AS.get(t.dtype, t.dtype) not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise TypeError(f"{name}: dtype {t.dtype} is not supported by the '{BACKEND}' backend "
                        f"(supported: {names}, bool, and complex types as pairs of their real type)")  # fmt: skip


def check_movable(name: str, t: torch.Tensor) -> None:
    """Raise a clear error if `t` cannot be moved as bytes (broadcast, all-gather): any dtype, dense only."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__} ('{BACKEND}' backend)")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: {t.layout} tensors are not supported by the '{BACKEND}' backend (dense only)")


def as_bytes(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor of any dtype seen as its bytes (no copy): what a gather moves."""
    return flat.view(torch.uint8)


def real(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, complex tensors seen as (..., 2) real views, bools as uint8: what travels on the wire."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return torch.view_as_real(t) if t.is_complex() else t


def neutral(dtype: torch.dtype) -> float | int:
    """The addend that leaves any value bit-for-bit unchanged: -0.0 for floats (x + -0.0 == x, even for
    x == -0.0), 0 for integers. Ranks that do not contribute to a slot fill it with this."""
    return -0.0 if dtype.is_floating_point else 0


def cpu_flat(t: torch.Tensor) -> torch.Tensor:
    """A fresh 1-D contiguous CPU copy of `real(t)`."""
    r = real(t)
    return r.to("cpu", copy=True, memory_format=torch.contiguous_format).reshape(-1)


def fill_except(buf: torch.Tensor, start: int, stop: int) -> None:
    """Fill `buf` with the neutral addend outside [start, stop)."""
    buf[:start].fill_(neutral(buf.dtype))
    buf[stop:].fill_(neutral(buf.dtype))


class HostCopy:
    """One caller tensor as a flat CPU buffer: its own storage when contiguous on CPU, else a copy.

    `flat` is what to push_pull; `write_back()` (a no-op for the zero-copy case) puts `flat` into the tensor.
    With `load=False` a copy starts uninitialised (for tensors the collective only writes). With `movable`, any
    dtype is accepted (the collective moves bytes and never sums them).
    """

    def __init__(self, name: str, tensor: torch.Tensor, load: bool = True, movable: bool = False):
        (check_movable if movable else check_tensor)(name, tensor)
        self.tensor = tensor
        self._real = real(tensor)
        self.kind = staging_kind(self._real.device, self._real.is_contiguous())
        self.zero_copy = self.kind == "in_place"
        self._device = None
        if self.kind == "device":
            self._device = DeviceStaging(self._real, load)
            self.flat = self._device.flat
        elif self.zero_copy:
            self.flat = self._real.view(-1)
        elif load:
            self.flat = cpu_flat(tensor)
        else:
            self.flat = torch.empty(self._real.numel(), dtype=self._real.dtype)

    def write_back(self) -> None:
        if self._device is not None:
            self._device.write_back()
        elif not self.zero_copy:
            self._real.copy_(self.flat.view(self._real.shape))


def copy_into(dst: torch.Tensor, src_flat: torch.Tensor) -> None:
    """Copy a flat slice of a sum into a caller's tensor (any device, any strides). A bool tensor gets
    `sum != 0` (gloo's sum of bools is a logical or): a byte of 2 in a bool's storage is no bool. A device tensor is
    written on the side stream (device/pinned.py's `copy_on_side`; the collective's launch ordered it after the
    caller's).
    """
    if dst.dtype == torch.bool:
        dst, src = dst.detach(), src_flat.view(dst.shape) != 0
    else:
        dst = real(dst)
        src = src_flat.view(dst.shape)
    if dst.device.type == "cpu":
        dst.copy_(src)
    else:
        copy_on_side(dst, src, dst.device)


def logical_counts(flat: torch.Tensor, op: str, world: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """A reduction of bools (`flat`: their uint8 bytes) as one sum of int32 counts of True, exact at any world
    size: returns the counts to sum and the function that writes the result back into `flat`, as gloo
    computes it: SUM, MAX, BOR -> any; MIN, PRODUCT, BAND -> all; BXOR -> an odd count."""
    counts = flat.to(torch.int32)

    def back() -> None:
        if op in ("MIN", "PRODUCT", "BAND"):
            flat.copy_(counts == world)
        elif op == "BXOR":
            flat.copy_(counts % 2 == 1)
        else:
            flat.copy_(counts != 0)

    return counts, back


def reduce_gathered(rows: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce the (world, n) rows of an all-gather with MIN/MAX/PRODUCT/BAND/BOR/BXOR."""
    if op == "MIN":
        return rows.amin(dim=0)
    if op == "MAX":
        return rows.amax(dim=0)
    if op == "PRODUCT":
        return rows.prod(dim=0).to(rows.dtype)  # prod promotes small integers to int64; wrap like the others
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    out = rows[0].clone()
    for row in rows[1:]:
        fn(out, row, out=out)
    return out
