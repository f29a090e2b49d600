"""A summation server's counters for monitoring: Prometheus text over HTTP, and `bps-server --stats HOST:PORT`.

The counters live on the server's loop thread (the native core's, and the control plane's memory book). The
HTTP thread never reads them itself: it asks the loop for a snapshot (`SummationServer.on_loop`), which the
loop's next tick takes, so a scrape costs the loop one snapshot and costs nothing between scrapes.

`--metrics-port` is not authenticated: whoever reaches it sees the server's job ids and their byte counts.
Bind it (`--metrics-host`, default the server's `--host`) where only your monitoring reaches.

May import: the standard library, pyzmq, torch_bps.wire and torch_bps.security.
"""

from __future__ import annotations

import http.server
import os
import struct
import threading
from collections.abc import Callable

import zmq

from torch_bps.security import ClientCredentials
from torch_bps.wire import STATS_FIELDS, Command, Header, Status

# (STATS field, Prometheus name, type, help) of the server's totals and of each job's share.
_SERVER = (
    ("pushes", "bps_server_pushes_total", "counter", "PUSH requests served"),
    ("pulls", "bps_server_pulls_total", "counter", "PULL requests served"),
    ("bytes_in", "bps_server_received_bytes_total", "counter", "PUSH payload bytes received"),
    ("bytes_out", "bps_server_sent_bytes_total", "counter", "payload bytes of successful PULL replies"),
    ("sums", "bps_server_sums_total", "counter", "pushes added into a round"),
    ("bytes_summed", "bps_server_summed_bytes_total", "counter", "bytes added"),
    ("sum_ns", "bps_server_sum_seconds_total", "counter", "time spent adding"),
    ("errors", "bps_server_errors_total", "counter", "error replies"),
    ("requests", "bps_server_requests_total", "counter", "messages read"),
    ("wakeups", "bps_server_wakeups_total", "counter", "loop wake-ups that read messages (requests / wakeups: queue)"),
    ("keys_waiting", "bps_server_keys_waiting", "gauge", "keys with pulls waiting for their round to close"),
    ("jobs", "bps_server_jobs", "gauge", "jobs registered"),
    ("memory_charged", "bps_server_memory_charged_bytes", "gauge", "bytes charged against the memory bound"),
    ("memory_bound", "bps_server_memory_bound_bytes", "gauge", "the memory bound (--max-memory-bytes)"),
    ("resident_bytes", "process_resident_memory_bytes", "gauge", "resident memory of the server process"),
)  # fmt: skip
_JOB = (
    ("pushes", "bps_job_pushes_total", "counter", "PUSH requests served for the job"),
    ("pulls", "bps_job_pulls_total", "counter", "PULL requests served for the job"),
    ("bytes_in", "bps_job_received_bytes_total", "counter", "the job's PUSH payload bytes"),
    ("bytes_out", "bps_job_sent_bytes_total", "counter", "payload bytes of the job's successful PULL replies"),
    ("sums", "bps_job_sums_total", "counter", "the job's pushes added into a round"),
    ("bytes_summed", "bps_job_summed_bytes_total", "counter", "the job's bytes added"),
    ("sum_ns", "bps_job_sum_seconds_total", "counter", "time spent adding the job's pushes"),
    ("errors", "bps_job_errors_total", "counter", "error replies to the job"),
    ("late_pushes", "bps_job_late_pushes_total", "counter", "pushes dropped: their backup round had closed"),
    ("memory_charged", "bps_job_memory_charged_bytes", "gauge", "bytes charged to the job"),
    ("workers", "bps_job_workers", "gauge", "workers of the job"),
    ("keys", "bps_job_keys", "gauge", "keys the job declared"),
)  # fmt: skip


