"""How every training benchmark counts: useful samples, time to a target accuracy, ranges over repeats.

- **Samples that entered a sum.** A worker's computed gradient counts only if the servers added it: under backup
  workers a round closes at n - b pushes and drops the rest. `contributed_share` reads that from the servers'
  own counters (pushes served, pushes dropped late), never assumes it; `job_rate` divides by the job's wall time (the
  slowest rank's), so a fast rank that finishes early is not counted as extra throughput.
- **Time to a target accuracy** is read off a per-step curve of (training seconds, step, accuracy), the
  evaluation's own time left out, with the crossing interpolated between the two steps around it.
- **Ranges.** Each figure over repeats is its median with its min and max; a ratio between two modes is taken
  within each round (the runs alternated on one cluster) and then summarised the same way.

May import: the standard library.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

INF = float("inf")


def contributed_share(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> float:
    """Return the share of the pushes served in a run that entered a sum, from the servers' per-job counters.

    Args:
        before, after: {job: {"pushes": served, "late_pushes": dropped because their round had closed}}, summed
            over every server, read before and after the run (a job absent before counts from 0).

    Example: `contributed_share({}, {"j": {"pushes": 400, "late_pushes": 100}})` -> 0.75.
    """
    pushes = late = 0
    for job, counts in after.items():
        was = before.get(job, {"pushes": 0, "late_pushes": 0})
        pushes += counts["pushes"] - was["pushes"]
        late += counts["late_pushes"] - was["late_pushes"]
    if pushes <= 0 or not 0 <= late <= pushes:
        raise ValueError(f"server counters out of order: {pushes} pushes served and {late} dropped in the run")
    return 1 - late / pushes


def job_rate(samples: float, seconds_per_rank: Sequence[float]) -> float:
    """Return samples per second of the whole job: `samples` over the slowest rank's wall seconds."""
    return samples / max(seconds_per_rank)


def time_to_target(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Return the training seconds at which accuracy first reaches `target`, interpolated linearly between the
    last point under it and the first at or over it; None if the curve never reaches it.

    Args:
        curve: (seconds, step, accuracy) points in step order, seconds excluding evaluation; the first point may
            be step 0 at 0 s (the initial model), so a crossing in the first step interpolates from the start.

    Example: `time_to_target([(0, 0, 0.1), (1, 1, 0.5), (2, 2, 0.9)], 0.7)` -> 1.5.
    """
    previous = None
    for point in curve:
        seconds, accuracy = point[0], point[2]
        if accuracy >= target:
            if previous is None:
                return seconds
            s0, a0 = previous
            return s0 + (target - a0) / (accuracy - a0) * (seconds - s0)
        previous = (seconds, accuracy)
    return None


@dataclass(frozen=True)
class Spread:
    """A figure over repeats: median, min and max (inf stands for "never reached")."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        """Summarise `values` (None counts as inf: a run that never reached its target)."""
        clean = [INF if v is None else v for v in values]
        if not clean:
            raise ValueError("no runs to summarise")
        return cls(statistics.median(clean), min(clean), max(clean), len(clean))

    def format(self, digits: int = 2) -> str:
        """'1.23 [1.10-1.30]'; a single run shows its value alone."""

        def f(v: float) -> str:
            return "never" if v == INF else f"{v:.{digits}f}"

        return f(self.median) if self.count == 1 else f"{f(self.median)} [{f(self.low)}-{f(self.high)}]"


def paired_ratios(values: Sequence[float | None], base: Sequence[float | None]) -> list[float]:
    """Return values[r] / base[r] for each round r in which both are finite (runs alternated within a round)."""
    out = []
    for v, b in zip(values, base, strict=False):
        if v is not None and b is not None and v != INF and b != INF and b > 0:
            out.append(v / b)
    return out
