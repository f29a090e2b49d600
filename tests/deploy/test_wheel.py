"""The package: a wheel built from a copy of the sources in a fresh virtual environment holding only torch (and the
build tools `--no-build-isolation` needs) installs, imports `torch_bps._C`, and runs its entry points; a build that
lacks torch or a compiler stops naming it. The fresh build compiles the whole C++ client (minutes): `slow`, run by
`make deploy-check`."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import venv

import pytest

import torch_bps
from tests.helpers import REPO
from torch_bps.address import parse_listening

TORCH = "torch==2.13.0"  # the CPU wheel on disk here; a bare `torch` would pull a CUDA build
SOURCES = ("setup.py", "pyproject.toml", "cpp_ext", "torch_bps", "triton_kernels")


def copy_sources(dest: str) -> str:
    """Copy what the package is built from (no built extension, no caches) to dest; return dest."""
    ignore = shutil.ignore_patterns("_C*.so", "_C.stamp", "__pycache__", "*.egg-info")
    os.makedirs(dest, exist_ok=True)
    for name in SOURCES:
        src = os.path.join(REPO, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=ignore)
        else:
            shutil.copy(src, dest)
    return dest


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
    )
    return done


def test_a_missing_compiler_is_named(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent/c++"}
    done = subprocess.run([sys.executable, "setup.py", "--version"], cwd=copy_sources(str(tmp_path)), env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "no C++ compiler: '/nonexistent/c++'" in done.stderr and "apt-get install g++" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_isolated_build_names_torch_and_no_build_isolation(tmp_path):
    """pip's default, an isolated build environment, has setuptools (pyproject's build-system) but no torch."""
    src = copy_sources(str(tmp_path / "src"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), src],
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert done.returncode != 0
    assert "torch is not installed" in done.stderr + done.stdout and "--no-build-isolation" in done.stderr + done.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wheel_builds_in_a_fresh_venv_with_only_torch(tmp_path):
    env_dir = str(tmp_path / "venv")
    venv.create(env_dir, with_pip=True)
    python = os.path.join(env_dir, "bin", "python")
    # torch, and what `pip wheel --no-build-isolation` needs of a build backend (pyproject.toml's build-system);
    # ninja compiles the client's files side by side (MAX_JOBS), as torch.utils.cpp_extension does when it is there.
    run([python, "-m", "pip", "install", "-q", TORCH, "setuptools>=70.1", "ninja"], timeout=900)
    src, dist = copy_sources(str(tmp_path / "src")), str(tmp_path / "dist")
    build_env = {**os.environ, "MAX_JOBS": "2"}
    build_env.pop("PYTHONPATH", None)
    run([python, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", dist, src], timeout=1500,
        env=build_env)  # fmt: skip
    (wheel,) = glob.glob(os.path.join(dist, "torch_bps-*.whl"))
    run([python, "-m", "pip", "install", "-q", wheel], timeout=600)
    # From elsewhere than the sources, so that only the installed package can be imported.
    elsewhere = {"cwd": str(tmp_path), "env": {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}}
    check = "import torch_bps, torch_bps._C; print(torch_bps.__version__, torch_bps._C.__file__)"
    version, where = run([python, "-c", check], timeout=120, **elsewhere).stdout.split()
    assert where.startswith(env_dir) and version == torch_bps.__version__
    run([os.path.join(env_dir, "bin", "bps-doctor"), "--help"], timeout=120, **elsewhere)
    run([python, "-m", "torch_bps.doctor", "--help"], timeout=120, **elsewhere)
    server = subprocess.Popen([os.path.join(env_dir, "bin", "bps-server"), "--host", "127.0.0.1", "--port", "0",
                               "--auth", "off"], stdout=subprocess.PIPE, text=True, **elsewhere)  # fmt: skip
    try:
        assert parse_listening(server.stdout.readline()), "the installed bps-server did not listen"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()
