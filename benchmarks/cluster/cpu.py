"""CPU accounting over a timed window, so a report can tell a link-bound run from a CPU-bound one.

Namespaces share the machine's CPUs, so `/proc/stat` (all cores, softirq included: that is where the
emulated links' packet work lands) is the machine-wide figure; `time.process_time()` is this process's.
May import: the standard library only (it runs inside every worker).
"""

from __future__ import annotations

import os
import time


def machine_jiffies() -> tuple[int, int, int]:
    """Return (busy, softirq, total) jiffies of all cores since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice; guest time is already in user.
    total = sum(fields[:8])
    idle = fields[3] + fields[4]
    return total - idle, fields[6], total


def machine_busy_over(seconds: float) -> float:
    """Return the share of all cores busy during the next `seconds` (e.g. load from other jobs)."""
    busy0, _, total0 = machine_jiffies()
    time.sleep(seconds)
    busy1, _, total1 = machine_jiffies()
    return round((busy1 - busy0) / max(total1 - total0, 1), 3)


def process_cpu_seconds(pid: int) -> float:
    """Return the CPU seconds process `pid` used so far (every thread, user and system), 0.0 if it is gone.

    Read from the process's CPU-time clock (Linux's clock id for another process, ((~pid) << 3) | 2, as
    clock_getcpuclockid makes it), which counts nanoseconds: /proc/PID/stat's utime and stime count 10 ms ticks,
    too coarse for a window of a fraction of a second.
    """
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return 0.0


def softirq_thread_seconds() -> float:
    """Return the CPU seconds the kernel's softirq threads (ksoftirqd/N) used so far, all cores together.

    Packet work (the emulated links' qdiscs and veths, every receiver's TCP) runs as softirq: in the process that
    raised it, counted in that process's clock, or, when there is more than a slice's worth, in ksoftirqd, counted in
    no process. How much lands where differs between runners and runs, so CPU per step is given with and without it.
    Precise: schedstat's first field is nanoseconds run.
    """
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("ksoftirqd/"):
                    continue
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def process_wait_seconds(pid: int | str = "self") -> float:
    """Return the seconds `pid`'s live threads spent runnable but waiting for a core (0.0 if it is gone).

    The second field of /proc/PID/task/TID/schedstat is the thread's run-queue delay. Summed over the
    threads and divided by wall time it is how many of the process's threads, on average, were ready to
    run and had no core: on a 2-core machine emulating a cluster, the scheduling delay the links never see.
    """
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended between listdir and open
    return total / 1e9


class CpuWindow:
    """Measure CPU use between `start()` and `stop()`.

    Example: `w = CpuWindow().start(); work(); cpu = w.stop()` ->
    `{"process_cores": 0.4, "process_waiting": 0.3, "softirq_threads_cores": 0.02, "machine_busy": 0.55, ...}`: this
    process used 0.4 cores on average, and on average 0.3 of its threads were ready to run with no core
    free (`process_wait_seconds`); the kernel's softirq threads used 0.02 cores (`softirq_thread_seconds`); all cores
    together were busy 55% of the time, 10% of it in
    softirq (packet processing of the emulated links lands there). Machine-wide figures include
    whatever else runs on the machine. `watch` ({name: pid}): other processes (the servers) measured over the
    same window, under "watched".
    """

    def __init__(self, watch: dict[str, int] | None = None):
        self._watch = dict(watch or {})  # name -> pid of another process measured over the same window

    def start(self) -> CpuWindow:
        self._wall = time.monotonic()
        self._proc = time.process_time()
        self._wait = process_wait_seconds()
        self._softirq_threads = softirq_thread_seconds()
        self._watched = {
            name: (process_cpu_seconds(pid), process_wait_seconds(pid)) for name, pid in self._watch.items()
        }
        self._busy, self._softirq, self._total = machine_jiffies()
        return self

    def stop(self) -> dict:
        end = time.monotonic()
        wall = max(end - self._wall, 1e-9)
        busy, softirq, total = machine_jiffies()
        jiffies = max(total - self._total, 1)
        return {
            "process_cores": round((time.process_time() - self._proc) / wall, 3),
            "process_waiting": round((process_wait_seconds() - self._wait) / wall, 3),
            # The machine's, not this process's: every host's window sees the same threads (count one host's).
            "softirq_threads_cores": round((softirq_thread_seconds() - self._softirq_threads) / wall, 4),
            "machine_busy": round((busy - self._busy) / jiffies, 3),
            "machine_softirq": round((softirq - self._softirq) / jiffies, 3),
            "machine_cores": os.cpu_count(),
            "window": [round(self._wall, 3), round(end, 3)],  # CLOCK_MONOTONIC, as `perf record -k mono` stamps
            "watched": {
                name: {
                    "process_cores": round((process_cpu_seconds(pid) - cpu0) / wall, 3),
                    "process_waiting": round((process_wait_seconds(pid) - wait0) / wall, 3),
                }
                for (name, pid), (cpu0, wait0) in zip(self._watch.items(), self._watched.values(), strict=True)
            },
        }
