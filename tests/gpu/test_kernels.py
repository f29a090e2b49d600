"""The Triton kernels compiled and run on the device, against their torch references computed on the device.

Every dtype the engine uses (float32, float16, bfloat16, in and out), 1 to MAX_TENSORS inputs or destinations,
sizes at the block edges and a few MB, in place, local_sum's (L, n) view of shared rows, and offsets past 2**31
elements (the kernels compute 64-bit offsets). Tolerance: one unit in the last place of the output dtype, the
contract tests/kernels/test_triton_kernels.py holds the interpreted kernels to (the kernels do the reference's fp32
operations in the reference's order with FMA fusion off; only the final cast may round differently).

Dry run on CPU: TRITON_INTERPRET=1 runs these on CPU tensors under the interpreter (not a GPU result).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.gpu.common import kernel_device, requires
from triton_kernels import (
    BLOCK_SIZE,
    MAX_TENSORS,
    SUPPORTED_DTYPES,
    scale_cast_into,
    scale_cast_reference,
    sum_scale_cast,
    sum_scale_cast_reference,
)

DEVICE = kernel_device()
pytestmark = requires(DEVICE)
ON_GPU = DEVICE is not None and DEVICE.startswith("cuda")
TOLERANCE = {
    torch.float32: {"rtol": 2**-23, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
}
# Block edges, and (on the device) sizes of many blocks; the interpreter runs programs one by one, so it gets less.
SIZES = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 7] + ([(1 << 22) + 3] if ON_GPU else [])
PAIRS = list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_DTYPES))
SCALES = [1.0, 0.25, 1 / 3]


def randn(seed: int, count: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [(torch.randn(n, generator=g, device=DEVICE) * 4).to(dtype) for _ in range(count)]


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device == expected.device and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("count", range(1, MAX_TENSORS + 1))
def test_sum_scale_cast_on_device(in_dtype, out_dtype, count):
    for i, (n, scale) in enumerate(itertools.product(SIZES, SCALES)):
        inputs = randn(i, count, n, in_dtype)
        out = sum_scale_cast(inputs, scale=scale, out_dtype=out_dtype, backend="triton")
        assert out.device == inputs[0].device
        assert_within_one_ulp(out, sum_scale_cast_reference(inputs, scale, out_dtype))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("count", [1, 2, MAX_TENSORS])
def test_sum_scale_cast_in_place_on_device(dtype, count):
    for i, n in enumerate(SIZES):
        inputs = randn(100 + i, count, n, dtype)
        expected = sum_scale_cast_reference(inputs, 0.5)
        assert sum_scale_cast(inputs, inputs[0], scale=0.5, backend="triton") is inputs[0]
        assert_within_one_ulp(inputs[0], expected)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("count", [1, 2, 4, MAX_TENSORS])
def test_scale_cast_into_on_device(src_dtype, dst_dtype, count):
    for i, (n, scale) in enumerate(itertools.product(SIZES, SCALES)):
        (src,) = randn(200 + i, 1, n, src_dtype)
        dsts = [torch.full((n,), float("nan"), dtype=dst_dtype, device=DEVICE) for _ in range(count)]
        assert scale_cast_into(src, dsts, scale=scale, backend="triton") is dsts
        expected = scale_cast_reference(src, scale, dst_dtype)
        for dst in dsts:
            assert_within_one_ulp(dst, expected)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_scale_cast_into_in_place_on_device(dtype):
    for i, n in enumerate(SIZES):
        (src,) = randn(300 + i, 1, n, dtype)
        expected = scale_cast_reference(src, 1 / 8)
        scale_cast_into(src, src, scale=1 / 8, backend="triton")
        assert_within_one_ulp(src, expected)


def test_auto_backend_picks_triton_on_the_device():
    """backend="auto" (what the engine passes) must take the kernel on CUDA tensors, the torch path on CPU ones."""
    from triton_kernels._common import resolve_backend
    from triton_kernels.reduce import _sum_scale_cast_kernel

    expected = "triton" if ON_GPU else "torch"
    assert resolve_backend("auto", torch.device(DEVICE), _sum_scale_cast_kernel) == expected


@pytest.mark.parametrize("rows", [2, 4, MAX_TENSORS])
def test_local_sum_of_shared_rows_on_device(rows):
    """torch_bps.local.local_sum's fp32 path (the fused kernel) over an (L, n) view whose rows lie apart."""
    from torch_bps.local import local_sum

    n = 3 * BLOCK_SIZE + 5
    block = torch.randn(rows, n + 64, device=DEVICE)  # rows n + 64 apart: a strided view, each row contiguous
    parts = block[:, :n]
    out = torch.empty(n, device=DEVICE)
    local_sum(parts, out)
    assert_within_one_ulp(out, sum_scale_cast_reference(list(parts.unbind(0))))
    if rows == 2:  # into one of its own rows, as LocalComm sums in place (a + b == b + a: exact)
        local_sum(parts, parts[1])
        torch.testing.assert_close(parts[1], out, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="offsets past 2**31 elements: on the device only (12 GiB)")
def test_offsets_past_2_31_elements():
    """A bucket past 2**31 elements: with 32-bit offsets the tail would stay NaN (or the kernel would fault)."""
    n = 2**31 + 3 * BLOCK_SIZE + 5
    free, _ = torch.cuda.mem_get_info()
    if free < 14 * 2**30:
        pytest.skip(f"needs 14 GiB of free device memory, {free / 2**30:.1f} GiB free")
    head, tail = slice(0, 2**31), slice(2**31, n)
    a = torch.empty(n, dtype=torch.float16, device=DEVICE)
    b = torch.empty_like(a)
    a[head], a[tail], b[head], b[tail] = 1.0, 3.0, 2.0, 5.0
    out = torch.full_like(a, float("nan"))
    sum_scale_cast([a, b], out, scale=0.5)
    assert torch.all(out[tail] == 4.0).item(), "the elements past 2**31 were not summed"
    assert torch.all(out[head] == 1.5).item()
    del out
    scale_cast_into(a, b, scale=2.0)
    assert torch.all(b[tail] == 6.0).item() and torch.all(b[head] == 2.0).item()
