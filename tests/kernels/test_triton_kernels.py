"""triton_kernels: each Triton kernel and each CPU torch path against the plain torch reference; bad inputs.

The Triton kernels run on CPU tensors under the Triton interpreter. Triton reads TRITON_INTERPRET when a
kernel is decorated, i.e. when triton_kernels is imported, so `test_triton_kernels_under_interpreter`
runs this file's `TestTritonInterpreted` in a child pytest with the variable set: no other test module,
nor this process, ever sees it.

Tolerance: one unit in the last place of the output dtype (TOLERANCE). The kernels do the reference's
fp32 operations in the reference's order, so only the final cast may differ: the interpreter rounds
fp32 -> bf16 toward zero where GPUs (and torch) round to nearest even. The CPU torch path does exactly
the reference's operations and must match it bit for bit.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import REPO
from triton_kernels import (
    BLOCK_SIZE,
    MAX_TENSORS,
    SUPPORTED_DTYPES,
    scale_cast_into,
    scale_cast_reference,
    sum_scale_cast,
    sum_scale_cast_reference,
)
from triton_kernels._common import CPU_CHUNK_ELEMENTS, resolve_backend
from triton_kernels.reduce import _sum_scale_cast_kernel

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {
    torch.float32: {"rtol": 2**-23, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
}

dtypes = st.sampled_from(SUPPORTED_DTYPES)
counts = st.integers(1, MAX_TENSORS)
seeds = st.integers(0, 2**32 - 1)
scales = st.one_of(st.just(1.0), st.sampled_from([0.5, 1 / 3, 1 / 8]), st.floats(-4, 4, allow_nan=False, width=32))
# Tiny sizes, block-size edges and a few blocks: the interpreter runs each program in turn.
kernel_sizes = st.one_of(
    st.integers(0, 40),
    st.sampled_from([BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 7]),
    st.integers(41, 3 * BLOCK_SIZE),
)
# The CPU path works in chunks of CPU_CHUNK_ELEMENTS: cross their edges too.
cpu_sizes = st.one_of(
    kernel_sizes, st.sampled_from([CPU_CHUNK_ELEMENTS - 1, CPU_CHUNK_ELEMENTS + 1, 2 * CPU_CHUNK_ELEMENTS + 5])
)


def randn(seed: int, count: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` tensors of `n` normal values times 4, rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 4).to(dtype) for _ in range(count)]


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --- The Triton kernels, interpreted (collected only in the child process) ---------------------------------

if INTERPRETING:

    class TestTritonInterpreted:
        @settings(max_examples=150, deadline=None)
        @given(n=kernel_sizes, count=counts, in_dtype=dtypes, out_dtype=dtypes, scale=scales, seed=seeds)
        def test_sum_scale_cast(self, n, count, in_dtype, out_dtype, scale, seed):
            inputs = randn(seed, count, n, in_dtype)
            out = sum_scale_cast(inputs, scale=scale, out_dtype=out_dtype, backend="triton")
            assert_within_one_ulp(out, sum_scale_cast_reference(inputs, scale, out_dtype))

        @settings(max_examples=30, deadline=None)
        @given(n=kernel_sizes, count=counts, dtype=dtypes, scale=scales, seed=seeds)
        def test_sum_scale_cast_in_place(self, n, count, dtype, scale, seed):
            inputs = randn(seed, count, n, dtype)
            expected = sum_scale_cast_reference(inputs, scale)
            out = sum_scale_cast(inputs, inputs[0], scale=scale, backend="triton")
            assert out is inputs[0]
            assert_within_one_ulp(out, expected)

        @settings(max_examples=150, deadline=None)
        @given(n=kernel_sizes, count=counts, src_dtype=dtypes, dst_dtype=dtypes, scale=scales, seed=seeds)
        def test_scale_cast_into(self, n, count, src_dtype, dst_dtype, scale, seed):
            (src,) = randn(seed, 1, n, src_dtype)
            dsts = [torch.full((n,), float("nan"), dtype=dst_dtype) for _ in range(count)]
            assert scale_cast_into(src, dsts, scale=scale, backend="triton") is dsts
            expected = scale_cast_reference(src, scale, dst_dtype)
            for dst in dsts:
                assert_within_one_ulp(dst, expected)

        @settings(max_examples=30, deadline=None)
        @given(n=kernel_sizes, dtype=dtypes, scale=scales, seed=seeds)
        def test_scale_cast_into_in_place(self, n, dtype, scale, seed):
            (src,) = randn(seed, 1, n, dtype)
            expected = scale_cast_reference(src, scale)
            scale_cast_into(src, src, scale=scale, backend="triton")
            assert_within_one_ulp(src, expected)

else:

    def test_triton_kernels_under_interpreter():
        """Run TestTritonInterpreted in a child pytest with TRITON_INTERPRET=1."""
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::TestTritonInterpreted"]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        child = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        if child.returncode != 0:
            report = f"{child.stdout[-8000:]}\n{child.stderr[-4000:]}"
            pytest.fail(f"interpreted kernels failed (exit {child.returncode}):\n{report}", pytrace=False)
        print(child.stdout.strip().splitlines()[-1])


# --- The CPU torch path ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(n=cpu_sizes, count=counts, in_dtype=dtypes, out_dtype=dtypes, scale=scales, seed=seeds)
def test_sum_scale_cast_cpu(n, count, in_dtype, out_dtype, scale, seed):
    inputs = randn(seed, count, n, in_dtype)
    out = sum_scale_cast(inputs, scale=scale, out_dtype=out_dtype)
    assert out.shape == (n,) and out.dtype == out_dtype
    assert_bitwise_equal(out, sum_scale_cast_reference(inputs, scale, out_dtype))


@settings(max_examples=50, deadline=None)
@given(n=cpu_sizes, count=counts, in_dtype=dtypes, out_dtype=dtypes, scale=scales, seed=seeds)
def test_sum_scale_cast_cpu_into_given_out(n, count, in_dtype, out_dtype, scale, seed):
    inputs = randn(seed, count, n, in_dtype)
    out = torch.full((n,), float("nan"), dtype=out_dtype)
    assert sum_scale_cast(inputs, out, scale=scale) is out
    assert_bitwise_equal(out, sum_scale_cast_reference(inputs, scale, out_dtype))


@settings(max_examples=50, deadline=None)
@given(n=cpu_sizes, count=counts, dtype=dtypes, scale=scales, seed=seeds)
def test_sum_scale_cast_cpu_in_place(n, count, dtype, scale, seed):
    inputs = randn(seed, count, n, dtype)
    expected = sum_scale_cast_reference(inputs, scale)
    assert sum_scale_cast(inputs, inputs[0], scale=scale) is inputs[0]
    assert_bitwise_equal(inputs[0], expected)


@settings(max_examples=100, deadline=None)
@given(n=cpu_sizes, count=counts, src_dtype=dtypes, dst_dtype=dtypes, scale=scales, seed=seeds)
def test_scale_cast_into_cpu(n, count, src_dtype, dst_dtype, scale, seed):
    (src,) = randn(seed, 1, n, src_dtype)
    dsts = [torch.full((n,), float("nan"), dtype=dst_dtype) for _ in range(count)]
    assert scale_cast_into(src, dsts, scale=scale) is dsts
    expected = scale_cast_reference(src, scale, dst_dtype)
    for dst in dsts:
        assert_bitwise_equal(dst, expected)


@settings(max_examples=50, deadline=None)
@given(n=cpu_sizes, count=st.integers(2, MAX_TENSORS), dtype=dtypes, scale=scales, seed=seeds, data=st.data())
def test_scale_cast_into_cpu_with_src_among_dsts(n, count, dtype, scale, seed, data):
    # The local all-gather: the rank that owns the slice scales its own copy in place and fills the others.
    (src,) = randn(seed, 1, n, dtype)
    expected = scale_cast_reference(src, scale)
    dsts = [torch.empty(n, dtype=dtype) for _ in range(count)]
    dsts[data.draw(st.integers(0, count - 1), label="src position")] = src
    scale_cast_into(src, dsts, scale=scale)
    for dst in dsts:
        assert_bitwise_equal(dst, expected)


def test_single_tensor_destination_is_returned_as_given():
    src, dst = torch.arange(5.0), torch.empty(5, dtype=torch.float16)
    assert scale_cast_into(src, dst, scale=2.0) is dst
    assert dst.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_empty_tensors_are_a_no_op():
    out = sum_scale_cast([torch.empty(0), torch.empty(0)], out_dtype=torch.bfloat16)
    assert out.shape == (0,) and out.dtype == torch.bfloat16
    scale_cast_into(torch.empty(0), [torch.empty(0, dtype=torch.float16)], scale=3.0)


def test_torch_path_runs_on_other_devices():
    # Off the CPU the torch path does not chunk (each op would be a kernel launch); meta tensors stand in.
    n = 2 * CPU_CHUNK_ELEMENTS + 1
    inputs = [torch.empty(n, dtype=torch.float16, device="meta") for _ in range(3)]
    out = sum_scale_cast(inputs, inputs[0], scale=0.5, backend="torch")
    assert out is inputs[0]
    dsts = [torch.empty(n, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    assert scale_cast_into(inputs[0], dsts, scale=0.5, backend="torch") is dsts


def test_inputs_that_require_grad_are_accepted():
    inputs = [torch.ones(4, requires_grad=True) for _ in range(2)]
    assert sum_scale_cast(inputs, scale=0.5).tolist() == [1.0] * 4
    dst = torch.empty(4)
    scale_cast_into(inputs[0], dst, scale=3.0)
    assert dst.tolist() == [3.0] * 4


# --- Layering, dispatch and bad inputs -------------------------------------------------------------------------------


def test_package_imports_only_torch_triton_and_the_standard_library():
    package = os.path.join(REPO, "triton_kernels")
    for filename in sorted(f for f in os.listdir(package) if f.endswith(".py")):
        with open(os.path.join(package, filename)) as f:
            tree = ast.parse(f.read(), filename)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                allowed = root in ("torch", "triton", "triton_kernels") or root in sys.stdlib_module_names
                assert allowed, f"triton_kernels/{filename}:{node.lineno} imports {root}"


def test_auto_backend_runs_triton_on_cuda_and_torch_elsewhere():
    assert resolve_backend("auto", torch.device("cuda", 1), _sum_scale_cast_kernel) == "triton"
    assert resolve_backend("auto", torch.device("cpu"), _sum_scale_cast_kernel) == "torch"
    assert resolve_backend("torch", torch.device("cuda"), _sum_scale_cast_kernel) == "torch"


def test_triton_backend_on_cpu_needs_the_interpreter():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sum_scale_cast([torch.ones(4)], backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        scale_cast_into(torch.ones(4), torch.empty(4), backend="triton")


def _f32(n=8):
    return torch.zeros(n)


_buffer = torch.zeros(16)
BAD_SUM_CALLS = {
    "no inputs": (lambda: sum_scale_cast([]), ValueError, "1 to 8 tensors"),
    "nine inputs": (lambda: sum_scale_cast([_f32() for _ in range(9)]), ValueError, "1 to 8 tensors"),
    "bare tensor": (lambda: sum_scale_cast(_f32()), TypeError, "list or tuple"),
    "not a tensor": (lambda: sum_scale_cast([_f32(), [0.0] * 8]), TypeError, r"inputs\[1\] must be a torch.Tensor"),
    "numel mismatch": (lambda: sum_scale_cast([_f32(8), _f32(9)]), ValueError, r"inputs\[1\] has 9 elements"),
    "out numel": (lambda: sum_scale_cast([_f32(8)], _f32(7)), ValueError, "out has 7 elements"),
    "int dtype": (lambda: sum_scale_cast([torch.zeros(8, dtype=torch.int32)]), ValueError, "torch.int32; supported"),
    "float64": (lambda: sum_scale_cast([torch.zeros(8, dtype=torch.float64)]), ValueError, "float64; supported"),
    "mixed dtypes": (
        lambda: sum_scale_cast([_f32(), torch.zeros(8, dtype=torch.float16)]),
        ValueError,
        "all must share a dtype",
    ),
    "bad out dtype": (lambda: sum_scale_cast([_f32()], out_dtype=torch.int8), ValueError, "out_dtype is torch.int8"),
    "out_dtype vs out": (
        lambda: sum_scale_cast([_f32()], _f32(), out_dtype=torch.float16),
        ValueError,
        "out_dtype is torch.float16 but out is torch.float32",
    ),
    "non-contiguous": (lambda: sum_scale_cast([_f32(16)[::2]]), ValueError, "must be contiguous"),
    "2-D": (lambda: sum_scale_cast([torch.zeros(2, 4)]), ValueError, r"must be 1-D, got shape \(2, 4\)"),
    "device mismatch": (
        lambda: sum_scale_cast([_f32(), torch.zeros(8, device="meta")]),
        ValueError,
        "all must share a device",
    ),
    "out device": (lambda: sum_scale_cast([_f32()], torch.zeros(8, device="meta")), ValueError, "out is on meta"),
    "peers on the torch path": (
        lambda: sum_scale_cast([_f32(), torch.zeros(8, device="meta")], _f32(), peers=True, backend="torch"),
        ValueError,
        "read by the Triton kernel only",
    ),
    "peers, numel mismatch": (
        lambda: sum_scale_cast([_f32(), torch.zeros(8, device="meta")], _f32(9), peers=True),
        ValueError,
        "out has 9 elements, inputs",
    ),
    "out is a later input": (
        lambda: sum_scale_cast([_buffer[:8], _buffer[8:]], _buffer[8:]),
        ValueError,
        r"out overlaps inputs\[1\]",
    ),
    "out straddles inputs": (
        lambda: sum_scale_cast([_buffer[:8], _buffer[8:]], _buffer[4:12]),
        ValueError,
        r"out overlaps inputs\[0\]",
    ),
    "scale is a tensor": (lambda: sum_scale_cast([_f32()], scale=torch.tensor(2.0)), TypeError, "real number"),
    "unknown backend": (lambda: sum_scale_cast([_f32()], backend="cuda"), ValueError, "backend must be one of"),
}
BAD_SCALE_CAST_CALLS = {
    "no dsts": (lambda: scale_cast_into(_f32(), []), ValueError, "1 to 8 tensors"),
    "nine dsts": (lambda: scale_cast_into(_f32(), [_f32() for _ in range(9)]), ValueError, "1 to 8 tensors"),
    "numel mismatch": (lambda: scale_cast_into(_f32(8), _f32(9)), ValueError, r"dsts\[0\] has 9 elements"),
    "dst numel mismatch": (lambda: scale_cast_into(_f32(8), [_f32(8), _f32(9)]), ValueError, r"dsts\[1\] has 9"),
    "mixed dst dtypes": (
        lambda: scale_cast_into(_f32(), [_f32(), torch.zeros(8, dtype=torch.bfloat16)]),
        ValueError,
        "all must share a dtype",
    ),
    "int src": (lambda: scale_cast_into(torch.zeros(8, dtype=torch.int64), _f32()), ValueError, "src is torch.int64"),
    "non-contiguous dst": (lambda: scale_cast_into(_f32(8), _f32(16)[::2]), ValueError, "must be contiguous"),
    "device mismatch": (
        lambda: scale_cast_into(_f32(), torch.zeros(8, device="meta")),
        ValueError,
        "all must share a device",
    ),
    "dsts overlap": (
        lambda: scale_cast_into(_f32(8), [_buffer[:8], _buffer[4:12]]),
        ValueError,
        r"dsts\[0\] overlaps dsts\[1\]",
    ),
    "same dst twice": (lambda: scale_cast_into(_f32(8), [_buffer[:8], _buffer[:8]]), ValueError, "overlaps"),
    "dst straddles src": (lambda: scale_cast_into(_buffer[:8], _buffer[4:12]), ValueError, "overlaps src"),
    "dst is src as another dtype": (
        lambda: scale_cast_into(_buffer[:8], _buffer[:8].view(torch.float16)[:8]),
        ValueError,
        "overlaps src",
    ),
    "scale is None": (lambda: scale_cast_into(_f32(), _f32(), scale=None), TypeError, "real number"),
}


@pytest.mark.parametrize("call,error,match", BAD_SUM_CALLS.values(), ids=BAD_SUM_CALLS.keys())
def test_sum_scale_cast_rejects(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("call,error,match", BAD_SCALE_CAST_CALLS.values(), ids=BAD_SCALE_CAST_CALLS.keys())
def test_scale_cast_into_rejects(call, error, match):
    with pytest.raises(error, match=match):
        call()
