"""Where a step's link time goes: every worker host's link, sampled every 2 ms while the cluster benchmark runs.

    python -m benchmarks.cluster.linktrace record trace.json &    # then, meanwhile:
    python -m benchmarks.cluster --ks 0,4 --repeats 1 --no-ddp
    python -m benchmarks.cluster.linktrace report trace.json --rate 500

`record` finds the benchmark's worker processes (workers/bps_pushpull.py, workers/gloo_allreduce.py) and the
dedicated servers beside them, and reads each host's bytes received and sent on `bps0` from /proc/PID/net/dev (a
process's view of its own network namespace) until the workers exit; then it waits for the next point's, until
`--seconds`. `report` prints, per point and host, over the last 55% of that point's trace (the timed steps;
start-up and warm-up come first): the mean utilization of each direction against the link rate (Ethernet and IP
headers included, as tbf counts them) and how long each direction was idle (under 20% of the rate in a 5 ms
bin). A step that ends when its last pull arrives shows up as the uplink idle at the step's end and the downlink
idle at the next one's start.
May import: the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

WORKERS = re.compile(rb"workers[./](bps_pushpull|gloo_allreduce)")
SERVER = b"torch_bps.server"
BIN_S, IDLE, TIMED_SHARE = 0.005, 0.2, 0.55


def _hosts() -> dict[int, tuple[str, str]]:
    """The benchmark's running workers, pid -> (name, k or "gloo"), and the dedicated servers beside them
    (named "s" + the host's address; a colocated server shares its worker's link and is left out)."""
    workers, servers = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if any(WORKERS.search(a) for a in argv) and "--worker" in args and "--k" in args:
            workers[int(pid)] = (args[args.index("--worker") + 1], args[args.index("--k") + 1], netns)
        elif any(WORKERS.search(a) for a in argv) and "--rank" in args:
            workers[int(pid)] = (args[args.index("--rank") + 1], "gloo", netns)
        elif SERVER in argv and "--host" in args:
            servers[int(pid)] = ("s" + args[args.index("--host") + 1], netns)
    if not workers:
        return {}
    k = next(iter(workers.values()))[1]
    found = {pid: (name, k) for pid, (name, _, _) in workers.items()}
    worker_netns = {netns for _, _, netns in workers.values()}
    if k != "gloo":
        found.update({pid: (name, k) for pid, (name, netns) in servers.items() if netns not in worker_netns})
    return found


def _counters(pid: int) -> tuple[int, int] | None:
    """(bytes received, bytes sent) on the host's bps0, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                if line.strip().startswith("bps0:"):
                    fields = line.split(":", 1)[1].split()
                    return int(fields[0]), int(fields[8])
    except OSError:
        pass
    return None


def record(path: str, seconds: float) -> None:
    """Sample each point's workers until they exit; write every point's samples to `path` after each."""
    points, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        workers = _hosts()
        if not any(not name.startswith("s") for name, _ in workers.values()):
            time.sleep(0.05)
            continue
        point = {"k": next(iter(workers.values()))[1], "samples": {w: [] for w, _ in workers.values()}}
        while any(not name.startswith("s") for name, _ in workers.values()) and time.monotonic() < deadline:
            now = time.monotonic()
            for pid, (w, _) in list(workers.items()):
                got = _counters(pid)
                if got is None:
                    del workers[pid]
                else:
                    point["samples"][w].append((now, *got))
            time.sleep(0.002)
        points.append(point)
        with open(path, "w") as f:
            json.dump(points, f)
        print(f"point k={point['k']}: {sorted(point['samples'])}", flush=True)


def utilization(samples: list, rate_bytes: float) -> list[tuple[float, float]]:
    """Per 5 ms bin from the first sample: (received, sent) as shares of the link rate."""
    t0, bins = samples[0][0], {}
    for (_, rx0, tx0), (t, rx1, tx1) in zip(samples, samples[1:], strict=False):
        b = bins.setdefault(int((t - t0) / BIN_S), [0, 0])
        b[0] += rx1 - rx0
        b[1] += tx1 - tx0
    return [tuple(v / (BIN_S * rate_bytes) for v in bins.get(i, (0, 0))) for i in range(max(bins) + 1)]


def summary(samples: list, rate_bytes: float) -> dict:
    """The timed part's mean utilization and idle seconds, each direction (the module's docstring says how)."""
    bins = utilization(samples, rate_bytes)
    active = [i for i, (rx, tx) in enumerate(bins) if rx > IDLE or tx > IDLE]
    span = bins[active[0] : active[-1] + 1]
    timed = span[int(len(span) * (1 - TIMED_SHARE)) :]
    return {
        "seconds": round(len(timed) * BIN_S, 3),
        "rx_util": round(sum(rx for rx, _ in timed) / len(timed), 3),
        "tx_util": round(sum(tx for _, tx in timed) / len(timed), 3),
        "rx_idle_s": round(sum(BIN_S for rx, _ in timed if rx < IDLE), 3),
        "tx_idle_s": round(sum(BIN_S for _, tx in timed if tx < IDLE), 3),
    }


def report(path: str, rate_mbit: float) -> None:
    with open(path) as f:
        points = json.load(f)
    for point in points:
        print(f"k = {point['k']}")
        for w, samples in sorted(point["samples"].items()):
            if len(samples) > 10:
                s = summary(samples, rate_mbit * 1e6 / 8)
                print(f"  {w}: {s['seconds']:.2f} s timed; utilization in {s['rx_util']:.3f} out "
                      f"{s['tx_util']:.3f}; idle in {s['rx_idle_s']:.3f} s, out {s['tx_idle_s']:.3f} s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample the workers' links while a benchmark runs")
    rec.add_argument("path")
    rec.add_argument("--seconds", type=float, default=600.0, help="stop after this long (default 600)")
    rep = sub.add_parser("report", help="utilization and idle time per point and worker")
    rep.add_argument("path")
    rep.add_argument("--rate", type=float, default=500.0, help="the links' rate in Mbit/s (default 500)")
    args = p.parse_args(argv)
    if args.command == "record":
        record(args.path, args.seconds)
    else:
        report(args.path, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
