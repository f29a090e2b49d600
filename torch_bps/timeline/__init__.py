"""A timeline of a job without the profiler (BPS_TRACE): Chrome-trace / Perfetto JSON files per worker and per
server, and `python -m torch_bps.timeline DIR -o timeline.json`, which merges them into one.

- events.py: the client's raw events (cpp_ext/common/trace.h) -> Chrome-trace events, and writing a file;
- recorder.py: a Runtime's window of collectives (BPS_TRACE=DIR[,START:END]), and `recording(client, path)`;
- merge.py: the merge (the servers write their own files: torch_bps/server/timeline.py).

May import: the standard library, torch_bps.errors, torch_bps.futures and torch_bps.timeline.
"""
