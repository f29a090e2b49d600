"""What `make gpu-test` / `make gpu-bench` need on a machine, checked up front: one line per missing piece.

Run with the machine's own Python (GPU_PY), never the CPU .venv. It imports nothing of torch_bps, so it runs
before anything is built.

    python tests/gpu/preflight.py deps --wheelhouse W --target T   # install missing Python packages from W into T
    python tests/gpu/preflight.py build                            # can the C++ client build here? (zmq.h, a compiler)
    python tests/gpu/preflight.py cuda                             # is there a CUDA device? exit 3 if not
    python tests/gpu/preflight.py probe [--json F]                 # versions, tools, GPUs, CUDA IPC between 2 processes
    python tests/gpu/preflight.py compat --torch-wheel W --work D  # compile (and link) the C++ client against the
                                                                   # torch of wheel W, no GPU and no install needed

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


# The CUDA IPC probe, run as a script of its own (spawn pickles `child` by reference to __main__, which `python -c`
# has not): a parent shares a tensor with a spawned child (torch.multiprocessing sends a CUDA IPC handle), the child
# adds 1 in place, and both must then read the same sum. The device local stage needs exactly this between local
# ranks (device/comm.py); a sandbox that refuses it sends every local stage to the host. On a CPU tensor the same
# script checks its own mechanics (shared memory instead of IPC).
IPC_PROBE = """
import sys, torch, torch.multiprocessing as mp
def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
def child(q, r, device):
    t = q.get(); t.add_(1); sync(device); r.put(float(t.sum()))
if __name__ == "__main__":
    device, wait = sys.argv[1], float(sys.argv[2])
    ctx = mp.get_context("spawn"); q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, r, device)); p.start()
    x = torch.zeros(1 << 20, device=device); q.put(x)
    try:
        got = r.get(timeout=wait); sync(device); mine = float(x.sum())
        print("works" if got == mine == float(1 << 20) else f"FAILED: child read {got}, parent {mine}")
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}")
    p.kill()
"""


def ipc_probe(device: str, timeout: float = 60) -> str:
    """'works', or 'FAILED: why': a tensor on `device` shared with a spawned process, written there, read here."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "ipc_probe.py")
        with open(script, "w") as f:
            f.write(IPC_PROBE)
        try:
            command = [sys.executable, script, device, str(timeout * 0.8)]  # the script's own wait answers first
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"FAILED: no answer in {timeout:.0f} s"
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else f"FAILED: {done.stderr.strip()[-300:]}"


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "MISSING"
    try:
        return getattr(__import__(module), "__version__", "present")
    except Exception as e:  # noqa: BLE001 - a module that fails to import is reported, not fatal
        return f"BROKEN ({type(e).__name__}: {e})"


