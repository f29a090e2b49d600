"""BPS_TRACE: per-worker and per-server Chrome-trace files with every partition's steps, merged into one timeline."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO, run_ranks
from torch_bps.client import Client
from torch_bps.timeline.merge import load, merge
from torch_bps.timeline.recorder import TimelineSpec, recording
from torch_bps.wire import Mode, Partition

_PHASES = {"X", "i", "C", "M"}


def _check_chrome_trace(events: list[dict]) -> None:
    """Every event has what chrome://tracing and Perfetto need; a slice has a non-negative duration."""
    for e in events:
        assert e["ph"] in _PHASES and isinstance(e["name"], str) and isinstance(e["pid"], int), e
        assert isinstance(e.get("tid", 0), int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e


def _partitions(events: list[dict]) -> dict[tuple[int, int], dict[str, dict]]:
    """(key, round) -> {stage name: its slice}."""
    found: dict = {}
    for e in events:
        if e["ph"] == "X" and e["name"] in ("queued", "push", "pull"):
            found.setdefault((e["args"]["key"], e["args"]["round"]), {})[e["name"]] = e
    return found


@pytest.mark.timeout(60)
def test_a_traced_push_pull_batch_shows_every_partition(server, job_id, tmp_path):
    t = torch.arange(40_000, dtype=torch.float32)
    cuts = [(i * 5000, 5000) for i in range(8)]  # 8 partitions of 20 kB
    path = str(tmp_path / "worker-0.json")
    with Client([server.address], job_id, 0, 1, timeout=20, credit_bytes=40_000) as c:
        with recording(c, path):
            for _ in range(2):  # rounds 0 and 1 of every key
                parts = [(t[lo : lo + n], key, None, None, Mode.SUM, None, 0, 0) for key, (lo, n) in enumerate(cuts)]
                c.push_pull_batch(parts).wait()  # the client times out after 20 s, naming the key
    with open(path) as f:
        trace = json.load(f)  # valid JSON, or this fails
    events = trace["traceEvents"]
    _check_chrome_trace(events)
    partitions = _partitions(events)
    assert sorted(partitions) == [(key, rnd) for key in range(8) for rnd in range(2)], sorted(partitions)
    for (key, rnd), stages in partitions.items():
        assert set(stages) == {"queued", "push", "pull"}, (key, rnd, stages)
        for stage in stages.values():
            assert stage["args"]["bytes"] == 20_000 and stage["args"]["server"] == server.address, stage
        # one after the other: queued until sent, pushed until acknowledged, then the pull
        q, p, s = stages["queued"], stages["push"], stages["pull"]
        assert q["ts"] + q["dur"] == pytest.approx(p["ts"], abs=0.5)  # float us since 1970: 0.25 us apart
        assert p["ts"] + p["dur"] == pytest.approx(s["ts"], abs=0.5)
    assert trace["otherData"]["dropped_events"] == 0


def _traced_steps(rank, world, gloo):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 64))  # a few collectives of its own
    for _ in range(3):  # a step: the one bucket, and small collectives of DDP's
        model(torch.ones(4, 256)).sum().backward()
    t = torch.ones(100_000)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, world))


