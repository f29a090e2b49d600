"""Present a sweep report: the table with ratios, the CPU summary, `--json`, and the `--plot` PNG.

May import: the standard library, matplotlib (only in `plot`) and benchmarks.cluster.theory.
"""

from __future__ import annotations

import json
import os


def cpu_summary(report: dict) -> dict:
    """Summarise CPU use per measurement: our processes' cores and CPU-seconds per step (against gloo's), machine-wide
    busy and softirq shares, drops and TCP's losses.

    All hosts share the machine's cores. `processes_cores` (sum over hosts) well below the core count
    while the step time sits at the link's theory means the link set the pace; `machine_busy` near 1.0
    with little of it ours means something else on the machine competed (see `background_busy`).
    """
    # name -> (cpu per host, tbf drops per link, TCP losses per host and counter, seconds per step or None)
    windows: dict[str, tuple[list[dict], dict | None, dict | None, float | None]] = {}
    if report.get("gloo"):
        gloo = report["gloo"]
        windows["gloo all_reduce"] = (
            list(gloo["cpu"].values()), gloo.get("tbf_drops"), gloo.get("tcp_losses"), gloo.get("seconds_per_step"),
        )  # fmt: skip
    for k, point in (report.get("byteps") or {}).get("points", {}).items():
        if "cpu" in point:
            windows[f"byteps k={k}"] = (
                list(point["cpu"].values()), point.get("tbf_drops"), point.get("tcp_losses"),
                point.get("seconds_per_step"),
            )  # fmt: skip
    ddp = report.get("ddp") or {}
    for backend, cpu in (ddp.get("cpu") or {}).items():
        if cpu:
            windows[f"ddp {backend}"] = (
                list(cpu.values()),
                (ddp.get("tbf_drops") or {}).get(backend),
                (ddp.get("tcp_losses") or {}).get(backend),
                None,
            )
    for name, point in ((report.get("fsdp") or {}).get("points") or {}).items():
        if point:
            windows[f"fsdp {name}"] = (
                list(point["cpu"].values()), point.get("tbf_drops"), point.get("tcp_losses"),
                point.get("seconds_per_step"),
            )  # fmt: skip
    measurements = {name: _window(*window) for name, window in windows.items()}
    gloo = measurements.get("gloo all_reduce", {})
    for name, m in measurements.items():
        if name.startswith("byteps") and gloo.get("cpu_s_per_step") and m["cpu_s_per_step"]:
            m["cpu_vs_gloo"] = round(m["cpu_s_per_step"] / gloo["cpu_s_per_step"], 3)
            if gloo.get("with_softirq_threads"):
                m["with_softirq_threads_vs_gloo"] = round(m["with_softirq_threads"] / gloo["with_softirq_threads"], 3)
    return {
        "cores": os.cpu_count(),
        "background_busy": report.get("background_busy"),
        "machine_busy_max": max((m["machine_busy"] for m in measurements.values()), default=None),
        "measurements": measurements,
    }


def _window(cpus: list[dict], drops: dict | None, tcp: dict | None, step: float | None) -> dict:
    """One measurement's CPU, drops and TCP losses, summed over its hosts."""
    cores = sum(c["process_cores"] for c in cpus)
    # The packet work the kernel ran in its softirq threads (cpu.softirq_thread_seconds) is the machine's: every
    # host's window sees the same threads, so one host's counts.
    softirq_threads = max((c.get("softirq_threads_cores", 0.0) for c in cpus), default=0.0)
    m = {
        "processes_cores": round(cores, 3),
        "processes_waiting": round(sum(c.get("process_waiting", 0.0) for c in cpus), 3),
        "machine_busy": max(c.get("machine_busy", 0.0) for c in cpus),
        "machine_softirq": max(c.get("machine_softirq", 0.0) for c in cpus),
        "tbf_drops": sum(drops.values()) if drops is not None else None,
        "tcp_retransmitted": tcp_total(tcp, "retransmitted segments"),
        "tcp_spurious": tcp_total(tcp, "spurious (D-SACKed)"),
        "tcp_timeouts": tcp_total(tcp, "timeouts"),
        # Issue 15's measure: cores x seconds per step, the CPU a step costs whatever the step's length.
        "cpu_s_per_step": round(cores * step, 4) if step else None,
        "softirq_threads_cores": softirq_threads,
    }
    if step:
        m["with_softirq_threads"] = round((cores + softirq_threads) * step, 4)
    return m