def _first_line(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"MISSING ({type(e).__name__})"
    return (done.stdout or done.stderr).strip().splitlines()[0] if (done.stdout or done.stderr).strip() else "?"


def cmd_probe(args) -> int:
    """Everything the first minutes on a GPU machine should record: versions, tools, GPUs, CUDA IPC. Exit as `cuda`."""
    import json

    import torch

    found = {"python": sys.version.split()[0], "executable": sys.executable, "cores": os.cpu_count(),
             "torch": torch.__version__, "torch_cuda": torch.version.cuda,
             **{m: _version(m) for m in ("triton", "numpy", "zmq", "pytest", "pytest_timeout", "setuptools")},
             "ninja": shutil.which("ninja") or "MISSING", "make": shutil.which("make") or "MISSING",
             "c++": _first_line([os.environ.get("CXX") or "c++", "--version"]),
             "Python.h": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
             "nvidia-smi": _first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                        "--format=csv,noheader"]),
             "kernel": os.uname().release, "gpus": [], "cuda_ipc": "not tried (no GPU)"}  # fmt: skip
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            found["gpus"].append(f"cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
        found["cuda_ipc"] = ipc_probe("cuda:0")
    for key, value in found.items():
        print(f"gpu probe: {key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=2)
    return 0 if found["gpus"] else NO_GPU


# What torch's BuildExtension adds for a CppExtension (torch/utils/cpp_extension.py), beside setup.py's own flags.
_TORCH_EXTENSION_FLAGS = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", "-D_GLIBCXX_USE_CXX11_ABI=1",
                          '-DPYBIND11_COMPILER_TYPE="_gcc"', '-DPYBIND11_STDLIB="_libstdcpp"',
                          '-DPYBIND11_BUILD_ABI="_cxxabi1018"', "-fPIC"]  # fmt: skip
_TORCH_LIBS = ("libtorch_python.so", "libtorch.so", "libtorch_cpu.so", "libc10.so")


def _extract_torch(wheel: str, into: str) -> str:
    """torch/include and the libraries the client links, from a torch wheel (a zip), once; returns torch/."""
    import zipfile

    torch_dir = os.path.join(into, "torch")
    if os.path.exists(os.path.join(into, ".extracted")):
        return torch_dir
    with zipfile.ZipFile(wheel) as z:
        wanted = [n for n in z.namelist() if n.startswith("torch/include/")
                  or n.startswith("torch/lib/") and os.path.basename(n) in _TORCH_LIBS]  # fmt: skip
        z.extractall(into, wanted)
    open(os.path.join(into, ".extracted"), "w").close()
    return torch_dir


def cmd_compat(args) -> int:
    """Compile every cpp_ext source against the torch in `--torch-wheel` (objects), then link them with
    --no-undefined against its libraries: a C++ API or ABI drift between torch versions fails here, on a CPU."""
    import concurrent.futures
    import time

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = os.path.basename(args.torch_wheel).split("-")
    where = os.path.join(os.path.abspath(args.work), f"torch-{name[1]}")
    start = time.monotonic()
    torch_dir = _extract_torch(args.torch_wheel, where)
    includes = [os.path.join(torch_dir, "include"), os.path.join(torch_dir, "include", "torch", "csrc", "api",
                "include"), sysconfig.get_paths()["include"], os.path.join(repo, "cpp_ext"),
                os.path.join(repo, "cpp_ext", "vendor", "zmq")]  # fmt: skip
    compiler = os.environ.get("CXX", "c++")
    objects = os.path.join(where, "objects")
    os.makedirs(objects, exist_ok=True)
    sources = []
    for folder, subfolders, files in os.walk(os.path.join(repo, "cpp_ext")):
        subfolders[:] = [d for d in subfolders if d != "vendor"]
        sources += sorted(os.path.join(folder, f) for f in files if f.endswith(".cpp"))

    # Objects newer than every file under cpp_ext/ are kept: a rerun with no change there compiles nothing.
    tree = os.walk(os.path.join(repo, "cpp_ext"))
    newest = max(os.path.getmtime(os.path.join(d, f)) for d, _, files in tree for f in files)

    def compile_one(source: str) -> tuple[str, str, str | None]:
        obj = os.path.join(objects, os.path.relpath(source, repo).replace(os.sep, "_") + ".o")
        if os.path.exists(obj) and os.path.getmtime(obj) > newest:
            return source, obj, None
        command = [compiler, "-c", source, "-o", obj, "-O0", "-std=c++20", "-Wall", *_TORCH_EXTENSION_FLAGS,
                   *(f"-I{d}" for d in includes)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        return source, obj, None if done.returncode == 0 else "\n".join(errors[:8]) or done.stderr[-800:]

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(compile_one, sources))
    failed = [(s, e) for s, _, e in results if e is not None]
    for source, error in failed:
        print(f"gpu compat: FAILED {os.path.relpath(source, repo)} against torch {name[1]}:\n{error}")
    print(f"gpu compat: {len(sources) - len(failed)} of {len(sources)} C++ files compiled against torch {name[1]}'s "
          f"headers (Python {sysconfig.get_python_version()}, {_first_line([compiler, '--version'])}), "
          f"{time.monotonic() - start:.0f} s")  # fmt: skip
    if failed:
        return 1
    library = os.path.join(where, "_C.so")
    python_lib = f"python{sysconfig.get_python_version()}"
    command = [compiler, "-shared", "-o", library, *(o for _, o, _ in results), f"-L{os.path.join(torch_dir, 'lib')}",
               "-Wl,--no-undefined", "-Wl,--allow-shlib-undefined", "-ltorch_python", "-ltorch", "-ltorch_cpu",
               "-lc10", "-lzmq", f"-L{sysconfig.get_config_var('LIBDIR')}", f"-l{python_lib}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        undefined = [line for line in done.stderr.splitlines() if "undefined reference" in line]
        print(f"gpu compat: FAILED to link against torch {name[1]}'s libraries:\n" +
              "\n".join(undefined[:15] or done.stderr.splitlines()[-15:]))  # fmt: skip
        return 1
    print(
        f"gpu compat: linked with --no-undefined against torch {name[1]}'s {', '.join(_TORCH_LIBS)} and "
        f"lib{python_lib}: every symbol the client uses is there ({os.path.getsize(library) / 2**20:.1f} MB)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    deps = sub.add_parser("deps", help="install missing Python packages from a wheelhouse, offline")
    deps.add_argument("--wheelhouse", required=True)
    deps.add_argument("--target", required=True)
    sub.add_parser("build", help="check what the C++ client needs to build")
    sub.add_parser("cuda", help="check for a CUDA device")
    probe = sub.add_parser("probe", help="versions, tools, GPUs and CUDA IPC between two processes")
    probe.add_argument("--json", help="also write what was found here")
    compat = sub.add_parser("compat", help="compile and link the C++ client against another torch's wheel")
    compat.add_argument("--torch-wheel", required=True)
    compat.add_argument("--work", required=True, help="where the wheel's headers, objects and library go")
    compat.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    commands = {"deps": cmd_deps, "build": cmd_build, "cuda": cmd_cuda, "probe": cmd_probe, "compat": cmd_compat}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
