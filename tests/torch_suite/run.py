"""Run torch's distributed test-suite (suite.py) with "byteps" as the default group, then every test that failed
there once more with gloo, and report: a test gloo passes must pass on "byteps" (or be named in
suite.GLOO_ONLY with its reason). Exit status 1 otherwise. `make torch-suite` runs this (tens of minutes).

    python tests/torch_suite/run.py [-k EXPR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def outcomes(backend: str, select: list[str], keyword: str | None, timeout: float) -> dict[str, str]:
    """Run suite.py's tests (all, or `select`) with `backend` as the default group: {test name: outcome}."""
    with tempfile.TemporaryDirectory(prefix=f"torch-suite-{backend}-") as tmp:
        report = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
               f"--junitxml={report}", "-o", "junit_family=xunit1"]  # fmt: skip
        cmd += [f"{HERE}/suite.py::TorchSuite::{name}" for name in select] or [f"{HERE}/suite.py"]
        cmd += ["-k", keyword] if keyword else []
        env = {**os.environ, "TORCH_SUITE_BACKEND": backend, "TEMP_DIR": tmp}
        subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, stdout=sys.stderr)
        result = {}
        for case in ET.parse(report).iter("testcase"):
            kinds = {child.tag for child in case}
            result[case.get("name")] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", dest="keyword", help="only the tests pytest's -k selects")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds for each of the two runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    from tests.torch_suite.suite import GLOO_ONLY

    byteps = outcomes("byteps", [], args.keyword, args.timeout)
    failed = sorted(n for n, o in byteps.items() if o in ("failure", "error"))
    gloo = outcomes("gloo", failed + sorted(GLOO_ONLY), None, args.timeout) if failed or GLOO_ONLY else {}
    regressions = [n for n in failed if gloo.get(n) == "passed"]
    summary = {
        "passed": sum(o == "passed" for o in byteps.values()),
        "gloo_passes_byteps_fails": regressions,
        "failing_on_gloo_too": [n for n in failed if gloo.get(n) != "passed"],
        "gloo_only_skipped": {n: GLOO_ONLY[n] for n in sorted(GLOO_ONLY) if gloo.get(n) == "passed"},
        "skipped_on_both": sum(o == "skipped" for n, o in byteps.items() if n not in GLOO_ONLY),
    }
    summary["of_gloo_passes"] = summary["passed"] + len(regressions) + len(summary["gloo_only_skipped"])
    if args.json:
        print(json.dumps(summary, indent=1))
    print(f"byteps passes {summary['passed']} of the {summary['of_gloo_passes']} tests gloo passes on CPU; "
          f"{len(summary['gloo_only_skipped'])} need gloo by name (suite.GLOO_ONLY)")  # fmt: skip
    for name in regressions:
        print(f"FAILS on byteps, passes on gloo: {name}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
