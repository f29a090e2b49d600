"""A summation server's timeline (`bps-server --trace DIR`): its sums and its queue, as Chrome-trace JSON.

The native core records each push it adds (or keeps, or copies) and each wake-up of its loop (cpp_ext/common/trace.h);
every tick of the loop moves what it recorded into DIR/server-HOST-PORT.json, a Chrome-trace JSON array
written as it goes (closed with "]" when the server stops; `python -m torch_bps.timeline` also reads one left
open by a killed server). Times are CLOCK_REALTIME microseconds, like the workers' files, so
`python -m torch_bps.timeline DIR` lines them up (across machines, only as well as their clocks are synced).

Rows: "loop" holds a slice per push handled ("sum": added into its round, the slice lasts as long as the add;
"store": a round's first push kept as it arrived, or a COPY key's range), with job, key, round, worker and
bytes; the "queue" counter shows, at each wake-up that changed them, the requests read in that wake-up (what had
queued while the loop was busy) and the keys with pulls waiting for their round to close.

May import: the standard library.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("torch_bps.server")

# cpp_ext/common/trace.h's kinds and columns
_SUM, _STORE, _WAKE = 16, 17, 18
_T, _DUR, _ID, _KEY, _ROUND, _BYTES, _PEER, _KIND = range(8)
_BUFFER_EVENTS = 1 << 16  # recorded between two ticks at most (0.2 s); more are counted as dropped


class ServerTimeline:
    """Streams the core's timeline events into `path`, `max_events` at most.

    Example: `t = ServerTimeline(core, "/tmp/trace/server-h-9000.json", "server h:9000"); t.flush(); t.close()`.
    """

    def __init__(self, core, path: str, name: str, max_events: int = 500_000):
        self._core = core
        self._pid = os.getpid()
        self._left = self._max = max_events
        self._dropped = 0
        self._queue = (-1, -1)  # the last (requests, keys waiting) written
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "w")  # noqa: SIM115 - open for the server's lifetime, closed by close()
        meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0, "args": {"name": name}},
                {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": 1, "args": {"name": "loop"}}]  # fmt: skip
        self._file.write("[\n" + ",\n".join(json.dumps(e) for e in meta))
        core.trace(_BUFFER_EVENTS)

    def flush(self) -> None:
        """Write what the core recorded since the last flush (on the loop thread)."""
        if self._file is None:
            return
        events, dropped = self._core.trace(_BUFFER_EVENTS if self._left > 0 else 0)
        self._dropped += dropped
        rows = events.tolist()[: max(self._left, 0)]
        if rows and len(rows) >= self._left:
            log.warning("timeline %s: full (%d events, --trace-events): recording stops", self.path, self._max)
        self._left -= len(rows)
        out = [e for row in rows if (e := self._event(row)) is not None]
        if out:
            self._file.write(",\n" + ",\n".join(json.dumps(e) for e in out))
            self._file.flush()

    def close(self) -> None:
        """Write the last events and close the file."""
        if self._file is None:
            return
        self.flush()
        self._core.trace(0)
        if self._dropped:
            log.warning("timeline %s: %d events were dropped (more than %d between two ticks)", self.path,
                        self._dropped, _BUFFER_EVENTS)  # fmt: skip
        self._file.write("\n]\n")
        self._file.close()
        self._file = None

    def _event(self, row: list[int]) -> dict | None:
        kind, ts = row[_KIND], row[_T] / 1e3
        if kind == _WAKE:
            queue = (row[_BYTES], row[_KEY])
            if queue == self._queue:  # a counter is a step function: only changes matter
                return None
            self._queue = queue
            args = {"requests read": queue[0], "keys with pulls waiting": queue[1]}
            return {"name": "queue", "ph": "C", "ts": ts, "pid": self._pid, "tid": 1, "args": args}
        args = {"job": f"{row[_ID] & (1 << 64) - 1:#x}", "key": row[_KEY] & (1 << 64) - 1, "round": row[_ROUND],
                "worker": row[_PEER], "bytes": row[_BYTES]}  # fmt: skip
        return {"name": "sum" if kind == _SUM else "store", "ph": "X", "ts": ts, "dur": max(row[_DUR], 0) / 1e3,
                "pid": self._pid, "tid": 1, "args": args}  # fmt: skip
