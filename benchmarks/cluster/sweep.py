"""The measurement plan: calibrate, gloo all_reduce, byteps push/pull per k, DDP, FSDP2; one report dict.

Every measurement prints one progress line as it finishes and has a time budget derived from the
theory (generous: startup plus five times the expected time), so a wedged run ends, it never hangs.
May import: the standard library, benchmarks.cluster (its errors) and
benchmarks.cluster.{byteps,calibrate,cpu,ddp,procs,report,theory,topology}.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from benchmarks.cluster import BackendUnavailable, ClusterError, procs, theory
from benchmarks.cluster.byteps import WARMUP, BytepsJob, BytepsRunner, run_torch_bps
from benchmarks.cluster.cpu import machine_busy_over
from benchmarks.cluster.ddp import DdpSpec, run_ddp, run_ddp_byteps
from benchmarks.cluster.report import cpu_summary, tcp_total
from benchmarks.cluster.topology import IFNAME, TCP_LOSS_COUNTERS, Cluster, calibrate

STARTUP_ALLOWANCE_S = 90.0  # n Python processes importing torch on 2 shared cores


@dataclass(frozen=True)
class Plan:
    """What to measure. `ks`: the numbers of dedicated server hosts to sweep."""

    n: int = 4
    ks: tuple[int, ...] = (0, 1, 2, 3, 4)
    size_bytes: int = 64 << 20
    rate_mbit: float = 500.0
    steps: int = 5
    warmup: int = WARMUP
    repeats: int = 3  # runs per gloo, byteps and DDP point (fresh processes each); the median run is reported
    gloo: bool = True  # the gloo all_reduce point (off: A/B runs of byteps settings, ~30 s less at n = 8)
    calibration_s: float = 3.0
    ddp: DdpSpec | None = field(default_factory=DdpSpec)
    ddp_k: int = 4  # server hosts of the byteps DDP run
    fsdp: DdpSpec | None = None  # the same MLP sharded with fully_shard: gloo once, byteps at every k of `ks`
    socket_buffer_bytes: int = -1  # the byteps DDP / FSDP workers' BPS_SOCKET_BUFFER_BYTES (-1: socket_buffer_for)
    # Every host's TCP congestion control ("": the machine's). Reno is loss-based, as datacenter TCP (CUBIC, DCTCP)
    # is. This machine's default, BBR, holds every flow at 4 packets for 200 ms every 10 s (PROBE_RTT) when the
    # queues keep the RTT up, which costs a step tenths of a second in every runner, gloo's and plain TCP's too.
    tcp_congestion: str = "reno"

    @property
    def rate_bps(self) -> float:
        return self.rate_mbit * 1e6

    def budget_s(self, expected_step_s: float) -> float:
        return STARTUP_ALLOWANCE_S + 5.0 * (self.steps + self.warmup) * expected_step_s


class Progress:
    """Print `[  12.3 s] message` lines, timed from the start of the run."""

    def __init__(self, out=sys.stdout):
        self._t0 = time.monotonic()
        self._out = out

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self._t0:6.1f} s] {message}", file=self._out, flush=True)


def run(plan: Plan, byteps_runner: BytepsRunner = run_torch_bps, progress: Callable[[str], None] | None = None) -> dict:
    """Build the cluster, run every measurement of `plan`, tear the cluster down; return the report."""
    say = progress or Progress()
    # Other jobs on the machine compete for its cores: measure them once so the report can say so.
    report: dict = {"plan": _plan_dict(plan), "errors": [], "background_busy": machine_busy_over(1.0)}
    n_servers = max([*plan.ks, plan.ddp_k if plan.ddp else 0])
    with Cluster(plan.n, n_servers, plan.rate_mbit, tcp_congestion=plan.tcp_congestion) as cluster:
        s = cluster.shaping
        report["tcp_congestion"] = cluster.congestion_control()
        say(
            f"cluster {cluster.run_id}: {plan.n} workers + {len(cluster.servers)} server hosts, tbf "
            f"{s.rate_mbit:g} Mbit/s burst {s.burst_bytes} B limit {s.limit_bytes} B per direction, TCP "
            f"{report['tcp_congestion']}"
        )
        report["calibration"] = _guard(report, "calibration", lambda: calibrate(cluster, plan.calibration_s))
        if report["calibration"]:
            c = report["calibration"]
            say(f"calibration: TCP stream {c['from']} -> {c['to']}: {c['mbit_s']:.1f} Mbit/s = {c['ratio']:.3f} x rate")
        gloo = None
        if plan.gloo:

            def measure() -> dict:
                return _median_run(plan.repeats, lambda: measure_gloo(cluster, plan))

            gloo = _guard(report, "gloo all_reduce", lambda: _counting_drops(cluster, measure))
        if gloo:
            bound = theory.allreduce_bound_s(plan.n, plan.size_bytes, plan.rate_bps)
            say(
                f"gloo all_reduce n={plan.n} {plan.size_bytes / 2**20:g} MiB: {gloo['seconds_per_step']:.3f} "
                f"s/step{_runs(gloo)} = {gloo['seconds_per_step'] / bound:.2f} x bound {bound:.3f} s; "
                f"our processes {_cores(gloo['cpu'])}, machine CPU {gloo['machine_busy']:.0%}; "
                f"{_losses(gloo)}"
            )
        report["gloo"] = gloo
        report["byteps"] = _sweep_byteps(cluster, plan, byteps_runner, say)
        report["ddp"] = _ddp(cluster, plan, say, report) if plan.ddp else None
        report["fsdp"] = _fsdp(cluster, plan, say, report) if plan.fsdp else None
        report["run_id"] = cluster.run_id
    report["sweep"] = _rows(plan, gloo, report["byteps"])
    report["cpu"] = cpu_summary(report)
    return report


def measure_gloo(cluster: Cluster, plan: Plan, store_port: int = 29500) -> dict:
    """Time gloo all_reduce of plan.size_bytes on the worker hosts; return s/step of the slowest rank."""
    store = f"{cluster.workers[0].ip}:{store_port}"
    expected = theory.allreduce_bound_s(plan.n, plan.size_bytes, plan.rate_bps)
    budget = plan.budget_s(expected)
    ranks = [
        cluster.spawn(
            f"gloo rank {r}",
            h,
            [
                sys.executable, "-m", "benchmarks.cluster.workers.gloo_allreduce", "--rank", str(r),
                "--world", str(plan.n), "--store", store, "--size-bytes", str(plan.size_bytes),
                "--steps", str(plan.steps), "--warmup", str(plan.warmup), "--timeout", str(budget),
            ],
            {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1"},
        )
        for r, h in enumerate(cluster.workers)
    ]  # fmt: skip
    results = procs.wait_all(ranks, budget, "gloo all_reduce")
    return {
        "seconds_per_step": max(r["seconds_per_step"] for r in results),
        "machine_busy": max(r["cpu"]["machine_busy"] for r in results),
        "cpu": {h.name: {**r["cpu"], "steps_s": r["steps"]} for h, r in zip(cluster.workers, results, strict=True)},
    }


def _sweep_byteps(cluster: Cluster, plan: Plan, runner: BytepsRunner, say) -> dict:
    points: dict = {"status": "ok", "reason": "", "points": {}}
    for k in plan.ks:
        t_opt = theory.t_opt_s(plan.n, k, plan.size_bytes, plan.rate_bps)
        job = BytepsJob(
            cluster, tuple(cluster.workers), tuple(cluster.servers[:k]), plan.size_bytes, plan.steps, plan.warmup,
            plan.budget_s(t_opt),
        )  # fmt: skip
        try:
            before = _losses_now(cluster)
            got, runs = _median_of(plan.repeats, functools.partial(runner, job), lambda r: r.seconds_per_step)
            losses = _losses_since(cluster, before)
        except BackendUnavailable as e:
            points.update(status="unavailable", reason=str(e))
            say(f"byteps: unavailable ({e}); skipping the byteps points")
            break
        except ClusterError as e:
            points["points"][k] = {"error": str(e)}
            say(f"byteps push/pull k={k}: FAILED: {_first_line(e)}")
            continue
        busy = max((c.get("machine_busy", 0.0) for c in got.cpu.values()), default=0.0)  # runners may omit it
        points["points"][k] = {
            "seconds_per_step": got.seconds_per_step,
            "runs_seconds_per_step": runs,
            "machine_busy": busy,
            "cpu": got.cpu,
            **losses,
        }
        if got.paired:
            points["points"][k]["paired"] = got.paired
        say(
            f"byteps push/pull n={plan.n} k={k} x={theory.dedicated_fraction(plan.n, k):.3f}: "
            f"{got.seconds_per_step:.3f} s/step{_runs(points['points'][k])} = {got.seconds_per_step / t_opt:.2f} x "
            f"t_opt {t_opt:.3f} s; "
            f"our processes {_cores(got.cpu)}, machine CPU {busy:.0%}; {_losses(points['points'][k])}"
        )
        if got.paired:
            p = got.paired
            say(
                f"  alternated with gloo, {len(p['cpu_vs_gloo'])} pairs: CPU-s per step {p['median_cpu_vs_gloo']:.2f}x "
                f"gloo's (pairs {min(p['cpu_vs_gloo']):.2f}-{max(p['cpu_vs_gloo']):.2f}); with the softirq threads "
                f"{p['median_with_softirq_threads_vs_gloo']:.2f}x ({min(p['with_softirq_threads_vs_gloo']):.2f}-"
                f"{max(p['with_softirq_threads_vs_gloo']):.2f})"
            )
    return points


def _ddp(cluster: Cluster, plan: Plan, say, report: dict) -> dict:
    # The budget follows the gradient bytes like every other measurement's.
    expected = theory.allreduce_bound_s(plan.n, plan.ddp.params * 4, plan.rate_bps)
    spec = dataclasses.replace(plan.ddp, timeout_s=plan.budget_s(expected))
    out: dict = {"params": spec.params, "batch_per_rank": spec.batch, "k": plan.ddp_k}
    gloo = _guard(
        report,
        "DDP gloo",
        lambda: _counting_drops(
            cluster, lambda: _median_run(plan.repeats, lambda: run_ddp(cluster, "gloo", spec, 29600))
        ),
    )
    if gloo:
        say(
            f"DDP gloo: {gloo['samples_per_s']:.1f} samples/s ({gloo['seconds_per_step']:.3f} s/step{_runs(gloo)}, "
            f"{spec.params / 1e6:.1f} M params); {_losses(gloo)}"
        )
    try:
        k = min(plan.ddp_k, len(cluster.servers))
        bps = _counting_drops(
            cluster,
            lambda: _median_run(
                plan.repeats,
                lambda: run_ddp_byteps(cluster, spec, 29700, k, socket_buffer_bytes=plan.socket_buffer_bytes),
            ),
        )
        say(
            f"DDP byteps (k={k}): {bps['samples_per_s']:.1f} samples/s "
            f"({bps['seconds_per_step']:.3f} s/step{_runs(bps)}); {_losses(bps)}"
        )
    except BackendUnavailable as e:
        bps, out["byteps_unavailable"] = None, str(e)
        say(f"DDP byteps: unavailable ({e})")
    except ClusterError as e:
        bps = None
        report["errors"].append({"what": "DDP byteps", "error": str(e)})
        say(f"DDP byteps: FAILED: {_first_line(e)}")
    out["gloo_samples_per_s"] = gloo["samples_per_s"] if gloo else None
    out["byteps_samples_per_s"] = bps["samples_per_s"] if bps else None
    out["runs_seconds_per_step"] = {
        "gloo": gloo and gloo["runs_seconds_per_step"],
        "byteps": bps and bps["runs_seconds_per_step"],
    }
    out["cpu"] = {"gloo": gloo and gloo["cpu"], "byteps": bps and bps["cpu"]}
    out["tbf_drops"] = {"gloo": gloo and gloo["tbf_drops"], "byteps": bps and bps["tbf_drops"]}
    out["tcp_losses"] = {"gloo": gloo and gloo["tcp_losses"], "byteps": bps and bps["tcp_losses"]}
    return out


def _fsdp(cluster: Cluster, plan: Plan, say, report: dict) -> dict:
    """FSDP2 steps/s and bytes per step: gloo once, then byteps at every k of the sweep."""
    # A ring moves (n-1)/n of the parameters per all-gather (forward and backward) and per reduce-scatter:
    # 1.5 x an all-reduce of the parameters, the budget's expected step.
    expected = 1.5 * theory.allreduce_bound_s(plan.n, plan.fsdp.params * 4, plan.rate_bps)
    spec = dataclasses.replace(plan.fsdp, timeout_s=plan.budget_s(expected))
    out: dict = {"params": spec.params, "batch_per_rank": spec.batch, "steps": spec.steps, "points": {}}
    gloo = _guard(
        report,
        "FSDP2 gloo",
        lambda: _counting_drops(
            cluster, lambda: _median_run(plan.repeats, lambda: run_ddp(cluster, "gloo", spec, 29800))
        ),
    )
    out["points"]["gloo"] = gloo
    if gloo:
        say(f"FSDP2 gloo: {_training_line(gloo)}")
    for k in plan.ks:
        name = f"byteps k={k}"
        try:
            bps = _counting_drops(
                cluster,
                lambda k=k: _median_run(
                    plan.repeats,
                    lambda: run_ddp_byteps(
                        cluster, spec, 29810 + k, k, server_port=9600 + k, socket_buffer_bytes=plan.socket_buffer_bytes
                    ),
                ),
            )
        except BackendUnavailable as e:
            out["byteps_unavailable"] = str(e)
            say(f"FSDP2 byteps: unavailable ({e})")
            break
        except ClusterError as e:
            report["errors"].append({"what": f"FSDP2 {name}", "error": str(e)})
            say(f"FSDP2 {name}: FAILED: {_first_line(e)}")
            continue
        out["points"][name] = bps
        say(f"FSDP2 {name}: {_training_line(bps)}")
    return out


def _training_line(point: dict) -> str:
    """ "1.23 steps/s (0.813 s/step), worker links 75.0 MB/step each way; servers ... ; tbf drops 0" """
    link = point["link_bytes_per_step"].values()
    line = (
        f"{1 / point['seconds_per_step']:.3f} steps/s ({point['seconds_per_step']:.3f} s/step{_runs(point)}), "
        f"worker links {max(b['tx'] for b in link) / 1e6:.1f} MB/step up, {max(b['rx'] for b in link) / 1e6:.1f} "
        "down (busiest)"
    )
    if "server_bytes_per_step" in point:
        line += (
            f", servers {point['server_bytes_per_step'] / 1e6:.1f} MB/step = "
            f"{point['server_bytes_per_step'] / point['ideal_bytes_per_step']:.4f} x ideal"
        )
    return f"{line}; {_losses(point)}"


def _rows(plan: Plan, gloo: dict | None, bps: dict) -> list[dict]:
    bound = theory.allreduce_bound_s(plan.n, plan.size_bytes, plan.rate_bps)
    rows = []
    for k in plan.ks:
        point = bps["points"].get(k, {})
        rows.append({
            "k": k,
            "x": theory.dedicated_fraction(plan.n, k),
            "byteps_s": point.get("seconds_per_step"),
            "gloo_s": gloo["seconds_per_step"] if gloo else None,
            "t_opt_s": theory.t_opt_s(plan.n, k, plan.size_bytes, plan.rate_bps),
            "allreduce_bound_s": bound,
        })  # fmt: skip
    return rows


def _guard(report: dict, what: str, measure: Callable[[], dict]) -> dict | None:
    """Run one measurement; on a ClusterError record it and go on with the others."""
    try:
        return measure()
    except ClusterError as e:
        report["errors"].append({"what": what, "error": str(e)})
        print(f"{what}: FAILED: {e}", file=sys.stderr, flush=True)
        return None


def _median_run(repeats: int, measure: Callable[[], dict]) -> dict:
    """Run `measure` `repeats` times; return the median run's result, with every run's s/step added.

    One run of a point differs from the next by about ±5% on a shared 2-core machine: the median of a few
    fresh runs is what a single-run figure cannot be, a stable number to compare with a target.
    """
    got, runs = _median_of(repeats, measure, lambda r: r["seconds_per_step"])
    return {**got, "runs_seconds_per_step": runs}


def _median_of(repeats: int, measure: Callable[[], object], seconds: Callable[[object], float]):
    """Run `measure` `repeats` times; return (the median run's result, every run's seconds, sorted)."""
    runs = sorted((measure() for _ in range(repeats)), key=seconds)
    return runs[len(runs) // 2], [seconds(r) for r in runs]


def _runs(point: dict) -> str:
    """ " (median of 1.2, 1.3, 1.4)" for a point measured more than once, else ""."""
    runs = point.get("runs_seconds_per_step", [])
    return f" (median of {', '.join(f'{s:.3f}' for s in runs)})" if len(runs) > 1 else ""


def _counting_drops(cluster: Cluster, measure: Callable[[], dict]) -> dict:
    """Run `measure`; add to its result the tbf drops per link ("tbf_drops") and TCP's losses per host ("tcp_losses")
    it caused."""
    before = _losses_now(cluster)
    result = measure()
    result.update(_losses_since(cluster, before))
    return result


def _losses_now(cluster: Cluster) -> tuple[dict[str, int], dict[str, int]]:
    """The tbf drops per link and TCP's losses per host so far: `_losses_since` counts from here."""
    return cluster.link_drops(), cluster.tcp_losses()


