"""Tell whether a torch_bps front door is usable here, without touching the network.

    python -m benchmarks.cluster.workers.probe client    # torch_bps.client.Client importable?
    python -m benchmarks.cluster.workers.probe backend   # does `import torch_bps` register "byteps"?

Always exits 0 and prints `RESULT {"ok": bool, "reason": str}`.
May import: the standard library, torch, torch_bps and benchmarks.cluster.workers.common.
"""

from __future__ import annotations

import sys

from benchmarks.cluster.workers.common import emit


def probe(what: str) -> str:
    """Return "" if `what` ("client" or "backend") is usable, else the reason it is not."""
    try:
        if what == "client":
            from torch_bps.client import Client  # noqa: F401
        else:
            import torch.distributed as dist

            import torch_bps  # noqa: F401

            if "byteps" not in dist.Backend.backend_list:
                return "`import torch_bps` registered no 'byteps' process group"
    except Exception as e:  # ImportError, or the extension failing to load: report, never crash the sweep
        return f"{type(e).__name__}: {e}"
    return ""


if __name__ == "__main__":
    reason = probe(sys.argv[1] if len(sys.argv) > 1 else "client")
    emit({"ok": not reason, "reason": reason})
