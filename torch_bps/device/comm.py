"""DeviceLocalComm: reduce-scatter and all-gather among a machine's local ranks on the device (paper, section 4.2).

Each local rank allocates one device buffer at set-up and shares it with the others through CUDA IPC (torch's
`reduce_tensor` handles, exchanged through the store), so every rank can read every other's buffer. A round:

    every rank copies its contributions into its buffer's current half (on its stage stream), waits for that
    copy's event, and meets the others at a host barrier; then each rank sums its own slice from every peer's
    half in one pass (`triton_kernels.sum_scale_cast`: fp32 accumulation, the scale of an AVG and the cast to
    the output dtype, e.g. the wire's bf16, fused), or, in an all-gather, copies every peer's slice out.

Halves alternate between rounds: a rank writes a half again two rounds later, after a barrier it reaches only
once its reads of the peers' halves have finished (the copy's event wait covers them: one stream), so no
reader sees a half being overwritten. The barrier is a one-element all-gather of a host `LocalComm`: its futex
board, timeouts and dead-peer detection. The caller's stream is waited for on entry, and made to wait for the
stage stream on exit. Every stream and event goes through `CudaOps` (cuda_ops.py), which a test records.

`open_local_stage` decides, the same way on every local rank, whether the buffers can be shared (every pair of
ranks on one device, or on devices with peer access); if not, it returns None and the machine takes the
CPU-assisted path (pinned staging and `LocalComm` in host shared memory). Either way the log says which.

CPU tensors share through a /dev/shm file instead of IPC and run with no stream (unless a test hands it a recording
`CudaOps`): a stand-in with which the CPU tests run the exchange between real processes, the kernel under
TRITON_INTERPRET=1. Never used in training.
May import: torch, torch.distributed (the Store), torch_bps.errors, torch_bps.wire (dtype codes), torch_bps.local,
triton_kernels.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import pickle
import secrets

import torch
import torch.distributed as dist

from torch_bps.device.cuda_ops import CudaOps
from torch_bps.errors import BpsTimeoutError, ConfigError
from torch_bps.local.comm import LocalComm, LocalInputError, raise_if_peer_failed, split_range
from torch_bps.wire import DTYPE_CODES

log = logging.getLogger("torch_bps.local")

_ALIGN = 256  # bytes: every region starts on a boundary vector loads like
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNEL_MAX_INPUTS = 8
_REDUCE_SCATTER, _ALL_GATHER = 1, 2
_FAILED = -2  # a barrier's descriptor: this rank's collective failed before its all-gather (-1: invalid input)
_OP_NAMES = {_REDUCE_SCATTER: "reduce_scatter", _ALL_GATHER: "all_gather"}
_DTYPE_OF = {code: dt for dt, code in DTYPE_CODES.items()}


class DeviceLocalComm:
    """Reduce-scatter / all-gather among the `local_size` ranks of node `node_id`, in device memory.

    Args:
        store: the job's c10d Store, used during set-up only (buffer handles, the barrier's segment).
        local_rank, local_size, node_id: as LocalComm's.
        device: this rank's device (cuda:i; cpu only for the tests' stand-in).
        capacity_bytes: this rank's shared buffer; larger tensors take several rounds.
        timeout: the longest any wait may take, in seconds.
        kernel_backend: `sum_scale_cast`'s backend ("auto": Triton on CUDA; "triton" on CPU needs TRITON_INTERPRET=1).
        ops: its stream operations (cuda_ops.py; default torch.cuda's on a GPU, none on CPU; tests pass a recorder).

    Every local rank makes the same calls in the same order. Example:
        comm = DeviceLocalComm(store, local_rank, 2, "node0", "cuda:0")
        mine = comm.reduce_scatter(grad, scale=1 / world, out_dtype=torch.bfloat16)  # my slice, summed, for the wire
        comm.all_gather(summed_slice, out=grad)
    """

    def __init__(self, store: dist.Store, local_rank: int, local_size: int, node_id: str, device, *,
                 capacity_bytes: int = 64 << 20, timeout: float = 300.0, kernel_backend: str = "auto",
                 ops: CudaOps | None = None):  # fmt: skip
        if local_size < 2 or not 0 <= local_rank < local_size:
            raise ConfigError(
                f"DeviceLocalComm needs 2 or more local ranks, got local_rank={local_rank} of {local_size}"
            )
        self.local_rank, self.local_size, self.node_id = local_rank, local_size, str(node_id)
        self.device, self.timeout, self._backend = torch.device(device), timeout, kernel_backend
        L = local_size
        self.capacity_bytes = capacity_bytes // (2 * L * _ALIGN) * (2 * L * _ALIGN)
        if self.capacity_bytes == 0:
            raise ConfigError(f"capacity_bytes={capacity_bytes} is below {2 * L * _ALIGN}, the least for {L} ranks")
        self._half = self.capacity_bytes // 2
        self._region = self._half // L // _ALIGN * _ALIGN  # reduce-scatter: one region per destination rank
        self._round = 0
        self._calls = 0
        self._file = None
        if ops is None and self.device.type == "cuda":
            from torch_bps.device.pinned import cuda_ops

            ops = cuda_ops()
        self._ops = ops
        self._stream = ops.new_stream(self.device) if ops is not None else None  # this channel's stage stream
        self._barrier_comm = LocalComm(store, local_rank, L, f"{node_id}/device-stage", timeout=timeout,
                                       capacity_bytes=2 * L * L * 64)  # fmt: skip
        self._flags = torch.zeros(L, dtype=torch.int64)  # each rank's call descriptor, exchanged at barriers
        prefix = f"torch_bps/device-local/{node_id}"
        key = f"{prefix}/{store.add(f'{prefix}/instances/{local_rank}', 1)}"
        self._buf = self._allocate()
        # Sharing may fail where the devices' peer access said it would not (a sandbox without CUDA IPC): then every
        # rank learns it at the set-up barrier and raises the same LocalInputError (open_local_stage: the host path).
        problem, handle = None, None
        try:
            handle = self._export()
        except Exception as e:  # noqa: BLE001 - every rank hears of it at the barrier
            problem = f"cannot share its buffer ({type(e).__name__}: {e})"
        store.set(f"{key}/{local_rank}", pickle.dumps(handle))
        self._peers = []
        for p in range(L):
            try:
                self._peers.append(self._buf if p == local_rank else self._open(store, f"{key}/{p}", p))
            except BpsTimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 - likewise
                problem = problem or f"cannot map local rank {p}'s buffer ({type(e).__name__}: {e})"
        try:
            self._barrier("set-up", -1 if problem else 0, problem)  # every rank mapped every buffer, or all raise
        except LocalInputError:
            self.close()
            raise
        finally:
            if self._file is not None:  # mapped by every rank that could: the stand-in's file may go
                os.unlink(self._file)
                self._file = None

    # -- public operations -----------------------------------------------------------------------
    def slice_range(self, numel: int, local_rank: int | None = None) -> tuple[int, int]:
        """[start, end) of `local_rank`'s slice (default: this rank's), as LocalComm.slice_range."""
        return split_range(numel, self.local_size, self.local_rank if local_rank is None else local_rank)

    def reduce_scatter(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None, scale: float = 1.0,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
        """Sum `tensor` over the local ranks, times `scale`, cast to `out`'s dtype: this rank's slice.

        Args:
            tensor: 1-D contiguous on `device`, the same numel and dtype on every local rank.
            out: the slice's destination (may be this rank's slice of `tensor`); default a fresh tensor of
                `out_dtype` (default tensor's dtype).
            scale: multiplies the fp32 sum (1 / world for an AVG); integers take 1 only.
        Returns: `out`.
        """
        self._calls += 1
        L, me = self.local_size, self.local_rank
        problem = _problem(lambda: _check(tensor, self.device, "tensor"))
        bounds = [self.slice_range(tensor.numel() if problem is None else 0, p) for p in range(L)]
        lo_me, hi_me = bounds[me]
        if problem is None and out is None:
            out = torch.empty(hi_me - lo_me, dtype=out_dtype or tensor.dtype, device=self.device)
        problem = problem or _problem(lambda: _check(out, self.device, "out"))
        if problem is None and out.numel() != hi_me - lo_me:
            problem = f"out has {out.numel()} elements; local rank {me}'s slice has {hi_me - lo_me}"
        what = f"reduce_scatter call #{self._calls}"
        if problem is not None:
            self._barrier(what, -1, problem)  # every rank raises the same call's LocalInputError
        es, desc = tensor.element_size(), _descriptor(_REDUCE_SCATTER, tensor)
        chunk = self._region // es
        rounds = max(1, -(-(bounds[0][1] - bounds[0][0]) // chunk))
        with self._on_stage_stream():
            for j in range(rounds):
                h = (self._round + 1) % 2
                mine = self._regions(self._buf, h, tensor.dtype, chunk)
                for d, (lo, hi) in enumerate(bounds):
                    a = lo + j * chunk
                    if a < hi:
                        mine[d, : min(hi - a, chunk)].copy_(tensor[a : a + min(hi - a, chunk)])
                self._barrier(f"{what} round {j + 1}/{rounds}", desc if j == 0 else None)
                a = lo_me + j * chunk
                if a < hi_me:
                    n = min(hi_me - a, chunk)
                    parts = [self._regions(peer, h, tensor.dtype, chunk)[me, :n] for peer in self._peers]
                    self._sum(parts, out[j * chunk : j * chunk + n], scale)
        return out

    def all_gather(self, slice_: torch.Tensor, out: torch.Tensor, *, failed: bool = False) -> None:
        """Write every local rank's slice into `out` (1-D contiguous on `device`, same numel everywhere): device
        copies from the peers' buffers. `slice_` may be this rank's slice of `out` itself. `failed`: this rank's
        collective failed before its all-gather, so it has no slice to give: it meets its peers, and every rank
        raises LocalPeerFailedError (as LocalComm.all_gather_steps)."""
        self._calls += 1
        L, me = self.local_size, self.local_rank
        if failed:
            self._barrier(f"all_gather call #{self._calls}", _FAILED)
        problem = _problem(lambda: (_check(out, self.device, "out"), _check(slice_, self.device, "slice_")))
        bounds = [self.slice_range(out.numel() if problem is None else 0, p) for p in range(L)]
        if problem is None and (slice_.numel() != bounds[me][1] - bounds[me][0] or slice_.dtype != out.dtype):
            problem = (f"slice_ ({slice_.numel()} x {slice_.dtype}) is not local rank {me}'s slice of "
                       f"out ({bounds[me]} of {out.numel()} x {out.dtype})")  # fmt: skip
        what = f"all_gather call #{self._calls}"
        if problem is not None:
            self._barrier(what, -1, problem)
        es, desc = out.element_size(), _descriptor(_ALL_GATHER, out)
        chunk = self._half // es
        rounds = max(1, -(-(bounds[0][1] - bounds[0][0]) // chunk))
        with self._on_stage_stream():
            lo_me, hi_me = bounds[me]
            if slice_.data_ptr() != out[lo_me:hi_me].data_ptr():
                out[lo_me:hi_me].copy_(slice_)
            for j in range(rounds):
                h = (self._round + 1) % 2
                a = j * chunk
                if a < slice_.numel():
                    n = min(slice_.numel() - a, chunk)
                    self._block(self._buf, h, out.dtype, chunk)[:n].copy_(slice_[a : a + n])
                self._barrier(f"{what} round {j + 1}/{rounds}", desc if j == 0 else None)
                for p, (lo, hi) in enumerate(bounds):
                    a = lo + j * chunk
                    if p != me and a < hi:
                        n = min(hi - a, chunk)
                        out[a : a + n].copy_(self._block(self._peers[p], h, out.dtype, chunk)[:n])

    def close(self) -> None:
        """Leave: peers still mid-call get an error from the barrier."""
        self._barrier_comm.close()
        self._peers = []
        self._buf = None

    # -- internals -------------------------------------------------------------------------------
    def _regions(self, buf: torch.Tensor, h: int, dtype: torch.dtype, chunk: int) -> torch.Tensor:
        """Half h of `buf` as (L, chunk) rows of `dtype`, one per destination rank."""
        half = buf[h * self._half : (h + 1) * self._half]
        rows = half[: self.local_size * self._region].view(self.local_size, self._region)
        return rows.view(dtype)[:, :chunk]

    def _block(self, buf: torch.Tensor, h: int, dtype: torch.dtype, chunk: int) -> torch.Tensor:
        return buf[h * self._half : (h + 1) * self._half].view(dtype)[:chunk]

    def _sum(self, parts: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
        if parts[0].dtype in _KERNEL_DTYPES and out.dtype in _KERNEL_DTYPES and len(parts) <= _KERNEL_MAX_INPUTS:
            from triton_kernels import sum_scale_cast  # imports triton: only where a device local stage runs

            peers = any(p.device != out.device for p in parts)  # ranks on other GPUs, with peer access
            sum_scale_cast(parts, out, scale=scale, backend=self._backend, peers=peers)
            return
        parts = [p.to(out.device) for p in parts]  # (a no-op on one device)
        if scale != 1.0 and not parts[0].dtype.is_floating_point:
            raise ValueError(f"scale={scale} on {parts[0].dtype}: integers are summed, never scaled")
        total = torch.stack(parts).sum(0, dtype=parts[0].dtype if not parts[0].dtype.is_floating_point else None)
        out.copy_(total * scale if scale != 1.0 else total)

    def _barrier(self, what: str, descriptor: int | None = None, problem: str | None = None) -> None:
        """Every rank's queued work on its buffer is done, then every rank is here. With descriptors (a call's first
        round), every rank checks that all passed the same call, and raises the same LocalInputError if not (or
        LocalPeerFailedError, if a rank came with the descriptor _FAILED)."""
        if self._stream is not None:
            event = self._ops.new_event()
            self._ops.record(event, self._stream)
            self._ops.wait_host(event, self.timeout, f"local rank {self.local_rank}'s device work before {what}")
        me = self.local_rank
        self._flags.fill_(0)
        self._flags[me] = 0 if descriptor is None else descriptor
        try:
            self._barrier_comm.all_gather(self._flags[me : me + 1], self._flags)
        except Exception as e:
            e.add_note(f"torch_bps: node {self.node_id!r} local rank {me}: device local stage, {what}")
            raise
        self._round += 1
        if descriptor is None:
            return
        where = f"node {self.node_id!r} local rank {me}: device local stage, {what}"
        if problem is not None:
            raise LocalInputError(f"{where}: {problem}")
        flags = self._flags.tolist()
        if -1 in flags:
            raise LocalInputError(f"{where}: local rank(s) {[p for p, f in enumerate(flags) if f == -1]} passed "
                                  "invalid input (their errors say why)")  # fmt: skip
        raise_if_peer_failed(where, descriptor == _FAILED, [p for p, f in enumerate(flags) if f == _FAILED])
        if len(set(flags)) > 1:
            seen = "; ".join(f"rank {p}: {_describe(f)}" for p, f in enumerate(flags))
            raise LocalInputError(f"{where}: local ranks disagree ({seen})")

    @contextlib.contextmanager
    def _on_stage_stream(self):
        if self._stream is None:
            yield
            return
        ops = self._ops
        caller, written, done = ops.current_stream(self.device), ops.new_event(), ops.new_event()
        ops.record(written, caller)
        ops.wait_event(self._stream, written)  # the copies in read what the caller's stream wrote
        with ops.on_stream(self.device, self._stream):
            yield
        ops.record(done, self._stream)
        ops.wait_event(caller, done)  # and the caller reads the results after they are written

    def _allocate(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        self._file = os.path.join("/dev/shm", f"torch_bps_devstage_{os.getpid()}_{secrets.token_hex(4)}")
        fd = os.open(self._file, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.capacity_bytes)
            self._map = mmap.mmap(fd, self.capacity_bytes)
        finally:
            os.close(fd)
        return torch.frombuffer(self._map, dtype=torch.uint8)

    def _export(self):
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            return reduce_tensor(self._buf)  # (rebuild function, its arguments: the IPC handle among them)
        return self._file

    def _open(self, store: dist.Store, key: str, peer: int) -> torch.Tensor:
        handle = pickle.loads(_store_get(store, key, self.timeout, f"local rank {peer}'s buffer"))
        if handle is None:
            raise ValueError(f"local rank {peer} could not share it")
        if self.device.type == "cuda":
            rebuild, args = handle
            return rebuild(*args)
        fd = os.open(handle, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, self.capacity_bytes)
        finally:
            os.close(fd)
        self._peer_maps = [*getattr(self, "_peer_maps", []), mapped]
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _descriptor(op: int, t: torch.Tensor) -> int:
    """A call as one int64 every rank compares: numel, dtype, op."""
    return (t.numel() << 16) | (DTYPE_CODES.get(t.dtype, 255) << 8) | op


def _describe(descriptor: int) -> str:
    op, code, numel = descriptor & 0xFF, (descriptor >> 8) & 0xFF, descriptor >> 16
    return f"{_OP_NAMES.get(op, op)} {_DTYPE_OF.get(code, code)} numel={numel}"


def _problem(check) -> str | None:
    try:
        check()
    except ValueError as e:
        return str(e)
    return None


def _check(t: torch.Tensor, device: torch.device, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device != device or t.dim() != 1 or not t.is_contiguous():
        what = f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D contiguous tensor on {device}, got {what}")


def _store_get(store: dist.Store, key: str, timeout: float, what: str) -> bytes:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise BpsTimeoutError(f"set-up: waited up to {timeout:.1f} s for {what} (store key {key!r}): {e}") from e
    return store.get(key)


def device_identity(device: torch.device) -> str:
    """What names a GPU across processes whatever CUDA_VISIBLE_DEVICES says: its UUID."""
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_path(identities: list[str], can_access) -> tuple[str, str]:
    """("device" or "host", why): device when every pair of ranks shares a GPU or has peer access.

    `identities`: each local rank's device identity; `can_access(a, b)`: whether identity a's GPU can map b's.
    Example: choose_path(["gpu0", "gpu0"], lambda a, b: False) == ("device", "2 local ranks on 1 device(s)").
    """
    if any(not i or i.startswith("!") for i in identities):
        bad = [(r, i[1:]) for r, i in enumerate(identities) if not i or i.startswith("!")]
        return "host", "; ".join(f"local rank {r}: {why or 'no device'}" for r, why in bad)
    distinct = sorted(set(identities))
    for a in distinct:
        for b in distinct:
            if a != b and not can_access(a, b):
                return "host", f"no peer access from device {a} to device {b}"
    return "device", f"{len(identities)} local ranks on {len(distinct)} device(s)"


def open_local_stage(store: dist.Store, local_rank: int, local_size: int, node_id: str, device, **kwargs
                     ) -> DeviceLocalComm | None:  # fmt: skip
    """The device local stage when every local rank can share device memory with every other, else None (the
    CPU-assisted path). Every local rank takes the same decision, and logs it."""
    device = torch.device(device)
    prefix = f"torch_bps/device-local-path/{node_id}"
    key = f"{prefix}/{store.add(f'{prefix}/instances/{local_rank}', 1)}"
    try:
        mine = device_identity(device) if device.type == "cuda" else f"!tensors on {device}"
    except Exception as e:  # noqa: BLE001 - this rank cannot name its device: the host path, for every rank
        mine = f"!{type(e).__name__}: {e}"
    store.set(f"{key}/{local_rank}", mine)
    timeout = kwargs.get("timeout", 300.0)
    identities = [
        _store_get(store, f"{key}/{p}", timeout, f"local rank {p}'s device").decode() for p in range(local_size)
    ]
    visible = {}
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            with contextlib.suppress(Exception):
                visible[device_identity(torch.device("cuda", i))] = i

    def can_access(a: str, b: str) -> bool:
        return a in visible and b in visible and torch.cuda.can_device_access_peer(visible[a], visible[b])

    path, why = choose_path(identities, can_access)
    # Peer access seen from one process may differ from another's (what each may see): agree on the strictest.
    store.set(f"{key}/verdict/{local_rank}", path)
    verdicts = [_store_get(store, f"{key}/verdict/{p}", timeout, f"local rank {p}'s verdict").decode()
                for p in range(local_size)]  # fmt: skip
    if path == "device" and "host" in verdicts:
        path, why = "host", f"local rank {verdicts.index('host')} cannot share device memory with every peer"
    if path == "host":
        log.info("torch_bps: node %r local rank %d: local stage CPU-assisted (host shared memory): %s",
                 node_id, local_rank, why)  # fmt: skip
        return None
    try:
        comm = DeviceLocalComm(store, local_rank, local_size, node_id, device, **kwargs)
    except LocalInputError as e:  # every local rank raised it at the same barrier: all take the host path
        log.info("torch_bps: node %r local rank %d: local stage CPU-assisted (host shared memory): %s",
                 node_id, local_rank, e)  # fmt: skip
        return None
    log.info("torch_bps: node %r local rank %d: local stage on the device (CUDA IPC): %s", node_id, local_rank, why)
    return comm
