"""Complete torch futures so that C++ consumers see failures as failures.

`torch.futures.Future.set_exception` stores the exception as the future's *value* with a Python-only
unwrap: Python's `wait()` raises, but C++ consumers (DDP's reducer reading a comm hook's or a Work's
future) read the exception object as a tensor and crash. Every future torch_bps hands out is failed here
instead, with `setError` on the C++ future; Python's `wait()` still raises the original exception object.

May import: torch; torch_bps._C when a future fails (`import torch_bps` must not load the C++ client).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# A collective's completion: called once, with its error or None.
Done = Callable[[BaseException | None], None]


def fail(future: torch.futures.Future, error: BaseException) -> None:
    """Fail `future` with `error` in C++ (a no-op if it is already complete)."""
    from torch_bps import _C

    _C.fail_future(future, error)


def completer(future: torch.futures.Future, value: object) -> Callable[[BaseException | None], None]:
    """Return a callback that completes `future` with `value`, or fails it with the error it is given.

    Example: `client.push_pull(t, key, on_done=completer(fut, t))`.
    """

    def complete(error: BaseException | None) -> None:
        if error is None:
            future.set_result(value)
        else:
            fail(future, error)

    return complete
