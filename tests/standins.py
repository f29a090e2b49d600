"""Stand-ins shared by the tests of CUDA paths on machines without a GPU: a recording `CudaOps` (pg/cuda_ops.py)
that copies CPU tensors at once and logs every stream, event and copy, in order."""

from __future__ import annotations

import contextlib
import threading

import torch

DEVICE = torch.device("cuda", 0)  # a label only: the recorder never touches a GPU


class _Event:
    def __init__(self, n: int):
        self.n, self.stream = n, None


class RecordingOps:
    """CudaOps that performs copies at once on CPU tensors and logs every operation, in order, as tuples."""

    def __init__(self):
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._events = 0
        self._pinned: list[torch.Tensor] = []
        self._current = threading.local()

    def _add(self, *entry) -> None:
        with self._lock:
            self.log.append(entry)

    def current_stream(self, device):
        return getattr(self._current, "stream", "caller")

    def side_stream(self, device):
        return "side"

    def new_event(self):
        with self._lock:
            self._events += 1
            return _Event(self._events)

    def record(self, event, stream):
        event.stream = stream
        self._add("record", stream, event.n)

    def wait_event(self, stream, event):
        assert event.stream is not None, "waited for an event never recorded"
        self._add("wait", stream, event.n)

    def wait_host(self, event, timeout, what):
        assert event.stream is not None, "host-waited for an event never recorded"
        self._add("host_wait", event.n)

    def _is_host(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(b.data_ptr() <= p < b.data_ptr() + b.numel() for b in self._pinned)

    def copy(self, dst, src, stream):
        dst.copy_(src)
        kind = "d2h" if self._is_host(dst) else "h2d" if self._is_host(src) else "d2d"
        self._add("copy", stream, kind, src.numel())

    def record_stream(self, tensor, stream):
        self._add("record_stream", stream)

    def pinned(self, nbytes):
        self._add("pinned", self.current_stream(DEVICE))  # "side": allocated with the device set (on_stream)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._pinned.append(buf)
        return buf

    @contextlib.contextmanager
    def on_stream(self, device, stream):
        before = self.current_stream(device)
        self._current.stream = stream
        self._add("enter", stream)
        try:
            yield
        finally:
            self._current.stream = before

    def future(self, devices):
        self._add("future", tuple(str(d) for d in devices))
        return torch.futures.Future()

    def index(self, entry: tuple) -> int:
        return self.log.index(entry)

    def pushes(self) -> list[int]:
        return [e[1] for e in self.log if e[0] == "push"]
