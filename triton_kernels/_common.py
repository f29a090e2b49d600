"""Checks and dispatch shared by the kernels: supported dtypes, argument validation, backend choice.

May import: torch, triton and the standard library only.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# At most this many inputs per reduction (and destinations per broadcast): one per local GPU of a machine.
# Each count is its own kernel specialization, so the set of compiled kernels stays small and AOT-tested.
MAX_TENSORS = 8
# Elements per Triton program: 8 per thread with the default 4 warps, i.e. one 128-bit access per fp16 load.
BLOCK_SIZE = 1024
# The CPU path works through buffers in chunks of this many elements: the fp32 accumulator (1 MiB) stays in
# cache between the passes over a chunk, and no temporary is ever as large as a bucket.
CPU_CHUNK_ELEMENTS = 1 << 18
BACKENDS = ("auto", "torch", "triton")


def check_tensors(name: str, tensors: Sequence[torch.Tensor], same_device: bool = True) -> None:
    """Raise unless `tensors` are 1..MAX_TENSORS contiguous 1-D tensors sharing numel, dtype and (unless
    `same_device` is False) device."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"{name} must hold 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    first = tensors[0]
    for i, t in enumerate(tensors):
        check_tensor(f"{name}[{i}]", t)
        if same_device and t.device != first.device:
            raise ValueError(f"{name}[{i}] is on {t.device}, {name}[0] on {first.device}: all must share a device")
        if t.dtype != first.dtype:
            raise ValueError(f"{name}[{i}] is {t.dtype}, {name}[0] is {first.dtype}: all must share a dtype")
        if t.numel() != first.numel():
            raise ValueError(f"{name}[{i}] has {t.numel()} elements, {name}[0] has {first.numel()}")


def check_tensor(name: str, t: torch.Tensor) -> None:
    """Raise unless `t` is a contiguous 1-D tensor of a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} is {t.dtype}; supported: float32, float16, bfloat16")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)} (flatten it with .view(-1))")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()} (copy it with .contiguous())")


def check_same_device_and_numel(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless `t` matches `ref` in device and number of elements."""
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, {ref_name} on {ref.device}: all must share a device")
    if t.numel() != ref.numel():
        raise ValueError(f"{name} has {t.numel()} elements, {ref_name} has {ref.numel()}")


def check_scale(scale: float) -> float:
    """Return `scale` as a Python float; raise TypeError unless it is a real number."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    return float(scale)


def check_no_overlap(
    written: tuple[str, torch.Tensor], others: Sequence[tuple[str, torch.Tensor]], may_alias: Sequence[str] = ()
) -> None:
    """Raise if the memory of `written` overlaps any of `others`.

    A tensor named in `may_alias` may be exactly `written` (same start, dtype and numel: elementwise in place),
    never partially overlap it.
    """
    name, w = written
    for other_name, o in others:
        if not _overlaps(w, o):
            continue
        exact = w.data_ptr() == o.data_ptr() and w.dtype == o.dtype and w.numel() == o.numel()
        if exact and other_name in may_alias:
            continue
        hint = f" (only {' or '.join(may_alias)} may be {name} itself, element for element)" if may_alias else ""
        raise ValueError(f"{name} overlaps {other_name} in memory{hint}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device.type == "meta":  # meta tensors have no memory
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def resolve_backend(backend: str, device: torch.device, kernel: object) -> str:
    """Return "triton" or "torch" for tensors on `device`: Triton on CUDA, torch ops elsewhere.

    backend="triton" on CPU tensors needs the kernels interpreted, i.e. TRITON_INTERPRET=1 set before
    triton_kernels was imported (triton reads it when a kernel is decorated).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not _interpreted(kernel):
        raise ValueError(
            f"backend='triton' on {device.type} tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing triton_kernels (tests only; it is slow)"
        )
    return backend


def _interpreted(kernel: object) -> bool:
    # Imported here, not at the top: triton's interpreter imports numpy, which a GPU machine may not have and
    # the compiled kernels do not need.
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no numpy: then no interpreter either
        return False
    return isinstance(kernel, InterpretedFunction)


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make `t`'s GPU current for a launch: Triton launches on the current device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def chunk_size(n_elements: int, device: torch.device) -> int:
    """Elements per chunk of the torch path: cache-sized on CPU; one chunk elsewhere (each op is a launch)."""
    return min(n_elements, CPU_CHUNK_ELEMENTS) if device.type == "cpu" else n_elements


def chunks(n_elements: int, device: torch.device) -> Iterator[slice]:
    """Yield slices covering range(n_elements), chunk_size() elements each."""
    step = max(1, chunk_size(n_elements, device))
    for start in range(0, n_elements, step):
        yield slice(start, min(n_elements, start + step))
