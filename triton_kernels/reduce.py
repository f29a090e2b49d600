"""Local reduction of the intra-machine hierarchy: out = cast(scale * (in_0 + ... + in_{N-1}), out.dtype).

The sum is accumulated in fp32 whatever the input and output dtypes, in input order, then scaled once
(scale = 1/world_size averages) and cast once. One fused pass on CUDA tensors (Triton), a few cache-blocked
torch passes on CPU tensors; `sum_scale_cast_reference` is the plain torch statement of the result.
May import: torch, triton and the standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from triton_kernels import _common


@triton.jit
def _sum_scale_cast_kernel(in_ptrs, out_ptr, n_elements, scale, BLOCK_SIZE: tl.constexpr):
    # in_ptrs is a tuple of N pointers: N is part of the specialization (one compiled kernel per count),
    # the loop unrolls, and no dummy pointer stands in for absent inputs. Stacking the inputs into one
    # tensor instead would cost a copy of all of them before the kernel even runs.
    pid = tl.program_id(axis=0)
    # 64-bit offsets: a bucket may hold more than 2**31 elements.
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    acc = tl.load(in_ptrs[0] + offsets, mask=mask).to(tl.float32)
    for i in tl.static_range(1, len(in_ptrs)):
        acc += tl.load(in_ptrs[i] + offsets, mask=mask).to(tl.float32)
    out = acc * scale
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def sum_scale_cast(
    inputs: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    peers: bool = False,
) -> torch.Tensor:
    """Sum `inputs` in fp32, multiply by `scale` and cast into `out`: the local reduce of one partition.

    Args:
        inputs: 1 to 8 contiguous 1-D tensors of one dtype (float32, float16 or bfloat16), numel and device.
        out: where to write; allocated when None. It may be `inputs[0]` itself (reduce in place) and must
            not otherwise overlap an input.
        scale: multiplies the fp32 sum before the cast (e.g. 1 / world_size to average).
        out_dtype: dtype of an allocated `out` (default: the inputs' dtype); must match `out` if both given.
        backend: "auto" (Triton on CUDA, torch ops elsewhere), "torch", or "triton" (on CPU tensors only
            when TRITON_INTERPRET=1 was set before triton_kernels was imported: for tests).
        peers: inputs may lie on other GPUs than `out` (buffers of other processes mapped through CUDA IPC, which
            enables peer access): the kernel runs on `out`'s GPU and reads them over the peer link. Triton only.

    Returns:
        `out`.

    Example:
        >>> grads = [torch.ones(4, dtype=torch.float16) for _ in range(4)]
        >>> sum_scale_cast(grads, scale=0.25, out_dtype=torch.float32)
        tensor([1., 1., 1., 1.])
    """
    _common.check_tensors("inputs", inputs, same_device=not peers)
    first = inputs[0]
    if out is None:
        dtype = first.dtype if out_dtype is None else out_dtype
        if dtype not in _common.SUPPORTED_DTYPES:
            raise ValueError(f"out_dtype is {dtype}; supported: float32, float16, bfloat16")
        out = torch.empty(first.numel(), dtype=dtype, device=first.device)
    else:
        _common.check_tensor("out", out)
        if peers and first.numel() != out.numel():
            raise ValueError(f"out has {out.numel()} elements, inputs[0] has {first.numel()}")
        if not peers:
            _common.check_same_device_and_numel("out", out, "inputs[0]", first)
        if out_dtype is not None and out_dtype != out.dtype:
            raise ValueError(f"out_dtype is {out_dtype} but out is {out.dtype}")
        named = [(f"inputs[{i}]", t) for i, t in enumerate(inputs)]
        _common.check_no_overlap(("out", out), named, may_alias=("inputs[0]",))
    scale = _common.check_scale(scale)
    backend = _common.resolve_backend(backend, out.device, _sum_scale_cast_kernel)
    if peers and any(t.device != out.device for t in inputs) and backend != "triton":
        raise ValueError(f"inputs on other devices than out ({out.device}) are read by the Triton kernel only")
    if out.numel() == 0:
        return out
    if backend == "triton":
        _launch(inputs, out, scale)
    else:
        _sum_scale_cast_torch(inputs, out, scale)
    return out


def _launch(inputs: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    n_elements = out.numel()
    grid = (triton.cdiv(n_elements, _common.BLOCK_SIZE),)
    with _common.device_guard(out):
        # No FMA to fuse here; pinning fusion off keeps the rounding the reference's, whatever triton's default.
        _sum_scale_cast_kernel[grid](
            tuple(inputs), out, n_elements, scale, BLOCK_SIZE=_common.BLOCK_SIZE, enable_fp_fusion=False
        )


@torch.no_grad()
def _sum_scale_cast_torch(inputs: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    # Accumulate in `out` when it is fp32, else in a chunk-sized fp32 scratch; per chunk: N - 1 adds
    # (N with reduced-precision inputs: fp32 += fp16 widens exactly), then one scale-and-cast.
    scratch = None
    if out.dtype != torch.float32:
        scratch = torch.empty(_common.chunk_size(out.numel(), out.device), dtype=torch.float32, device=out.device)
    for part in _common.chunks(out.numel(), out.device):
        dst = out[part]
        acc = dst if scratch is None else scratch[: dst.numel()]
        _accumulate([t[part] for t in inputs], acc)
        if acc is not dst:
            torch.mul(acc, scale, out=dst)
        elif scale != 1.0:
            dst.mul_(scale)


def _accumulate(parts: Sequence[torch.Tensor], acc: torch.Tensor) -> None:
    """acc = parts[0] + parts[1] + ... in fp32, left to right; acc may be parts[0] itself."""
    rest = parts[1:]
    if parts[0].dtype == torch.float32 and rest:
        torch.add(parts[0], rest[0], out=acc)
        rest = rest[1:]
    elif acc.data_ptr() != parts[0].data_ptr():
        acc.copy_(parts[0])
    for t in rest:
        acc.add_(t)


def sum_scale_cast_reference(
    inputs: Sequence[torch.Tensor], scale: float = 1.0, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Return cast(scale * sum(inputs), out_dtype) in plain torch: fp32 sum in input order, then scale, then cast.

    Example:
        >>> sum_scale_cast_reference([torch.ones(2), torch.ones(2)], scale=0.5)
        tensor([1., 1.])
    """
    acc = inputs[0].to(torch.float32)
    for t in inputs[1:]:
        acc = acc + t.to(torch.float32)
    return (acc * scale).to(inputs[0].dtype if out_dtype is None else out_dtype)