@pytest.mark.timeout(150)
def test_bps_trace_writes_workers_and_servers_files_that_merge_into_one_timeline():
    directory = tempfile.mkdtemp(prefix="bps-trace-")
    try:
        # collectives 1 to 49: more than the job has, so the files are written at close
        run_ranks(_traced_steps, 2, env={"BPS_TRACE": f"{directory},1:50", "BPS_PARTITION_BYTES": "16384"},
                  timeout=130)  # fmt: skip
        workers = sorted(glob.glob(os.path.join(directory, "worker-*.json")))
        servers = sorted(glob.glob(os.path.join(directory, "server-*.json")))
        assert [os.path.basename(w) for w in workers] == ["worker-0.json", "worker-1.json"]
        assert len(servers) == 2, servers  # each rank's machine ran an embedded server
        bucket = f": (sum) 1 tensor, {(256 * 64 + 64) * 4} bytes"
        for path in workers:
            events = load(path)
            _check_chrome_trace(events)
            collectives = [e for e in events if e["name"].startswith("collective ")]
            indices = sorted(e["args"]["index"] for e in collectives)
            assert indices == list(range(1, len(collectives) + 1)), indices  # collective 0 is not in the window
            steps = [c for c in collectives if c["name"].endswith(bucket)]
            all_reduce = [c for c in collectives if c["name"].endswith(": (sum) 1 tensor, 400000 bytes")]
            assert len(steps) == 3 and len(all_reduce) == 1, [c["name"] for c in collectives]
            # every partition of each (16 KiB each), with its three stages, inside the collective's span
            partitions = _partitions(events)
            for c in steps + all_reduce:
                nbytes = int(c["name"].rsplit(" ", 2)[1])
                mine = [s for s in partitions.values() if c["ts"] <= s["queued"]["ts"] <= c["ts"] + c["dur"]]
                assert len(mine) == -(-nbytes // 16384), (c, sorted(partitions))
                assert all(set(s) == {"queued", "push", "pull"} for s in mine)
                assert sum(s["push"]["args"]["bytes"] for s in mine) == nbytes
                assert sum(s["pull"]["args"]["bytes"] for s in mine) == nbytes
                assert all(s["pull"]["ts"] + s["pull"]["dur"] <= c["ts"] + c["dur"] for s in mine)
        for path in servers:
            events = load(path)
            _check_chrome_trace(events)
            sums = [e for e in events if e["name"] == "sum"]
            assert sums and all(e["args"]["worker"] in (0, 1) and e["args"]["bytes"] > 0 for e in sums)
            assert any(e["ph"] == "C" and e["name"] == "queue" for e in events)

        out = os.path.join(directory, "timeline.json")
        done = subprocess.run([sys.executable, "-m", "torch_bps.timeline", directory, "-o", out], cwd=REPO,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        with open(out) as f:
            timeline = json.load(f)
        events = timeline["traceEvents"]
        _check_chrome_trace(events)
        names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert sorted(names.values()) == sorted(["worker 0", "worker 1"] + [f"server {s}" for s in _addresses(servers)])
        worker_pids = {p for p, n in names.items() if n.startswith("worker")}
        timed = [e for e in events if e["ph"] != "M"]
        span = (min(e["ts"] for e in timed if e["pid"] in worker_pids),
                max(e["ts"] + e.get("dur", 0) for e in timed if e["pid"] in worker_pids))  # fmt: skip
        handled = [e for e in timed if e["pid"] not in worker_pids and e["name"] in ("sum", "store")]
        assert all(span[0] <= e["ts"] <= span[1] for e in handled)
        # every partition the workers pushed in the window was handled by a server in it: one worker's push kept,
        # the other's added (a sum) or both copied (a gather's ranges)
        pushed = {(e["args"]["key"], e["args"]["round"]) for e in timed if e["name"] == "push"}
        summed = {(e["args"]["key"], e["args"]["round"]) for e in handled if e["name"] == "sum"}
        assert pushed == {(e["args"]["key"], e["args"]["round"]) for e in handled}
        assert len(summed) >= 3 * 5 + 25  # the steps' buckets and the all_reduce
        assert min(e["ts"] for e in timed) == 0
    finally:
        subprocess.run(["rm", "-rf", directory], check=False)


def _addresses(paths: list[str]) -> list[str]:
    """server-HOST-PORT.json -> HOST:PORT"""
    return [":".join(os.path.basename(p)[len("server-") : -len(".json")].rsplit("-", 1)) for p in paths]


@pytest.mark.timeout(60)
def test_the_file_is_written_when_the_window_ends(server, job_id, tmp_path):
    from torch_bps.timeline.recorder import Recorder

    with Client([server.address], job_id, 0, 1, timeout=20) as c:
        recorder = Recorder.create(f"{tmp_path},1:3", c, 0, "default")
        for i in range(4):
            t = torch.ones(1000)
            future = torch.futures.Future()
            done = recorder.wrap([t], lambda error, f=future: f.set_result(error))
            c.push_pull_batch([Partition(t, key=0)], on_done=done)
            assert future.wait() is None  # the client times out after 20 s, naming the key
            if i == 2:  # collectives 1 and 2 are done: the file is written (after their callbacks ran)
                events = _wait_for_file(str(tmp_path / "worker-0.json"), 10.0)
        recorder.close()  # nothing left to write
    assert [e["args"]["index"] for e in events if e["name"].startswith("collective")] == [1, 2]
    assert sorted(_partitions(events)) == [(0, 1), (0, 2)]


def _wait_for_file(path: str, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            pytest.fail(f"{path} was not written within {timeout} s of the window's end")
        time.sleep(0.01)
    return load(path)


def test_merge_reads_a_server_file_a_killed_server_left_open(tmp_path):
    (tmp_path / "worker-0.json").write_text(json.dumps({"traceEvents": [
        {"name": "push", "ph": "X", "ts": 1000.0, "dur": 50.0, "pid": 7, "tid": 1000, "args": {}}]}))  # fmt: skip
    (tmp_path / "server-h-1.json").write_text(
        '[\n{"name": "process_name", "ph": "M", "pid": 9, "tid": 0, "args": {"name": "server h:1"}},\n'
        '{"name": "sum", "ph": "X", "ts": 1010.0, "dur": 5.0, "pid": 9, "tid": 1, "args": {}},\n'
        '{"name": "sum", "ph": "X", "ts": 2000.0, "dur": 5.0, "pid": 9, "tid": 1, "args": {}},\n'
        '{"name": "sum", "ph": "X", "ts": 10'  # cut mid-event
    )
    events = merge(str(tmp_path))["traceEvents"]
    sums = [e for e in events if e["name"] == "sum"]
    assert [e["ts"] for e in sums] == [10.0]  # the one inside the worker's span, counted from its start
    assert {e["pid"] for e in events} == {1, 2}


def test_trace_spec():
    assert TimelineSpec.parse("") is None
    assert TimelineSpec.parse("/tmp/t") == TimelineSpec("/tmp/t", 0, 50)
    assert TimelineSpec.parse("/tmp/t,10:20") == TimelineSpec("/tmp/t", 10, 20)
    with pytest.raises(Exception, match="START:END"):
        TimelineSpec.parse("/tmp/t,20:10")
