"""Profiler spans: what the engine shows in a torch.profiler recording, a span per collective and per stage.

A span opened on the thread that issues a collective and closed when it completes (on a completion thread) is
a `record_function` whose end is tied to a torch Future: the profiler records it on the issuing thread, which
it profiles by default. A local stage is such a span too, opened on the thread where it begins: the caller's, or
one of the engine's own threads, which torch.profiler records only when asked to
(`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`).
With no profiler running, each call costs one check.
May import: torch, torch_bps.futures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_bps.futures import Done


def span(name: Callable[[], str], done: Done) -> Done:
    """Open a span named `name()` now, on this thread, if torch.profiler is recording; return `done`, which closes
    it first. `name` is called only then.

    Example: `done = span(lambda: "torch_bps::all_reduce 4.0 MB", done)`.
    """
    if not recording():
        return done
    end: torch.futures.Future = torch.futures.Future()
    with torch.profiler.record_function(name()) as rf:
        rf._call_end_callbacks_on_future(end)

    def closing(error: BaseException | None) -> None:
        end.set_result(None)
        done(error)

    return closing


def recording() -> bool:
    """Whether a torch.profiler is running in this process (torch's own fast global check: the autograd flag
    `torch.autograd._profiler_enabled()` is per thread, and off everywhere when every thread is recorded)."""
    return torch.autograd.profiler._is_profiler_enabled


def describe(nbytes: int, tensors: int) -> str:
    """'4.0 MB in 2 tensors', '8.3 kB in 1 tensor': how spans name a collective's size."""
    size = f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"
    return f"{size} in {tensors} tensor{'s' if tensors != 1 else ''}"
