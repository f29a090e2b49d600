"""torch.profiler sees torch_bps: a span per collective and its network stage on the calling thread, a span per
local stage when the profiler records every thread; the trace is Chrome-trace JSON."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from tests.helpers import run_ranks


def _profiled(rank, world, gloo, all_threads):
    from torch._C._profiler import _ExperimentalConfig

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32))
    config = _ExperimentalConfig(profile_all_threads=all_threads)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        t = torch.ones(250_000)
        start = time.perf_counter()
        dist.all_reduce(t)
        wall_us = (time.perf_counter() - start) * 1e6
        model(torch.ones(8, 64)).sum().backward()
    assert torch.equal(t, torch.full_like(t, world))
    path = os.path.join(tempfile.mkdtemp(), f"trace-{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]  # valid JSON, or this fails
    me = os.getpid()
    # in the order they began: the trace lists them thread by thread, and a local stage may run on any thread
    ours = sorted((e for e in events if e.get("name", "").startswith("torch_bps::")), key=lambda e: e["ts"])
    assert all(e["args"].get("finished", True) for e in ours), ours  # every span was closed, none cut at the end
    # the all_reduce's span: from the call to its completion, around its network stage
    first = {w: next(e["dur"] for e in ours if e["name"].startswith(f"torch_bps::{w}")) for w in ("coll", "net")}
    collective, network = first["coll"], first["net"]
    assert 0 < network <= collective <= wall_us, (network, collective, wall_us)
    return [(e["name"], e["dur"], e["tid"] == me) for e in ours]


@pytest.mark.timeout(120)
def test_a_profiled_step_shows_each_collective_and_its_network_stage():
    for events in run_ranks(_profiled, 2, False, timeout=100):
        names = [name for name, _, _ in events]
        # the all_reduce of 1 MB, then DDP's one bucket: the Linear's weight and bias, 32 * 64 + 32 floats
        collectives = [n for n in names if n.startswith("torch_bps::collective")]
        assert collectives == ["torch_bps::collective (sum) 1.0 MB in 1 tensor",
                               "torch_bps::collective (sum) 8.3 kB in 1 tensor"], names  # fmt: skip
        network = [n for n in names if n.startswith("torch_bps::network")]
        assert len(network) == 2 and all(", servers 127.0.0.1:" in n for n in network), names
        assert all(dur > 0 and on_caller for _, dur, on_caller in events), events
        assert not any("local_" in n for n in names)  # one rank per machine: no local stages


@pytest.mark.timeout(150)
def test_local_stages_show_when_every_thread_is_profiled():
    results = run_ranks(_profiled, 4, True, env={"LOCAL_WORLD_SIZE": "2"}, timeout=130)
    for events in results:
        names = [name for name, _, _ in events]
        for stage in ("local_reduce_scatter", "local_all_gather"):
            found = [(n, on_caller) for n, _, on_caller in events if n.startswith(f"torch_bps::{stage}")]
            # once each, on the thread where the stage began (the caller's, or the engine's own when its local peers
            # were late), however many threads ran it
            assert [n for n, _ in found] == [f"torch_bps::{stage} 1.0 MB in 1 tensor",
                                             f"torch_bps::{stage} 8.3 kB in 1 tensor"], names  # fmt: skip
