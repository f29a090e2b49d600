"""Where the CPU of a cluster run's timed steps went, gloo's window against a byteps point's, from a system-wide
profile taken during the run:

    python -m benchmarks.cluster --ks 0 --repeats 1 --no-ddp --json p.json &
    perf record -a -g -F 1999 -o p.data -- sleep 100    # (stop it once the run is done)
    perf script -i p.data -F comm,pid,tid,time,ip,sym,dso > p.txt
    python docs/results/session27/perf_split.py p.txt p.json 0

Prints samples per second by category for the runners' processes (gloo's threads; our workers' IO thread and
Python, the servers) and for the kernel's softirq threads, which no process's clock counts. perf stamps samples with
the same clock as the windows (CLOCK_MONOTONIC here).
"""

import collections
import json
import re
import sys

OURS = ("gloo_tcp_loop", "pt_gloo_runloop", "python", "bps-client-io", "bps-completion", "ZMQbg/IO/0", "ZMQbg/Reaper")


def samples(path: str):
    current = None
    for line in open(path):
        if not line.strip():
            if current:
                yield current
            current = None
        elif not line.startswith(("\t", " ")):
            m = re.match(r"(.+?)\s+(\d+)/(\d+)\s+([\d.]+):", line)
            current = (m.group(1).strip(), float(m.group(4)), []) if m else None
        elif current is not None:
            parts = line.strip().split(None, 1)
            current[2].append(parts[1] if len(parts) > 1 else "?")
    if current:
        yield current


def category(stack: list[str]) -> str:
    leaf, joined = stack[0], " | ".join(stack)
    if "_copy_to_iter" in leaf or "_copy_from_iter" in leaf:
        return "kernel copy (socket <-> user)"
    if "memmove" in leaf or "memcpy" in leaf:
        return "user memcpy"
    if "addInPlace" in leaf or "gloo::sum" in leaf:
        return "summing"
    if any(k in leaf for k in ("malloc", "_int_free", "cfree")) and "kallsyms" not in leaf:
        return "malloc/free"
    if "libzmq" in joined:
        return "zeromq"
    if "libpython" in leaf:
        return "python"
    if "kallsyms" in leaf:
        for name, keys in (("k softirq (packets)", ("handle_softirqs", "net_rx_action", "do_softirq")),
                           ("k scheduling", ("finish_task_switch", "schedule")),
                           ("k epoll", ("ep_poll", "do_epoll", "sock_poll", "ep_send_events")),
                           ("k tcp send", ("tcp_sendmsg",)), ("k tcp receive", ("tcp_recvmsg",)),
                           ("k unix socket", ("unix_stream",)), ("k futex", ("futex",))):  # fmt: skip
            if any(k in joined for k in keys):
                return name
        return "k other"
    if "_C.cpython" in leaf:
        return "torch_bps C++"
    if "gloo" in leaf or "libtorch" in leaf:
        return "gloo / torch C++"
    return "user other"


def main() -> None:
    report = json.load(open(sys.argv[2]))
    point = report["byteps"]["points"][sys.argv[3]]
    windows = {}
    for name, cpu in (("gloo", report["gloo"]["cpu"]), (f"byteps k={sys.argv[3]}", point["cpu"])):
        spans = [c["window"] for c in cpu.values() if c.get("window")]
        windows[name] = (min(s[0] for s in spans), max(s[1] for s in spans))
    counts = {name: collections.Counter() for name in windows}
    for comm, t, stack in samples(sys.argv[1]):
        for name, (a, b) in windows.items():
            if a <= t <= b and stack:
                if comm.startswith("ksoftirqd"):
                    counts[name]["(ksoftirqd threads)"] += 1
                elif comm in OURS:
                    counts[name][category(stack)] += 1
    names = list(windows)
    print(f"{'samples/s':32}" + "".join(f"{n:>16}" for n in names))
    keys = sorted(set().union(*counts.values()), key=lambda k: -counts[names[-1]][k])
    for key in keys + ["total"]:
        cells = []
        for n in names:
            seconds = windows[n][1] - windows[n][0]
            v = sum(counts[n].values()) if key == "total" else counts[n][key]
            cells.append(f"{v / seconds:16.1f}")
        print(f"{key:32}" + "".join(cells))


if __name__ == "__main__":
    main()
