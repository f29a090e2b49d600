"""Lightning, Accelerate and Ignite train on "byteps" to gloo's parameters, bit for bit, with the same logged
metrics (examples/frameworks/run.py, real launchers and processes); each skips, saying so, where its framework is
not installed (`make frameworks` installs them and runs this)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, os.path.join(REPO, "examples", "frameworks"))
import run  # noqa: E402


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(run.FRAMEWORKS))
def test_trains_as_on_gloo(name):
    if not run.installed(name):
        pytest.skip(f"{run.FRAMEWORKS[name][0]} is not installed: `make frameworks` installs it")
    result = run.check(name)
    assert result["group_names"] == {"gloo": "gloo", "byteps": "byteps"}
    assert result["params_differ"] == [], f"{name}: parameters differ from gloo's: {result}"
    assert result["metrics_equal"], f"{name}: logged metrics differ from gloo's"
