"""Wire precision's pieces (torch_bps/engine/precision.py): which tensors are cast, and the staging buffers."""

from __future__ import annotations

import torch

from torch_bps.engine.precision import StagingBuffers, travels_as, wire_dtype
from torch_bps.wire import Mode


def test_only_fp32_sums_travel_as_the_wire_dtype():
    bf16 = wire_dtype("bf16")
    assert bf16 is torch.bfloat16 and wire_dtype("fp16") is torch.float16 and wire_dtype("fp32") is None
    f32 = torch.zeros(4)
    assert travels_as(f32, Mode.SUM, bf16) is torch.bfloat16
    assert travels_as(f32, Mode.COPY, bf16) is torch.float32  # gathers deliver their bytes exactly
    assert travels_as(f32, Mode.SUM, None) is torch.float32
    for other in (torch.float64, torch.float16, torch.int32, torch.int64):
        assert travels_as(torch.zeros(4, dtype=other), Mode.SUM, bf16) is other


def test_a_staging_buffer_is_never_shared_while_taken_and_reused_once_given_back():
    staging = StagingBuffers()
    exact = torch.tensor([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(2.0**20) - 1])
    a, b = staging.cast(exact, torch.bfloat16), staging.cast(exact, torch.bfloat16)
    assert a.data_ptr() != b.data_ptr()  # two collectives in flight
    # Rounded to nearest, ties to even, as torch rounds: the two ties go to 1 and to 1 + 2**-6.
    assert torch.equal(a, exact.to(torch.bfloat16)) and a.tolist() == [1.0, 1.0, 1.0 + 2.0**-6, -(2.0**20)]
    staging.give(a)
    assert staging.cast(exact, torch.bfloat16).data_ptr() == a.data_ptr()
    assert staging.cast(exact, torch.float16).dtype is torch.float16  # by dtype too: a new one
