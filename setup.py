"""Build torch_bps and its C++ push/pull client (cpp_ext/, linked against libzmq).

Build with `pip install --no-build-isolation -e .` (the Makefile does): the extension compiles against
the torch already installed, so pip must not build it in an isolated environment of its own.
"""

import os
import sys

from setuptools import find_packages, setup

ZMQ_HINT = (
    "torch_bps: zmq.h not found. The C++ push/pull client links libzmq: install Debian's "
    "libzmq3-dev (apt-get update && apt-get install -y libzmq3-dev), or run `make test`, which does."
)


def zmq_include_dirs():
    candidates = [os.environ.get("ZMQ_INCLUDE_DIR", ""), "/usr/include", "/usr/local/include"]
    found = [d for d in candidates if d and os.path.exists(os.path.join(d, "zmq.h"))]
    if not found:
        sys.exit(ZMQ_HINT)
    return found[:1]


def extensions():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sources = sorted(os.path.join("cpp_ext", f) for f in os.listdir("cpp_ext") if f.endswith(".cpp"))
    ext = CppExtension(
        "torch_bps._C",
        sources,
        include_dirs=zmq_include_dirs() + [os.path.abspath("cpp_ext")],
        libraries=["zmq"],
        extra_compile_args=["-O3", "-std=c++20", "-Wall"],
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions() if os.path.isdir("cpp_ext") else ([], {})

setup(
    name="torch_bps",
    version="0.1.0",
    description="BytePS, PyTorch-native: gradient summation on spare CPU servers",
    packages=find_packages(include=["torch_bps", "torch_bps.*", "triton_kernels", "triton_kernels.*"]),
    python_requires=">=3.10",
    # torch must already be installed (torch==2.13.0 CPU here): a bare `torch` would pull a CUDA build.
    install_requires=["torch>=2.13,<2.15", "triton>=3.0", "pyzmq>=25", "numpy"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["bps-server=torch_bps.server.cli:main"]},
)
