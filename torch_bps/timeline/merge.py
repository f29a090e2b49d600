"""Merge the workers' and servers' timeline files into one: `python -m torch_bps.timeline DIR -o timeline.json`.

Reads DIR/worker-*.json (torch_bps.timeline.recorder) and DIR/server-*.json (bps-server --trace; a file left
open by a killed server is read up to its last complete event), gives each file a process of its own (workers
first, by rank, then servers), cuts the servers' events to the span the workers recorded (servers record from
their start, workers only their window; --whole keeps everything) and counts time from the earliest event.
Files of several machines line up only as well as their clocks do (CLOCK_REALTIME): sync them (NTP, PTP).

May import: the standard library.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re


def load(path: str) -> list[dict]:
    """The events of one Chrome-trace file: object or array form, the array maybe never closed."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # An array a killed writer left open: keep its complete events (one per line, as the server writes them).
        body = text.rstrip().rstrip(",")
        while body:
            try:
                data = json.loads(body + "\n]")
                break
            except json.JSONDecodeError:
                body = body[: body.rfind("\n")].rstrip().rstrip(",")
        else:
            raise ValueError(f"{path} is not a Chrome-trace JSON file") from None
    return data["traceEvents"] if isinstance(data, dict) else data


def _order(path: str) -> tuple:
    name = os.path.basename(path)
    rank = re.match(r"worker-(\d+)", name)
    return (0, int(rank.group(1)), name) if rank else (1, 0, name)


def merge(directory: str, whole: bool = False) -> dict:
    """Return the merged timeline of the files in `directory` as a Chrome-trace object.

    Example: `json.dump(merge("/tmp/trace"), open("timeline.json", "w"))`.
    """
    paths = [p for role in ("worker", "server") for p in glob.glob(os.path.join(directory, f"{role}-*.json"))]
    paths.sort(key=_order)
    if not paths:
        raise FileNotFoundError(f"no worker-*.json or server-*.json in {directory}")
    files = [(path, load(path)) for path in paths]
    timed = [e for path, evs in files if _order(path)[0] == 0 for e in evs if e.get("ph") != "M"]
    span = (min(e["ts"] for e in timed), max(e["ts"] + e.get("dur", 0) for e in timed)) if timed else None
    merged = []
    for pid, (path, evs) in enumerate(files, start=1):
        server = _order(path)[0] == 1
        for e in evs:
            if server and span and not whole and e.get("ph") != "M" and not span[0] <= e["ts"] <= span[1]:
                continue
            merged.append({**e, "pid": pid})
        merged.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    origin = min((e["ts"] for e in merged if e.get("ph") != "M"), default=0.0)
    for e in merged:
        if "ts" in e:
            e["ts"] -= origin
    files_info = [os.path.basename(p) for p, _ in files]
    return {"traceEvents": merged, "displayTimeUnit": "ms",
            "otherData": {"files": files_info, "origin_unix_us": origin}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torch_bps.timeline",
        description="Merge the timeline files of a job's workers and servers into one Chrome-trace / Perfetto JSON "
        "file (open it in ui.perfetto.dev or chrome://tracing).",
    )
    p.add_argument("directory", help="where BPS_TRACE / bps-server --trace wrote the files")
    p.add_argument("-o", "--output", default="timeline.json", help="the merged file (default %(default)s)")
    p.add_argument("--whole", action="store_true", help="keep the servers' events outside the workers' window")
    args = p.parse_args(argv)
    timeline = merge(args.directory, args.whole)
    with open(args.output, "w") as f:
        json.dump(timeline, f, separators=(",", ":"))
    n = sum(1 for e in timeline["traceEvents"] if e.get("ph") != "M")
    print(f"{args.output}: {n} events from {', '.join(timeline['otherData']['files'])}")
    return 0
