"""A lease on a Runtime of the process's one registry (runtime.py), by its job namespace (a group's name): made on
first use, shared by every lease that names it, closed by the last one to let go.

A "byteps" process group makes its own Runtime with the group (process_group.py); what runs beside any backend
leases one by name: bps_hook ("hook", "hook-<group>"), BackupWorkers ("backup"), AsyncTraining ("async"). Two
holders of one name (two hooked models on one group) share one Runtime: a second rendezvous in the same store
namespace would race with the first one's keys.

May import: torch; torch_bps.runtime on first use (it loads the C++ client).
"""

from __future__ import annotations

import threading

import torch.distributed as dist


class Lease:
    """A hold on the Runtime of `group` under job namespace `name`, made by the first `get()` of any lease of that
    name (every rank of the group must call it: a rendezvous) and closed when the last lease is closed (a later
    `get()` makes a new one).

    Example: `lease = Lease("backup", group, config); lease.get().run(...); lease.close()`.
    """

    def __init__(self, name: str, group: dist.ProcessGroup, config):
        self.name, self.group, self.config = name, group, config
        self._lock = threading.Lock()
        self._runtime = None

    def get(self):
        """The Runtime; the first call takes a hold on it, making it if no lease holds one."""
        with self._lock:
            if self._runtime is None:
                from torch_bps.runtime import acquire  # loads the C++ client: only when a Runtime is really needed

                self._runtime = acquire(self.name, self.group, self.config)
            return self._runtime

    def close(self) -> None:
        """Let go of the Runtime; the last holder closes it."""
        with self._lock:
            if self._runtime is not None:
                from torch_bps.runtime import release

                release(self.name, self._runtime)
                self._runtime = None
