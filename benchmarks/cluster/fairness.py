"""How long one step's flows take when the links share themselves fairly per flow, as TCP does, against t_opt.

The paper's t_opt at 0 < k < n keeps every link busy the whole step, which needs each flow to run at its own rate:
a worker's push to a dedicated server carries 3-4x the bytes of its push to a colocated one and must go 3-4x as
fast over the same uplink. TCP gives the flows that share a bottleneck equal rates instead (max-min fairness). This
fluid model fills the links by progressive filling, lets the flows run, and refills whenever one ends; the
flows are the step's pushes and replies, one per worker and server in each direction (no dependency between them,
every flow sending from the start: `python -m benchmarks.cluster --runner tcp-free` measures the same on the
emulated links).

    python -m benchmarks.cluster.fairness          # the table for n = 2, 4, 8, 16, every k
May import: the standard library and benchmarks.cluster.{placement,theory}.
"""

from __future__ import annotations

import argparse

from benchmarks.cluster import placement, theory


def step_flows(n: int, k: int) -> list[tuple[str, str, float]]:
    """Return (from host, to host, bytes) of every flow of a step of 1 byte per worker, under the paper's split.

    Hosts are "w0".."w{n-1}" (each with its colocated server) and "d0".."d{k-1}". A worker's bytes to the server on
    its own host never cross a link and are left out.
    """
    flows = []
    for server, share in enumerate(placement.server_shares(n, k)):
        if share == 0.0:
            continue
        host = f"d{server}" if server < k else f"w{server - k}"
        for w in range(n):
            if host != f"w{w}":
                flows += [(f"w{w}", host, share), (host, f"w{w}", share)]
    return flows


def max_min_rates(flows: list[tuple[str, str]], capacity: float = 1.0) -> list[float]:
    """Return each flow's max-min fair rate; flow i leaves host flows[i][0]'s uplink for flows[i][1]'s downlink."""
    links = [((a, "up"), (b, "down")) for a, b in flows]
    left = {link: capacity for pair in links for link in pair}
    rates = [0.0] * len(flows)
    active = set(range(len(flows)))
    while active:
        users: dict = {}
        for i in active:
            for link in links[i]:
                users.setdefault(link, []).append(i)
        grow = min(left[link] / len(ids) for link, ids in users.items())
        for link, ids in users.items():
            left[link] -= grow * len(ids)
        for i in active:
            rates[i] += grow
        full = {link for link, ids in users.items() if left[link] <= 1e-12 * capacity}
        active = {i for i in active if not full.intersection(links[i])}
    return rates


def fair_step_over_t_opt(n: int, k: int) -> float:
    """Return the step time of `step_flows(n, k)` under max-min fair sharing, over t_opt.

    Example: `fair_step_over_t_opt(2, 1)` -> 1.25 (every flow gets a third of a worker's link, the colocated ones
    end at 0.75 t_opt and the dedicated ones take half a link each for the rest); 1.0 at k = 0 and k = n.
    """
    flows = [[a, b, size] for a, b, size in step_flows(n, k)]
    elapsed = 0.0
    while flows:
        rates = max_min_rates([(a, b) for a, b, _ in flows])
        dt = min(size / rate for (_, _, size), rate in zip(flows, rates, strict=True))
        elapsed += dt
        for flow, rate in zip(flows, rates, strict=True):
            flow[2] -= rate * dt
        flows = [f for f in flows if f[2] > 1e-12]
    return elapsed / theory.t_opt_s(n, k, 1.0, 8.0)  # 1 byte per worker over a link of 1 byte/s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4,8,16", help="comma-separated n (default 2,4,8,16)")
    args = p.parse_args(argv)
    for n in (int(v) for v in args.workers.split(",")):
        ratios = " ".join(f"{fair_step_over_t_opt(n, k):.3f}" for k in range(n + 1))
        print(f"n = {n:2d}, k = 0..{n}: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