def _losses_since(cluster: Cluster, before: tuple[dict[str, int], dict[str, int]]) -> dict:
    """{"tbf_drops": per link, "tcp_losses": per host and counter}, since `before` (`_losses_now`)."""
    drops, tcp = before
    return {"tbf_drops": _delta(drops, cluster.link_drops()), "tcp_losses": _delta(tcp, cluster.tcp_losses())}


def _losses(point: dict) -> str:
    """ "tbf drops 12; TCP: retransmitted segments 10, loss probes 3, timeouts 0, spurious (D-SACKed) 2" (summed
    over links and hosts)."""
    tcp = point.get("tcp_losses") or {}
    counts = ", ".join(f"{label} {tcp_total(tcp, label)}" for label in TCP_LOSS_COUNTERS.values())
    return f"tbf drops {sum(point['tbf_drops'].values())}; TCP: {counts}"


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {link: after[link] - before.get(link, 0) for link in after if after[link] != before.get(link, 0)}


def _cores(cpu_by_host: dict) -> str:
    """Cores our processes used, and how many of their threads waited for a core on average."""
    used = sum(c.get("process_cores", 0.0) for c in cpu_by_host.values())
    waiting = sum(c.get("process_waiting", 0.0) for c in cpu_by_host.values())
    return f"{used:.2f} cores ({waiting:.2f} threads waiting for one)"


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _plan_dict(plan: Plan) -> dict:
    d = asdict(plan)
    d["ks"] = list(plan.ks)
    return d
