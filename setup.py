"""Build torch_bps and its C++ push/pull client (cpp_ext/, linked against libzmq).

Build with `pip install --no-build-isolation .` (or `pip wheel --no-build-isolation .`; the Makefile installs
with -e): the extension compiles against the torch already installed, whose C++ ABI it must match, so pip must
not build it in an isolated environment with a torch of its own (pyproject.toml's build-system names setuptools
only). See docs/deploy.md.
"""

import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ZMQ_HINT = (
    "torch_bps: zmq.h not found. The C++ push/pull client links libzmq: install Debian's "
    "libzmq3-dev (apt-get update && apt-get install -y libzmq3-dev), or run `make test`, which does; "
    "offline, install pyzmq from a wheel first: its bundled libzmq is then used with cpp_ext/vendor/zmq/zmq.h."
)
VENDORED_ZMQ_H = os.path.join("cpp_ext", "vendor", "zmq")


def zmq_build_args():
    """include_dirs, libraries and extra link args for libzmq: the system's if zmq.h is found, else pyzmq's.

    A machine with libzmq's headers (Debian's libzmq3-dev, a conda env's zeromq) links its libzmq.so. Without
    them (an offline GPU machine), the libzmq 4.3.5 bundled in pyzmq's wheel (pyzmq.libs/) is linked by its
    file name, found at run time through an rpath, with libzmq's own public header vendored beside the sources.
    """
    candidates = [os.environ.get("ZMQ_INCLUDE_DIR", ""), "/usr/include", "/usr/local/include",
                  os.path.join(sys.prefix, "include")]  # fmt: skip
    found = [d for d in candidates if d and os.path.exists(os.path.join(d, "zmq.h"))]
    # TORCH_BPS_ZMQ=pyzmq takes pyzmq's library even where system headers exist (to test the offline build).
    if found and os.environ.get("TORCH_BPS_ZMQ", "auto") != "pyzmq":
        lib_dir = os.path.join(sys.prefix, "lib")
        extra = [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"] if found[0] == candidates[3] else []
        return found[:1], ["zmq"], extra
    bundled = pyzmq_bundled_libzmq()
    if bundled is None:
        sys.exit(ZMQ_HINT)
    print(f"torch_bps: building against pyzmq's bundled {bundled} with {VENDORED_ZMQ_H}/zmq.h")
    lib_dir, name = os.path.split(bundled)
    return [os.path.abspath(VENDORED_ZMQ_H)], [], [f"-L{lib_dir}", f"-l:{name}", f"-Wl,-rpath,{lib_dir}"]


def pyzmq_bundled_libzmq():
    """The path of the libzmq shared library pyzmq's manylinux wheel bundles (pyzmq.libs/libzmq-*.so*), or None."""
    try:
        import zmq
    except ImportError:
        return None
    libs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(zmq.__file__))), "pyzmq.libs")
    names = sorted(n for n in os.listdir(libs) if n.startswith("libzmq")) if os.path.isdir(libs) else []
    return os.path.join(libs, names[0]) if names else None


def check_build_tools() -> None:
    """Exit naming what the build lacks: torch in this Python (no build isolation), a C++ compiler."""
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit(
            "torch_bps: torch is not installed in the Python that builds it. The C++ client compiles against the "
            "installed torch: install torch first (pip install torch==2.13.0, a CPU build here; CUDA machines: "
            "their torch), then build with `pip install --no-build-isolation .` (pip's isolated build environment "
            "has no torch)."
        )
    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        sys.exit(f"torch_bps: no C++ compiler: {compiler!r} (CXX, default c++) is not on PATH. Install one "
                 "(Debian: apt-get install g++) or set CXX.")  # fmt: skip


def version() -> str:
    """torch_bps/__init__.py's __version__, read without importing torch_bps (which needs torch and _C)."""
    with open(os.path.join("torch_bps", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def cpp_sources(root="cpp_ext"):
    """Every .cpp under cpp_ext/ (one folder per layer: common, transport, client, server, python), not vendor/."""
    sources = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != "vendor"]
        sources += [os.path.join(folder, f) for f in files if f.endswith(".cpp")]
    return sorted(sources)


def debug_build() -> bool:
    """TORCH_BPS_DEBUG=1: keep debug info in _C (about 54 MB). Otherwise none: about 1 MB, what a wheel ships and a
    64 MiB carried copy of the tree has room for."""
    return os.environ.get("TORCH_BPS_DEBUG", "0") == "1"


def debug_flags() -> list[str]:
    # Python's own CFLAGS, which setuptools passes first, carry -g; the last -g/-g0 on the command line wins.
    return ["-g"] if debug_build() else ["-g0"]


def extensions():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    zmq_includes, zmq_libraries, zmq_link_args = zmq_build_args()
    sources = cpp_sources()
    ext = CppExtension(
        "torch_bps._C",
        sources,
        # Sources include each other by their path under cpp_ext/ ("transport/wire.h").
        include_dirs=zmq_includes + [os.path.abspath("cpp_ext")],
        libraries=zmq_libraries,
        extra_compile_args=["-O3", "-std=c++20", "-Wall", *debug_flags()],
        extra_link_args=zmq_link_args + ([] if debug_build() else ["-Wl,--strip-debug"]),
    )
    return [ext], {"build_ext": BuildExtension}


if os.path.isdir("cpp_ext"):
    check_build_tools()
ext_modules, cmdclass = extensions() if os.path.isdir("cpp_ext") else ([], {})

setup(
    name="torch_bps",
    version=version(),
    description="BytePS, PyTorch-native: gradient summation on spare CPU servers",
    packages=find_packages(include=["torch_bps", "torch_bps.*", "triton_kernels", "triton_kernels.*"]),
    python_requires=">=3.10",
    # torch must already be installed (torch==2.13.0 CPU here): a bare `torch` would pull a CUDA build.
    install_requires=["torch>=2.13,<2.15", "triton>=3.0", "pyzmq>=25", "numpy"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"], "torchx": ["torchx"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["bps-server=torch_bps.server.cli:main", "bps-doctor=torch_bps.doctor.__main__:main"]
    },
)
