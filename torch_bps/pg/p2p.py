"""Point-to-point, all-to-all and monitored barriers of a "byteps" group, on an internal gloo group.

A summation service has no good way to move bytes from one rank to another (every byte would cross a
server and be summed with -0.0), so these go worker to worker through gloo. The gloo group is made when the
"byteps" group is, by every rank of it, on the same store under a prefix of its own: the user never sees it.
Its Works are gloo's (they honour `wait(timeout)`; `recv_anysource`'s knows the sender).

May import: torch, torch_bps.futures, torch_bps.pg.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from torch_bps.futures import fail
from torch_bps.pg.staging import BACKEND
from torch_bps.pg.work import make_work

_PREFIX = "torch_bps/p2p"


class GlooSide:
    """The gloo group beside one "byteps" group: created collectively, by every rank of the group."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX, store), rank, size, timeout)
        self._timeout = timeout.total_seconds()

    def set_timeout(self, timeout: timedelta) -> None:
        self._gloo._set_default_timeout(timeout)
        self._timeout = timeout.total_seconds()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._gloo.send(_check(tensors, "send"), dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._gloo.recv(_check(tensors, "recv"), src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        return self._gloo.recv_anysource(_check(tensors, "recv_anysource"), tag)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts) -> dist.Work:  # fmt: skip
        _check([output, input], "all_to_all_single")
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts) -> dist.Work:
        """The list form through one all_to_all_single of the inputs laid end to end."""
        _check(outputs + inputs, "all_to_all")
        if len({t.dtype for t in outputs + inputs}) > 1:
            raise TypeError(f"all_to_all: tensors of different dtypes mixed ('{BACKEND}' backend)")
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype, device=flat_in.device)
        work = self._gloo.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs],
                                        [t.numel() for t in inputs], opts)  # fmt: skip
        future = torch.futures.Future()

        def unpack(done: torch.futures.Future) -> None:
            try:
                done.wait()
                offset = 0
                for t in outputs:
                    t.copy_(flat_out[offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()
            except BaseException as e:  # noqa: BLE001 - the collective fails with it
                fail(future, e)
                return
            future.set_result(outputs)

        work.get_future().add_done_callback(unpack)
        # A C++ Work (not a Python subclass of dist.Work, whose overrides C++ callers never reach).
        return make_work(future, self._timeout, f"all_to_all on the internal gloo group of '{BACKEND}'")

    def monitored_barrier(self, opts, wait_all_ranks: bool) -> None:
        self._gloo.monitored_barrier(opts.timeout, wait_all_ranks=wait_all_ranks)


def _check(tensors: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"{op}: expected dense tensors ('{BACKEND}' backend, through its internal gloo group)")
    return tensors
