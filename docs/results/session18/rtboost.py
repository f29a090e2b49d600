"""Beside a cluster benchmark run: put chosen threads of its workers and servers under SCHED_FIFO, and report
each thread kind's CPU, run-queue wait and wake-ups over the timed steps (from /proc/PID/task/TID/schedstat).

    python3 rtboost.py SECONDS MODE &    # then, meanwhile: python -m benchmarks.cluster -n 8 ... --ks 4
    MODE: none | io (bps-client-io and ZeroMQ's IO threads) | io+server (also the servers' main threads, where the
          core loop runs) | workers (every worker thread, and the IO ones) | servers (every server thread, and the
          IO ones)

The timed steps are taken as the last 40% of the time during which bps-client-io threads exist (start-up and
warm-up come first). Scratch measurement tool of session 18 (docs/issue15.md, "Is it the 2 cores?"); root only.
"""

import collections
import os
import sys
import time

IO = {"bps-client-io", "ZMQbg/IO/0", "bps-completion"}


def processes():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"bps_pushpull" in cmdline:
            yield pid, "worker"
        elif b"torch_bps.server" in cmdline:
            yield pid, "server"


def threads():
    """(pid, tid), role, thread name, run ns, wait ns, wake-ups: of every thread of the benchmark's processes."""
    for pid, role in processes():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait, wakeups = map(int, f.read().split())
            except (OSError, ValueError):
                continue
            yield (pid, tid), role, name, run, wait, wakeups


def boost(mode: str, key: tuple[str, str], role: str, name: str) -> bool:
    if mode == "all":
        return True
    if mode in ("workers", "servers") and (name in IO or role == mode[:-1]):
        return True
    if mode in ("io", "io+server") and name in IO:
        return True
    return mode == "io+server" and role == "server" and key[0] == key[1]


def main() -> None:
    seconds, mode = float(sys.argv[1]), sys.argv[2]
    snaps, boosted = [], set()
    end = time.time() + seconds
    while time.time() < end:
        snap = {}
        snaps.append((time.time(), snap))
        for key, role, name, run, wait, wakeups in threads():
            snap[key] = (role, name, run, wait, wakeups)
            if key not in boosted and boost(mode, key, role, name):
                try:
                    os.sched_setscheduler(int(key[1]), os.SCHED_FIFO, os.sched_param(10))
                    boosted.add(key)
                except OSError:
                    pass  # the thread ended
        time.sleep(0.2)
    live = [t for t, snap in snaps if any(v[1] == "bps-client-io" for v in snap.values())]
    start = live[0] + 0.6 * (live[-1] - live[0])
    (t0, first), (t1, last) = next(s for s in snaps if s[0] >= start), [s for s in snaps if s[0] <= live[-1]][-1]
    wall = t1 - t0
    totals = collections.defaultdict(lambda: [0, 0, 0, 0])
    for key, (role, name, run, wait, wakeups) in last.items():
        if key in first:
            total = totals[(role, name)]
            total[0] += run - first[key][2]
            total[1] += wait - first[key][3]
            total[2] += wakeups - first[key][4]
            total[3] += 1
    print(f"window {wall:.1f} s")
    print(f"mode {mode}: boosted {len(boosted)} threads")
    for (role, name), (run, wait, wakeups, count) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        if run >= 1e7:
            print(
                f"{role:7s} {name:16s} threads {count:3d} cpu-s {run / 1e9:7.2f} wait-s {wait / 1e9:7.2f} "
                f"waiting {wait / 1e9 / wall:5.2f} wakeups {wakeups:8d} "
                f"mean wait {wait / max(wakeups, 1) / 1e3:6.0f} us"
            )


if __name__ == "__main__":
    main()
