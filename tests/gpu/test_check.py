"""`make gpu-check`'s driver on CPU (no GPU needed): step time limits kill the whole process group, the report's
test counts and targets, and a machine with no GPU reported as such, never as a pass."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.gpu import check
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(60)


def test_a_step_past_its_limit_is_killed_with_its_children_and_reported(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '30']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(30)")  # fmt: skip
    start = time.monotonic()
    step = check.run_step("slow", [sys.executable, "-c", script], 1.5, str(tmp_path))
    assert step["timed_out"] and time.monotonic() - start < 10
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert _state(child) in (None, "Z"), "the step's own child outlived its time limit"


def _state(pid: int) -> str | None:
    """A process's state letter (Z: dead, not yet reaped), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_junit_counts_and_failed_tests(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.gpu.test_x" name="test_a"><failure message="x"/></testcase>'
                   '<testcase classname="tests.gpu.test_x" name="test_b"/></testsuite></testsuites>')  # fmt: skip
    counts = check.junit_counts(str(xml))
    assert counts["tests"] == 3 and counts["failures"] == 1 and counts["skipped"] == 1
    assert counts["failed_tests"] == ["tests.gpu.test_x::test_a"]


def test_targets_are_judged_on_the_worst_row_and_the_ddp_ratio():
    bench = {
        "partition_staging": {"staged_vs_raw": 0.95},
        "local_reduce": [{"size_mb_each": 16, "triton_vs_copy_traffic": 0.9, "triton_vs_reference": 1.5},
                         {"size_mb_each": 16, "triton_vs_copy_traffic": 0.7, "triton_vs_reference": 2.0}],
        "ddp": {"no_ddp_s": 1.0, "byteps_one_machine_s": 1.2, "byteps_s": 1.0, "parameters": 100, "world": 2},
    }  # fmt: skip
    met = {t["target"].split(" ")[0] + str(i): t["met"] for i, t in enumerate(check.targets(bench))}
    assert list(met.values()) == [True, False, True, False], check.targets(bench)
    assert all(t["met"] is None for t in check.targets({}))
    failed = {name: {"error": "RuntimeError: x"} for name in ("partition_staging", "local_reduce", "ddp")}
    assert all(t["met"] is None for t in check.targets(failed)), "a failed section is no figure, not a crash"


def test_no_gpu_is_reported_as_no_gpu_and_fails(tmp_path):
    if check.subprocess.run([sys.executable, "-c", "import torch; assert not torch.cuda.is_available()"]).returncode:
        pytest.skip("a GPU is present: this checks the report of a machine without one")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        rc = check.main(["--out", str(tmp_path)])
    finally:
        os.chdir(cwd)
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert rc == check.NO_GPU and report["verdict"] == "NO GPU" and len(report["steps"]) == 1
    assert (tmp_path / "gpu-check.txt").read_text().startswith("gpu-check NO GPU")