def resident_bytes() -> int:
    """This process's resident memory (statm), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def exposition(server: dict[str, int], jobs: dict[int, dict[str, int]]) -> str:
    """Render a snapshot (the server's totals, each job's share) in Prometheus text exposition format 0.0.4.

    Example: `exposition({"pushes": 3, ...}, {0x2a: {"pushes": 3, ...}})` -> "bps_server_pushes_total 3\\n...".
    """
    lines = []
    per_job = [(f'{{job="{job_id:#018x}"}}', counters) for job_id, counters in sorted(jobs.items())]
    for table, rows in ((_SERVER, [("", server)]), (_JOB, per_job)):
        for field, name, kind, text in table:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for labels, counters in rows:
                value = counters[field]
                lines.append(f"{name}{labels} {value / 1e9 if field == 'sum_ns' else value}")
    return "\n".join(lines) + "\n"


class NotReady(Exception):
    """Raised by a page of MetricsEndpoint to answer 503 with its message (a probe that says "not now")."""


class MetricsEndpoint:
    """GET /metrics over plain HTTP, from one thread of its own; `snapshot()` gives the text (it may block).

    pages: more paths and what they serve, the same way (the health probes: /healthz, /readyz). A page that raises
    TimeoutError or NotReady is answered 503 with the exception's message.

    Example: `m = MetricsEndpoint("127.0.0.1", 0, lambda: "up 1\\n"); m.start(); ...; m.stop()`.
    """

    def __init__(self, host: str, port: int, snapshot: Callable[[], str],
                 pages: dict[str, Callable[[], str]] | None = None):  # fmt: skip
        served = {**(pages or {}), "/metrics": snapshot}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                page = served.get(self.path.split("?")[0])
                if page is None:
                    self.send_error(404, f"only {', '.join(sorted(served))} are served here")
                    return
                try:
                    body = page().encode()
                except (TimeoutError, NotReady) as e:
                    self.send_error(503, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are routine: no line per request on stderr
                pass

        self._http = http.server.HTTPServer((host, port), Handler)
        self.host, self.port = host, self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="bps-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


def query_stats(address: str, *, credential: str = "", mechanism: str = "token", timeout: float = 10.0) -> dict:
    """Ask the server at "host:port" for its STATS; return {field: value} (torch_bps.wire.STATS_FIELDS).

    Connects as a pool client with `credential` (mechanism "token" or "curve"; "off": no authentication); STATS
    needs no HELLO, so the query registers nothing on the server. Raises TimeoutError naming the server when it
    does not answer within `timeout` seconds (a wrong credential looks the same: the server drops the connection).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if mechanism != "off":
            if not credential:
                raise ValueError("the server authenticates: give its pool credential (BPS_POOL_CREDENTIAL, "
                                 "--credential-file) or --auth off")  # fmt: skip
            credentials = ClientCredentials.for_pool(credential, 0, 1, mechanism)
            if mechanism == "curve":
                sock.curve_publickey, sock.curve_secretkey = credentials.client.public, credentials.client.secret
                sock.curve_serverkey = credentials.server_keys[0]
            else:
                sock.plain_username, sock.plain_password = credentials.client.public, credentials.tokens[0]
        sock.connect(f"tcp://{address}")
        sock.send_multipart([Header(command=Command.STATS, request_id=1).pack()])
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no STATS reply from {address} within {timeout:g} s (is it running, with this "
                               f"--auth ({mechanism}) and credential?)")  # fmt: skip
        frames = sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()
    header = Header.unpack(frames[0])
    if header.status != Status.OK or len(frames) != 2 or len(frames[1]) != 8 * len(STATS_FIELDS):
        raise RuntimeError(f"{address} answered STATS with status {header.status} and {len(frames)} frame(s): "
                           f"{frames[1:]!r:.200}")  # fmt: skip
    return dict(zip(STATS_FIELDS, struct.unpack(f"<{len(STATS_FIELDS)}Q", frames[1]), strict=True))


def format_stats(address: str, stats: dict[str, int]) -> str:
    """What `bps-server --stats` prints: one counter a line, and the two rates that explain them."""
    lines = [f"bps-server {address}"] + [f"  {name:<15} {stats[name]}" for name in STATS_FIELDS]
    if stats["sum_ns"]:
        lines.append(f"  summation rate  {stats['bytes_summed'] / stats['sum_ns']:.2f} GB/s while adding")
    if stats["wakeups"]:
        lines.append(f"  queue depth     {stats['requests'] / stats['wakeups']:.2f} requests per wake-up (mean)")
    return "\n".join(lines)
