"""benchmarks/metrics.py, the counting every training benchmark's figures go through, on hand-made inputs."""

from __future__ import annotations

import pytest

from benchmarks import metrics
from benchmarks.cluster.workers.common import parse_job_counters
from torch_bps.server.metrics import exposition


def test_backup_rounds_count_only_the_pushes_the_servers_summed():
    # n = 4, b = 1, 10 rounds of 5 keys: 200 pushes served, one in four dropped late.
    after = {"0x1": {"pushes": 200, "late_pushes": 50}}
    assert metrics.contributed_share({}, after) == 0.75
    # 4 ranks computed 10 rounds of 256 samples each in 2 s: 5120 computed samples/s, 3840 of them summed.
    computed = 4 * 10 * 256
    assert metrics.job_rate(computed * metrics.contributed_share({}, after), [1.5, 2.0, 1.8, 2.0]) == 3840


def test_counters_of_other_jobs_and_of_earlier_runs_are_not_counted():
    before = {"0x1": {"pushes": 100, "late_pushes": 0}, "0x2": {"pushes": 60, "late_pushes": 20}}
    after = {"0x2": {"pushes": 60, "late_pushes": 20}, "0x3": {"pushes": 40, "late_pushes": 10}}  # 0x1 ended
    assert metrics.contributed_share(before, after) == 0.75
    # A job that grew in the run counts by its growth alone.
    assert metrics.contributed_share(before, {"0x2": {"pushes": 100, "late_pushes": 20}}) == 1.0


@pytest.mark.parametrize("after", [{}, {"0x1": {"pushes": 10, "late_pushes": 11}}])
def test_counters_that_cannot_be_are_an_error(after):
    with pytest.raises(ValueError, match="out of order"):
        metrics.contributed_share({}, after)


def test_job_rate_is_over_the_slowest_rank():
    # A fast rank that finished early adds no throughput: 1000 samples over the job's 4 s, not 250 + 500.
    assert metrics.job_rate(1000, [4.0, 2.0]) == 250


def test_time_to_target_interpolates_between_the_steps_around_the_crossing():
    curve = [(0.0, 0, 0.10), (1.0, 1, 0.50), (3.0, 2, 0.90), (4.0, 3, 0.95)]
    assert metrics.time_to_target(curve, 0.70) == pytest.approx(2.0)
    assert metrics.time_to_target(curve, 0.90) == 3.0  # reached exactly at a step
    assert metrics.time_to_target(curve, 0.10) == 0.0  # the initial model already there
    assert metrics.time_to_target(curve, 0.99) is None


def test_time_to_target_takes_the_first_crossing_not_a_later_one():
    curve = [(0.0, 0, 0.5), (1.0, 1, 0.8), (2.0, 2, 0.6), (3.0, 3, 0.9)]
    assert metrics.time_to_target(curve, 0.7) == pytest.approx(2 / 3)


def test_spread_is_median_min_max_and_never_stays_never():
    assert metrics.Spread.of([3.0, 1.0, 2.0]).format() == "2.00 [1.00-3.00]"
    assert metrics.Spread.of([1.5]).format(1) == "1.5"
    assert metrics.Spread.of([1.0, None, 2.0]).format(1) == "2.0 [1.0-never]"
    with pytest.raises(ValueError):
        metrics.Spread.of([])


def test_ratios_are_paired_within_a_round_and_skip_rounds_that_never_reached():
    assert metrics.paired_ratios([2.0, 3.0, None], [1.0, 2.0, 1.0]) == [2.0, 1.5]
    # Not the ratio of medians: (2/1, 1/2) pairs as [2.0, 0.5], where medians would give 1.0 alone.
    assert metrics.paired_ratios([2.0, 1.0], [1.0, 2.0]) == [2.0, 0.5]


def test_the_job_counters_are_read_from_what_the_server_exposes():
    job = dict.fromkeys(("pushes", "pulls", "bytes_in", "bytes_out", "sums", "bytes_summed", "sum_ns", "errors",
                         "late_pushes", "memory_charged", "workers", "keys"), 0)  # fmt: skip
    server = {"pushes": 999, "pulls": 0, "bytes_in": 0, "bytes_out": 0, "sums": 0, "bytes_summed": 0, "sum_ns": 0,
              "errors": 0, "requests": 0, "wakeups": 0, "keys_waiting": 0, "jobs": 2, "memory_charged": 0,
              "memory_bound": 0, "resident_bytes": 0}  # fmt: skip
    text = exposition(server, {0x2A: {**job, "pushes": 400, "late_pushes": 100}, 0x2B: {**job, "pushes": 7}})
    counters = parse_job_counters(text)
    assert counters == {"0x000000000000002a": {"pushes": 400, "late_pushes": 100},
                        "0x000000000000002b": {"pushes": 7, "late_pushes": 0}}  # fmt: skip
    assert metrics.contributed_share({}, {"0x000000000000002a": counters["0x000000000000002a"]}) == 0.75
