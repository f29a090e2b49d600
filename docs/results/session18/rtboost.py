"""While the cluster benchmark runs: put chosen threads of its workers/servers under SCHED_FIFO, and sample schedstat.
usage: rtboost.py SECONDS MODE   (MODE: none | io | io+server | all)
Prints per (role, thread name) cores, waiting threads and mean wait per wake-up, over the whole run (threads seen)."""
import os, sys, time, collections
IO = {"bps-client-io", "ZMQbg/IO/0", "bps-completion"}
def procs():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try: c = open(f"/proc/{pid}/cmdline","rb").read()
        except OSError: continue
        if b"bps_pushpull" in c: yield pid, "worker"
        elif b"torch_bps.server" in c: yield pid, "server"
        elif b"gloo_allreduce" in c: yield pid, "gloo"
def threads():
    for pid, role in procs():
        try: tids = os.listdir(f"/proc/{pid}/task")
        except OSError: continue
        for t in tids:
            try:
                name = open(f"/proc/{pid}/task/{t}/comm").read().strip()
                run, wait, n = map(int, open(f"/proc/{pid}/task/{t}/schedstat").read().split())
            except (OSError, ValueError): continue
            yield (pid, t), role, name, run, wait, n
seconds, mode = float(sys.argv[1]), sys.argv[2]
snaps, boosted = [], set()
end = time.time() + seconds
while time.time() < end:
    snap = {}
    snaps.append((time.time(), snap))
    for key, role, name, run, wait, n in threads():
        snap[key] = (role, name, run, wait, n)
        want = mode == "all" or (mode == "workers" and (role == "worker" or name in IO)) or (mode == "servers" and (role == "server" or name in IO)) or (name in IO and mode in ("io", "io+server")) or (mode == "io+server" and role == "server" and key[0] == key[1])
        if want and key not in boosted:
            try: os.sched_setscheduler(int(key[1]), os.SCHED_FIFO, os.sched_param(10)); boosted.add(key)
            except OSError as e: pass
    time.sleep(0.2)
# steady state: from 60% of the span where client-io threads exist to its end (warm-up + start-up excluded)
live = [t for t, snap in snaps if any(v[1] == "bps-client-io" for v in snap.values())]
t0 = live[0] + 0.6 * (live[-1] - live[0])
a = min(((t, s) for t, s in snaps if t >= t0), key=lambda x: x[0])
b = max(((t, s) for t, s in snaps if t <= live[-1]), key=lambda x: x[0])
print(f"window {b[0] - a[0]:.1f} s")
first, last = a[1], b[1]
agg = collections.defaultdict(lambda: [0, 0, 0, 0])
for key, (role, name, run, wait, n) in last.items():
    if key not in first: continue
    _, _, r0, w0, n0 = first[key]
    g = agg[(role, name)]; g[0] += run - r0; g[1] += wait - w0; g[2] += n - n0; g[3] += 1
print(f"mode {mode}: boosted {len(boosted)} threads")
for (role, name), (run, wait, n, cnt) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
    if run < 1e7: continue
    print(f"{role:7s} {name:16s} threads {cnt:3d} cpu-s {run/1e9:7.2f} wait-s {wait/1e9:7.2f} waiting {wait/1e9/(b[0]-a[0]):5.2f} wakeups {n:8d} mean wait {wait/max(n,1)/1e3:6.0f} us")
