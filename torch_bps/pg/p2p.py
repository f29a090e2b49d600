"""Point-to-point, all-to-all and monitored barriers of a "byteps" group, on an internal gloo group.

A summation service has no good way to move bytes from one rank to another (every byte would cross a
server and be summed with -0.0), so these go worker to worker through gloo. The gloo group is made when the
"byteps" group is, by every rank of it, on the same store under a prefix of its own: the user never sees it.
Its Works are gloo's (they honour `wait(timeout)`; `recv_anysource`'s knows the sender). gloo's send and recv
read and write host memory only, so CUDA tensors go through CPU copies here (all-to-all has gloo's own CUDA path).

May import: torch, torch_bps.futures, torch_bps.pg, torch_bps.device.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_bps.device.pinned import completion_context, copy_on_side, cuda_ops, order_after_caller
from torch_bps.futures import fail
from torch_bps.pg.staging import BACKEND
from torch_bps.pg.work import make_work

_PREFIX = "torch_bps/p2p"


class GlooSide:
    """The gloo group beside one "byteps" group: created collectively, by every rank of the group."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, attempt: str):
        # torchrun restarts reuse the store: each attempt (Launch.attempt) meets under keys of its own, never the
        # last attempt's addresses.
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{_PREFIX}/{attempt}", store), rank, size, timeout)
        self._timeout = timeout.total_seconds()

    def set_timeout(self, timeout: timedelta) -> None:
        self._gloo._set_default_timeout(timeout)
        self._timeout = timeout.total_seconds()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        _check(tensors, "send")
        # gloo's send and recv hand the tensor's data pointer to a TCP socket as host memory, whatever its
        # device: a CUDA tensor travels as a CPU copy (made on the caller's stream, so it sees what that
        # stream wrote; gloo's Work keeps the copy alive until it is sent).
        return self._gloo.send([_on_host(t) for t in tensors], dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        _check(tensors, "recv")
        if all(t.device.type == "cpu" for t in tensors):
            return self._gloo.recv(tensors, src, tag)
        hosts = [_on_host(t, load=False) for t in tensors]
        device = next(t.device for t in tensors if t.device.type != "cpu")
        work = self._gloo.recv(hosts, src, tag)
        what = f"recv from rank {src} on the internal gloo group of '{BACKEND}'"
        return copied_back(work, hosts, tensors, device, what, self._timeout)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        _check(tensors, "recv_anysource")
        if any(t.device.type != "cpu" for t in tensors):
            # torch reads the sender from gloo's own Work (sourceRank), which a copy back cannot pass on.
            raise TypeError(f"recv from any source: CUDA tensors are not supported ('{BACKEND}' backend); "
                            "name the source rank, or receive into a CPU tensor")  # fmt: skip
        return self._gloo.recv_anysource(tensors, tag)

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
        # With the outputs' devices: on CUDA its event follows the copies below (gloo runs this callback on a stream
        # that waits for its own work), and a reader's stream waits for it.
        future = cuda_ops().future([t.device for t in outputs])

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


def copied_back(work: dist.Work, hosts: list[torch.Tensor], tensors: list[torch.Tensor], device: torch.device,
                what: str, timeout: float) -> dist.Work:  # fmt: skip
    """A Work that completes once gloo's `work` received into `hosts` and they are copied into `tensors` (on
    `device`, whose side stream the caller ordered after its own at launch: `order_after_caller`).

    gloo's recv Work has no future to chain on, so a thread of its own waits for it (p2p on CUDA tensors is
    rare; a collective never takes this path). The copies go on the side stream with the device set, and the
    Future, which carries the device, records its event after them."""
    future = cuda_ops().future([t.device for t in tensors])
    order_after_caller(device)  # on the caller's thread: the copies back land after what it queued before the recv

    def wait_and_copy() -> None:
        try:
            work.wait()
            with completion_context(device):
                for t, h in zip(tensors, hosts, strict=True):
                    copy_on_side(t, h, device)
                future.set_result(tensors)
        except BaseException as e:  # noqa: BLE001 - the receive fails with it
            fail(future, e)

    threading.Thread(target=wait_and_copy, name="torch_bps-recv", daemon=True).start()
    return make_work(future, timeout, what)


def _on_host(t: torch.Tensor, load: bool = True) -> torch.Tensor:
    """`t` itself on the CPU; elsewhere a CPU copy of it (`load`) or a CPU tensor of its shape to receive into."""
    if t.device.type == "cpu":
        return t
    return t.detach().cpu() if load else torch.empty(t.shape, dtype=t.dtype)


def _check(tensors: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"{op}: expected dense tensors ('{BACKEND}' backend, through its internal gloo group)")
    return tensors
