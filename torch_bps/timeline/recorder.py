"""Record a worker's timeline for a window of collectives (BPS_TRACE=DIR[,START:END]).

A Runtime counts its collectives from 0. With BPS_TRACE set, the client starts recording when collective
START is issued, and once collectives START..END-1 are all done (or at close, whichever comes first) it stops
and DIR/worker-RANK.json is written (worker-RANK-GROUP.json for groups other than the default one), from a
completion thread. Default window: collectives 0..49. With the embedded servers, each writes its own file
into DIR too (bps-server --trace); `python -m torch_bps.timeline DIR -o timeline.json` merges them.

Costs: while the window is open, a clock read and a locked append per partition step in the IO thread, and
a few Python lines per collective; outside it, one check per collective and one branch per step.

May import: the standard library, torch_bps.errors, torch_bps.futures and torch_bps.timeline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from torch_bps.errors import ConfigError
from torch_bps.futures import Done
from torch_bps.timeline import events

log = logging.getLogger("torch_bps.timeline")

CAPACITY = 1 << 18  # events the client records in a window at most (56 bytes each); more are counted as dropped
DEFAULT_WINDOW = (0, 50)


@dataclass(frozen=True)
class TimelineSpec:
    """Where the files go and which collectives: [start, end)."""

    directory: str
    start: int = DEFAULT_WINDOW[0]
    end: int = DEFAULT_WINDOW[1]

    @classmethod
    def parse(cls, value: str) -> TimelineSpec | None:
        """Parse BPS_TRACE: "" -> None, "DIR" -> the default window, "DIR,START:END" -> collectives [START, END).

        Example: `TimelineSpec.parse("/tmp/trace,10:20")` -> TimelineSpec("/tmp/trace", 10, 20).
        """
        if not value:
            return None
        directory, _, window = value.rpartition(",")
        if not directory or ":" not in window:
            return cls(value)
        start, _, end = window.partition(":")
        if not (start.isdigit() and end.isdigit() and int(start) < int(end)):
            raise ConfigError(f"BPS_TRACE={value!r}: the window is START:END, collectives START..END-1, START < END")
        return cls(directory, int(start), int(end))


class Recorder:
    """One Runtime's timeline window. `wrap` each collective's `done`; `close` at the end.

    Example: `rec = Recorder.create(config.trace, client, "worker 0", "/tmp/t/worker-0.json")`.
    """

    def __init__(self, client, spec: TimelineSpec | None, name: str, path: str):
        self._client, self._spec, self._name, self.path = client, spec, name, path
        self._lock = threading.Lock()
        self._issued = 0
        self._pending = 0
        self._started = self._finished = spec is None
        self._collectives: dict[int, list] = {}  # index -> [index, start ns, end ns or None, what, error]

    @classmethod
    def create(cls, setting: str, client, rank: int, group: str) -> Recorder:
        """The recorder BPS_TRACE (`setting`) asks for, for rank `rank` of group `group`: off if it is empty."""
        spec = TimelineSpec.parse(setting)
        suffix = "" if group == "default" else f"-{group}"
        path = os.path.join(spec.directory, f"worker-{rank}{suffix}.json") if spec else ""
        return cls(client, spec, f"worker {rank}" + (f" ({group})" if suffix else ""), path)

    def wrap(self, tensors, done: Done) -> Done:
        """Return `done`, timed if this collective is in the window (one check when it is not)."""
        if self._finished:
            return done
        with self._lock:
            index = self._issued
            self._issued += 1
            if not self._spec.start <= index < self._spec.end or self._finished:
                return done
            if not self._started:
                self._started = True
                self._client.record_steps(CAPACITY)  # starts recording before this collective's partitions are queued
            what = _describe(tensors)
            record = self._collectives[index] = [index, time.time_ns(), None, what, None]
            self._pending += 1

        def timed(error: BaseException | None) -> None:
            record[2] = time.time_ns()
            record[4] = None if error is None else f"{type(error).__name__}: {error}"
            done(error)  # the caller first: writing the file can wait
            with self._lock:
                self._pending -= 1
                last = self._pending == 0 and self._issued >= self._spec.end
            if last:
                self.close()

        return timed

    def close(self) -> None:
        """Stop recording and write the file (once; the window's end or the Runtime's close, whichever first)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            started = self._started
        if not started:
            return
        rows, dropped = self._client.record_steps(0)
        pid = os.getpid()
        out = events.partition_events(rows.tolist(), self._client.servers, pid)
        out += events.collective_events([tuple(c) for c in self._collectives.values()], pid)
        other = {"window": [self._spec.start, self._spec.end], "dropped_events": dropped}
        events.write(self.path, out, self._name, pid, other)
        if dropped:
            log.warning("torch_bps timeline %s: %d events dropped (more than %d in the window)", self.path, dropped,
                        CAPACITY)  # fmt: skip
        log.info("torch_bps timeline: wrote %s", self.path)


def _describe(tensors) -> str:
    """'(sum) 2 tensors, 4096 bytes': a collective's mode (an engine Exchange's, else a sum), tensors and size."""
    modes = sorted({("sum", "copy")[int(x.mode) if hasattr(x, "tensor") else 0] for x in tensors})
    nbytes = sum(t.numel() * t.element_size() for t in (getattr(x, "tensor", x) for x in tensors))
    return f"({'/'.join(modes)}) {len(tensors)} tensor{'s' if len(tensors) != 1 else ''}, {nbytes} bytes"


@contextlib.contextmanager
def recording(client, path: str, name: str = "worker") -> Iterator[None]:
    """Record the client's partitions (push_pull, push_pull_batch) inside the block into Chrome-trace `path`.

    Example:
        with recording(client, "trace/worker-0.json"):
            client.push_pull_batch(parts).wait()
    """
    client.record_steps(CAPACITY)
    try:
        yield
    finally:
        rows, dropped = client.record_steps(0)
        pid = os.getpid()
        out = events.partition_events(rows.tolist(), client.servers, pid)
        events.write(path, out, name, pid, {"dropped_events": dropped})
