"""`make gpu-check OUT=dir`: build, test and benchmark the CUDA path on one GPU, offline, and write one report.

Runs the Makefile's own targets, each under its own time limit (the whole fits in 8 minutes):

    preflight   tests/gpu/preflight.py cuda        is there a GPU (no GPU: the report says so, exit 3)
    build       make gpu-build                      wheelhouse deps, the C++ client (ninja, every core)
    test        make gpu-test                       tests/gpu -m cuda, JUnit XML into OUT
    bench       make gpu-bench                      benchmarks/gpu.py --quick, its JSON into OUT

and writes OUT/gpu-check.json (every step's status and time, the test counts, the benchmark's rows, the issue's
targets met or not) and OUT/gpu-check.txt (the same in a few lines); each step's output goes to OUT/<step>.log.
Exit 0 only if every step passed on a GPU. It imports nothing of torch_bps and needs only the standard library.

    python tests/gpu/check.py --out DIR [--make make] [--python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

# Seconds per step, 480 in all: the build (18 C++ files, in parallel with ninja) and the benchmark (a ~100 M-parameter
# DDP model in four runs, first; its JSON is rewritten after every section, so a cut leaves what was measured) are
# the long ones; none of these was measured on a GPU machine yet.
LIMITS = {"preflight": 15, "build": 180, "test": 140, "bench": 140}
NO_GPU = 3
# The DDP model at the size: 4096 x 4096 x 6 linear layers, ~100 M parameters.
BENCH_ARGS = "--quick --ddp-width 4096 --ddp-depth 6"


def run_step(name: str, command: list[str], limit: float, out: str) -> dict:
    """Run `command` in its own process group, killed as a group after `limit` seconds; its output to OUT/name.log."""
    log_path = os.path.join(out, f"{name}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    seconds = time.monotonic() - start
    with open(log_path, errors="replace") as log:
        tail = log.read()[-2000:]
    print(f"gpu-check: {name}: {'TIMED OUT after' if timed_out else f'exit {rc},'} {seconds:.0f} s (limit {limit} s)",
          flush=True)  # fmt: skip
    return {"step": name, "command": " ".join(command), "rc": rc, "timed_out": timed_out,
            "seconds": round(seconds, 1), "limit_s": limit, "log": log_path, "tail": tail}  # fmt: skip


def junit_counts(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]  # fmt: skip
    return counts


def targets(bench: dict) -> list[dict]:
    """The issue's targets, each with the figure measured and whether it was met (benchmarks, not tests)."""
    found = []

    def add(name: str, value, threshold: float, higher: bool = True) -> None:
        met = None if value is None else (value >= threshold if higher else value <= threshold)
        found.append({"target": name, "measured": value, "threshold": threshold, "met": met})

    rows = bench.get("partition_staging")
    add("per-partition staging round trip vs raw pinned copy >= 0.9", rows and rows.get("staged_vs_raw"), 0.9)
    rows_or_error = bench.get("local_reduce")  # a section that failed is {"error": ...}
    reduce_rows = [r for r in rows_or_error if r.get("size_mb_each", 0) >= 1] if isinstance(rows_or_error, list) else []
    worst = min((r["triton_vs_copy_traffic"] for r in reduce_rows), default=None)
    add("Triton local reduce traffic vs device copy_ >= 0.8 (worst row)", worst, 0.8)
    slowest = min((r["triton_vs_reference"] for r in reduce_rows), default=None)
    add("Triton local reduce faster than torch's stack-sum-cast (worst row) > 1", slowest, 1.0)
    ddp = bench.get("ddp") or {}
    ratio = ddp["byteps_one_machine_s"] / ddp["no_ddp_s"] if ddp.get("no_ddp_s") else None
    add(f"DDP step ({ddp.get('parameters', '?')} parameters, {ddp.get('world', '?')} ranks as one machine, k = 0, "
        f"local stage on the {ddp.get('one_machine_local_stage', '?')}) vs no communication <= 1.15", ratio, 1.15,
        higher=False)  # fmt: skip
    return found


def summary(report: dict) -> str:
    lines = [f"gpu-check {report['verdict']}: {report.get('device', 'no GPU')} ({report['seconds']:.0f} s)"]
    for s in report["steps"]:
        state = "TIMED OUT" if s["timed_out"] else "ok" if s["rc"] == 0 else f"exit {s['rc']}"
        lines.append(f"  {s['step']:9s} {state:9s} {s['seconds']:6.0f} s of {s['limit_s']}")
    t = report.get("tests") or {}
    if t:
        lines.append(f"  tests: {t['tests']} run, {t['failures'] + t['errors']} failed, {t['skipped']} skipped")
        lines += [f"    FAILED {name}" for name in t["failed_tests"]]
    for g in report.get("targets", []):
        state = "n/a" if g["met"] is None else "met" if g["met"] else "NOT met"
        value = "-" if g["measured"] is None else f"{g['measured']:.3g}"
        lines.append(f"  target {state:7s} {value:>7s}  {g['target']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the report and the logs")
    p.add_argument("--make", default="make")
    p.add_argument("--python", default=sys.executable, help="the GPU machine's Python (GPU_PY)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    make = [args.make, "--no-print-directory", f"GPU_PY={args.python}"]
    junit, bench_json = os.path.join(out, "tests.xml"), os.path.join(out, "bench.json")
    steps = [run_step("preflight", [args.python, "tests/gpu/preflight.py", "cuda"], LIMITS["preflight"], out)]
    report = {"device": steps[0]["tail"].strip().splitlines()[-1] if steps[0]["tail"].strip() else None}
    if steps[0]["rc"] == 0:
        for name, command in (
            ("build", [*make, "gpu-build"]),
            ("test", [*make, "gpu-test", f"GPU_TEST_ARGS=--junitxml={junit}"]),
            ("bench", [*make, "gpu-bench", f"GPU_BENCH_JSON={bench_json}", f"GPU_BENCH_ARGS={BENCH_ARGS}"]),
        ):
            steps.append(run_step(name, command, LIMITS[name], out))
            if name == "build" and steps[-1]["rc"] != 0:
                break  # nothing else can run
    bench = {}
    if os.path.exists(bench_json):
        with open(bench_json) as f:
            bench = json.load(f)
    passed = steps[0]["rc"] == 0 and len(steps) == 4 and all(s["rc"] == 0 for s in steps)
    report.update(verdict="PASSED" if passed else "NO GPU" if steps[0]["rc"] == NO_GPU else "FAILED",
                  seconds=time.monotonic() - start, steps=steps, tests=junit_counts(junit), bench=bench,
                  targets=targets(bench) if bench else [])  # fmt: skip
    with open(os.path.join(out, "gpu-check.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = summary(report)
    with open(os.path.join(out, "gpu-check.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0 if passed else NO_GPU if steps[0]["rc"] == NO_GPU else 1


if __name__ == "__main__":
    sys.exit(main())
