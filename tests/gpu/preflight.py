"""What `make gpu-test` / `make gpu-bench` need on a machine, checked up front: one line per missing piece.

Run with the machine's own Python (GPU_PY), never the CPU .venv. It imports nothing of torch_bps, so it runs
before anything is built.

    python tests/gpu/preflight.py deps --wheelhouse W --target T   # install missing Python packages from W into T
    python tests/gpu/preflight.py build                            # can the C++ client build here? (zmq.h, a compiler)
    python tests/gpu/preflight.py cuda                             # is there a CUDA device? exit 3 if not

The Python packages come only from a wheelhouse carried to the machine (`make gpu-wheels`, run where there is
network): `pip install --no-index --find-links W --target T`, never the network, and never torch or triton,
which are used as installed.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

# module -> the distribution that provides it (what the wheelhouse holds). numpy: the summation server hands
# pyzmq its replies as numpy arrays (torch's .numpy() fails without it); the compiled kernels do not need it.
NEEDED = {"zmq": "pyzmq", "numpy": "numpy", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
          "setuptools": "setuptools"}  # fmt: skip
PREINSTALLED = {"torch": "torch", "triton": "triton"}  # used as they are: never installed by these targets
# Not needed, but without it the C++ files compile one after another (minutes): installed when the wheelhouse has it.
SPEED_UPS = {"ninja": "ninja"}
NO_GPU = 3  # exit code of `cuda` without a device: a CPU box must not pass for a GPU pass


def missing_modules(names) -> list[str]:
    return [m for m in names if importlib.util.find_spec(m) is None]


def cmd_deps(args) -> int:
    """Install from the wheelhouse whatever of NEEDED this Python lacks; refuse if torch or triton are absent."""
    status = 0
    for module in missing_modules(PREINSTALLED):
        print(f"gpu preflight: MISSING {PREINSTALLED[module]}: it must be preinstalled in {sys.executable} "
              "(these targets never install it; set GPU_PY to the Python that has it)")  # fmt: skip
        status = 2
    wanted = [NEEDED[m] for m in missing_modules(NEEDED)]
    if status:  # without torch and triton nothing can run: install nothing
        return status
    if shutil.which("ninja") is None and missing_modules(SPEED_UPS):
        _install_speed_ups(args)
    if not wanted:
        return status
    wheels = sorted(glob.glob(os.path.join(args.wheelhouse, "*.whl"))) if os.path.isdir(args.wheelhouse) else []
    if not wheels:
        for dist in wanted:
            print(f"gpu preflight: MISSING {dist} for {sys.executable} and no wheelhouse at {args.wheelhouse}: "
                  "run `make gpu-wheels` on a machine with network and copy the directory here")  # fmt: skip
        return 2
    if importlib.util.find_spec("pip") is None:
        print(f"gpu preflight: MISSING pip in {sys.executable}: cannot install {', '.join(wanted)} from the wheelhouse")
        return 2
    print(f"gpu preflight: installing {', '.join(wanted)} from {args.wheelhouse} into {args.target} (no network)")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", args.wheelhouse,
               "--target", args.target, "--disable-pip-version-check", *wanted]  # fmt: skip
    done = subprocess.run(command, timeout=600)
    if done.returncode != 0:
        print(f"gpu preflight: pip could not install {', '.join(wanted)} from {args.wheelhouse} for Python "
              f"{sys.version_info.major}.{sys.version_info.minor}: the wheelhouse lacks a matching wheel")  # fmt: skip
        return 2
    return status


def _install_speed_ups(args) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", args.wheelhouse,
               "--target", args.target, "--disable-pip-version-check", *SPEED_UPS.values()]  # fmt: skip
    if not os.path.isdir(args.wheelhouse) or subprocess.run(command, timeout=300).returncode != 0:
        print(f"gpu preflight: no ninja (not on PATH, not in {args.wheelhouse}): the C++ client builds one file at "
              "a time, which may not fit `make gpu-check`'s time limit")  # fmt: skip


def system_zmq_h() -> str | None:
    # The places setup.py looks in.
    places = [os.environ.get("ZMQ_INCLUDE_DIR", ""), "/usr/include", "/usr/local/include", sys.prefix + "/include"]
    for d in places:
        if d and os.path.exists(os.path.join(d, "zmq.h")):
            return os.path.join(d, "zmq.h")
    return None


def pyzmq_libzmq() -> str | None:
    spec = importlib.util.find_spec("zmq")
    if spec is None or spec.origin is None:
        return None
    libs = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "pyzmq.libs")
    found = sorted(glob.glob(os.path.join(libs, "libzmq*")))
    return found[0] if found else None


def cmd_build(args) -> int:
    """Can the C++ client build here: a C++ compiler, and libzmq's header (system) or pyzmq's bundled libzmq."""
    status = 0
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        print("gpu preflight: MISSING a C++ compiler (c++ or g++ on PATH, or CXX): the C++ client cannot build")
        status = 2
    python_h = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(python_h):
        print(f"gpu preflight: MISSING {python_h} (the python3-dev package): the C++ client and Triton's launcher "
              "are compiled against it")  # fmt: skip
        status = 2
    header = system_zmq_h()
    bundled = pyzmq_libzmq()
    if header is not None and os.environ.get("TORCH_BPS_ZMQ", "auto") != "pyzmq":
        print(f"gpu preflight: libzmq: the system's ({header})")
    elif bundled is not None:
        print(f"gpu preflight: libzmq: pyzmq's bundled {os.path.basename(bundled)}, header cpp_ext/vendor/zmq/zmq.h")
    else:
        print("gpu preflight: MISSING libzmq: no zmq.h (Debian's libzmq3-dev) and no pyzmq wheel with a bundled "
              "libzmq (pyzmq.libs/): install pyzmq from the wheelhouse (`make gpu-deps`)")  # fmt: skip
        status = 2
    return status


def cmd_cuda(args) -> int:
    """Exit 0 with one line per visible GPU, or NO_GPU with the reason in one line."""
    import torch

    cuda = torch.version.cuda
    if not torch.cuda.is_available():
        build = f"built with CUDA {cuda}" if cuda else "a CPU-only build"
        print(f"gpu preflight: NO GPU FOUND: torch {torch.__version__} ({build}) sees no CUDA device; "
              "nothing ran on a device: this is NOT a GPU pass")  # fmt: skip
        return NO_GPU
    import triton

    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu preflight: cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB; torch "
              f"{torch.__version__}, CUDA {cuda}, triton {triton.__version__}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    deps = sub.add_parser("deps", help="install missing Python packages from a wheelhouse, offline")
    deps.add_argument("--wheelhouse", required=True)
    deps.add_argument("--target", required=True)
    sub.add_parser("build", help="check what the C++ client needs to build")
    sub.add_parser("cuda", help="check for a CUDA device")
    args = parser.parse_args(argv)
    return {"deps": cmd_deps, "build": cmd_build, "cuda": cmd_cuda}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
