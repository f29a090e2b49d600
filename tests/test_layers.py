"""Layers point one way: transport <- engine <- front doors; the server and the kernels stand alone; the reference
models are imported by tests only."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# package folder -> the torch_bps modules its files may import
ALLOWED = {
    "torch_bps/server": {
        "torch_bps._C",  # the server's native core (cpp_ext/server/), not the client
        "torch_bps.address",
        "torch_bps.wire",
        "torch_bps.errors",
        "torch_bps.registry",
        "torch_bps.server",
        "torch_bps.security",
    },
    # The wire format is the bottom layer: the engine names its key modes (SUM, COPY).
    "torch_bps/engine": {
        "torch_bps.errors",
        "torch_bps.engine",
        "torch_bps.config",
        "torch_bps.futures",
        "torch_bps.wire",
    },
    # The timeline reads the client it is handed; it imports no layer above it.
    "torch_bps/timeline": {"torch_bps.errors", "torch_bps.futures", "torch_bps.timeline"},
    "torch_bps/local": {"torch_bps.errors", "torch_bps.local", "torch_bps.wire", "triton_kernels"},
    # The CUDA path's room: under the front doors, beside the engine (whose objects it is handed, never imports).
    "torch_bps/device": {
        "torch_bps.device",
        "torch_bps.errors",
        "torch_bps.futures",
        "torch_bps.local",
        "torch_bps.wire",
        "triton_kernels",
    },
    # Python statements of what the C++ core runs: they import what they model, nothing above it.
    "torch_bps/_reference": {"torch_bps._reference", "torch_bps.errors", "torch_bps.wire", "torch_bps.server.job"},
    "triton_kernels": {"triton_kernels"},
}


def torch_bps_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)  # a name may be a module (`_C`)
    return {n for n in names if n.split(".")[0] in ("torch_bps", "triton_kernels")}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_one_way(folder):
    allowed = ALLOWED[folder]
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in torch_bps_imports(path):
            assert any(name == a or name.startswith(a + ".") for a in allowed), (
                f"{path.relative_to(ROOT)} imports {name}; {folder} may import only {sorted(allowed)}"
            )


def test_nothing_in_the_package_imports_the_reference_models():
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "torch_bps").rglob("*.py"))
        if "_reference" not in path.parts
        and any(n == "torch_bps._reference" or n.startswith("torch_bps._reference.") for n in torch_bps_imports(path))
    ]
    assert not importers, f"{importers} import torch_bps._reference, which only the tests may"


def _may_import(path: pathlib.Path) -> str | None:
    """The text after "May import:" in a module's docstring (to the paragraph's end); None if it has none."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found = re.search(r"May import:(.*?)(?:\n\n|\Z)", doc, re.S)
    return " ".join(found.group(1).split()) if found else None


def test_each_modules_may_import_line_names_what_it_imports():
    # A module's header says which of our modules it may import ("torch_bps.errors", or "errors" for short; a package
    # covers its modules); modules of a subpackage import each other freely. A header that drifts from the code goes.
    drifted = []
    for path in sorted([*(ROOT / "torch_bps").rglob("*.py"), *(ROOT / "triton_kernels").rglob("*.py")]):
        header = _may_import(path)
        if header is None:
            continue
        named = {w.rstrip(".*") for w in re.findall(r"[A-Za-z_][\w.*]*", header)}
        named |= {f"torch_bps.{w}" for w in named if not w.startswith(("torch", "triton"))}
        named.discard("torch_bps")  # the bare package ("`import torch_bps` must not ...") names no module
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for name in sorted(torch_bps_imports(path)):
            own = package != "torch_bps" and (name == package or name.startswith(package + "."))
            if not own and not any(name == w or name.startswith(w + ".") for w in named):
                drifted.append(f"{path.relative_to(ROOT)} imports {name}; its header: May import: {header}")
    assert not drifted, "\n".join(drifted)


def test_each_packages_may_import_line_covers_its_modules():
    # A package's __init__.py header says what the whole package may import: every module in it (and in its
    # subpackages) imports only what that line names, or the package's own modules.
    drifted = []
    for init in sorted([*(ROOT / "torch_bps").rglob("__init__.py"), ROOT / "triton_kernels" / "__init__.py"]):
        header = _may_import(init)
        if header is None:
            continue
        named = {w.rstrip(".*") for w in re.findall(r"[A-Za-z_][\w.*]*", header)}
        named |= {f"torch_bps.{w}" for w in named if not w.startswith(("torch", "triton"))}
        named.discard("torch_bps")
        package = ".".join(init.relative_to(ROOT).parts[:-1])
        for path in sorted(init.parent.rglob("*.py")):
            for name in sorted(torch_bps_imports(path)):
                own = name == package or name.startswith(package + ".")
                if not own and not any(name == w or name.startswith(w + ".") for w in named):
                    drifted.append(f"{path.relative_to(ROOT)} imports {name}; {init.relative_to(ROOT)}: {header}")
    assert not drifted, "\n".join(drifted)
