"""`make gpu-check`'s runner on CPU (no GPU needed): a step past its limit is killed with its children and the report
keeps the steps before it; the report is on disk while a step runs; the budget cuts and skips; a background step
runs beside the next ones and a step that needs it waits; every CUDA test is taken by exactly one step; a machine
without a GPU is reported as such, never as a pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.gpu import check
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)
PY = sys.executable


def _step(name: str, code: str, limit: float = 30, **kw) -> check.Step:
    return check.Step(name, [PY, "-c", code], limit, f"what {name} proves", **kw)


def _run(tmp_path, steps, budget: float = 60, bundle: bool = False, min_step: float = 2) -> dict:
    logs = tmp_path / "steps"
    logs.mkdir(exist_ok=True)
    runner = check.Runner(steps, str(tmp_path), str(logs), budget, dry_run=False, bundle=bundle, min_step=min_step)
    return runner.run()


def _state(pid: int) -> str | None:
    """A process's state letter (Z: dead, not yet reaped), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_cut_step_is_killed_with_its_children_and_the_report_keeps_every_other_step(tmp_path):
    pid_file, seen = tmp_path / "child.pid", tmp_path / "seen.json"
    slow = (f"import shutil, subprocess, time; p = subprocess.Popen(['sleep', '30']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            f"shutil.copy({str(tmp_path / 'gpu-check.json')!r}, {str(seen)!r}); time.sleep(30)")  # fmt: skip
    start = time.monotonic()
    report = _run(tmp_path, [_step("first", "print('ok')"), _step("slow", slow, limit=2), _step("after", "pass")],
                  bundle=True)  # fmt: skip
    assert time.monotonic() - start < 15
    states = {s["step"]: s["state"] for s in report["steps"]}
    assert states == {"first": "passed", "slow": "cut", "after": "passed"}, states
    time.sleep(0.2)
    assert _state(int(pid_file.read_text())) in (None, "Z"), "the step's own child outlived its time limit"
    # While `slow` ran, the report on disk already held `first`'s result and named `slow` as running.
    during = {s["step"]: s.get("state") for s in json.loads(seen.read_text())["steps"]}
    assert during == {"first": "passed", "slow": "running", "after": None}, during
    on_disk = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["state"] for s in on_disk["steps"]] == ["passed", "cut", "passed"] and on_disk["verdict"] == "FAILED"
    text = (tmp_path / "gpu-check.txt").read_text()
    assert "slow" in text and "cut" in text
    assert (tmp_path / "steps" / "first.log").read_text() == "ok\n"
    import tarfile

    with tarfile.open(tmp_path / "steps.tar.gz") as tar:
        assert "steps/first.log" in tar.getnames()


def test_the_budget_cuts_the_step_in_flight_and_skips_the_rest(tmp_path):
    report = _run(tmp_path, [_step("long", "import time; time.sleep(30)", limit=60), _step("never", "pass")],
                  budget=8)  # fmt: skip
    long, never = report["steps"]
    assert long["state"] == "cut" and long["seconds"] < 8, long
    assert never["state"] == "skipped" and "budget" in never["why"], never


def test_a_background_step_runs_beside_the_next_and_its_dependents_wait_or_skip(tmp_path):
    stamp = tmp_path / "stamps"
    mark = f"import time; open({str(stamp)!r}, 'a').write('%s %f\\n' % ({{}}, time.monotonic()))"
    steps = [
        _step("build", "import time; time.sleep(2); " + mark.format("'build'"), background=True),
        _step("meanwhile", mark.format("'meanwhile'")),
        _step("needs_build", mark.format("'needs_build'"), needs="build"),
        _step("broken", "raise SystemExit(1)", background=True),
        _step("needs_broken", "pass", needs="broken"),
    ]
    report = _run(tmp_path, steps)
    order = [line.split()[0] for line in stamp.read_text().splitlines()]
    assert order == ["meanwhile", "build", "needs_build"], order
    states = {s["step"]: (s["state"], s.get("why")) for s in report["steps"]}
    assert states["needs_broken"] == ("skipped", "broken did not pass"), states
    assert states["broken"][0] == "failed" and states["needs_build"][0] == "passed"


def test_a_cut_test_step_counts_its_tests_from_the_log(tmp_path):
    log, xml = tmp_path / "t.log", tmp_path / "absent.xml"
    log.write_text("tests/gpu/test_x.py::test_a PASSED [ 10%]\ntests/gpu/test_x.py::test_b[p-1] FAILED [ 20%]\n"
                   "tests/gpu/test_x.py::test_c SKIPPED (no GPU) [ 30%]\n")  # fmt: skip
    counts = check.test_results(str(xml), str(log))
    assert (counts["tests"], counts["failures"], counts["skipped"]) == (3, 1, 1), counts
    assert counts["failed_tests"] == ["tests/gpu/test_x.py::test_b[p-1]"]