def tcp_total(tcp_losses: dict | None, label: str) -> int | None:
    """One counter of `tcp_losses` ({"w0 timeouts": 2, ...}) summed over the hosts; None when not measured."""
    if tcp_losses is None:
        return None
    return sum(v for key, v in tcp_losses.items() if key.endswith(f" {label}"))


def format_table(report: dict) -> str:
    """Return the sweep as text: measured step times next to the theory, as ratios."""
    lines = []
    c = report.get("calibration")
    if c:
        lines.append(
            f"calibration: one TCP stream {c['from']} -> {c['to']} {c['mbit_s']:.1f} Mbit/s "
            f"= {c['ratio']:.3f} x the {c['rate_mbit']:g} Mbit/s tbf rate "
            f"(the best a measured/theory ratio can be is ~{1 / c['ratio']:.3f})"
        )
    lines.append(
        f"{'k':>3} {'x':>6} {'t_opt s':>9} {'t_opt/AR':>9} {'byteps s':>9} {'bps/t_opt':>9} {'runs':>9} "
        f"{'gloo s':>8} {'gloo/AR':>8}"
    )
    points = (report.get("byteps") or {}).get("points") or {}
    for row in report["sweep"]:
        bound = row["allreduce_bound_s"]
        bps, gloo = row["byteps_s"], row["gloo_s"]
        point = points.get(row["k"]) or points.get(str(row["k"])) or {}  # int keys in the run, str from its JSON
        runs = point.get("runs_seconds_per_step") or []  # every run, not only the median
        spread = f"{min(runs) / row['t_opt_s']:.2f}-{max(runs) / row['t_opt_s']:.2f}" if len(runs) > 1 else "-"
        lines.append(
            f"{row['k']:>3} {row['x']:>6.3f} {row['t_opt_s']:>9.3f} {row['t_opt_s'] / bound:>9.3f} "
            f"{_f(bps, '9.3f')} {_f(bps and bps / row['t_opt_s'], '9.2f')} {spread:>9} "
            f"{_f(gloo, '8.3f')} {_f(gloo and gloo / bound, '8.2f')}"
        )
    if report["sweep"]:
        lines.append(
            f"AR = all-reduce bound 2(n-1)S/(nB) = {report['sweep'][0]['allreduce_bound_s']:.3f} s; "
            "t_opt = 2n(n-1)S/((n^2+kn-2k)B), S/B for k >= n"
        )
    bps = report.get("byteps") or {}
    if bps.get("status") == "unavailable":
        lines.append(f"byteps: unavailable: {bps['reason']}")
    ddp = report.get("ddp")
    if ddp:
        why = f" (unavailable: {ddp['byteps_unavailable']})" if ddp.get("byteps_unavailable") else ""
        lines.append(
            f"DDP ({ddp['params'] / 1e6:.1f} M params, batch {ddp['batch_per_rank']}/rank): "
            f"gloo {_f(ddp['gloo_samples_per_s'], '.1f')} samples/s, "
            f"byteps {_f(ddp['byteps_samples_per_s'], '.1f')} samples/s{why}"
        )
    lines += _fsdp_lines(report.get("fsdp"))
    cpu = report.get("cpu") or {}
    if cpu.get("measurements"):
        bg = cpu.get("background_busy")
        lines.append(
            f"CPU during timed steps, tbf drops, TCP's retransmitted segments and timeouts (RTOs) over the whole "
            f"measurement ({cpu['cores']} cores"
            + (f"; machine {bg:.0%} busy in the second before the run" if bg is not None else "")
            + "):"
        )
        for name, m in cpu["measurements"].items():
            lines.append(
                f"  {name}: our processes {m['processes_cores']:.2f} cores "
                f"({_f(m.get('processes_waiting'), '.2f')} threads waiting for one"
                + (f"; {m['cpu_s_per_step']:.3f} CPU-s per step" if m.get("cpu_s_per_step") else "")
                + (f", {m['cpu_vs_gloo']:.2f}x gloo's" if m.get("cpu_vs_gloo") else "")
                + (f"; with softirq threads {m['with_softirq_threads']:.3f}" if m.get("with_softirq_threads") else "")
                + (f", {m['with_softirq_threads_vs_gloo']:.2f}x" if m.get("with_softirq_threads_vs_gloo") else "")
                + "); "
                f"machine {m['machine_busy']:.0%} busy ({m['machine_softirq']:.0%} softirq); "
                f"tbf drops {_f(m['tbf_drops'], 'd')}; TCP retransmitted "
                f"{_f(m.get('tcp_retransmitted'), 'd')} ({_f(m.get('tcp_spurious'), 'd')} spurious), timeouts "
                f"{_f(m.get('tcp_timeouts'), 'd')}"
            )
    for err in report.get("errors", []):
        lines.append(f"ERROR in {err['what']}: {err['error'].splitlines()[0]}")
    return "\n".join(lines)


