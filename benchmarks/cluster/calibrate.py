"""Calibration: one plain TCP stream between two emulated hosts, to show the shaped link delivers ~B.

May import: the standard library and benchmarks.cluster.{procs,topology}.
"""

from __future__ import annotations

import sys

from benchmarks.cluster import procs
from benchmarks.cluster.topology import Cluster

STREAM = "benchmarks.cluster.workers.stream"


def calibrate(cluster: Cluster, seconds: float = 3.0, port: int = 5201) -> dict:
    """Stream for `seconds` from the first worker to the next host; return goodput next to the rate.

    Example: `calibrate(c)` -> `{"from": "w0", "to": "w1", "mbit_s": 478.0, "ratio": 0.956, ...}`.
    The ratio is TCP goodput over the tbf rate: headers cost ~4% at MTU 1500, so ~0.95 is a link
    working as configured.
    """
    src = cluster.workers[0]
    dst = (cluster.workers[1:] + cluster.servers)[0]
    timeout = seconds + 30.0
    recv = cluster.spawn(
        "stream recv", dst, [sys.executable, "-m", STREAM, "recv", "--port", str(port), "--timeout", str(timeout)]
    )
    send = cluster.spawn(
        "stream send",
        src,
        [
            sys.executable,
            "-m",
            STREAM,
            "send",
            "--to",
            f"{dst.ip}:{port}",
            "--seconds",
            str(seconds),
            "--timeout",
            str(timeout),
        ],
    )
    got, _ = procs.wait_all([recv, send], timeout + 10.0, "calibration stream")
    shaping = cluster.shaping
    return {
        "from": src.name,
        "to": dst.name,
        "mbit_s": round(got["mbit_s"], 1),
        "rate_mbit": shaping.rate_mbit,
        "ratio": round(got["mbit_s"] / shaping.rate_mbit, 3),
        "seconds": round(got["seconds"], 2),
        "tbf": {"burst_bytes": shaping.burst_bytes, "limit_bytes": shaping.limit_bytes},
    }