def test_junit_counts_and_failed_tests(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.gpu.test_x" name="test_a"><failure message="x"/></testcase>'
                   '<testcase classname="tests.gpu.test_x" name="test_b"/></testsuite></testsuites>')  # fmt: skip
    counts = check.test_results(str(xml), str(tmp_path / "none.log"))
    assert counts["tests"] == 3 and counts["failures"] == 1 and counts["skipped"] == 1
    assert counts["failed_tests"] == ["tests.gpu.test_x::test_a"]


def test_targets_are_judged_on_the_worst_row_and_the_like_for_like_ddp_ratio():
    bench = {
        "partition_staging": {"staged_vs_raw": 0.95},
        "local_reduce": [{"size_mb_each": 16, "triton_vs_copy_traffic": 0.9, "triton_vs_reference": 1.5},
                         {"size_mb_each": 16, "triton_vs_copy_traffic": 0.7, "triton_vs_reference": 2.0}],
        "ddp": {"no_ddp_s": 0.5, "byteps_one_machine_s": 1.2, "no_communication_one_machine_s": 1.1,
                "one_machine_vs_no_communication": 1.2 / 1.1, "parameters": 100, "world": 2},
    }  # fmt: skip
    assert [t["met"] for t in check.targets(bench)] == [True, False, True, True], check.targets(bench)
    assert all(t["met"] is None for t in check.targets({}))
    failed = {name: {"error": "RuntimeError: x"} for name in ("partition_staging", "local_reduce", "ddp")}
    assert all(t["met"] is None for t in check.targets(failed)), "a failed section is no figure, not a crash"


def test_the_steps_come_in_order_of_value_and_take_every_cuda_test_once(tmp_path):
    steps = check.plan(PY, str(tmp_path), dry_run=False)
    names = [s.name for s in steps]
    assert names == ["probe", "deps", "build", "device_stage", "kernels", "broadcast", "ddp", "allreduce", "powersgd",
                     "bench", "rest"]  # fmt: skip
    assert [s.name for s in steps if s.needs == "deps"] == ["build", "device_stage", "kernels"]
    # One pytest process collects tests/gpu -m cuda and, through this module as its plugin, says which step's
    # selection (its paths, --ignore and -k, judged by pytest's own keyword matcher) takes each test.
    done = subprocess.run([PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                           "-p", "tests.gpu.test_check", "tests/gpu"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "GPU_CHECK_SELECTIONS": json.dumps(check.SELECTIONS)},
                          timeout=100)  # fmt: skip
    taken = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert len(taken) > 100, taken
    wrong = {test: steps for test, steps in taken.items() if len(steps) != 1}
    assert not wrong, f"tests taken by no step or by several: {wrong}"
    assert {s for (s,) in taken.values()} == set(check.SELECTIONS)


def pytest_collection_modifyitems(config, items):
    """As a plugin of the pytest run above: print {test id: [the steps whose selection takes it]} as JSON."""
    selections = os.environ.get("GPU_CHECK_SELECTIONS")
    if not selections:
        return
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    def takes(selection: list[str], item) -> bool:
        paths, ignored, expression, args = [], [], None, iter(selection)
        for arg in args:
            if arg == "-k":
                expression = Expression.compile(next(args))
            elif arg.startswith("--ignore="):
                ignored.append(arg.removeprefix("--ignore="))
            else:
                paths.append(arg)
        where = item.nodeid.split("::")[0]
        return (any(where == p or where.startswith(p.rstrip("/") + "/") for p in paths) and where not in ignored
                and (expression is None or expression.evaluate(KeywordMatcher.from_item(item))))  # fmt: skip

    steps = json.loads(selections)
    print(
        json.dumps(
            {i.nodeid: [n for n, sel in steps.items() if takes(sel, i)] for i in items if i.get_closest_marker("cuda")}
        )
    )


@pytest.mark.timeout(200)
def test_the_ipc_probe_shares_a_tensor_with_a_spawned_process():
    """The probe's own mechanics, on a CPU tensor (shared memory where a GPU uses CUDA IPC); two torch imports, slow
    on a busy machine."""
    from tests.gpu import preflight

    assert preflight.ipc_probe("cpu", timeout=180) == "works"


def test_no_gpu_is_reported_as_no_gpu_and_fails(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the report of a machine without one")
    monkeypatch.delenv(check.DRY_RUN_ENV, raising=False)
    rc = check.main(["--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert rc == check.NO_GPU and report["verdict"] == "NO GPU", report["verdict"]
    assert [s["state"] for s in report["steps"]] == ["no gpu"] + ["skipped"] * (len(report["steps"]) - 1)
    assert (tmp_path / "gpu-check.txt").read_text().startswith("gpu-check NO GPU")
    assert os.path.exists(tmp_path / "steps" / "probe.json")
