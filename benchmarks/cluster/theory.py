"""The paper's section 4.1 communication times (BytePS, OSDI'20), for n workers, k CPU servers, bandwidth B.

All functions take bytes and bits per second and return seconds; `size_bytes` is the gradient size M.
May import: the standard library only.
"""

from __future__ import annotations


def _check(n: int, k: int = 0) -> None:
    if n < 2 or k < 0:
        raise ValueError(f"need n >= 2 workers and k >= 0 servers, got n={n}, k={k}")


def allreduce_bound_s(n: int, size_bytes: float, rate_bps: float) -> float:
    """Return the ring all-reduce bound 2(n-1)M/(nB): each worker sends and receives 2(n-1)/n x M.

    Example: `allreduce_bound_s(4, 64 * 2**20, 500e6)` -> 1.61 s.
    """
    _check(n)
    return 2 * (n - 1) * size_bytes * 8 / (n * rate_bps)


def dedicated_fraction(n: int, k: int) -> float:
    """Return x, the share of bytes sent to the k CPU servers: 2k(n-1)/(n^2+kn-2k), and 1 for k >= n."""
    _check(n, k)
    if k >= n:
        return 1.0
    return 2 * k * (n - 1) / (n * n + k * n - 2 * k)


def t_opt_s(n: int, k: int, size_bytes: float, rate_bps: float) -> float:
    """Return the optimal step time 2n(n-1)M/((n^2+kn-2k)B); M/B for k >= n (the x = 1 formula).

    k = 0 is the all-reduce bound, k = n the parameter-server time M/B.
    Example: `t_opt_s(4, 2, 64 * 2**20, 500e6)` -> 1.29 s.
    """
    _check(n, k)
    if k >= n:
        return size_bytes * 8 / rate_bps
    return 2 * n * (n - 1) * size_bytes * 8 / ((n * n + k * n - 2 * k) * rate_bps)