def _fsdp_lines(fsdp: dict | None) -> list[str]:
    """The FSDP2 row: steps/s per backend and k, the busiest worker link's MB/step, the servers' bytes vs ideal."""
    if not fsdp:
        return []
    gloo = fsdp["points"].get("gloo")
    parts = []
    for name, point in fsdp["points"].items():
        if not point:
            parts.append(f"{name} -")
            continue
        link = point["link_bytes_per_step"].values()
        speedup = gloo["seconds_per_step"] / point["seconds_per_step"] if gloo and name != "gloo" else None
        text = (
            f"{name} {1 / point['seconds_per_step']:.3f} steps/s"
            + (f" ({speedup:.2f}x gloo)" if speedup else "")
            + f", link {max(b['tx'] for b in link) / 1e6:.0f}/{max(b['rx'] for b in link) / 1e6:.0f} MB"
        )
        if "server_bytes_per_step" in point:
            ratio = point["server_bytes_per_step"] / point["ideal_bytes_per_step"]
            text += f", servers {point['server_bytes_per_step'] / 1e6:.1f} MB = {ratio:.4f} x ideal"
        parts.append(text)
    why = f" (byteps unavailable: {fsdp['byteps_unavailable']})" if fsdp.get("byteps_unavailable") else ""
    return [
        f"FSDP2 ({fsdp['params'] / 1e6:.1f} M params, batch {fsdp['batch_per_rank']}/rank; per step, link = busiest "
        "worker link up/down, headers included): " + "; ".join(parts) + why
    ]


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def plot(report: dict, path: str) -> str:
    """Write a PNG of step time vs k: byteps measured, t_opt theory, gloo measured, all-reduce bound.

    Returns "" on success, or why no plot was written (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib into the venv)"
    rows = report["sweep"]
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(ks, [r["t_opt_s"] for r in rows], "-", color="C0", label="t_opt (theory)")
    measured = [r for r in rows if r["byteps_s"] is not None]
    if measured:
        ax.plot(
            [r["k"] for r in measured], [r["byteps_s"] for r in measured], "o", color="C0", label="torch_bps measured"
        )
    if rows and rows[0]["gloo_s"] is not None:
        ax.axhline(rows[0]["gloo_s"], color="C1", linestyle="--", label="gloo all_reduce measured")
    if rows:
        ax.axhline(rows[0]["allreduce_bound_s"], color="C1", linestyle=":", label="all-reduce bound (theory)")
    bps = report.get("byteps") or {}
    if bps.get("status") == "unavailable":
        ax.text(0.5, 0.5, "torch_bps: unavailable", transform=ax.transAxes, ha="center", color="C0", alpha=0.7)
    top = max([v for r in rows for v in (r["t_opt_s"], r["byteps_s"], r["gloo_s"], r["allreduce_bound_s"]) if v] or [1])
    ax.set_ylim(0, top * 1.15)
    plan = report["plan"]
    ax.set_xlabel("k dedicated summation servers")
    ax.set_ylabel("seconds per step")
    ax.set_xticks(ks)
    ax.set_title(f"n={plan['n']} workers, S={plan['size_bytes'] / 2**20:g} MiB, B={plan['rate_mbit']:g} Mbit/s")
    ax.legend(loc="lower left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def _f(value, spec: str) -> str:
    width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
    if value is None:
        return f"{'-':>{width}}" if width else "-"
    return format(value, spec)
