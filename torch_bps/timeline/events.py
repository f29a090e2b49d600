"""A worker's timeline as Chrome-trace events: its partitions' steps and its collectives; and writing the file.

The C++ client records, per partition, when it was queued (handed to the IO thread), sent (its PUSH left: it
took its credit), acknowledged (the credit came back) and pulled (the sum arrived), or failed (cpp_ext/common/trace.h).
Each partition becomes three slices on its key's row: "queued" (waiting for credit, or for the key's previous
round), "push" (sent until acknowledged) and "pull" (acknowledged until the sum arrived: the other workers'
pushes, the server's sum and the reply), each with key, round, server and bytes. Times are CLOCK_REALTIME
(time.time_ns()) in microseconds, so the files of one machine line up; across machines, as well as their
clocks are synced.

May import: the standard library.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence

# cpp_ext/common/trace.h's kinds and columns
QUEUED, SENT, ACKED, PULLED, FAILED = 1, 2, 3, 4, 5
_T, _DUR, _ID, _KEY, _ROUND, _BYTES, _PEER, _KIND = range(8)
_STAGES = {(QUEUED, SENT): "queued", (SENT, ACKED): "push", (ACKED, PULLED): "pull"}
_U64 = (1 << 64) - 1
KEY_ROWS = 1000  # tids of key rows start here; collectives take the rows below


def partition_events(rows: Sequence[Sequence[int]], servers: Sequence[str], pid: int) -> list[dict]:
    """Chrome-trace events of the partitions in the client's raw events (rows of cpp_ext/common/trace.h's columns).

    A partition's events share an id (its operation) from "queued" to its end; an id seen again after that is
    another partition. A partition already in flight when recording started shows from its first step seen.
    """
    partitions: list[list[Sequence[int]]] = []
    current: dict[int, list[Sequence[int]]] = {}
    for row in rows:
        steps = current.get(row[_ID])
        if steps is None or row[_KIND] == QUEUED:
            steps = current[row[_ID]] = []
            partitions.append(steps)
        steps.append(row)
    keys = sorted({steps[0][_KEY] & _U64 for steps in partitions})
    tids = {key: KEY_ROWS + i for i, key in enumerate(keys)}
    events = []
    for steps in partitions:
        key = steps[0][_KEY] & _U64
        server = servers[steps[0][_PEER]] if steps[0][_PEER] < len(servers) else f"server {steps[0][_PEER]}"
        sent = next((s for s in steps if s[_KIND] != QUEUED), steps[0])
        args = {"key": key, "round": sent[_ROUND], "server": server}
        for a, b in itertools.pairwise(steps):
            name = _STAGES.get((a[_KIND], b[_KIND]))
            if name is not None:
                nbytes = b[_BYTES] if name == "pull" else a[_BYTES]
                events.append(_slice(name, a[_T], b[_T], pid, tids[key], {**args, "bytes": nbytes}))
        if steps[-1][_KIND] == FAILED:
            events.append({"name": "failed", "ph": "i", "s": "t", "ts": steps[-1][_T] / 1e3, "pid": pid,
                           "tid": tids[key], "args": args})  # fmt: skip
    for key, tid in tids.items():
        events.append(_meta("thread_name", pid, tid, f"key {key:#x}"))
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def collective_events(collectives: Sequence[tuple[int, int, int | None, str, str | None]], pid: int) -> list[dict]:
    """Chrome-trace events of collectives given as (index, start ns, end ns or None, what, error or None).

    Collectives overlap (DDP keeps several buckets in flight): each goes on the first row free at its start.
    """
    lanes: list[int] = []  # per row, when its last collective ended
    events = []
    for index, start, end, what, error in sorted(collectives, key=lambda c: c[1]):
        lane = next((i for i, free in enumerate(lanes) if free <= start), len(lanes))
        if lane == len(lanes):
            lanes.append(0)
            events.append(_meta("thread_name", pid, 1 + lane, f"collectives {lane}"))
        lanes[lane] = end if end is not None else 1 << 62
        args = {"index": index, "error": error} if error else {"index": index}
        if end is None:
            args["unfinished"] = True
        events.append(_slice(f"collective {index}: {what}", start, end or start, pid, 1 + lane, args))
    return events


def write(path: str, events: list[dict], name: str, pid: int, other: dict | None = None) -> None:
    """Write `events` as a Chrome-trace JSON file of process `name`: {"traceEvents": [...], "otherData": other}."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    meta = [_meta("process_name", pid, 0, name)]
    with open(path + ".tmp", "w") as f:  # renamed when complete: a merge never reads half a file
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other or {}}, f,
                  separators=(",", ":"))  # fmt: skip
    os.replace(path + ".tmp", path)


def _slice(name: str, start_ns: int, end_ns: int, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "X", "ts": start_ns / 1e3, "dur": max(end_ns - start_ns, 0) / 1e3, "pid": pid,
            "tid": tid, "args": args}  # fmt: skip


def _meta(what: str, pid: int, tid: int, name: str) -> dict:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
