"""Where a push/pull step's time goes, from a cluster run's `--trace DIR` files (scratch analysis, session 19).

    python docs/results/session19/trace_steps.py DIR/k4

Per step: when the first sum reached a worker, when the last push left, when the last round closed (ms from the
step's start), each worker's last push / last pull, each server's last round closed / last reply delivered; then,
for two middle steps, each link's MB/s in 100 ms bins: a worker's pushes as its servers summed them ("wN up"), a
server host's replies as its workers received them ("H up"), and the same bytes on the receiving links ("down").
Servers are named by their address's last number: 1..n are the workers' colocated ones, 101.. the dedicated ones.
"""

import collections
import glob
import json
import math
import os
import sys

BIN_US = 100e3


def events(path):
    data = json.load(open(path))
    return data["traceEvents"] if isinstance(data, dict) else data


def server_name(path):
    host, port = os.path.basename(path)[len("server-") : -len(".json")].rsplit("-", 1)
    return f"{host}:{port}"


def host(server):
    return server.split(":")[0].split(".")[-1]


def main(d):
    parts = []  # one per partition and round: its worker, key, round, server, bytes and stages (start, end)
    for path in sorted(glob.glob(f"{d}/worker-*.json")):
        worker = int(path.rsplit("-", 1)[1].split(".")[0])
        by = {}
        for e in events(path):
            if e.get("ph") == "X":
                a = e["args"]
                p = by.setdefault((a["key"], a["round"]), {"w": worker, **a})
                p[e["name"]] = (e["ts"], e["ts"] + e["dur"])
        parts += by.values()
    arrivals = collections.defaultdict(list)  # (server, key, round) -> [(summed at, worker, bytes)]
    for path in glob.glob(f"{d}/server-*.json"):
        for e in events(path):
            if e["name"] in ("sum", "store"):
                a = e["args"]
                arrivals[(server_name(path), a["key"], a["round"])].append(
                    (e["ts"] + e["dur"], a["worker"], a["bytes"])
                )
    parts.sort(key=lambda p: p["queued"][0])
    steps, current = [], [parts[0]]
    for p in parts[1:]:  # a step hands all its partitions down at once: a gap starts the next
        if p["queued"][0] - current[-1]["queued"][0] > 50e3:
            steps.append(current)
            current = []
        current.append(p)
    steps.append(current)

    def closed(p):
        return max(t for t, _, _ in arrivals[(p["server"], p["key"], p["round"])])

    for st in steps:
        t0 = min(p["queued"][0] for p in st)

        def ms(t, t0=t0):
            return f"{(t - t0) / 1e3:.0f}"

        print(
            f"step of {len(st)} partitions, {ms(max(p['pull'][1] for p in st))} ms: first sum at a worker "
            f"{ms(min(p['pull'][1] for p in st))}, last push left {ms(max(p['push'][0] for p in st))}, "
            f"last round closed {ms(max(closed(p) for p in st))}"
        )
        workers = sorted({p["w"] for p in st})
        print(
            "  workers' last push / last pull:",
            " ".join(
                f"{ms(max(p['push'][0] for p in st if p['w'] == w))}/{ms(max(p['pull'][1] for p in st if p['w'] == w))}"
                for w in workers
            ),
        )
        print(
            "  servers' last round closed / last reply:",
            " ".join(
                f"{host(s)}:{ms(max(closed(p) for p in st if p['server'] == s))}/"
                f"{ms(max(p['pull'][1] for p in st if p['server'] == s))}"
                for s in sorted({p["server"] for p in st})
            ),
        )
    for st in steps[len(steps) // 2 - 1 : len(steps) // 2 + 1]:
        t0 = min(p["queued"][0] for p in st)
        bins = math.ceil((max(p["pull"][1] for p in st) - t0) / BIN_US)
        up = collections.defaultdict(lambda bins=bins: [0] * bins)
        down = collections.defaultdict(lambda bins=bins: [0] * bins)
        for p in st:
            s = host(p["server"])
            if s == str(p["w"] + 1):  # the worker's own colocated server: no link
                continue
            b = int((p["pull"][1] - t0) / BIN_US)
            up[s][b] += p["bytes"]
            down[f"w{p['w']}"][b] += p["bytes"]
            for t, w, nbytes in arrivals[(p["server"], p["key"], p["round"])]:
                if w == p["w"] and 0 <= (b := int((t - t0) / BIN_US)) < bins:
                    up[f"w{w}"][b] += nbytes
                    down[s][b] += nbytes
        print(f"step of {(max(p['pull'][1] for p in st) - t0) / 1e3:.0f} ms, MB/s per {BIN_US / 1e3:.0f} ms bin:")
        for name in sorted(set(up) | set(down), key=lambda x: (x[0] != "w", x)):
            print(f"  {name:>4} up  ", " ".join(f"{v / BIN_US:4.1f}" for v in up[name]))
            print(f"  {name:>4} down", " ".join(f"{v / BIN_US:4.1f}" for v in down[name]))


if __name__ == "__main__":
    main(sys.argv[1])
