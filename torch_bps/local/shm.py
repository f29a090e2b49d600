"""Shared-memory segment lifetime: create, attach, unlink, unmap; sweep segments left by failed set-ups.

A segment is one file under /dev/shm named `torch_bps_<job>_<node>_<pid>_<token>`, mapped with
`os.open` + `mmap` (not `multiprocessing.shared_memory`, whose resource_tracker would warn about, and
unlink, segments it believes leaked). The lifetime rule, which `LocalComm` follows:

  1. local rank 0 creates the file and publishes its name through the job's store;
  2. every local rank maps it;
  3. the last rank to map it unlinks it (`unlink`), before any data moves.

After step 3 the name is gone and the kernel frees the memory when the last mapping goes, however the
processes end (close, exception, SIGKILL). Only a crash inside the set-up window (steps 1-3) can leave a
file behind; its header records the creator's pid and a deadline, and `sweep_stale` removes such files
the next time a segment is created on the machine.

May import: the standard library and torch_bps.errors only.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import struct
import tempfile
import time
from dataclasses import dataclass

from torch_bps.errors import BpsError

PREFIX = "torch_bps_"
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
MAGIC = b"BPSLOCL1"
VERSION = 1

# Segment header at offset 0: magic, version, local_size, data_offset, data_bytes, creator pid,
# creator start time (clock ticks since boot, from /proc; 0 if unknown), set-up deadline (unix seconds).
HEADER = struct.Struct("<8sIIQQQQd")


@dataclass(frozen=True)
class SegmentHeader:
    local_size: int
    data_offset: int
    data_bytes: int
    creator_pid: int
    creator_start: int
    setup_deadline: float

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.local_size, self.data_offset, self.data_bytes,
                           self.creator_pid, self.creator_start, self.setup_deadline)  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes, where: str) -> SegmentHeader:
        if len(raw) < HEADER.size:
            raise BpsError(f"shared-memory segment {where} is truncated ({len(raw)} bytes)")
        magic, version, *fields = HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise BpsError(f"{where} is not a torch_bps local segment of version {VERSION} ({magic!r} v{version})")
        return cls(*fields)


def process_start_time(pid: int) -> int | None:
    """Return the start time of `pid` in clock ticks since boot, or None if it is not running (or a zombie).

    Comparing it with the value recorded at attach time tells a live peer from a recycled pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux): fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    # Fields after the command name (which may itself hold ") "): state is field 3, starttime field 22.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # killed but not yet reaped by its parent: dead for our purpose
        return None
    return int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """Tell whether the process `pid` that started at `start_time` (0: unknown) is still running."""
    now = process_start_time(pid)
    return now is not None and (start_time == 0 or now == 0 or now == start_time)


def segment_name(job: str, node_id: str) -> str:
    """Return a fresh segment name: prefix, job, node, pid and a random token, safe as a file name."""

    def clean(s: str) -> str:
        return re.sub(r"[^A-Za-z0-9.-]", "-", s)[:48] or "x"

    return f"{PREFIX}{clean(job)}_{clean(node_id)}_{os.getpid()}_{secrets.token_hex(4)}"


class Segment:
    """One mapped segment. `buf` is the mmap; `unlink()` removes the name (idempotent); `close()` unmaps."""

    def __init__(self, path: str, fd_or_none: int | None, size: int, *, created: bool):
        self.path = path
        self.created = created
        fd = fd_or_none if fd_or_none is not None else os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise BpsError(f"shared-memory segment {path} has {actual} bytes, expected {size}")
            self.buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory; no descriptor needs to stay open
        self.size = size
        self._unlinked = False

    @classmethod
    def create(cls, name: str, header: SegmentHeader, *, reserve: bool = True) -> Segment:
        """Create /dev/shm/<name> (exclusively, mode 0600), size it and write its header.

        With `reserve`, the pages are allocated now (posix_fallocate): a full /dev/shm then fails here
        with ENOSPC instead of killing the process with SIGBUS at its first write.
        """
        path = os.path.join(SHM_DIR, name)
        size = header.data_offset + header.data_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.ftruncate(fd, size)
                if reserve and hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                os.pwrite(fd, header.pack(), 0)
            except BaseException:
                os.close(fd)
                raise
            return cls(path, fd, size, created=True)  # closes fd
        except BaseException:
            _unlink_quietly(path)
            raise

    @classmethod
    def attach(cls, name: str) -> tuple[Segment, SegmentHeader]:
        """Map an existing segment by name and return it with its header."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise BpsError(
                f"shared-memory segment {path} is gone: its creator (local rank 0) died or gave up"
            ) from None
        try:
            header = SegmentHeader.unpack(os.pread(fd, HEADER.size, 0), path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, header.data_offset + header.data_bytes, created=False), header

    def unlink(self) -> None:
        """Remove the name; mappings stay valid. Safe to call from every rank and more than once."""
        if not self._unlinked:
            _unlink_quietly(self.path)
            self._unlinked = True

    def close(self) -> None:
        """Unmap. If tensors still view the memory the unmap is left to the garbage collector."""
        if self.buf is None:
            return
        try:
            self.buf.close()
        except BufferError:  # exported views outlive us; the mapping goes when they do
            pass
        self.buf = None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_stale(directory: str = SHM_DIR, now: float | None = None) -> list[str]:
    """Remove segments whose set-up deadline passed and whose creator is dead; return the removed paths.

    A segment only keeps its name during set-up, so such a file is the leftover of a crash in that
    window. Files that are not torch_bps segments, or whose creator still runs, are left alone.
    """
    now = time.time() if now is None else now
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            header = SegmentHeader.unpack(os.pread(fd, HEADER.size, 0), path)
        except (OSError, BpsError):
            continue
        finally:
            os.close(fd)
        if now > header.setup_deadline and not process_alive(header.creator_pid, header.creator_start):
            _unlink_quietly(path)
            removed.append(path)
    return removed
