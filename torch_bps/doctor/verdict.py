"""What the doctor's measurements mean: the paper's prediction for this job, and what limits it.

Pure: measurements in, a verdict out, so the rules are tested without a network. The links are found from
paths: a path (machine i -> remote server s -> machine i) goes no faster than either end's link, so an end's
link rate is about the fastest path through it (another end is faster, unless every end is slow alike). A
colocated server shares its machine's link: its end is that machine.
May import: the standard library and torch_bps.engine.placement.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from torch_bps.engine.placement import dedicated_fraction, t_opt

SLOW = 0.75  # an end below this share of the median end's rate is named slow
SUM_SHARE = 0.5  # summation taking more than this share of the predicted communication time limits the job
LOCAL_SHARE = 0.5  # the local reduce taking more than this share of it, likewise
OVERHEAD = 1.3  # measured above this multiple of the prediction: something besides the links limits the job


@dataclass
class Path:
    machine: int
    server: str  # its address
    end: str  # the host whose link the server uses: "machine j" or the server's address
    goodput: float  # bytes/s of one push_pull alone on the path (each byte up and back down)
    rtt: float  # seconds: a tiny push_pull's round trip


@dataclass
class Measurements:
    machines: int  # n
    dedicated: list[str]  # the k dedicated servers' addresses
    nbytes: int  # M, bytes per collective
    paths: list[Path]
    collective: float  # seconds of one push_pull of M bytes over the whole job (median)
    gloo: float | None = None  # seconds of gloo's all_reduce of the same tensor, if measured
    sum_rates: dict[str, float] = field(default_factory=dict)  # server address -> bytes/s of its adds
    local_seconds: float | None = None  # the local reduce-scatter + all-gather of M bytes (several local ranks)


@dataclass
class Verdict:
    link_rates: dict[str, float]  # end -> bytes/s
    bandwidth: float  # the slowest end's rate: what every collective is paced by
    predicted: float  # t_opt at this job's k
    allreduce: float  # the all-reduce bound at the same bandwidth (k = 0)
    by_k: dict[int, float]  # t_opt for k = 0..n dedicated servers
    best_k: int
    limits: list[str]  # what limits this job, most important first; never empty

    def text(self, m: Measurements) -> str:
        """The report a person reads."""
        k, n = len(m.dedicated), m.machines
        lines = [f"torch_bps doctor: {n} machine(s), {k} dedicated server(s), {m.nbytes / 1e6:.1f} MB per collective"]
        for end, rate in sorted(self.link_rates.items()):
            lines.append(f"  link of {end}: {rate * 8 / 1e6:.0f} Mbit/s")
        for p in m.paths:
            lines.append(f"  path machine {p.machine} <-> {p.server}: {p.goodput * 8 / 1e6:.0f} Mbit/s, "
                         f"round trip {p.rtt * 1e3:.2f} ms")  # fmt: skip
        for server, rate in sorted(m.sum_rates.items()):
            lines.append(f"  server {server} sums at {rate / 1e9:.2f} GB/s")
        if m.local_seconds is not None:
            lines.append(f"  local reduce-scatter + all-gather: {m.local_seconds * 1e3:.1f} ms")
        lines.append(f"predicted (paper, at {self.bandwidth * 8 / 1e6:.0f} Mbit/s): {self.predicted * 1e3:.1f} ms at "
                     f"k = {k}; all-reduce {self.allreduce * 1e3:.1f} ms; k = {self.best_k}: "
                     f"{self.by_k[self.best_k] * 1e3:.1f} ms")  # fmt: skip
        measured = f"measured: {m.collective * 1e3:.1f} ms ({m.collective / self.predicted:.2f} x predicted)"
        if m.gloo is not None:
            measured += f"; gloo all_reduce {m.gloo * 1e3:.1f} ms"
        lines.append(measured)
        lines += [f"limit: {why}" for why in self.limits]
        return "\n".join(lines)


def judge(m: Measurements) -> Verdict:
    """Predict this job's communication time from its measured links, and name what limits it."""
    n, k = m.machines, len(m.dedicated)
    rates: dict[str, float] = {}
    for p in m.paths:
        for end in (f"machine {p.machine}", p.end):
            rates[end] = max(rates.get(end, 0.0), p.goodput)
    if not rates:
        raise ValueError("no path was measured: the doctor needs a server on another host than some machine")
    bandwidth = min(rates.values())
    by_k = {kk: t_opt(n, kk, m.nbytes, bandwidth) for kk in range(n + 1)}
    best_k = min(by_k, key=lambda kk: (by_k[kk], kk))
    predicted, allreduce = t_opt(n, k, m.nbytes, bandwidth), by_k[0]
    limits = _slow_links(rates) + _slow_sums(m, predicted)
    if m.local_seconds is not None and m.local_seconds > LOCAL_SHARE * predicted:
        limits.append(f"the local reduce among a machine's ranks takes {m.local_seconds * 1e3:.1f} ms, against "
                      f"{predicted * 1e3:.1f} ms predicted for the network")  # fmt: skip
    if m.collective > OVERHEAD * predicted and not limits:
        limits.append(f"not the links: measured {m.collective / predicted:.2f} x the prediction with every link and "
                      "server at speed; look at CPU (the machine's load, the partition size) and the step's "
                      "overlap")  # fmt: skip
    if k < best_k and by_k[best_k] < 0.9 * predicted:
        limits.append(f"too few dedicated servers: k = {best_k} would cut communication from {predicted * 1e3:.1f} to "
                      f"{by_k[best_k] * 1e3:.1f} ms (the paper's rule; x = {dedicated_fraction(n, best_k):.2f} of "
                      f"the bytes to them)")  # fmt: skip
    if not limits:
        limits.append(f"the links themselves: measured {m.collective / predicted:.2f} x the paper's prediction")
    return Verdict(rates, bandwidth, predicted, allreduce, by_k, best_k, limits)


def _slow_links(rates: dict[str, float]) -> list[str]:
    median = statistics.median(rates.values())
    slow = sorted((rate, end) for end, rate in rates.items() if rate < SLOW * median)
    return [f"the link of {end} is slow: {rate * 8 / 1e6:.0f} Mbit/s against a median of {median * 8 / 1e6:.0f}: "
            "every collective goes at its pace" for rate, end in slow]  # fmt: skip


def _slow_sums(m: Measurements, predicted: float) -> list[str]:
    """A server whose adds of its share of a collective take a large part of the predicted time."""
    n, k = m.machines, len(m.dedicated)
    x = dedicated_fraction(n, k)
    out = []
    for server, rate in sorted(m.sum_rates.items()):
        share = x / k if server in m.dedicated else (1 - x) / n  # of the collective's bytes
        seconds = (n - 1) * share * m.nbytes / rate if rate > 0 else float("inf")  # n - 1 adds of its share
        if seconds > SUM_SHARE * predicted:
            out.append(f"server {server} sums its share in {seconds * 1e3:.1f} ms ({rate / 1e9:.2f} GB/s), against "
                       f"{predicted * 1e3:.1f} ms predicted for the network: a CPU-bound server")  # fmt: skip
    return out
