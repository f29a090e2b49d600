"""A process group's own Runtime (its own job on the servers), made on first use: what BackupWorkers and AsyncTraining
hold beside whatever backend the group runs on.

May import: torch; torch_bps.runtime on first use.
"""

from __future__ import annotations

import threading

import torch.distributed as dist


class GroupRuntime:
    """The Runtime of `group` under job namespace `name`, made by the first `get()` (every rank of the group must
    call it: a rendezvous) and closed by `close()` (a later `get()` makes a new one)."""

    def __init__(self, name: str, group: dist.ProcessGroup, config):
        self.name, self.group, self.config = name, group, config
        self._lock = threading.Lock()
        self._runtime = None

    def get(self):
        with self._lock:
            if self._runtime is None:
                from torch_bps.runtime import Runtime  # loads the C++ client

                store = dist.distributed_c10d._get_default_store()
                self._runtime = Runtime.create(store, self.group.rank(), self.group.size(), name=self.name,
                                               config=self.config)  # fmt: skip
            return self._runtime

    def close(self) -> None:
        with self._lock:
            if self._runtime is not None:
                self._runtime.close()
                self._runtime = None
