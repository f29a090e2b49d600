"""`make gpu-check`: the first hour on a lent GPU machine, most valuable step first, one report kept up to date.

For a machine with one GPU, no network, 16 cores and 10 minutes per command; it needs neither make nor torch_bps,
only the standard library, and runs the machine's own Python (torch and Triton as installed there):

    python3 tests/gpu/check.py --out DIR [--logs DIR] [--bundle] [--budget 540] [--limit STEP=SECONDS ...]

The steps, in order (a step's limit is cut to what is left of the budget; one past it is killed with its children):

    probe         versions, tools, the GPU, CUDA IPC between two processes       (preflight.py probe)
    deps          pyzmq (and whatever else is missing) from wheelhouse/ into .gpu/deps, offline
    build         the C++ client, in the background with ninja on every core, while the next step runs
    device_stage  needs no C++ client: the device local stage across processes (IPC, Triton's sum, bf16 cast),
                  the per-partition staging after a slow producer, the kernels training launches
    kernels       needs no C++ client either: the other kernel variants, while the build runs
    broadcast     the broadcast race: a receiver's queued write must not land after the result
    ddp           DDP through "byteps" and bps_hook against gloo: 1 machine of 4, 2 of 2, 2 of 1
    allreduce     every all_reduce op and dtype in those three layouts, against gloo
    powersgd      torch's PowerSGD hook on a "byteps" group (its callbacks wait on later collectives)
    bench         benchmarks/gpu.py --quick: staging, the Triton reduce, the DDP yardstick (docs/gpu.md)
    rest          every other test in tests/gpu, while time is left

Each step writes LOGS/<step>.log (and .xml for tests, .json for the bench); OUT/gpu-check.json and
OUT/gpu-check.txt are rewritten before and after every step, so a run cut anywhere keeps what it proved and names
the step it was in. LOGS defaults to OUT/steps; `--bundle` also packs LOGS into OUT/steps.tar.gz after every step
(a lent machine returns at most 8 files). Exit 0 only if every step passed on a GPU; 3 where there is no GPU.

A dry run on CPU (TORCH_BPS_TEST_DEVICE=cpu TRITON_INTERPRET=1) takes every step with CPU stand-ins; its verdict
says DRY RUN, never PASSED.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_GPU = 3
DRY_RUN_ENV = "TORCH_BPS_TEST_DEVICE"  # =cpu: the dry run (tests/gpu/common.py)
# 540 s: a lent machine's command runs 600 s at most; the rest is for installing the wheels' deps and returning files.
BUDGET = 540
# The DDP model of the yardstick: 4096 x 4096 x 6 linear layers, ~100 M parameters.
BENCH_ARGS = ["--quick", "--ddp-width", "4096", "--ddp-depth", "6"]
PYTEST = ["-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-m", "cuda"]
# Each test step's selection. "kernels" takes the kernel tests device_stage left, while the build still runs;
# "rest" runs every test no step above took.
# The kernels the device local stage launches in training: fp32 gradients summed into fp32, or into bf16 for the wire.
_KERNELS_IN_TRAINING = ("auto_backend or shared_rows or "
                        "(sum_scale_cast_on_device and (float32-float32 or float32-bfloat16))")  # fmt: skip
_TAKEN = "local_stage or round_trip or never_synchron or broadcast_lands or ddp_on_device or reductions or powersgd"
SELECTIONS = {
    "device_stage": ["tests/gpu/test_local_stage.py", "tests/gpu/test_staging.py", "tests/gpu/test_kernels.py",
                     "-k", f"(local_stage or round_trip or never_synchron or {_KERNELS_IN_TRAINING}) "
                           "and not broadcast"],
    "kernels": ["tests/gpu/test_kernels.py", "-k", f"not ({_KERNELS_IN_TRAINING})"],
    "broadcast": ["tests/gpu/test_staging.py", "-k", "broadcast_lands"],
    "ddp": ["tests/gpu/test_training.py", "-k", "ddp_on_device"],
    "allreduce": ["tests/gpu/test_collectives.py", "-k", "reductions"],
    "powersgd": ["tests/gpu/test_training.py", "-k", "powersgd"],
    "rest": ["tests/gpu", "--ignore=tests/gpu/test_kernels.py", "-k", f"not ({_TAKEN})"],
}  # fmt: skip


@dataclass
class Step:
    """One step: a command, its limit in seconds, and what it needs (a step whose need failed is skipped)."""

    name: str
    command: list[str]
    limit: float
    what: str
    background: bool = False  # started, then the next steps run; a step that `needs` it waits for it
    needs: str | None = None
    junit: str | None = None  # the JUnit XML a test step writes
    result: dict = field(default_factory=dict)


def plan(python: str, logs: str, dry_run: bool) -> list[Step]:
    """The steps of the first GPU hour, most valuable first."""

    def tests(name: str, limit: float, what: str, needs: str = "build") -> Step:
        xml = os.path.join(logs, f"{name}.xml")
        return Step(
            name, [python, *PYTEST, f"--junitxml={xml}", *SELECTIONS[name]], limit, what, needs=needs, junit=xml
        )

    build = f"{python} tests/gpu/check.py --build-if-stale && {python} -c 'import torch_bps._C'"
    # A dry run takes the script's CPU defaults (a 256 x 2 model): the yardstick's model would take minutes on a CPU.
    bench = [python, "benchmarks/gpu.py", *(["--quick", "--device", "cpu"] if dry_run else BENCH_ARGS), "--json",
             os.path.join(logs, "bench.json")]  # fmt: skip
    return [
        Step("probe", [python, "tests/gpu/preflight.py", "probe", "--json", os.path.join(logs, "probe.json")], 90,
             "the GPU, the versions, the tools, CUDA IPC between two processes"),
        Step("deps", [python, "tests/gpu/preflight.py", "deps", "--wheelhouse", "wheelhouse", "--target",
                      ".gpu/deps"], 60, "pyzmq from the carried wheelhouse (tests and servers import it)"),
        Step("build", ["sh", "-c", build], 300, "the C++ client against this torch (ninja, every core)",
             background=True, needs="deps"),
        tests("device_stage", 150, "the device local stage across processes (CUDA IPC, Triton sum, bf16 cast), "
                                   "per-partition staging, the kernels training launches", needs="deps"),
        tests("kernels", 90, "the other kernel variants (dtypes, counts, offsets past 2**31)", needs="deps"),
        tests("broadcast", 60, "a broadcast lands after a write still queued on a receiver's stream"),
        tests("ddp", 180, "DDP on both doors against gloo: 2 machines of 1, 1 machine of 4, 2 machines of 2"),
        tests("allreduce", 180, "every all_reduce op and dtype in the three layouts, against gloo"),
        tests("powersgd", 90, "PowerSGD's callbacks wait on later collectives: no hang, gloo's result"),
        Step("bench", bench, 150, "figures beside their baselines; the DDP yardstick", needs="build"),
        tests("rest", 240, "every other test in tests/gpu"),
    ]  # fmt: skip


class Runner:
    """Runs steps in order under one budget; rewrites the report before and after each."""

    RESERVE = 5  # seconds of the budget kept for the last report

    def __init__(self, steps: list[Step], out: str, logs: str, budget: float, dry_run: bool, bundle: bool,
                 env: dict | None = None, min_step: float = 15):  # fmt: skip
        self.steps, self.out, self.logs, self.dry_run, self.bundle = steps, out, logs, dry_run, bundle
        self.env = env if env is not None else os.environ.copy()
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.budget, self.min_step = budget, min_step  # a step with less than min_step seconds left is skipped
        self.running: dict[str, tuple[subprocess.Popen, float, float]] = {}  # name -> (process, start, deadline)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self) -> dict:
        by_name = {s.name: s for s in self.steps}
        for step in self.steps:
            need = by_name.get(step.needs) if step.needs else None
            if need is not None and need.name in self.running:
                self._finish(need)  # wait for the background step, within its own limit
            if need is not None and need.result.get("state") != "passed":
                step.result = {"state": "skipped", "why": f"{need.name} did not pass"}
            elif step.name != "probe" and self.probe_failed():
                step.result = {"state": "skipped", "why": "no GPU" + ("" if self.dry_run else " (not a dry run)")}
            elif self.left() - self.RESERVE < self.min_step:
                step.result = {"state": "skipped", "why": f"no time left in the {self.budget:.0f} s budget"}
            else:
                self._start(step)
                if not step.background:
                    self._finish(step)
            self.write()
        for step in self.steps:
            if step.name in self.running:
                self._finish(step)
        self.write()
        return self.report()

    def probe_failed(self) -> bool:
        probe = self.steps[0].result if self.steps and self.steps[0].name == "probe" else {}
        return probe.get("rc") == NO_GPU and not self.dry_run

    def _start(self, step: Step) -> None:
        limit = min(step.limit, max(self.left() - self.RESERVE, 1))
        log = open(os.path.join(self.logs, f"{step.name}.log"), "w")
        step.result = {"state": "running", "limit_s": round(limit), "started_s": round(time.monotonic() - self.start)}
        self.write()
        proc = subprocess.Popen(step.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env,
                                start_new_session=True)  # fmt: skip
        log.close()
        self.running[step.name] = (proc, time.monotonic(), time.monotonic() + limit)

    def _finish(self, step: Step) -> None:
        proc, started, deadline = self.running.pop(step.name)
        try:
            rc, cut = proc.wait(timeout=max(deadline - time.monotonic(), 0.01)), False
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, cut = proc.wait(), True
        seconds = time.monotonic() - started
        state = (
            "cut" if cut else "passed" if rc == 0 else "no gpu" if rc == NO_GPU and step.name == "probe" else "failed"
        )
        with open(os.path.join(self.logs, f"{step.name}.log"), errors="replace") as log:
            tail = log.read()[-1500:]
        step.result.update(state=state, rc=rc, seconds=round(seconds, 1), tail=tail)
        if step.junit is not None:
            step.result["tests"] = test_results(step.junit, os.path.join(self.logs, f"{step.name}.log"))
        print(f"gpu-check: {step.name}: {state}, {seconds:.0f} s (limit {step.result['limit_s']} s)", flush=True)

    def stop(self) -> None:
        """Kill every step still running (the run itself is being stopped) and record them as cut."""
        for name in list(self.running):
            step = next(s for s in self.steps if s.name == name)
            proc, started, _ = self.running.pop(name)
            _kill(proc)
            step.result.update(state="cut", rc=proc.wait(), seconds=round(time.monotonic() - started, 1),
                               why="the run was stopped")  # fmt: skip
        self.write()

    def report(self) -> dict:
        states = [s.result.get("state") for s in self.steps]
        probe = self.steps[0].result if self.steps and self.steps[0].name == "probe" else {}
        no_gpu = probe.get("rc") == NO_GPU
        if no_gpu and self.dry_run:
            verdict = "DRY RUN (no GPU; not a GPU result)"
        elif no_gpu:
            verdict = "NO GPU"
        elif None in states or "running" in states:
            verdict = "RUNNING"
        else:
            verdict = "PASSED" if all(s == "passed" for s in states) else "FAILED"
        bench = _read_json(os.path.join(self.logs, "bench.json"))
        return {"verdict": verdict, "seconds": round(time.monotonic() - self.start, 1), "budget_s": self.budget,
                "probe": _read_json(os.path.join(self.logs, "probe.json")),
                "steps": [{"step": s.name, "what": s.what, "command": " ".join(s.command), **s.result}
                          for s in self.steps],
                "targets": targets(bench) if bench else [], "bench": bench}  # fmt: skip

    def write(self) -> None:
        report = self.report()
        _atomic_write(os.path.join(self.out, "gpu-check.json"), json.dumps(report, indent=2))
        _atomic_write(os.path.join(self.out, "gpu-check.txt"), summary(report))
        if self.bundle:
            tmp = os.path.join(self.out, "steps.tar.gz.tmp")
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(self.logs, arcname="steps")
            os.replace(tmp, os.path.join(self.out, "steps.tar.gz"))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


_VERBOSE_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def test_results(junit: str, log: str) -> dict:
    """Counts and failed tests from the JUnit XML; from the -v log when the step was cut before pytest wrote it."""
    if os.path.exists(junit):
        try:
            root = ET.parse(junit).getroot()
        except ET.ParseError:
            root = None
        if root is not None:
            suites = [root] if root.tag == "testsuite" else list(root)
            counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
            counts["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites
                                      for c in s.iter("testcase")
                                      if c.find("failure") is not None or c.find("error") is not None]  # fmt: skip
            counts["from"] = "junit"
            return counts
    seen: dict[str, str] = {}
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            for line in f:
                m = _VERBOSE_LINE.match(line)
                if m:
                    seen[m.group(1)] = m.group(2)
    failed = [t for t, s in seen.items() if s in ("FAILED", "ERROR")]
    return {"tests": len(seen), "failures": len(failed), "errors": 0,
            "skipped": sum(s == "SKIPPED" for s in seen.values()), "failed_tests": failed,
            "from": "log (no JUnit XML: the step was cut)"}  # fmt: skip


def targets(bench: dict) -> list[dict]:
    """The targets stated in docs/gpu.md, each with the figure measured and whether it was met."""
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
    ratio = ddp.get("one_machine_vs_no_communication")
    add(f"DDP step ({ddp.get('parameters', '?')} parameters, {ddp.get('world', '?')} processes on the GPU as one "
        f"machine, local stage on the {ddp.get('one_machine_local_stage', '?')}) on \"byteps\" vs the same processes "
        "with the no-communication hook <= 1.15", ratio, 1.15, higher=False)  # fmt: skip
    return found


def summary(report: dict) -> str:
    probe = report.get("probe") or {}
    gpu = ", ".join(probe.get("gpus") or []) or "no GPU"
    lines = [f"gpu-check {report['verdict']}: {gpu} ({report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget)"]
    if probe:
        lines.append(
            f"  python {probe.get('python')}, torch {probe.get('torch')} (CUDA {probe.get('torch_cuda')}), "
            f"triton {probe.get('triton')}, pyzmq {probe.get('zmq')}, CUDA IPC: {probe.get('cuda_ipc')}"
        )
    for s in report["steps"]:
        state = s.get("state") or "not reached"
        if state in ("skipped",) or "seconds" not in s:
            detail = s.get("why", "")
        else:
            detail = f"{s['seconds']:6.0f} s of {s.get('limit_s')}"
        t = s.get("tests")
        counts = (f"  {t['tests'] - t['failures'] - t['errors'] - t['skipped']} passed, {t['failures'] + t['errors']}"
                  f" failed, {t['skipped']} skipped" if t else "")  # fmt: skip
        lines.append(f"  {s['step']:12s} {state:8s} {detail}{counts}")
        lines += [f"      FAILED {name}" for name in (t or {}).get("failed_tests", [])]
    for g in report.get("targets", []):
        state = "n/a" if g["met"] is None else "met" if g["met"] else "NOT met"
        value = "-" if g["measured"] is None else f"{g['measured']:.3g}"
        lines.append(f"  target {state:7s} {value:>7s}  {g['target']}")
    return "\n".join(lines) + "\n"


def build_if_stale() -> int:
    """Build the C++ client in place unless torch_bps/_C for this Python is newer than every source (a dry run
    on a machine that already built it skips the minutes of compiling)."""
    import glob
    import sysconfig

    built = os.path.join(REPO, "torch_bps", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    sources = glob.glob(os.path.join(REPO, "cpp_ext", "**", "*.*"), recursive=True) + [os.path.join(REPO, "setup.py")]
    if os.path.exists(built) and os.path.getmtime(built) > max(os.path.getmtime(s) for s in sources):
        print(f"gpu-check: {os.path.relpath(built, REPO)} is newer than every source: not rebuilt")
        return 0
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))  # ninja's parallelism in torch's BuildExtension
    command = [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace", "--build-temp", ".gpu/build"]
    print("gpu-check: " + " ".join(command), flush=True)
    return subprocess.run(command, cwd=REPO).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for gpu-check.json and gpu-check.txt")
    p.add_argument("--logs", help="directory for each step's files (default OUT/steps)")
    p.add_argument("--bundle", action="store_true", help="also pack the step files into OUT/steps.tar.gz")
    p.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for the whole run (default {BUDGET})")
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="change one step's limit")
    p.add_argument("--only", help="comma-separated steps to run (the probe always runs)")
    p.add_argument("--python", default=sys.executable, help="the GPU machine's Python (default: this one)")
    p.add_argument("--build-if-stale", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build_if_stale:
        return build_if_stale()
    if not args.out:
        p.error("--out is required")
    out = os.path.abspath(args.out)
    logs = os.path.abspath(args.logs or os.path.join(out, "steps"))
    os.makedirs(out, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    dry_run = os.environ.get(DRY_RUN_ENV) == "cpu"
    steps = plan(args.python, logs, dry_run)
    for item in args.limit:
        name, _, seconds = item.partition("=")
        next(s for s in steps if s.name == name).limit = float(seconds)
    if args.only:
        keep = {"probe", *args.only.split(",")}
        steps = [s for s in steps if s.name in keep]
        for s in steps:  # a step's need left out of the run is taken as met
            if s.needs not in keep:
                s.needs = None
    env = os.environ.copy()
    deps = os.path.join(REPO, ".gpu", "deps")
    # PATH: the wheelhouse's scripts, then the Python's own bin (a venv's ninja: without ninja on PATH torch's
    # BuildExtension compiles one file at a time, minutes past the build's limit).
    python_bin = os.path.dirname(shutil.which(args.python) or args.python)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [deps, REPO, env.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.join(deps, "bin"), python_bin, env.get("PATH", "")]))  # fmt: skip
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    runner = Runner(steps, out, logs, args.budget, dry_run, args.bundle, env)

    def stopped(signum, frame):
        runner.stop()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    report = runner.run()
    print(summary(report), end="")
    return exit_status(report)


def exit_status(report: dict) -> int:
    """0: every step passed on a GPU; 3: no GPU (a dry run whose steps all passed included); 1: anything else."""
    if report["verdict"] == "PASSED":
        return 0
    failed = any(s.get("state") in ("failed", "cut") for s in report["steps"][1:])
    if report["verdict"] == "NO GPU" or (report["verdict"].startswith("DRY RUN") and not failed):
        return NO_GPU
    return 1


if __name__ == "__main__":
    sys.exit(main())
